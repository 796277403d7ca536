"""A node's identity: one RSA key that is both its libp2p peer id and the key that signs its DHT records.

The identity file uses libp2p's format (a protobuf ``PrivateKey`` holding a DER RSA key), the same file hivemind's
``P2P(identity_path=...)`` reads, so the peer id other nodes see on a connection is the peer id derived from the
owner key of the records this node signs.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

import multihash
from cryptography.hazmat.primitives import serialization
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.p2p import PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

_OWNER_TAG = re.compile(rb"^\[owner:(.+)\]$", re.DOTALL)
_BASE58 = re.compile(r"^[1-9A-HJ-NP-Za-km-z]{20,128}$")


class IdentityError(ValueError):
    """An identity file or key is unusable; the message names the file and what to do."""


@dataclass(frozen=True)
class Identity:
    """A private key and the names derived from it."""

    private_key: RSAPrivateKey
    peer_id: str
    public_key: bytes  # OpenSSH form, as it appears in owner tags: b"ssh-rsa AAAA..."
    path: Path | None = None

    @property
    def owner_tag(self) -> bytes:
        """The subkey under which this node's records are stored; the DHT demands they be signed by this key."""
        return owner_tag(self.public_key)

    @classmethod
    def from_private_key(cls, private_key: RSAPrivateKey, path: Path | None = None) -> Identity:
        public_key = private_key.get_public_key().to_bytes()
        return cls(
            private_key=private_key, peer_id=peer_id_from_public_key(public_key), public_key=public_key, path=path
        )


def create_identity_file(path: str | Path) -> Identity:
    """Writes a new RSA-2048 identity to ``path``, readable by its owner only (0600). Refuses to overwrite."""
    path = Path(path)
    private_key = RSAPrivateKey()
    blob = crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA, data=private_key.to_bytes()).SerializeToString()
    try:
        # O_EXCL: two nodes racing to create the same file must not end up with different keys for one name.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise IdentityError(f"identity file {path} already exists; load it instead of creating it") from None
    except OSError as e:
        raise IdentityError(f"cannot create identity file {path}: {e.strerror}; check the directory") from None
    with os.fdopen(fd, "wb") as f:
        f.write(blob)
    return Identity.from_private_key(private_key, path=path)


def load_identity_file(path: str | Path) -> Identity:
    """Reads an identity written by :func:`create_identity_file` (or by hivemind's ``P2P.generate_identity``)."""
    path = Path(path)
    try:
        blob = path.read_bytes()
    except OSError as e:
        raise IdentityError(f"cannot read identity file {path}: {e.strerror}") from None
    try:
        proto = crypto_pb2.PrivateKey.FromString(blob)
        if proto.key_type != crypto_pb2.KeyType.RSA:
            raise ValueError("not an RSA key")
        key = serialization.load_der_private_key(proto.data, password=None)
        if key.key_size != 2048:
            raise ValueError(f"RSA-{key.key_size}, hivemind's record signatures need RSA-2048")
    except Exception as e:  # protobuf and cryptography raise several unrelated types for a corrupt file
        raise IdentityError(
            f"identity file {path} is not a libp2p RSA-2048 private key ({e}); "
            "point --identity at another path to create a new identity"
        ) from None
    private_key = RSAPrivateKey.__new__(RSAPrivateKey)
    private_key.__setstate__({"_private_key": proto.data})  # hivemind's own (pickle) path from DER bytes
    return Identity.from_private_key(private_key, path=path)


def ephemeral_identity() -> Identity:
    """A throwaway signing key for a node that only reads (hivemind's signature validator needs some key)."""
    return Identity.from_private_key(RSAPrivateKey())


def owner_tag(public_key: bytes) -> bytes:
    return RSASignatureValidator.PUBLIC_KEY_FORMAT.replace(b"_key_", public_key)


def public_key_from_owner_tag(subkey: bytes) -> bytes | None:
    """The public key of a subkey that is exactly one owner tag, else None."""
    match = _OWNER_TAG.match(subkey)
    return match.group(1) if match else None


@functools.lru_cache(maxsize=4096)
def peer_id_from_public_key(public_key: bytes) -> str:
    """The libp2p peer id (base58) of an OpenSSH RSA public key; IdentityError if it is not one."""
    try:
        key = RSAPublicKey.from_bytes(public_key)._public_key
    except Exception as e:
        raise IdentityError(f"not an OpenSSH RSA public key: {e}") from None
    der = key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    digest = multihash.encode(hashlib.sha256(encoded).digest(), multihash.coerce_code("sha2-256"))
    return PeerID(digest).to_base58()


def is_rsa_peer_id(text: str) -> bool:
    """Whether ``text`` is the base58 peer id of an RSA key (a sha2-256 multihash, ``Qm...``): the only kind of
    identity that can sign this swarm's records. A string of base58 letters is not enough."""
    if not isinstance(text, str) or not _BASE58.match(text):
        return False
    try:
        decoded = multihash.decode(PeerID.from_base58(text).to_bytes())
    except Exception:  # base58 or multihash decoding of arbitrary text raises several types
        return False
    return decoded.code == multihash.coerce_code("sha2-256") and len(decoded.digest) == 32


def peer_id_from_entry(entry: str, what: str) -> str:
    """The peer id that a config entry names: a peer id (``Qm...``), an OpenSSH RSA public key (``ssh-rsa
    AAAA...``) or an owner tag; ValueError naming ``what`` (e.g. "trusted verifier") and what to write instead."""
    if not isinstance(entry, str):
        raise ValueError(f"{what} {entry!r} must be a string: a peer id (Qm...) or an RSA public key")
    text = entry.strip()
    public_key = public_key_from_owner_tag(text.encode())
    if public_key is None and text.startswith("ssh-rsa "):
        public_key = text.encode()
    if public_key is not None:
        try:
            return peer_id_from_public_key(public_key)
        except IdentityError as e:
            raise ValueError(f"{what} {entry[:40]!r}... is not a valid RSA public key: {e}") from None
    if is_rsa_peer_id(text):
        return text
    raise ValueError(
        f"{what} {entry[:60]!r} is neither a peer id (base58 of an RSA key's sha2-256 multihash, e.g. Qm...) nor an "
        "RSA public key ('ssh-rsa AAAA...'); copy the peer id a node prints when it starts, or `sentinel-node swarm "
        "peers` lists"
    )
