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
def join(
    role: str,
    config_path: str | None,
    identity_path: str | None,
    initial_peers: tuple[str, ...],
    host_maddrs: tuple[str, ...],
    announce_maddrs: tuple[str, ...],
) -> None:
    """Run a node of the swarm in ROLE until SIGTERM or Ctrl-C."""
    import importlib

    from dht import IdentityError
    from sentinel_node.roles.common import JoinOptions, NodeError

    options = JoinOptions(
        config=_load(config_path),
        identity_path=identity_path,
        initial_peers=_maddrs(initial_peers, "--initial-peers"),
        host_maddrs=_maddrs(host_maddrs, "--host-maddrs"),
        announce_maddrs=_maddrs(announce_maddrs, "--announce-maddrs"),
    )
    module, function = ROLE_RUNNERS[role]
    runner = getattr(importlib.import_module(module), function)
    try:
        runner(options, on_ready=_print_ready)
    except (NodeError, IdentityError) as e:
        raise click.ClickException(str(e)) from None


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
