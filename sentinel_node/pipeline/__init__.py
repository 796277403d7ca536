"""The pipeline runtime shared by the simulator and the networked roles: a stage replica and a boundary verifier."""

from sentinel_node.pipeline.boundary_verifier import BoundaryVerifier
from sentinel_node.pipeline.stage_worker import StageWorker

__all__ = ["BoundaryVerifier", "StageWorker"]
