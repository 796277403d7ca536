"""``sentinel-node swarm serve``: a live status page of a swarm, its JSON API and swarm-wide Prometheus gauges.

One client-only DHT peer (:class:`~sentinel_node.swarm_reader.SwarmReader`) reads the swarm every ``refresh``
seconds in a thread of its own; every route answers from the latest snapshot, so a page or a scraper never waits
on the DHT. The server also keeps the training curve it sees (each trainer's announced step, loss, validation
loss and tokens/s), which no record holds beyond the latest value.

Routes: ``/`` the page (static HTML, CSS and JS shipped in the package: nothing is fetched from elsewhere),
``/api/status``, ``/api/peers``, ``/api/strikes``, ``/api/bans`` (the same JSON as ``swarm ... --json``),
``/api/history``, ``/metrics``.
"""

from __future__ import annotations

import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

from hivemind.utils import get_logger
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from peers import SwarmView
from sentinel_node.cli.swarm_tables import to_json
from sentinel_node.config import Config
from sentinel_node.roles.common import NodeStartError
from sentinel_node.swarm_reader import SwarmReader

logger = get_logger(__name__)

STATIC = Path(__file__).resolve().parent / "static"
HISTORY_POINTS = 5000


@dataclass(frozen=True)
class Point:
    """One global step as a trainer announced it, when this server saw it."""

    time: float
    trainer: str
    step: int
    loss: float | None
    val_loss: float | None
    tokens_per_s: float


class History:
    """The training curve this server has seen, one point per (trainer, step), the last :data:`HISTORY_POINTS`."""

    def __init__(self, limit: int = HISTORY_POINTS) -> None:
        self.points: deque[Point] = deque(maxlen=limit)
        self._last: dict[str, int] = {}
        self._lock = threading.Lock()

    def add(self, view: SwarmView) -> None:
        with self._lock:
            for peer, trainer in sorted(view.trainers.items()):
                if trainer.state != "online" or self._last.get(peer) == trainer.global_step:
                    continue
                self._last[peer] = trainer.global_step
                self.points.append(
                    Point(view.time, peer, trainer.global_step, trainer.loss, trainer.val_loss, trainer.throughput)
                )

    def as_json(self) -> list[dict]:
        with self._lock:
            return [asdict(point) for point in self.points]


class SwarmMonitor:
    """The latest snapshot of a swarm, read every ``refresh`` seconds by a thread until :meth:`stop`."""

    def __init__(self, reader: SwarmReader, refresh: float) -> None:
        self.reader, self.refresh = reader, refresh
        self.config: Config = reader.config
        self.history = History()
        self.view: SwarmView | None = None
        self.error: str | None = None
        self.read_at = 0.0
        self.read_s = 0.0
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="swarm-monitor", daemon=True)

    def start(self) -> SwarmMonitor:
        self.read_once()
        self._thread.start()
        return self

    def read_once(self) -> None:
        started = time.monotonic()
        try:
            view = self.reader.refresh()
        except NodeStartError as e:
            self.error = str(e)
            logger.warning(f"reading the swarm failed: {e}")
            return
        self.view, self.error = view, None
        self.read_at, self.read_s = time.time(), time.monotonic() - started
        self.history.add(view)

    def _run(self) -> None:
        while not self._stopped.wait(self.refresh):
            self.read_once()

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=self.reader.timeout + 5)

    def section(self, name: str) -> dict:
        if self.view is None:
            return {"error": self.error or "the swarm has not been read yet"}
        found = to_json(self.view, self.config, name)
        found["read"] = {"at": self.read_at, "seconds": self.read_s, "every": self.refresh, "error": self.error}
        return found


class SwarmCollector:
    """Swarm-wide Prometheus gauges from the monitor's latest snapshot."""

    def __init__(self, monitor: SwarmMonitor) -> None:
        self.monitor = monitor

    def collect(self) -> Iterable[Metric]:
        view = self.monitor.view
        if view is None:
            return []
        health = view.health()
        verdict = GaugeMetricFamily(
            "sentinel_swarm_health", "The swarm's health: 0 healthy, 1 degraded, 2 broken.", labels=["scope"]
        )
        verdict.add_metric(["swarm"], health.verdict.rank)
        stage_health = GaugeMetricFamily(
            "sentinel_stage_health", "Each stage's health: 0 healthy, 1 degraded, 2 broken.", labels=["stage"]
        )
        replicas = GaugeMetricFamily("sentinel_stage_live_replicas", "Live replicas of each stage.", labels=["stage"])
        compute = GaugeMetricFamily(
            "sentinel_stage_throughput_tokens_per_second",
            "Summed compute throughput of each stage's live replicas, tokens/s.",
            labels=["stage"],
        )
        served = GaugeMetricFamily(
            "sentinel_stage_served_tokens_per_second",
            "Tokens/s each stage's live replicas served over their last report periods.",
            labels=["stage"],
        )
        step = GaugeMetricFamily(
            "sentinel_stage_step", "The highest global step a live replica applied.", labels=["stage"]
        )
        for k in range(view.n_stages):
            live, label = view.live_replicas(k), [str(k)]
            stage_health.add_metric(label, health.stage(k).rank)
            replicas.add_metric(label, len(live))
            compute.add_metric(label, sum(a.throughput for a in live))
            served.add_metric(label, sum(a.network for a in live))
            step.add_metric(label, max((a.last_step for a in live), default=-1))
        boundary_health = GaugeMetricFamily(
            "sentinel_boundary_health", "Each boundary's health: 0 healthy, 1 degraded, 2 broken.", labels=["boundary"]
        )
        verifiers = GaugeMetricFamily(
            "sentinel_boundary_live_verifiers", "Live verifiers of each boundary.", labels=["boundary"]
        )
        checking = GaugeMetricFamily(
            "sentinel_boundary_checks_per_second",
            "Checks/s each boundary's live verifiers sustain.",
            labels=["boundary"],
        )
        for b in range(view.n_stages - 1):
            live, label = view.live_verifiers(b), [f"{b}|{b + 1}"]
            boundary_health.add_metric(label, health.boundary(b).rank)
            verifiers.add_metric(label, len(live))
            checking.add_metric(label, sum(a.throughput for a in live))
        excluded = GaugeMetricFamily("sentinel_swarm_excluded_peers", "Peers excluded swarm-wide.")
        excluded.add_metric([], len(view.excluded))
        strikes = GaugeMetricFamily("sentinel_swarm_strike_records", "Live strike records in the swarm.")
        strikes.add_metric([], len(view.ledger))
        trainer_step = GaugeMetricFamily(
            "sentinel_trainer_global_step", "Each trainer's global step.", labels=["trainer"]
        )
        loss = GaugeMetricFamily(
            "sentinel_trainer_loss", "Each trainer's latest loss, by split.", labels=["trainer", "split"]
        )
        for peer, trainer in sorted(view.trainers.items()):
            if not view.is_live(trainer):
                continue
            trainer_step.add_metric([peer], trainer.global_step)
            if trainer.loss is not None:
                loss.add_metric([peer, "train"], trainer.loss)
            if trainer.val_loss is not None:
                loss.add_metric([peer, "validation"], trainer.val_loss)
        return [
            verdict,
            stage_health,
            replicas,
            compute,
            served,
            step,
            boundary_health,
            verifiers,
            checking,
            excluded,
            strikes,
            trainer_step,
            loss,
        ]


def build_app(monitor: SwarmMonitor) -> Starlette:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SwarmCollector(monitor))

    async def page(_request: Request) -> Response:
        return FileResponse(STATIC / "index.html")

    def section(name: str):
        async def endpoint(_request: Request) -> Response:
            found = monitor.section(name)
            return JSONResponse(found, status_code=503 if "error" in found and len(found) == 1 else 200)

        return endpoint

    async def history(_request: Request) -> Response:
        return JSONResponse({"points": monitor.history.as_json()})

    async def metrics(_request: Request) -> Response:
        return Response(generate_latest(registry), media_type="text/plain; version=0.0.4; charset=utf-8")

    routes = [
        Route("/", page),
        Route("/api/status", section("status")),
        Route("/api/peers", section("peers")),
        Route("/api/strikes", section("strikes")),
        Route("/api/bans", section("bans")),
        Route("/api/history", history),
        Route("/metrics", metrics),
        Mount("/static", StaticFiles(directory=STATIC), name="static"),
    ]
    return Starlette(routes=routes)


def serve(
    initial_peers: list[str],
    config: Config | None,
    host: str = "127.0.0.1",
    port: int = 8400,
    refresh: float = 3.0,
    timeout: float = 15.0,
    on_ready: Callable[[str], None] = lambda url: None,
) -> None:
    """Serves the page until Ctrl-C/SIGTERM; NodeStartError when the port is taken or the swarm cannot be read."""
    import uvicorn

    listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host, port))
    except OSError as e:
        listener.close()
        raise NodeStartError(
            f"--port {port}: cannot listen on {host}:{port} ({e.strerror or e}); choose a free port, or 0 for any"
        ) from None
    try:
        with SwarmReader(initial_peers, config, timeout) as reader:
            monitor = SwarmMonitor(reader, refresh).start()
            try:
                app = build_app(monitor)
                server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False))
                on_ready(f"http://{host}:{listener.getsockname()[1]}/")
                server.run(sockets=[listener])  # handles SIGINT and SIGTERM itself: finishes requests, then returns
            finally:
                monitor.stop()
    finally:
        listener.close()
