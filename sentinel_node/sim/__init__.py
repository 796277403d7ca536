"""The in-process DP x PP mesh: same stage and verifier objects as the network, no network."""

from sentinel_node.sim.mesh import AttackPlan, Life, Mesh, SimResult, StepLog

__all__ = ["AttackPlan", "Life", "Mesh", "SimResult", "StepLog"]
