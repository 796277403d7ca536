"""What a new user reads: runs that would not attack say so, dropped steps say why, logs do not alarm (issue 18)."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import pytest
from click.testing import CliRunner
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.matchmaking import MatchmakingException

from sentinel_node.cli import main
from sentinel_node.config import ModelConfig, PipelineConfig
from sentinel_node.pipeline import StageWorker
from sentinel_node.roles.averaging import ExcludingAverager, OneLineRoundFailures
from sentinel_node.roles.replica_state import ReplicaState
from sentinel_node.sim.mesh import StepLog
from sentinel_node.sim.report import step_line


def test_simulate_that_would_never_attack_is_an_error_naming_both_numbers():
    result = CliRunner().invoke(main, ["simulate", "--attack", "constant", "--steps", "60", "--attack-start", "60"])
    assert result.exit_code != 0
    assert "start at step 60" in result.output and "after 60 steps" in result.output
    assert "Traceback" not in result.output


def test_demo_that_would_never_attack_is_an_error_before_anything_starts():
    result = CliRunner().invoke(main, ["demo", "--steps", "10", "--attack-start", "10"])
    assert result.exit_code == 2
    assert "start at step 10" in result.output and "steps 0..9" in result.output


def test_a_dropped_step_says_dropped_and_steps_count_from_zero():
    dropped = step_line(StepLog(61, None, None, flags=4, strikes=2, banned=[], microbatches=4, dropped=4))
    assert "nan" not in dropped and "dropped (verifiers dropped all 4 microbatches)" in dropped
    assert dropped.startswith("step   61")
    partly = step_line(StepLog(0, 5.5, 5.6, flags=1, strikes=1, banned=[], microbatches=4, dropped=1))
    assert partly.startswith("step    0  loss 5.500 (1/4 dropped)  val 5.600")


def test_an_averaging_round_that_fails_as_rounds_do_is_one_line_without_a_traceback(caplog):
    log = logging.getLogger("test.averaging")
    log.addFilter(OneLineRoundFailures())
    try:
        raise MatchmakingException("Unable to run All-Reduce: the group holds excluded peers")
    except MatchmakingException as e:
        with caplog.at_level(logging.DEBUG, logger="test.averaging"):
            log.exception(e)
    (record,) = caplog.records
    assert record.exc_info is None and record.levelno == logging.INFO
    assert record.getMessage() == (
        "averaging round failed: MatchmakingException: Unable to run All-Reduce: the group holds excluded peers"
    )
    try:
        raise KeyError("a bug")  # an unexpected failure keeps its traceback
    except KeyError:
        with caplog.at_level(logging.DEBUG, logger="test.averaging"):
            log.exception("boom")
    assert caplog.records[-1].exc_info is not None


def test_a_replica_alone_on_its_stage_says_it_starts_fresh_not_at_step_minus_one(caplog):
    model = ModelConfig(hidden_size=16, intermediate_size=32, n_layers=2, n_heads=2, n_kv_heads=2)
    state = ReplicaState(StageWorker(model, PipelineConfig(n_stages=2), 0), "cafe")

    async def nobody() -> list[str]:
        return []

    with caplog.at_level(logging.INFO):
        asyncio.run(state.sync(nobody, averager=None, lane=None))
    text = caplog.text
    assert "no other live replica; starting fresh (no step applied yet)" in text and "-1" not in text


def test_an_averager_stopped_during_a_round_ends_the_round_without_a_traceback():
    """A stage stopped while an all-reduce group forms (its future still pending) or runs (the future holds the
    runner): each is ended, where hivemind 1.1.12's own shutdown raises AttributeError in the averager's thread."""

    class Runner:
        cancelled = None

        def finalize(self, *, cancel: bool = False) -> None:
            self.cancelled = cancel

    class Handle:  # the averager's handle on p2pd
        closed = False

        async def shutdown(self) -> None:
            self.closed = True

    handle = Handle()

    async def stop(shutdown) -> tuple:
        loop = asyncio.get_running_loop()
        forming, running, runner = loop.create_future(), loop.create_future(), Runner()
        running.set_result(runner)
        groups = {b"forming": forming, b"running": running}
        averager = SimpleNamespace(client_mode=True, _running_groups=groups, _p2p=handle)
        await shutdown(averager, 1.0)
        return forming, runner

    forming, runner = asyncio.run(stop(ExcludingAverager._shutdown))
    assert forming.cancelled() and runner.cancelled is True
    assert handle.closed  # hivemind's own leaves it open, and its socket file in /tmp
    with pytest.raises(AttributeError, match="finalize"):
        asyncio.run(stop(DecentralizedAverager._shutdown))
