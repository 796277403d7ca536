"""The current state of each stage, downloaded from a live replica the swarm view names (for ``export``), through
the same state sharing a joining replica uses (:class:`sentinel_node.roles.averaging.ExcludingAverager`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from hivemind.utils import get_logger

from dht import ephemeral_identity
from sentinel_node.config import Config
from sentinel_node.model.plan import stage_params
from sentinel_node.model.weights import WeightsError
from sentinel_node.pipeline.checkpoint import CheckpointError
from sentinel_node.pipeline.export import StageState, check_payload
from sentinel_node.pipeline.state_transfer import unpack_state
from sentinel_node.roles.averaging import ExcludingAverager
from sentinel_node.roles.common import record_store, start_dht, stop_dht

logger = get_logger(__name__)


def states_from_peers(config: Config, initial_peers: Sequence[str], timeout: float = 120.0) -> dict[int, StageState]:
    """For every stage, the state of the first live, non-excluded replica that gives a usable one."""
    from peers import SwarmWatcher

    identity = ephemeral_identity()
    dht = start_dht(config, identity, initial_peers=initial_peers, client_mode=True, timeout=timeout)
    found: dict[int, StageState] = {}
    try:
        store = record_store(dht, config, identity=None)
        view = SwarmWatcher(store, config.pipeline.n_stages, config.swarm.exclusion_policy()).refresh()
        for k in range(config.pipeline.n_stages):
            replicas = [a.peer_id for a in view.live_replicas(k)]
            if not replicas:
                continue
            params = stage_params(config.model, k, config.pipeline.n_stages).total
            averager = ExcludingAverager(
                [torch.zeros(1)], dht, start=False, prefix=f"{config.swarm.prefix}_stage{k}", client_mode=True
            )
            averager.start()
            try:
                averager.wait_until_ready(timeout)
                for peer in replicas:
                    got = averager.download_state(peer, timeout, 16 * params + (1 << 20))
                    if got is None:
                        logger.warning(f"stage {k} replica {peer} gave no state")
                        continue
                    origin = f"the state of stage {k} replica {peer}"
                    try:
                        payload = unpack_state(*got, origin=origin, param_groups=[{"params": []}])
                        found[k] = check_payload(payload, config, origin)
                        break
                    except (CheckpointError, WeightsError) as e:
                        logger.warning(str(e))
            finally:
                averager.shutdown()
    finally:
        stop_dht(dht)
    return found
