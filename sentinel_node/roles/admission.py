"""Whether this node may hold its role, checked before it announces anything, and the certificate it shows.

Trainers and verifiers are admitted by the swarm's trust roots (dht.admission). A node that is not admitted would
be refused by every peer's validator, so it stops at start with a message saying how to be admitted instead of
announcing itself into silence.
"""

from __future__ import annotations

import time

from hivemind.utils import get_logger

from dht import AdmissionError, RoleCertificate, admission_problem
from sentinel_node.config import Config
from sentinel_node.roles.common import NodeError

logger = get_logger(__name__)

# A certificate that expires within this many seconds is worth a warning at start.
EXPIRY_WARNING_S = 7 * 86400.0


def admitted_certificate(
    config: Config, peer_id: str, role: str, path: str | None, boundaries: tuple[int, ...] = ()
) -> RoleCertificate | None:
    """The certificate this node shows in its records (None when the config lists it, or the role is open and it
    has none); NodeError saying how to be admitted when it is not."""
    certificate = None
    if path is not None:
        try:
            certificate = RoleCertificate.from_file(path)
        except AdmissionError as e:
            raise NodeError(str(e)) from None
    trust = config.swarm.trust_roots()
    prefix = config.swarm.prefix
    if certificate is not None:
        problem = admission_problem(trust, prefix, role, peer_id, certificate, boundaries)
        if problem is None and certificate.expires <= time.time():
            problem = f"the certificate in {path} expired"
        if problem is not None:
            raise NodeError(f"--certificate {path}: {problem}; {_how(role, peer_id, boundaries)}")
        left = certificate.expires - time.time()
        if left < EXPIRY_WARNING_S:
            logger.warning(
                f"this node's {role} certificate expires in {left / 3600:.1f} h; ask the organiser for a new one"
            )
        if peer_id in trust.listed(role):
            return None  # listed: nothing to show
        return certificate
    problem = admission_problem(trust, prefix, role, peer_id, None, boundaries)
    if problem is not None:
        raise NodeError(f"{problem} in swarm {prefix}; {_how(role, peer_id, boundaries)}")
    return None


def _how(role: str, peer_id: str, boundaries: tuple[int, ...]) -> str:
    bounds = f" --boundaries {','.join(map(str, boundaries))}" if boundaries and role == "verifier" else ""
    listing = "trainers" if role == "trainer" else "trusted_verifiers"
    return (
        f"ask the swarm's organiser to run `sentinel-node admit --role {role} --peer {peer_id}{bounds} --key "
        f"ORGANISER_KEY --out {role}.cert` and join with --certificate {role}.cert, or to list {peer_id} in the "
        f"config's swarm.{listing}"
    )
