"""An attacker's DHT primitives for the tests: honest hivemind software storing hand-made bytes (signed by any key
the attacker holds) straight into its peers' storage, skipping every check of ours on its own side."""

from __future__ import annotations

import dataclasses
import functools

import hivemind
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.utils import MSGPackSerializer

from dht import Identity


async def _raw_store(_dht, node, key: str, subkey: object, value: bytes, expiration: float) -> list:
    """Runs inside the attacker's DHT process: asks every known peer to store exactly these bytes."""
    peers = list(node.protocol.routing_table.peer_id_to_uid)
    results = [
        await node.protocol.call_store(peer, [DHTID.generate(source=key)], [value], expiration, [subkey])
        for peer in peers
    ]
    return [r[0] if r else None for r in results]


async def raw_store_many(_dht, node, key: str, subkeys: list, values: list, expiration: float) -> list:
    """Like _raw_store, with many subkeys of one key in one request per peer; how many each peer accepted."""
    peers = list(node.protocol.routing_table.peer_id_to_uid)
    key_ids = [DHTID.generate(source=key)] * len(values)
    results = [await node.protocol.call_store(peer, key_ids, values, expiration, subkeys) for peer in peers]
    return [sum(bool(ok) for ok in r) if r else None for r in results]


async def _raw_store_junk(_dht, node, key: str, count: int, size: int, expiration: float, tag: str) -> list:
    """Like raw_store_many with ``count`` subkeys of ``size`` junk bytes each, made inside the DHT process (a large
    argument through the DHT's pipe can break it)."""
    junk = MSGPackSerializer.dumps(b"j" * size)
    subkeys = [f"{tag}-{i}".encode() for i in range(count)]
    return await raw_store_many(_dht, node, key, subkeys, [junk] * count, expiration)


def raw_store_junk(dht: hivemind.DHT, key: str, count: int, size: int, expiration: float, tag: str = "junk") -> int:
    """How many junk entries the attacker's peers accepted, in all."""
    call = functools.partial(_raw_store_junk, key=key, count=count, size=size, expiration=expiration, tag=tag)
    return sum(n or 0 for n in dht.run_coroutine(call))


def signed_value(signer: Identity, key: str, subkey: bytes, value: dict, expiration: float) -> bytes:
    """The bytes hivemind's RSASignatureValidator would send for ``value``, signed by ``signer``."""
    value_bytes = MSGPackSerializer.dumps(value)
    record = DHTRecord(DHTID.generate(source=key).to_bytes(), MSGPackSerializer.dumps(subkey), value_bytes, expiration)
    signature = signer.private_key.sign(MSGPackSerializer.dumps(dataclasses.astuple(record)))
    return value_bytes + b"[signature:" + signature + b"]"


def raw_store(dht: hivemind.DHT, key: str, subkey: object, value: bytes, expiration: float) -> list:
    """What each peer of the attacker's routing table answered (True: stored)."""
    return dht.run_coroutine(functools.partial(_raw_store, key=key, subkey=subkey, value=value, expiration=expiration))


def raw_store_signed(dht: hivemind.DHT, signer: Identity, record: dict, key: str, expiration: float) -> list:
    """Stores ``record`` signed by ``signer`` under its owner tag, as hivemind would."""
    return raw_store(
        dht, key, signer.owner_tag, signed_value(signer, key, signer.owner_tag, record, expiration), expiration
    )
