"""``sentinel-node bench overhead``: what SENTINEL costs, measured on a local swarm.

One swarm (a bootstrap, 3 stages x 2 replicas, and three verifiers serving every boundary: one checking without
audits, one checking and auditing at the swarm's ``verification.audit_rate``, one a plain relay,
``BoundaryVerifier(enabled=False)``) is trained by one trainer that changes mode at every step, so the four modes
share the stages, the machine's load (which on a shared machine moves a lot) and the point of training:

- ``verified``: every activation and gradient checked by SENTINEL;
- ``audited``: the same, and a share of the settled microbatches recomputed by another replica (recomputation
  audits, run in the background);
- ``relay``: the same hops without checks (the pipeline's own cost);
- ``duplicate``: the baseline verification replaces, every microbatch computed by two replicas and the results
  compared (through the relay verifier).

Reported: tokens/s per mode (the first steps, everyone's warm-up, left out), the ratios verified/relay and
verified/duplicate, and the checking verifier's CPU time per checked tensor against the CPU time of the forward
pass that produced it.

The same is measured once per wire dtype (``pipeline.wire_dtype``, float32 then bfloat16 by default), one swarm
after the other in the same run (a swarm's nodes must agree on it), each with the bytes a microbatch puts on the
wire: the top-level figures are the first dtype's, ``wire_dtypes`` holds every dtype's.

The model: the demo's config with 4 layers per stage (:data:`BENCH_MODEL`). A stage of a real deployment holds
many layers; with the demo's single layer per stage a check costs about as much as the forward pass it checks,
which says nothing about a deployment. Everything here shares the machine's cores, verifiers included, so the
verifier's CPU time is on the critical path; on a real swarm it runs on machines of its own.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import yaml

from dht import create_identity_file, load_identity_file
from sentinel_node.config import Config, load_config
from sentinel_node.demo import DEMO_CONFIG_PATH
from sentinel_node.roles.status import StageStatus, VerifierStatus
from sentinel_node.supervisor import LOOPBACK, LocalSwarm, SwarmStartError

MODES = ("verified", "audited", "relay", "duplicate")
BENCH_MODEL = {"hidden_size": 128, "intermediate_size": 344, "n_layers": 12, "n_heads": 4, "n_kv_heads": 4}
TARGETS = {"verified_over_relay": 0.85, "verified_over_duplicate": 1.8}
AUDIT_MARGIN = 0.01  # audits may cost the audit rate plus this share of throughput
NEVER = 10**9


@dataclass(frozen=True)
class OverheadSettings:
    steps: int = 44  # cycled over the four modes
    microbatches_per_step: int = 12
    warmup_steps: int = 3  # left out of the figures
    replicas: int = 2
    config_path: Path = DEMO_CONFIG_PATH
    model: tuple[tuple[str, int], ...] = tuple(BENCH_MODEL.items())  # overrides of the config's model section
    workdir: Path | None = None
    start_timeout: float = 150.0
    wire_dtypes: tuple[str, ...] = ("float32", "bfloat16")  # one swarm each, in this order


def run_overhead(
    settings: OverheadSettings = OverheadSettings(), echo: Callable[[str], None] = lambda _: None
) -> dict:
    """Per wire dtype: starts the swarm, trains ``settings.steps`` steps cycling the modes, stops every process.
    The report: the first dtype's figures, and every dtype's under ``wire_dtypes``."""
    reports = {}
    for dtype in settings.wire_dtypes:
        echo(f"--- wire dtype {dtype}")
        reports[dtype] = _run_one(settings, dtype, echo)
    first = reports[settings.wire_dtypes[0]]
    return {**first, "wire_dtypes": {dtype: _dtype_summary(report) for dtype, report in reports.items()}}


def _dtype_summary(report: dict) -> dict:
    keys = ("wire", "tokens_per_s", "ratios", "verifier_cpu_ms_per_check", "cpu_accounting", "wall_s")
    return {key: report[key] for key in keys}


def wire_bytes(config: Config) -> dict:
    """What one microbatch puts on the wire (tensor payloads as the codec serializes them, without framing): the
    trainer's tokens and targets to stage 0, then per boundary the activation and targets to the verifier and on
    to the next stage, and the gradient back over both hops."""
    from sentinel_node.transport import TransportSettings
    from sentinel_node.transport.codec import TensorLimits, resolve_compression, serialize_tensors

    pipe = config.pipeline
    transport = TransportSettings(compression=pipe.compression, max_tensor_mib=pipe.max_tensor_mib)
    compression = resolve_compression(transport.compression)
    limits = TensorLimits(max_tensor_mib=pipe.max_tensor_mib)

    def size(tensor: torch.Tensor) -> int:
        return sum(len(proto.buffer) for proto in serialize_tensors([tensor], compression, limits))

    shape = (pipe.microbatch_size, pipe.seq_len, config.model.hidden_size)
    hidden = size(torch.zeros(shape, dtype=getattr(torch, pipe.wire_dtype)))
    tokens = size(torch.zeros(pipe.microbatch_size, pipe.seq_len, dtype=torch.int64))
    boundaries = pipe.n_stages - 1
    return {
        "dtype": pipe.wire_dtype,
        "compression": pipe.compression,
        "hidden_state_bytes": hidden,
        "bytes_per_microbatch": 2 * tokens + boundaries * (2 * (hidden + tokens) + 2 * hidden),
    }


def _run_one(settings: OverheadSettings, wire_dtype: str, echo: Callable[[str], None]) -> dict:
    from sentinel_node.roles.common import JoinOptions
    from sentinel_node.roles.route_modes import RoutingMode, RoutingSchedule
    from sentinel_node.roles.trainer import StepLog, TrainerOptions, run_trainer

    with tempfile.TemporaryDirectory(prefix="sentinel-bench-") as scratch:
        workdir = Path(settings.workdir or scratch) / wire_dtype
        workdir.mkdir(parents=True, exist_ok=True)
        # enough microbatches in flight to keep every core busy (a swarm's hardware is the scarce thing: duplicate
        # computation costs what it costs only when no core idles), and no parameter averaging, whose rounds
        # would land on some modes' steps and not others'
        pipeline = {
            "average_every": NEVER,
            "microbatches_per_step": settings.microbatches_per_step,
            "wire_dtype": wire_dtype,
        }
        (workdir / "identities").mkdir(exist_ok=True, mode=0o700)
        # a closed swarm, as a real one: its three verifiers (checking, checking and auditing, and a plain relay, the
        # bench's point of comparison) and its trainer are listed by peer id
        ids = {}
        for name in ("checking", "auditing", "relay", "trainer"):
            path = workdir / "identities" / f"{name}.key"
            ids[name] = (load_identity_file(path) if path.exists() else create_identity_file(path)).peer_id
        trust = {
            "trusted_verifiers": [ids["checking"], ids["auditing"], ids["relay"]],
            "trainers": [ids["trainer"]],
            "ban_quorum": 1,
            "open_trainers": False,
            "open_verifiers": False,
        }
        config = load_config(settings.config_path).with_overrides(
            model=dict(settings.model), pipeline=pipeline, swarm=trust
        )
        config_path = workdir / "swarm.yaml"
        config_path.write_text(yaml.safe_dump(config.model_dump(), sort_keys=False))
        started = time.monotonic()
        with LocalSwarm(workdir, config_path) as swarm:
            bootstrap = swarm.start("bootstrap", "bootstrap")
            swarm.wait_ready([bootstrap], settings.start_timeout)
            nodes = [
                swarm.start(f"stage{k}-{r}", "stage", "--stage", str(k))
                for k in range(config.pipeline.n_stages)
                for r in range(settings.replicas)
            ]
            nodes.append(swarm.start("checking", "verifier", "--no-audit"))
            nodes.append(swarm.start("auditing", "verifier"))
            nodes.append(swarm.start("relay", "verifier", "--no-verify"))
            swarm.wait_ready(nodes, settings.start_timeout)
            echo(f"swarm up in {time.monotonic() - started:.0f}s; {settings.steps} steps cycling {', '.join(MODES)}")
            checking, relay = swarm.nodes["checking"].peer_id, swarm.nodes["relay"].peer_id
            auditing = swarm.nodes["auditing"].peer_id
            schedule = RoutingSchedule(
                (
                    RoutingMode((checking,)),
                    RoutingMode((auditing,)),
                    RoutingMode((relay,)),
                    RoutingMode((relay,), copies=2),
                )
            )
            logs: list[StepLog] = []

            def on_step(log: StepLog) -> None:
                logs.append(log)
                echo(f"step {log.step:>3} {MODES[log.mode]:>9}: {log.tokens_per_s:7.0f} tokens/s")

            summary = run_trainer(
                JoinOptions(
                    config=config,
                    identity_path=str(workdir / "identities" / "trainer.key"),
                    initial_peers=tuple(swarm.initial_peers),
                    host_maddrs=(LOOPBACK,),
                ),
                on_ready=lambda *_: None,
                settings=TrainerOptions(steps=settings.steps, start_step=0, eval_every=0, routing=schedule),
                on_step=on_step,
            )
            checking_status = swarm.nodes["checking"].status()
            auditing_status = swarm.nodes["auditing"].status()
            if not isinstance(checking_status, VerifierStatus) or not isinstance(auditing_status, VerifierStatus):
                raise SwarmStartError("a checking verifier wrote no status; see its log in the workdir")
            stages = {name: node.status() for name, node in swarm.nodes.items() if node.role == "stage"}
            stages = {name: status for name, status in stages.items() if isinstance(status, StageStatus)}
        steps = {mode: [] for mode in MODES}
        for log in logs[settings.warmup_steps :]:
            steps[MODES[log.mode]].append(asdict(log))
        report = _report(
            config, settings, steps, summary.duplicate_loss_gap, checking_status, stages, time.monotonic() - started
        )
        report["audits"] = _audit_report(config, report, auditing_status, stages)
        return report


def _tokens_per_s(records: list[dict]) -> float:
    tokens = sum(r["tokens_per_s"] * r["step_s"] for r in records)
    seconds = sum(r["step_s"] for r in records)
    return tokens / seconds if seconds else 0.0


def _report(
    config: Config,
    settings: OverheadSettings,
    steps: dict[str, list[dict]],
    duplicate_loss_gap: float | None,
    checking: VerifierStatus,
    stages: dict[str, StageStatus],
    wall_s: float,
) -> dict:
    throughput = {mode: _tokens_per_s(records) for mode, records in steps.items()}
    forward_ms = [s.forward_cpu_ms for s in stages.values() if s.forward_cpu_ms is not None]
    check_ms = checking.cpu_ms_per_check
    mean_forward = sum(forward_ms) / len(forward_ms) if forward_ms else None
    ratios = {
        "verified_over_relay": throughput["verified"] / throughput["relay"] if throughput["relay"] else None,
        "verified_over_duplicate": throughput["verified"] / throughput["duplicate"]
        if throughput["duplicate"]
        else None,
    }
    cpu = _cpu_accounting(config, checking, stages)
    return {
        "wire": wire_bytes(config),
        "model": {"hidden_size": config.model.hidden_size, "n_layers": config.model.n_layers},
        "pipeline": {
            "n_stages": config.pipeline.n_stages,
            "replicas": settings.replicas,
            "microbatch": [config.pipeline.microbatch_size, config.pipeline.seq_len],
            "microbatches_per_step": config.pipeline.microbatches_per_step,
        },
        "steps_per_mode": {mode: len(records) for mode, records in steps.items()},
        "tokens_per_s": throughput,
        "ratios": ratios,
        "targets": TARGETS,
        "meets_targets": all(ratios[k] is not None and ratios[k] >= v for k, v in TARGETS.items()),
        "verifier_cpu_ms_per_check": check_ms,
        "checks": checking.checks,
        "stage_forward_cpu_ms": mean_forward,
        "check_over_forward": check_ms / mean_forward if check_ms and mean_forward else None,
        "cpu_accounting": cpu,
        "duplicate_loss_gap": duplicate_loss_gap,
        "wall_s": round(wall_s, 1),
    }


def _cpu_accounting(config: Config, checking: VerifierStatus, stages: dict[str, StageStatus]) -> dict | None:
    """The ratios a CPU-bound swarm would show, from CPU time alone, whatever else loads the machine.

    C: the stages' compute per microbatch (forward and backward on every stage of a route); V: the checks per
    microbatch (an activation and a gradient per boundary). verified/relay = C / (C + V), verified/duplicate =
    2C / (C + V). Transport CPU, paid alike by every mode (twice by duplicate), is left out, which understates
    both ratios.
    """
    visits = sum(s.served + s.dropped + s.evaluated for s in stages.values())
    cpu_s = sum(s.compute_cpu_s for s in stages.values())
    check_ms = checking.cpu_ms_per_check
    if not visits or not check_ms:
        return None
    n_stages = config.pipeline.n_stages
    compute_ms = 1000 * cpu_s / visits * n_stages
    checks_ms = check_ms * 2 * (n_stages - 1)
    return {
        "stage_compute_ms_per_microbatch": compute_ms,
        "checks_ms_per_microbatch": checks_ms,
        "verified_over_relay": compute_ms / (compute_ms + checks_ms),
        "verified_over_duplicate": 2 * compute_ms / (compute_ms + checks_ms),
    }


def _audit_report(config: Config, report: dict, auditing: VerifierStatus, stages: dict[str, StageStatus]) -> dict:
    """Audited against verified throughput (same run, alternate steps) and, from CPU time, what the audits the
    auditing verifier ran cost the stages that recomputed them, per microbatch."""
    rate = config.verification.audit_rate
    throughput = report["tokens_per_s"]
    ratio = throughput["audited"] / throughput["verified"] if throughput["verified"] else None
    recomputed = sum(s.recomputations.get("served", 0) for s in stages.values())
    recompute_cpu_s = sum(s.recompute_cpu_s for s in stages.values())
    cpu = report.get("cpu_accounting")
    by_cpu = None
    if recomputed and cpu:
        per_audit_ms = 1000 * recompute_cpu_s / recomputed
        # audits per microbatch: one draw per stage of its route, at the audit rate
        audit_ms = rate * config.pipeline.n_stages * per_audit_ms
        compute_ms = cpu["stage_compute_ms_per_microbatch"] + cpu["checks_ms_per_microbatch"]
        by_cpu = {
            "recompute_ms_per_audit": per_audit_ms,
            "audit_ms_per_microbatch": audit_ms,
            "audited_over_verified": compute_ms / (compute_ms + audit_ms),
        }
    target = 1 - (rate + AUDIT_MARGIN)
    return {
        "audit_rate": rate,
        "audited_over_verified": ratio,
        "target": target,
        "meets_target": ratio is not None and ratio >= target,
        "by_cpu": by_cpu,
        "audits": auditing.audits,
        "recomputations": recomputed,
    }


def table(report: dict) -> str:
    """The report as a readable table."""
    t, r = report["tokens_per_s"], report["ratios"]

    def ratio(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    lines = [
        f"{'mode':<12} {'tokens/s':>9} {'steps':>6}",
        *(f"{mode:<12} {t[mode]:>9.0f} {report['steps_per_mode'][mode]:>6}" for mode in MODES),
        "",
        f"verified / relay      {ratio(r['verified_over_relay']):>6}   (target >= {TARGETS['verified_over_relay']})",
        f"verified / duplicate  {ratio(r['verified_over_duplicate']):>6}   "
        f"(target >= {TARGETS['verified_over_duplicate']})",
    ]
    cpu = report.get("cpu_accounting")
    if cpu:
        lines.append(
            f"by CPU time: compute {cpu['stage_compute_ms_per_microbatch']:.1f} ms and checks "
            f"{cpu['checks_ms_per_microbatch']:.1f} ms per microbatch: verified / relay "
            f"{cpu['verified_over_relay']:.2f}, verified / duplicate {cpu['verified_over_duplicate']:.2f}"
        )
    audits = report.get("audits")
    if audits:
        lines.append(
            f"audited / verified    {ratio(audits['audited_over_verified']):>6}   (target >= {audits['target']:.2f}: "
            f"audit rate {audits['audit_rate']} + {AUDIT_MARGIN}); {audits['recomputations']} recomputations"
        )
        if audits["by_cpu"]:
            c = audits["by_cpu"]
            lines.append(
                f"by CPU time: {c['recompute_ms_per_audit']:.1f} ms per audit's recomputation, "
                f"{c['audit_ms_per_microbatch']:.2f} ms per microbatch: audited / verified "
                f"{c['audited_over_verified']:.3f}"
            )
    if report["verifier_cpu_ms_per_check"] is not None:
        lines.append(
            f"verifier CPU per checked tensor {report['verifier_cpu_ms_per_check']:.2f} ms; producing forward "
            f"{report['stage_forward_cpu_ms']:.2f} ms (ratio {ratio(report['check_over_forward'])})"
        )
    lines.append(f"targets {'met' if report['meets_targets'] else 'NOT met'}; wall time {report['wall_s']:.0f}s")
    by_dtype = report.get("wire_dtypes") or {}
    if len(by_dtype) > 1:
        lines += [
            "",
            f"{'wire dtype':<10} {'bytes/microbatch':>16} {'verified tok/s':>14} {'relay tok/s':>11} "
            f"{'duplicate tok/s':>15} {'check CPU ms':>12}",
        ]
        for dtype, summary in by_dtype.items():
            t, check = summary["tokens_per_s"], summary["verifier_cpu_ms_per_check"]
            lines.append(
                f"{dtype:<10} {summary['wire']['bytes_per_microbatch']:>16,} {t['verified']:>14.0f} "
                f"{t['relay']:>11.0f} {t['duplicate']:>15.0f} {'-' if check is None else f'{check:.2f}':>12}"
            )
    return "\n".join(lines)


def write_report(report: dict, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "overhead.json"
    path.write_text(json.dumps(report, indent=2))
    return path
