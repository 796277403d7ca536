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
