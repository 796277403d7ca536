"""The live status page of a swarm (``sentinel-node swarm serve``)."""
