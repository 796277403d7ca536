"""``sentinel-node swarm ...``: read the swarm from the DHT as a client-only peer and show it, once or live."""

from __future__ import annotations

import sys

import click

from sentinel_node.cli.options import initial_peers_option, maddrs

# `swarm status --check`, as monitoring plugins (Nagios, Icinga...) read exit codes
CHECK_CODES = {"healthy": 0, "degraded": 1, "broken": 2}
CHECK_UNKNOWN = 3


@click.group()
def swarm() -> None:
    """Read the swarm from the DHT as a client-only peer: status, peers, strikes, bans; or serve a live page."""


def _reader_options(command):
    command = initial_peers_option(command)
    command = click.option(
        "--config",
        "config_path",
        type=click.Path(dir_okay=False),
        help="The swarm's config YAML; default: the config the swarm publishes (checked against this one if given).",
    )(command)
    command = click.option(
        "--timeout", type=click.FloatRange(min=0.5), default=15.0, show_default=True, help="Seconds to give up after."
    )(command)
    command = click.option(
        "--watch",
        type=click.FloatRange(min=0.5),
        metavar="SECONDS",
        help="Read the swarm again every SECONDS and redraw in place, until Ctrl-C.",
    )(command)
    command = click.option("--wide", is_flag=True, help="Whole peer ids and every address.")(command)
    return click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables.")(command)


def _config(config_path):
    from sentinel_node.cli.options import load

    return load(config_path) if config_path else None


def _show_swarm(section: str, initial_peers, config_path, timeout, watch, wide, as_json, check=False) -> None:
    import json
    import time

    from sentinel_node.cli.swarm_tables import RENDERERS, to_json
    from sentinel_node.roles.common import NodeStartError
    from sentinel_node.swarm_reader import SwarmReader

    peers = maddrs(initial_peers, "--initial-peers")
    if not peers:
        raise click.UsageError("pass --initial-peers: the multiaddrs a bootstrap node printed when it started")
    config = _config(config_path)

    def show(reader: SwarmReader, clear: bool) -> str:
        view = reader.refresh()
        if as_json:
            text = json.dumps(to_json(view, reader.config, section), indent=2, allow_nan=False)  # strict JSON
        else:
            text = RENDERERS[section](view, reader.config, wide=wide)
        if clear:
            click.clear()
            text += f"\n\nevery {watch:g}s; Ctrl-C to stop"
        click.echo(text)
        return view.health().verdict.value

    try:
        with SwarmReader(peers, config, timeout) as reader:
            verdict = show(reader, clear=bool(watch))
            while watch:
                time.sleep(watch)
                try:
                    verdict = show(reader, clear=True)
                except NodeStartError as e:  # one slow read must not end a watch
                    click.echo(f"(read failed: {e}; trying again)", err=True)
    except KeyboardInterrupt:
        return
    except NodeStartError as e:
        if check:
            click.echo(f"UNKNOWN: {e}", err=True)
            sys.exit(CHECK_UNKNOWN)
        raise click.ClickException(str(e)) from None
    if check:
        sys.exit(CHECK_CODES[verdict])


@swarm.command()
@_reader_options
@click.option(
    "--check",
    is_flag=True,
    help="Exit 0 when the swarm is healthy, 1 when degraded (a stage or boundary has one peer left), 2 when broken "
    "(one has none), 3 when it cannot be read: for monitors.",
)
def status(initial_peers, config_path, timeout, watch, wide, as_json, check) -> None:
    """Stages with their replicas and throughput, boundaries with their verifiers, trainers, and the health of each."""
    _show_swarm("status", initial_peers, config_path, timeout, watch, wide, as_json, check)


@swarm.command()
@_reader_options
def peers(initial_peers, config_path, timeout, watch, wide, as_json) -> None:
    """Every announced node: role, stage, name, state, throughput, address."""
    _show_swarm("peers", initial_peers, config_path, timeout, watch, wide, as_json)


@swarm.command()
@_reader_options
def strikes(initial_peers, config_path, timeout, watch, wide, as_json) -> None:
    """Strike records per accused peer, with the verifier that issued each and its metrics against thresholds."""
    _show_swarm("strikes", initial_peers, config_path, timeout, watch, wide, as_json)


@swarm.command()
@_reader_options
def bans(initial_peers, config_path, timeout, watch, wide, as_json) -> None:
    """Excluded peers: why, on which boundary, since when, until when, and who voted."""
    _show_swarm("bans", initial_peers, config_path, timeout, watch, wide, as_json)


@swarm.command()
@initial_peers_option
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False),
    help="The swarm's config YAML; default: the config the swarm publishes (checked against this one if given).",
)
@click.option("--port", type=click.IntRange(0, 65535), default=8400, show_default=True, help="Port (0: any free).")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (0.0.0.0: every one).")
@click.option(
    "--refresh", type=click.FloatRange(min=0.5), default=3.0, show_default=True, help="Seconds between reads."
)
@click.option(
    "--timeout", type=click.FloatRange(min=0.5), default=15.0, show_default=True, help="Seconds a read may take."
)
def serve(initial_peers, config_path, port, host, refresh, timeout) -> None:
    """A live status page of the swarm (stages, boundaries, training curve, strikes, exclusions), its JSON API
    (/api/status, /api/peers, /api/strikes, /api/bans, /api/history) and swarm-wide Prometheus gauges (/metrics)."""
    from sentinel_node.roles.common import NodeStartError
    from sentinel_node.web.app import serve as run_server

    peers = maddrs(initial_peers, "--initial-peers")
    if not peers:
        raise click.UsageError("pass --initial-peers: the multiaddrs a bootstrap node printed when it started")
    try:
        run_server(
            list(peers),
            _config(config_path),
            host=host,
            port=port,
            refresh=refresh,
            timeout=timeout,
            on_ready=lambda url: click.echo(f"serving the swarm's status page at {url}", err=False),
        )
    except NodeStartError as e:
        raise click.ClickException(str(e)) from None
