"""Who may be a trainer or a verifier: the swarm's trust roots and the organiser's role certificates.

A role is never self-asserted. The swarm config names its trust roots (:class:`TrustRoots`): the organiser's RSA
public key, and the peer ids it lists as trainers and verifiers. A peer it does not list may still hold a
:class:`RoleCertificate`: a short statement "peer P may act as ROLE (on boundaries B) in swarm S until T", signed by
the organiser's key over a canonical encoding (:meth:`RoleCertificate.payload`). A node embeds its certificate in
every record it writes in that role (its announcement; a verifier's strike records), so any node can check it with
the organiser's public key alone, offline, in the DHT's validator as well as in its readers.

An open role (``open_trainers``/``open_verifiers`` in the config) admits anyone: an explicit opt-in whose limits
(Sybils) are documented in docs/security.md.
"""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional

import msgpack
import pydantic.v1 as pydantic
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey
from pydantic.v1 import StrictBytes, StrictFloat, conlist, constr

from dht.keys import MAX_STAGES, PREFIX_PATTERN

Role = Literal["trainer", "verifier"]
ROLES: tuple[Role, ...] = ("trainer", "verifier")

_PAYLOAD_TAG = "sentinel-node/role-certificate/1"
MAX_SIGNATURE_BYTES = 512  # RSA-2048 signatures are 256 bytes


class AdmissionError(ValueError):
    """A certificate or an admission that does not hold; the message says why and what to do."""


class RoleCertificate(pydantic.BaseModel):
    """The organiser's word that ``subject`` may act as ``role`` in swarm ``swarm`` until ``expires`` (unix time).

    ``boundaries`` limits a verifier to those boundaries (None: every boundary of the swarm); a trainer's is None.
    """

    swarm: constr(strict=True, regex=PREFIX_PATTERN.pattern, max_length=128)
    subject: constr(strict=True, regex=r"^[1-9A-HJ-NP-Za-km-z]{20,128}$")
    role: Role
    boundaries: Optional[conlist(pydantic.conint(strict=True, ge=0, lt=MAX_STAGES), max_items=MAX_STAGES)] = None
    expires: StrictFloat
    signature: StrictBytes

    class Config:
        extra = pydantic.Extra.forbid
        allow_mutation = False

    @pydantic.validator("expires")
    def _finite(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError("expires must be a finite unix time")
        return value

    @pydantic.validator("boundaries")
    def _sorted_unique(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and value != sorted(set(value)):
            raise ValueError("boundaries must be sorted and unique")
        return value

    @pydantic.validator("signature")
    def _short(cls, value: bytes) -> bytes:
        if not 0 < len(value) <= MAX_SIGNATURE_BYTES:
            raise ValueError(f"a signature has 1 to {MAX_SIGNATURE_BYTES} bytes")
        return value

    def payload(self) -> bytes:
        """The canonical bytes the organiser signs: every field but the signature, in a fixed order."""
        return certificate_payload(self.swarm, self.subject, self.role, self.boundaries, self.expires)

    def covers(self, boundaries: Iterable[int]) -> bool:
        """Whether the certificate admits its subject on every one of ``boundaries``."""
        return self.boundaries is None or set(boundaries) <= set(self.boundaries)

    def signed_by(self, organiser: bytes) -> bool:
        """Whether the organiser's OpenSSH public key made the signature."""
        try:
            return RSAPublicKey.from_bytes(organiser).verify(self.payload(), self.signature)
        except Exception:  # a malformed key or signature is simply not a valid signature
            return False

    # --- the certificate file (what `sentinel-node admit` writes and `join --certificate` reads)

    def to_file(self) -> str:
        data = self.dict()
        data["signature"] = base64.b64encode(self.signature).decode()
        return json.dumps(data, indent=2) + "\n"

    @classmethod
    def from_file(cls, path: str | Path) -> RoleCertificate:
        """Reads a certificate file; AdmissionError naming the file and what is wrong."""
        path = Path(path)
        try:
            data = json.loads(path.read_text())
            data["signature"] = base64.b64decode(data["signature"], validate=True)
            return cls.parse_obj(data)
        except OSError as e:
            raise AdmissionError(f"cannot read certificate {path}: {e.strerror}") from None
        except (ValueError, KeyError, TypeError, pydantic.ValidationError) as e:
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise AdmissionError(
                f"{path} is not a role certificate ({reason}); ask the organiser for a new one "
                "(`sentinel-node admit ...`)"
            ) from None


def certificate_payload(swarm: str, subject: str, role: str, boundaries: list[int] | None, expires: float) -> bytes:
    return msgpack.packb([_PAYLOAD_TAG, swarm, subject, role, boundaries, float(expires)], use_bin_type=True)


def issue_certificate(
    organiser: RSAPrivateKey,
    swarm: str,
    subject: str,
    role: Role,
    expires: float,
    boundaries: Iterable[int] | None = None,
) -> RoleCertificate:
    """A certificate signed with the organiser's private key."""
    bounds = None if boundaries is None else sorted(set(boundaries))
    if role == "trainer" and bounds is not None:
        raise AdmissionError("a trainer certificate names no boundaries")
    signature = organiser.sign(certificate_payload(swarm, subject, role, bounds, float(expires)))
    return RoleCertificate(
        swarm=swarm, subject=subject, role=role, boundaries=bounds, expires=float(expires), signature=signature
    )


@dataclass(frozen=True)
class TrustRoots:
    """What the swarm config says about roles: the organiser's public key (OpenSSH form, or None), the peer ids it
    lists per role, and which roles are open to anyone."""

    organiser: bytes | None = None
    trainers: frozenset[str] = field(default_factory=frozenset)
    verifiers: frozenset[str] = field(default_factory=frozenset)
    open_trainers: bool = False
    open_verifiers: bool = False

    def listed(self, role: Role) -> frozenset[str]:
        return self.trainers if role == "trainer" else self.verifiers

    def is_open(self, role: Role) -> bool:
        return self.open_trainers if role == "trainer" else self.open_verifiers

    def can_admit(self, role: Role) -> bool:
        """Whether anyone at all can hold ``role``: listed peers, certificate holders, or an open role."""
        return bool(self.listed(role)) or self.organiser is not None or self.is_open(role)


def admission_problem(
    trust: TrustRoots,
    swarm: str,
    role: Role,
    peer: str,
    certificate: RoleCertificate | None,
    boundaries: Iterable[int] = (),
) -> str | None:
    """Why ``peer`` is not admitted as ``role`` on ``boundaries`` in swarm ``swarm``, or None when it is: listed
    in the config, holding a certificate the organiser signed for exactly this peer, role and swarm (covering the
    boundaries), or in an open role. Expiry is the caller's to check (against a record's lifetime or the clock)."""
    if peer in trust.listed(role):
        return None
    if certificate is not None:
        if trust.organiser is None:
            return f"{peer} shows a {role} certificate, but this swarm's config names no organiser to check it"
        if certificate.role != role or certificate.subject != peer or certificate.swarm != swarm:
            return (
                f"{peer} shows a certificate for {certificate.role} {certificate.subject} in swarm "
                f"{certificate.swarm}, not for {role} {peer} in swarm {swarm}"
            )
        if not certificate.signed_by(trust.organiser):
            return f"{peer}'s {role} certificate is not signed by this swarm's organiser"
        boundaries = list(boundaries)
        if not certificate.covers(boundaries):
            return f"{peer}'s verifier certificate covers boundaries {certificate.boundaries}, not {boundaries}"
        return None
    if trust.is_open(role):
        return None
    return f"{peer} is not admitted as a {role}: the swarm config does not list it and it shows no certificate"
