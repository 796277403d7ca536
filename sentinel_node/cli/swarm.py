"""``sentinel-node swarm ...``: read the swarm from the DHT as a client-only peer and show it."""

from __future__ import annotations

import click

from sentinel_node.cli.options import config_option, initial_peers_option, load, maddrs


@click.group()
def swarm() -> None:
    """Read the swarm from the DHT as a client-only peer: status, peers, strikes, bans."""


def _reader_options(command):
    command = initial_peers_option(command)
    command = config_option(command)
    command = click.option(
        "--timeout", type=click.FloatRange(min=0.5), default=15.0, show_default=True, help="Seconds to give up after."
    )(command)
    return click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables.")(command)


def _show_swarm(section: str, initial_peers, config_path, timeout: float, as_json: bool) -> None:
    import json

    from sentinel_node.cli.swarm_tables import RENDERERS, read_swarm, to_json
    from sentinel_node.roles.common import NodeStartError

    config = load(config_path)
    peers = maddrs(initial_peers, "--initial-peers")
    if not peers:
        raise click.UsageError("pass --initial-peers: the multiaddrs a bootstrap node printed when it started")
    try:
        view = read_swarm(config, peers, timeout)
    except NodeStartError as e:
        raise click.ClickException(str(e)) from None
    if as_json:  # strict JSON: no NaN or Infinity, which strict parsers refuse
        click.echo(json.dumps(to_json(view, config, section), indent=2, allow_nan=False))
    else:
        click.echo(RENDERERS[section](view, config))


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
