"""Options and helpers the commands share: the config file, the swarm's addresses."""

from __future__ import annotations

import click

from sentinel_node.config import ConfigError, load_config


def load(config_path: str | None):
    try:
        return load_config(config_path)
    except ConfigError as e:
        raise click.BadParameter(str(e), param_hint="--config") from None


def maddrs(values: tuple[str, ...], option: str) -> tuple[str, ...]:
    from sentinel_node.roles.common import parse_maddrs

    try:
        return parse_maddrs(values, option, need_peer_id=option == "--initial-peers")
    except ValueError as e:
        raise click.UsageError(str(e)) from None


initial_peers_option = click.option(
    "--initial-peers",
    multiple=True,
    envvar="SENTINEL_INITIAL_PEERS",
    help="Multiaddrs of running nodes (what a bootstrap printed); repeat, or separate by spaces.",
)
config_option = click.option(
    "--config", "config_path", type=click.Path(dir_okay=False), help="Swarm config YAML (default: configs/tiny.yaml)."
)
