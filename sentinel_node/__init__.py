"""sentinel-node: a volunteer-computing node for pipeline-parallel LLM training, verified by SENTINEL."""
