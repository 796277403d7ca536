"""The organiser's side of admission: its key, the config line that names it, and the role certificates it signs
(``sentinel-node admit``; dht.admission checks them on every node)."""

from __future__ import annotations

import time
from collections.abc import Iterable
from pathlib import Path

from dht import (
    AdmissionError,
    Identity,
    IdentityError,
    RoleCertificate,
    create_identity_file,
    issue_certificate,
    load_identity_file,
    peer_id_from_entry,
)
from sentinel_node.config import Config

MAX_DAYS = 3650


def new_organiser_key(path: str | Path) -> Identity:
    """Creates the organiser's key (an RSA-2048 identity file, 0600); AdmissionError if it exists or cannot be
    written."""
    try:
        return create_identity_file(Path(path).expanduser())
    except IdentityError as e:
        raise AdmissionError(str(e)) from None


def config_line(identity: Identity) -> str:
    """The ``swarm:`` lines that make this key the swarm's organiser."""
    return f'swarm:\n  organiser: "{identity.public_key.decode()}"'


def admit(
    config: Config,
    key_path: str | Path,
    role: str,
    peer: str,
    boundaries: Iterable[int] | None = None,
    days: float = 30.0,
) -> RoleCertificate:
    """A certificate admitting ``peer`` as ``role`` in the swarm of ``config`` for ``days`` days, signed with the
    organiser key in ``key_path``; AdmissionError saying what is wrong (not the config's organiser, a peer id that
    names no peer, boundaries the swarm does not have)."""
    try:
        organiser = load_identity_file(Path(key_path).expanduser())
    except IdentityError as e:
        raise AdmissionError(str(e)) from None
    named = config.swarm.organiser
    if named is None:
        raise AdmissionError(
            "the swarm config names no organiser, so no node would accept this certificate; add these lines to it "
            f"(every node must use the same file):\n{config_line(organiser)}"
        )
    if named.strip().encode() != organiser.public_key:
        raise AdmissionError(f"{key_path} is not the organiser the swarm config names (its public key differs)")
    if role not in ("trainer", "verifier"):
        raise AdmissionError(f"role {role!r}: only trainers and verifiers are admitted (stages are open)")
    try:
        subject = peer_id_from_entry(peer, "--peer")
    except ValueError as e:
        raise AdmissionError(str(e)) from None
    if not 0 < days <= MAX_DAYS:
        raise AdmissionError(f"--days {days}: a certificate lives more than 0 and at most {MAX_DAYS} days")
    bounds = None
    if boundaries is not None:
        bounds = sorted(set(boundaries))
        if role == "trainer":
            raise AdmissionError("--boundaries is for verifiers: a trainer certificate names none")
        n_boundaries = config.pipeline.n_stages - 1
        outside = [b for b in bounds if not 0 <= b < n_boundaries]
        if outside:
            raise AdmissionError(f"--boundaries {outside}: the swarm's boundaries are 0..{n_boundaries - 1}")
    return issue_certificate(
        organiser.private_key, config.swarm.prefix, subject, role, time.time() + days * 86400.0, bounds
    )


def write_certificate(certificate: RoleCertificate, path: str | Path) -> None:
    Path(path).expanduser().write_text(certificate.to_file())
