"""The ``sentinel-node`` command: parse, build a config, call. No logic lives here.

``main.py`` holds the command group with ``demo``, ``simulate`` and ``bench``; ``join.py`` runs a node;
``swarm.py`` reads the swarm and ``swarm_tables.py`` renders what it read.
"""

from sentinel_node.cli.main import main

__all__ = ["main"]
