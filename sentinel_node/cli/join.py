"""``sentinel-node join``: run a node of the swarm in one role."""

from __future__ import annotations

import click

from sentinel_node.cli.options import config_option, initial_peers_option, load, maddrs

# role -> (module, function); each runner takes (JoinOptions, on_ready) and serves until SIGTERM/SIGINT.
# Modules are imported only when their role runs: importing hivemind takes seconds and --help must stay fast.
ROLE_RUNNERS = {
    "bootstrap": ("sentinel_node.roles.bootstrap", "run_bootstrap"),
    "stage": ("sentinel_node.roles.stage", "run_stage"),
    "verifier": ("sentinel_node.roles.verifier", "run_verifier"),
    "trainer": ("sentinel_node.roles.trainer", "run_trainer"),
}


def _swarm_config(peers: tuple[str, ...]):
    """The config the swarm at ``peers`` publishes (a node given --initial-peers and no --config runs it)."""
    from hivemind.utils import get_logger

    from sentinel_node.swarm_reader import fetch_swarm_config

    config = fetch_swarm_config(peers, timeout=60.0)
    get_logger("sentinel_node.join").info(
        f"running the config the swarm publishes: {config.swarm.prefix} ({config.swarm_hash()})"
    )
    return config


def _print_ready(peer_id: str, maddrs: list[str]) -> None:
    click.echo(f"node {peer_id} is up; other nodes join with:")
    for maddr in maddrs:
        click.echo(f"  --initial-peers {maddr}")


def _pipeline_options(command):
    """Options of the stage, verifier and trainer roles (ignored by the others)."""
    options = [
        click.option(
            "--stage",
            type=click.IntRange(min=0),
            help="stage: hold this stage of the model (0-based); default: the stage the swarm needs most, "
            "changed when the swarm needs another more.",
        ),
        click.option(
            "--device",
            help="stage: torch device: auto (the default: CUDA when visible, else cpu), cpu, cuda or cuda:N; "
            "verifier: where checks run: cpu (the default), cuda or cuda:N.",
        ),
        click.option(
            "--state-dir",
            type=click.Path(file_okay=False),
            help="stage: keep checkpoints here, resume from the newest on start; trainer: keep the data stream's "
            "position here (default: none kept).",
        ),
        click.option(
            "--checkpoint-every",
            type=click.IntRange(min=1),
            default=10,
            show_default=True,
            help="stage: global steps between checkpoints (one is also saved on shutdown).",
        ),
        click.option(
            "--resume-behind",
            is_flag=True,
            help="stage: serve a state older than the swarm's step (it adopts the swarm's step; training is lost).",
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
        click.option("--no-audit", is_flag=True, help="verifier: check, but run no recomputation audits (benches)."),
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
            resume_behind=opts["resume_behind"],
        )
        return {"settings": settings}
    if role == "verifier":
        from sentinel_node.roles.verifier import VerifierOptions

        try:
            boundaries = tuple(int(b) for value in opts["boundaries"] for b in value.replace(",", " ").split())
        except ValueError:
            raise click.BadParameter("integers, e.g. --boundaries 0,1", param_hint="--boundaries") from None
        verify, audit = not opts["no_verify"], not opts["no_audit"]
        settings = VerifierOptions(boundaries, verify, opts["status_file"], opts["device"] or "cpu", audit=audit)
        return {"settings": settings}
    if role == "trainer":
        from sentinel_node.roles.route_modes import RoutingMode, RoutingSchedule
        from sentinel_node.roles.trainer import TrainerOptions

        only_verifiers = tuple(p for value in opts["only_verifiers"] for p in value.replace(",", " ").split())

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
            routing=RoutingSchedule((RoutingMode(only_verifiers, copies=2 if opts["duplicate"] else 1),)),
            state_dir=opts["state_dir"],
        )
        return {"settings": settings}
    return {}


@click.command()
@click.option("--role", type=click.Choice(sorted(ROLE_RUNNERS)), required=True, help="What this node does.")
@config_option
@click.option(
    "--identity",
    "identity_path",
    type=click.Path(dir_okay=False),
    help="Private key file naming this node and signing its records; created (0600) if missing. "
    "Default: a new throwaway identity on every start.",
)
@initial_peers_option
@click.option(
    "--host-maddrs",
    multiple=True,
    default=("/ip4/0.0.0.0/tcp/0",),
    show_default=True,
    help="Multiaddrs to listen on, e.g. /ip4/0.0.0.0/tcp/31337 for a fixed port.",
)
@click.option("--announce-maddrs", multiple=True, help="Public multiaddrs to tell others (behind NAT or Docker).")
@click.option(
    "--certificate",
    "certificate_path",
    type=click.Path(dir_okay=False),
    help="trainer, verifier: the organiser's role certificate for this node (`sentinel-node admit`).",
)
@click.option(
    "--use-relay/--no-use-relay",
    default=True,
    show_default=True,
    help="Reach peers that are themselves reachable only through a libp2p relay.",
)
@click.option(
    "--use-auto-relay",
    is_flag=True,
    help="Behind NAT with no open port: reserve a slot at the --initial-peers' relays and be reachable through them "
    "(slower; announced as relayed, so trainers prefer direct peers).",
)
@click.option(
    "--metrics-port",
    type=click.IntRange(0, 65535),
    envvar="SENTINEL_METRICS_PORT",
    help="Serve Prometheus metrics on this port (0: any free port; default: off).",
)
@click.option(
    "--metrics-host",
    default="127.0.0.1",
    show_default=True,
    envvar="SENTINEL_METRICS_HOST",
    help="Address the metrics server listens on (0.0.0.0: every interface, e.g. for a Prometheus elsewhere).",
)
@click.option("--name", help="What to call this node in tables and on the status page (letters, digits, ' .-_@:+').")
@_pipeline_options
def join(
    role: str,
    config_path: str | None,
    identity_path: str | None,
    initial_peers: tuple[str, ...],
    host_maddrs: tuple[str, ...],
    announce_maddrs: tuple[str, ...],
    certificate_path: str | None,
    use_relay: bool,
    use_auto_relay: bool,
    metrics_port: int | None,
    metrics_host: str,
    name: str | None,
    **role_options,
) -> None:
    """Run a node of the swarm in ROLE until SIGTERM or Ctrl-C (a trainer with --steps ends after them).

    With --initial-peers and no --config, the node runs the config the swarm publishes; with both, the two must
    be the same config."""
    import importlib
    import re

    from dht import IdentityError
    from sentinel_node.attacks import AttackError
    from sentinel_node.roles.common import JoinOptions, NodeError

    if name is not None and not re.fullmatch(r"[A-Za-z0-9_.@:+ -]{1,64}", name):
        raise click.BadParameter("1 to 64 letters, digits, spaces or . - _ @ : +", param_hint="--name")
    peers = maddrs(initial_peers, "--initial-peers")
    from hivemind.utils.logging import use_hivemind_log_handler

    use_hivemind_log_handler("in_root_logger")  # the node's own INFO lines (steps, flags, bans) go to stderr too
    from_swarm = config_path is None and bool(peers)
    try:
        config = _swarm_config(peers) if from_swarm else load(config_path)
    except NodeError as e:
        raise click.ClickException(str(e)) from None
    options = JoinOptions(
        config=config,
        identity_path=identity_path,
        initial_peers=peers,
        host_maddrs=maddrs(host_maddrs, "--host-maddrs"),
        announce_maddrs=maddrs(announce_maddrs, "--announce-maddrs"),
        metrics_port=metrics_port,
        metrics_host=metrics_host,
        use_relay=use_relay,
        use_auto_relay=use_auto_relay,
        certificate_path=certificate_path,
        name=name,
        config_name="the swarm's own config" if from_swarm else (config_path or "the default config"),
        config_from_swarm=from_swarm,
    )
    if certificate_path and role not in ("trainer", "verifier"):
        raise click.UsageError(f"--certificate is for trainers and verifiers; a {role} is open to anyone")
    extra = _role_settings(role, role_options)
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
