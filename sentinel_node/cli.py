"""The `sentinel-node` command: parse, build a config, call. No logic lives here."""

from __future__ import annotations

import click

from sentinel_node.config import ConfigError, load_config


def _load(config_path: str | None):
    try:
        return load_config(config_path)
    except ConfigError as e:
        raise click.BadParameter(str(e), param_hint="--config") from None


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="sentinel-node")
def main() -> None:
    """sentinel-node: pipeline-parallel LLM training across untrusted volunteers, kept honest by SENTINEL."""


# --- join and swarm: running a node, and reading the swarm from the DHT -------------------------------------------

# role -> (module, function); each runner takes (JoinOptions, on_ready) and serves until SIGTERM/SIGINT.
# Modules are imported only when their role runs: importing hivemind takes seconds and --help must stay fast.
ROLE_RUNNERS = {
    "bootstrap": ("sentinel_node.roles.bootstrap", "run_bootstrap"),
    "stage": ("sentinel_node.roles.stage", "run_stage"),
    "verifier": ("sentinel_node.roles.verifier", "run_verifier"),
    "trainer": ("sentinel_node.roles.trainer", "run_trainer"),
}


def _maddrs(values: tuple[str, ...], option: str) -> tuple[str, ...]:
    from sentinel_node.roles.common import parse_maddrs

    try:
        return parse_maddrs(values, option, need_peer_id=option == "--initial-peers")
    except ValueError as e:
        raise click.UsageError(str(e)) from None


_initial_peers_option = click.option(
    "--initial-peers",
    multiple=True,
    envvar="SENTINEL_INITIAL_PEERS",
    help="Multiaddrs of running nodes (what a bootstrap printed); repeat, or separate by spaces.",
)
_config_option = click.option(
    "--config", "config_path", type=click.Path(dir_okay=False), help="Swarm config YAML (default: configs/tiny.yaml)."
)


def _print_ready(peer_id: str, maddrs: list[str]) -> None:
    click.echo(f"node {peer_id} is up; other nodes join with:")
    for maddr in maddrs:
        click.echo(f"  --initial-peers {maddr}")


def _pipeline_options(command):
    """Options of the stage, verifier and trainer roles (ignored by the others)."""
    options = [
        click.option("--stage", type=click.IntRange(min=0), help="stage: which stage of the model to hold (0-based)."),
        click.option(
            "--device",
            help="stage: torch device: auto (the default: CUDA when visible, else cpu), cpu, cuda or cuda:N; "
            "verifier: where checks run: cpu (the default), cuda or cuda:N.",
        ),
        click.option(
            "--state-dir",
            type=click.Path(file_okay=False),
            help="stage: keep checkpoints here; resume from the newest on start (default: none kept).",
        ),
        click.option(
            "--checkpoint-every",
            type=click.IntRange(min=1),
            default=10,
            show_default=True,
            help="stage: global steps between checkpoints (one is also saved on shutdown).",
        ),
        click.option("--attack", help="stage, red team: corrupt what it sends with this attack from the catalogue."),
        click.option("--attack-file", help="stage, red team: an attack of your own, PATH.py:NAME."),
        click.option(
            "--attack-target",
            type=click.Choice(["activation", "gradient", "both"]),
            default="both",
            show_default=True,
            help="stage, red team: which tensors it corrupts.",
        ),
        click.option(
            "--attack-start", type=click.IntRange(min=0), default=0, show_default=True, help="global step to start at."
        ),
        click.option(
            "--attack-probability",
            type=click.FloatRange(0, 1, min_open=True),
            default=1.0,
            show_default=True,
            help="share of tensors it corrupts.",
        ),
        click.option(
            "--boundaries",
            multiple=True,
            help="verifier: boundaries to serve (b sits between stage b and b+1), e.g. 0,1; default: all.",
        ),
        click.option("--no-verify", is_flag=True, help="verifier: relay without checking (overhead measurements)."),
        click.option(
            "--steps", type=click.IntRange(min=0), default=0, show_default=True, help="trainer: steps (0: no end)."
        ),
        click.option(
            "--inflight", type=click.IntRange(min=0), default=0, help="trainer: microbatches in flight (0: a step's)."
        ),
        click.option(
            "--eval-every", type=click.IntRange(min=0), default=10, show_default=True, help="trainer: validate every."
        ),
        click.option(
            "--eval-batches", type=click.IntRange(min=1), default=4, show_default=True, help="trainer: batches."
        ),
        click.option(
            "--microbatch-timeout",
            type=click.FloatRange(min=1),
            default=30.0,
            show_default=True,
            help="trainer: seconds a microbatch may take along its whole route.",
        ),
        click.option(
            "--start-step",
            type=click.IntRange(min=0),
            help="trainer: first global step (default: resume the swarm's).",
        ),
        click.option("--only-verifiers", multiple=True, help="trainer: route through these verifiers only (benches)."),
        click.option("--duplicate", is_flag=True, help="trainer: compute each microbatch on two replicas (baseline)."),
        click.option("--metrics-out", type=click.Path(dir_okay=False), help="trainer: append JSON lines per step."),
        click.option("--progress/--no-progress", default=None, help="trainer: progress bar (default: on a terminal)."),
        click.option("--status-file", type=click.Path(dir_okay=False), help="Keep this node's view in a JSON file."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def _role_settings(role: str, opts: dict) -> dict:
    """The keyword arguments a pipeline role's runner takes, from the join options."""
    import sys

    if role == "stage":
        from sentinel_node.roles.stage import AttackOptions, StageOptions

        if opts["stage"] is None:
            raise click.UsageError("--role stage needs --stage K: which stage of the model this node holds")
        attack = None
        if opts["attack"] or opts["attack_file"]:
            attack = AttackOptions(
                name=opts["attack"],
                file=opts["attack_file"],
                target=opts["attack_target"],
                start=opts["attack_start"],
                probability=opts["attack_probability"],
            )
        settings = StageOptions(
            opts["stage"],
            attack,
            opts["device"] or "auto",
            opts["status_file"],
            state_dir=opts["state_dir"],
            checkpoint_every=opts["checkpoint_every"],
        )
        return {"settings": settings}
    if role == "verifier":
        from sentinel_node.roles.verifier import VerifierOptions

        try:
            boundaries = tuple(int(b) for value in opts["boundaries"] for b in value.replace(",", " ").split())
        except ValueError:
            raise click.BadParameter("integers, e.g. --boundaries 0,1", param_hint="--boundaries") from None
        settings = VerifierOptions(boundaries, not opts["no_verify"], opts["status_file"], opts["device"] or "cpu")
        return {"settings": settings}
    if role == "trainer":
        from sentinel_node.roles.trainer import TrainerOptions

        progress = sys.stderr.isatty() if opts["progress"] is None else opts["progress"]
        settings = TrainerOptions(
            steps=opts["steps"],
            inflight=opts["inflight"],
            eval_every=opts["eval_every"],
            eval_batches=opts["eval_batches"],
            microbatch_timeout=opts["microbatch_timeout"],
            metrics_out=opts["metrics_out"],
            status_file=opts["status_file"],
            progress=progress,
            start_step=opts["start_step"],
            only_verifiers=tuple(p for value in opts["only_verifiers"] for p in value.replace(",", " ").split()),
            duplicate=opts["duplicate"],
        )
        return {"settings": settings}
    return {}


@main.command()
@click.option("--role", type=click.Choice(sorted(ROLE_RUNNERS)), required=True, help="What this node does.")
@_config_option
@click.option(
    "--identity",
    "identity_path",
    type=click.Path(dir_okay=False),
    help="Private key file naming this node and signing its records; created (0600) if missing. "
    "Default: a new throwaway identity on every start.",
)
@_initial_peers_option
@click.option(
    "--host-maddrs",
    multiple=True,
    default=("/ip4/0.0.0.0/tcp/0",),
    show_default=True,
    help="Multiaddrs to listen on, e.g. /ip4/0.0.0.0/tcp/31337 for a fixed port.",
)
@click.option("--announce-maddrs", multiple=True, help="Public multiaddrs to tell others (behind NAT or Docker).")
@click.option(
    "--use-relay/--no-use-relay",
    default=True,
    show_default=True,
    help="Reach peers that are themselves reachable only through a libp2p relay.",
)
@click.option(
    "--use-auto-relay",
    is_flag=True,
    help="Behind NAT with no open port: find relays and be reachable through them (slower; announced as relayed, "
    "so trainers prefer direct peers).",
)
@click.option(
    "--metrics-port",
    type=click.IntRange(0, 65535),
    envvar="SENTINEL_METRICS_PORT",
    help="Serve Prometheus metrics on this port (0: any free port; default: off).",
)
@_pipeline_options
def join(
    role: str,
    config_path: str | None,
    identity_path: str | None,
    initial_peers: tuple[str, ...],
    host_maddrs: tuple[str, ...],
    announce_maddrs: tuple[str, ...],
    use_relay: bool,
    use_auto_relay: bool,
    metrics_port: int | None,
    **role_options,
) -> None:
    """Run a node of the swarm in ROLE until SIGTERM or Ctrl-C (a trainer with --steps ends after them)."""
    import importlib

    from dht import IdentityError
    from sentinel_node.attacks import AttackError
    from sentinel_node.roles.common import JoinOptions, NodeError

    options = JoinOptions(
        config=_load(config_path),
        identity_path=identity_path,
        initial_peers=_maddrs(initial_peers, "--initial-peers"),
        host_maddrs=_maddrs(host_maddrs, "--host-maddrs"),
        announce_maddrs=_maddrs(announce_maddrs, "--announce-maddrs"),
        metrics_port=metrics_port,
        use_relay=use_relay,
        use_auto_relay=use_auto_relay,
    )
    extra = _role_settings(role, role_options)
    from hivemind.utils.logging import use_hivemind_log_handler

    use_hivemind_log_handler("in_root_logger")  # the node's own INFO lines (steps, flags, bans) go to stderr too
    module, function = ROLE_RUNNERS[role]
    runner = getattr(importlib.import_module(module), function)
    try:
        result = runner(options, on_ready=_print_ready, **extra)
    except (NodeError, IdentityError, AttackError) as e:
        raise click.ClickException(str(e)) from None
    if role == "trainer" and result is not None:
        first, last = result.first_val_loss, result.last_val_loss
        val = "no validation" if first is None or last is None else f"validation loss {first:.4f} -> {last:.4f}"
        click.echo(f"trained {result.steps} steps in {result.wall_s:.0f}s: {val}; microbatches {result.accounting}")


# --- demo: a whole swarm on this machine -----------------------------------------------------------------------


@main.command()
@click.option("--steps", type=click.IntRange(min=1), default=40, show_default=True, help="Global steps to train.")
@click.option(
    "--attack", default="random", show_default=True, help="The attacker's attack (from the catalogue); 'none': none."
)
@click.option(
    "--attack-start", type=click.IntRange(min=0), default=14, show_default=True, help="Step the attacker starts at."
)
@click.option("--config", "config_path", type=click.Path(dir_okay=False), help="Default: configs/demo.yaml.")
@click.option("--workdir", type=click.Path(file_okay=False), help="Keep logs and status files here.")
@click.option("--json", "as_json", is_flag=True, help="Print only the summary, as one JSON object.")
def demo(steps: int, attack: str, attack_start: int, config_path: str | None, workdir: str | None, as_json: bool):
    """Train the tiny model with a local swarm (bootstrap, 3 stages x 2 replicas, 2 verifiers, a trainer) in
    which one replica of the middle stage attacks; show it struck and excluded while the loss keeps falling."""
    import json
    from pathlib import Path

    from sentinel_node.demo import DEMO_CONFIG_PATH, DemoSettings, SwarmStartError, render_summary, run_demo

    _load(config_path)  # a bad --config fails here, before any process starts
    settings = DemoSettings(
        steps=steps,
        attack=None if attack == "none" else attack,
        attack_start=attack_start,
        config_path=Path(config_path) if config_path else DEMO_CONFIG_PATH,
        workdir=Path(workdir) if workdir else None,
    )
    try:
        result = run_demo(settings, echo=(lambda _: None) if as_json else click.echo)
    except SwarmStartError as e:
        raise click.ClickException(str(e)) from None
    if as_json:
        click.echo(json.dumps(result.summary))
    else:
        click.echo(render_summary(result.summary))


@main.group()
def swarm() -> None:
    """Read the swarm from the DHT as a client-only peer: status, peers, strikes, bans."""


def _reader_options(command):
    command = _initial_peers_option(command)
    command = _config_option(command)
    command = click.option(
        "--timeout", type=click.FloatRange(min=0.5), default=15.0, show_default=True, help="Seconds to give up after."
    )(command)
    return click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables.")(command)


def _show_swarm(section: str, initial_peers, config_path, timeout: float, as_json: bool) -> None:
    import json

    from sentinel_node.roles.common import NodeStartError
    from sentinel_node.swarm_view import RENDERERS, read_swarm, to_json

    config = _load(config_path)
    peers = _maddrs(initial_peers, "--initial-peers")
    if not peers:
        raise click.UsageError("pass --initial-peers: the multiaddrs a bootstrap node printed when it started")
    try:
        view = read_swarm(config, peers, timeout)
    except NodeStartError as e:
        raise click.ClickException(str(e)) from None
    click.echo(json.dumps(to_json(view, config, section), indent=2) if as_json else RENDERERS[section](view, config))


@swarm.command()
@_reader_options
def status(initial_peers, config_path, timeout, as_json) -> None:
    """Stages with their replicas, verifiers, trainers, and a health summary."""
    _show_swarm("status", initial_peers, config_path, timeout, as_json)


@swarm.command()
@_reader_options
def peers(initial_peers, config_path, timeout, as_json) -> None:
    """Every announced node: role, state, throughput, addresses."""
    _show_swarm("peers", initial_peers, config_path, timeout, as_json)


@swarm.command()
@_reader_options
def strikes(initial_peers, config_path, timeout, as_json) -> None:
    """Strike records per accused peer, with the verifier that issued each."""
    _show_swarm("strikes", initial_peers, config_path, timeout, as_json)


@swarm.command()
@_reader_options
def bans(initial_peers, config_path, timeout, as_json) -> None:
    """Excluded peers and the votes that excluded them."""
    _show_swarm("bans", initial_peers, config_path, timeout, as_json)


# --- simulate and bench: the in-process mesh and the measured figures ----------------------------------------------


def _attack_choice():
    from sentinel_node.attacks import CATALOGUE

    return click.Choice(sorted(CATALOGUE))


@main.command()
@_config_option
@click.option("--attack", type=_attack_choice(), help="Attack the malicious replicas run (default: none).")
@click.option("--attack-file", help="A red team's own attack: PATH.py:NAME, a function (tensor, step, state).")
@click.option(
    "--target", type=click.Choice(["activation", "gradient", "both"]), default="activation", show_default=True
)
@click.option("--steps", type=click.IntRange(min=1), help="Global steps (default: the config's sim.steps).")
@click.option("--attack-start", type=click.IntRange(min=0), help="Step the attackers start at.")
@click.option("--no-verify", is_flag=True, help="Run without SENTINEL (verifiers relay only).")
@click.option("--data", type=click.Path(file_okay=False), help="A folder of your own text files to train on.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as one JSON object.")
def simulate(config_path, attack, attack_file, target, steps, attack_start, no_verify, data, as_json) -> None:
    """Train a DP x PP mesh in this process, with SENTINEL verifiers and attacking replicas, and show it live."""
    import json

    from sentinel_node.attacks import AttackError
    from sentinel_node.sim.run import simulate as run_simulation

    config = _load(config_path)
    sim = {k: v for k, v in {"steps": steps, "attack_start": attack_start}.items() if v is not None}
    overrides = {"sim": sim, **({"data": {"path": data}} if data else {})}
    try:
        result = run_simulation(
            config.with_overrides(**overrides),
            attack=attack,
            attack_file=attack_file,
            target=target,
            verify=not no_verify,
            on_line=None if as_json else click.echo,
        )
    except (AttackError, FileNotFoundError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    click.echo(json.dumps(result, indent=2) if as_json else result["text"])


@main.group()
def bench() -> None:
    """Measured figures: detection (the attack catalogue in the simulator), overhead (a local swarm)."""


@bench.command()
@_config_option
@click.option("--quick", is_flag=True, help="The profile that finishes within 5 minutes on 2 cores.")
@click.option("--attack", "attacks", multiple=True, type=_attack_choice(), help="Only this attack (repeatable).")
@click.option("--attack-file", help="A red team's own attack, PATH.py:NAME; run on activations and on gradients.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the table.")
@click.option("--out", type=click.Path(file_okay=False), default="runs/bench", show_default=True, help="PNGs, JSON.")
@click.option("--workers", type=click.IntRange(min=1), default=2, show_default=True, help="Runs in parallel.")
def detection(config_path, quick, attacks, attack_file, as_json, out, workers) -> None:
    """SENTINEL against every attack: worker-level F1, flag rates, time to ban, validation loss."""
    import json
    from pathlib import Path

    from sentinel_node.attacks import AttackError
    from sentinel_node.bench.detection import plot, run_detection, table

    config = _load(config_path)
    try:
        report = run_detection(
            config,
            profile="quick" if quick else "full",
            attacks=list(attacks) or None,
            attack_file=attack_file,
            workers=workers,
            progress=None if as_json else lambda line: click.echo(line, err=True),
        )
    except (AttackError, FileNotFoundError) as e:
        raise click.ClickException(str(e)) from None
    out_dir = Path(out)
    plot(report, out_dir)
    (out_dir / "detection.json").write_text(json.dumps(report, indent=2))
    printable = {**report, "attacks": [{k: v for k, v in row.items() if k != "curves"} for row in report["attacks"]]}
    click.echo(json.dumps(printable, indent=2) if as_json else table(report))
    if not as_json:
        click.echo(f"plots and detection.json in {out_dir}/")


@bench.command()
@click.option("--config", "config_path", type=click.Path(dir_okay=False), help="Default: configs/demo.yaml.")
@click.option(
    "--steps", type=click.IntRange(min=6), default=33, show_default=True, help="Steps, cycling the three modes."
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the table.")
@click.option("--out", type=click.Path(file_okay=False), default="runs/bench", show_default=True, help="JSON here.")
@click.option("--workdir", type=click.Path(file_okay=False), help="Keep the swarm's logs and status files here.")
@click.option(
    "--wire-dtype",
    "wire_dtypes",
    multiple=True,
    type=click.Choice(["float32", "bfloat16", "float16"]),
    help="One swarm per wire dtype, in order (repeatable; default: float32 then bfloat16).",
)
def overhead(config_path, steps, as_json, out, workdir, wire_dtypes) -> None:
    """SENTINEL's cost on a local swarm: tokens/s verified vs plain relays vs duplicate computation, and the
    verifier's CPU time per checked tensor against the forward pass that produced it; per wire dtype, with the
    bytes a microbatch puts on the wire."""
    import json
    from pathlib import Path

    from sentinel_node.bench.overhead import OverheadSettings, run_overhead, table, write_report
    from sentinel_node.demo import DEMO_CONFIG_PATH, SwarmStartError
    from sentinel_node.roles.common import NodeError

    _load(config_path)
    settings = OverheadSettings(
        steps=steps,
        config_path=Path(config_path) if config_path else DEMO_CONFIG_PATH,
        workdir=Path(workdir) if workdir else None,
        **({"wire_dtypes": tuple(wire_dtypes)} if wire_dtypes else {}),
    )
    try:
        report = run_overhead(settings, echo=lambda line: click.echo(line, err=True))
    except (SwarmStartError, NodeError) as e:
        raise click.ClickException(str(e)) from None
    path = write_report(report, Path(out))
    click.echo(json.dumps(report, indent=2) if as_json else table(report))
    if not as_json:
        click.echo(f"{path} written")


# --- bench verifier: one check against the physical limits (issue 12) -----------------------------------------------


def _shape(value: str) -> tuple[int, int, int]:
    try:
        shape = tuple(int(part) for part in value.replace("x", ",").split(","))
    except ValueError:
        shape = ()
    if len(shape) != 3 or min(shape) < 1:
        raise click.BadParameter(f"{value!r}: give batch,tokens,hidden, e.g. 8,64,128", param_hint="--shape")
    return shape


@bench.command("verifier")
@_config_option
@click.option("--device", default="cpu", show_default=True, help="Where the checks run: cpu, cuda or cuda:N.")
@click.option(
    "--wire-dtype",
    type=click.Choice(["float32", "bfloat16", "float16"]),
    help="dtype of the checked tensors (default: the config's pipeline.wire_dtype).",
)
@click.option(
    "--shape", "shapes", multiple=True, help="batch,tokens,hidden (repeatable; default: 8,64,128 to 2,1024,4096)."
)
@click.option(
    "--threads", type=click.IntRange(min=1), default=1, show_default=True, help="torch threads (a verifier uses 1)."
)
@click.option("--repeats", type=click.IntRange(min=3), default=12, show_default=True, help="Timed checks per shape.")
@click.option("--accuracy", is_flag=True, help="Also compare the randomized spectral share with the exact one.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the tables.")
def verifier_bench(config_path, device, wire_dtype, shapes, threads, repeats, accuracy, as_json) -> None:
    """What one check costs per shape and direction: ms, MiB/s, ratio to a memory copy, the tensor's transfer
    time at 100 Mbit/s and 1 Gbit/s, and the time of each stage of the profile."""
    import json

    from sentinel_node.bench.verifier import (
        SHAPES,
        VerifierBenchSettings,
        accuracy_table,
        run_verifier_bench,
        spectral_accuracy,
        table,
    )
    from sentinel_node.pipeline.device import DeviceError

    config = _load(config_path)
    settings = VerifierBenchSettings(
        shapes=tuple(_shape(s) for s in shapes) or SHAPES,
        device=device,
        wire_dtype=wire_dtype or config.pipeline.wire_dtype,
        repeats=repeats,
        threads=threads,
    )
    try:
        report = run_verifier_bench(
            config, settings, echo=lambda line: None if as_json else click.echo(line, err=True)
        )
    except DeviceError as e:
        raise click.ClickException(str(e)) from None
    if accuracy:
        report["accuracy"] = spectral_accuracy(config)
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    click.echo(table(report))
    if accuracy:
        click.echo("")
        click.echo(accuracy_table(report["accuracy"]))
