"""Prometheus metrics of a running node (``join --metrics-port N``), in the standard text exposition format.

A role keeps its own counters (the ones its status file shows); at each scrape :class:`MetricsServer` asks the
role for :class:`Sample` values and serves them, so the two views never disagree and nothing is counted twice.
Every metric a role may report is declared once in :data:`METRICS`, with its type and help.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import hivemind
from hivemind.utils import get_logger
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from peers import SwarmView
from sentinel_node.roles.common import NodeStartError

if TYPE_CHECKING:
    from sentinel_node.roles.node import NodeContext

logger = get_logger(__name__)


@dataclass(frozen=True)
class MetricSpec:
    kind: str  # "counter" or "gauge"
    help: str
    labels: tuple[str, ...] = ()


METRICS: dict[str, MetricSpec] = {
    "sentinel_node_info": MetricSpec(
        "gauge", "This node: 1, labelled with its role and peer id.", ("role", "peer_id")
    ),
    "sentinel_microbatches": MetricSpec("counter", "Microbatches this node handled, by outcome.", ("outcome",)),
    "sentinel_checks": MetricSpec(
        "counter", "Tensors this verifier checked, per boundary and direction.", ("boundary", "direction")
    ),
    "sentinel_flags": MetricSpec(
        "counter", "Tensors this verifier flagged as corrupt, per boundary and direction.", ("boundary", "direction")
    ),
    "sentinel_strikes_issued": MetricSpec(
        "counter", "Strikes this verifier gave senders, per boundary and direction.", ("boundary", "direction")
    ),
    "sentinel_peers_banned": MetricSpec("gauge", "Peers this verifier has banned (and voted to exclude)."),
    "sentinel_peers_excluded": MetricSpec("gauge", "Peers excluded swarm-wide in this node's view."),
    "sentinel_swarm_peers": MetricSpec("gauge", "Live peers announced in the swarm, by role.", ("role",)),
    "sentinel_dht_peers": MetricSpec("gauge", "Peers in this node's DHT routing table."),
    "sentinel_tokens_per_second": MetricSpec("gauge", "Tokens per second (trainer: the last step's)."),
    "sentinel_loss": MetricSpec("gauge", "The latest loss, by split (train, validation).", ("split",)),
    "sentinel_global_step": MetricSpec("gauge", "The last global step this node applied or completed."),
    "sentinel_checkpoints_saved": MetricSpec("counter", "Checkpoints this stage replica wrote."),
    "sentinel_checkpoint_failures": MetricSpec(
        "counter", "Checkpoints this stage replica could not write (the log and `swarm status` say why)."
    ),
    "sentinel_audits": MetricSpec(
        "counter",
        "Recomputation audits this verifier ran, by outcome (passed, convicted, contradicted, disputed, "
        "unconfirmed), and auditor requests refused.",
        ("outcome",),
    ),
    "sentinel_quiet_verifiers": MetricSpec(
        "gauge", "Verifiers this trainer sees flag far less than the others of their boundary (peers.agreement)."
    ),
    "sentinel_recomputations": MetricSpec(
        "counter", "Audit recomputations this stage replica answered, by outcome (served, unavailable).", ("outcome",)
    ),
}


@dataclass(frozen=True)
class Sample:
    """One value of a metric declared in :data:`METRICS`; ``labels`` in its declared order."""

    name: str
    value: float
    labels: tuple[str, ...] = field(default_factory=tuple)


class _RoleCollector:
    def __init__(self, collect: Callable[[], Iterable[Sample]]) -> None:
        self._collect = collect

    def collect(self) -> Iterable[Metric]:
        families: dict[str, Metric] = {}
        try:
            samples = list(self._collect())
        except Exception:
            logger.warning("collecting metrics failed", exc_info=True)
            samples = []
        for sample in samples:
            spec = METRICS[sample.name]
            family = families.get(sample.name)
            if family is None:
                kind = CounterMetricFamily if spec.kind == "counter" else GaugeMetricFamily
                family = families[sample.name] = kind(sample.name, spec.help, labels=list(spec.labels))
            family.add_metric(list(sample.labels), float(sample.value))
        return list(families.values())


class MetricsServer:
    """Serves ``collect()``'s samples at ``http://host:port/metrics`` from a thread until :meth:`stop`."""

    def __init__(self, port: int, collect: Callable[[], Iterable[Sample]], host: str = "127.0.0.1") -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_RoleCollector(collect))
        try:
            self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as e:
            raise NodeStartError(
                f"--metrics-port {port}: cannot listen on {host}:{port} ({e.strerror or e}); choose a free port, "
                "or 0 for any"
            ) from None
        self.port = self._server.server_port
        logger.info(f"metrics on http://{host}:{self.port}/metrics")

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


async def _routing_table_size(_dht: hivemind.DHT, node) -> int:
    return len(node.protocol.routing_table.uid_to_peer_id)


class DHTPeerCount:
    """The size of a DHT's routing table, asked of its process at most every ``period`` seconds (scrapes must not
    queue behind a busy DHT)."""

    def __init__(self, dht: hivemind.DHT, period: float = 5.0) -> None:
        self.dht, self.period = dht, period
        self._value = 0
        self._lock = threading.Lock()
        self._asked: float | None = None

    def __call__(self) -> int:
        with self._lock:
            now = time.monotonic()
            if self._asked is None or now - self._asked >= self.period:
                self._asked = now
                with contextlib.suppress(Exception):
                    self._value = self.dht.run_coroutine(_routing_table_size, return_future=True).result(timeout=2)
            return self._value


def view_samples(view: SwarmView) -> list[Sample]:
    """What any node knows of the swarm from its view: live peers by role, and the excluded ones."""
    by_role = {
        "stage": sum(len(view.live_replicas(k)) for k in range(view.n_stages)),
        "verifier": sum(view.is_live(a) for a in view.verifiers.values()),
        "trainer": sum(view.is_live(a) for a in view.trainers.values()),
        "bootstrap": sum(view.is_live(a) for a in view.bootstraps.values()),
    }
    samples = [Sample("sentinel_swarm_peers", count, (role,)) for role, count in by_role.items()]
    samples.append(Sample("sentinel_peers_excluded", len(view.excluded)))
    return samples


def serve_metrics(
    context: NodeContext,
    role: str,
    samples: Callable[[], Iterable[Sample]] = list,
    view: Callable[[], SwarmView] | None = None,
) -> MetricsServer | None:
    """A started :class:`MetricsServer` when the node was given ``--metrics-port``, else None. It serves what every
    node reports (who it is, its DHT peers and, with ``view``, what it sees of the swarm) and the role's own
    ``samples()``."""
    port = context.options.metrics_port
    if port is None:
        return None
    dht_peers, peer_id = DHTPeerCount(context.dht), context.peer_id

    def collect() -> list[Sample]:
        found = [Sample("sentinel_node_info", 1, (role, peer_id)), Sample("sentinel_dht_peers", dht_peers())]
        found += samples()
        return found + (view_samples(view()) if view is not None else [])

    return MetricsServer(port, collect, host=context.options.metrics_host)
