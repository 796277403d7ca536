"""A cap on the subkeys of every key a swarm node stores, so that no key can outgrow a DHT message.

hivemind answers a ``get`` with a key's whole dictionary in one message, and the daemon refuses messages above
4 MiB: a key grown beyond that is unreadable from every node holding it, and its holders' memory grows without
bound. hivemind's ``DictionaryDHTValue`` is a ``TimedStorage`` with an optional ``maxsize`` (past it, the entries
that expire first are dropped), but its ``DHTLocalStorage`` creates every dictionary without one.

:func:`cap_subkeys` replaces the storage and the cache of a running DHT node (hivemind 1.1.12's
``DHTProtocol.storage`` and ``.cache``, both ``DHTLocalStorage``) with :class:`CappedStorage`, which gives every
dictionary it holds that ``maxsize``. It runs once, inside the DHT's own process, right after the node starts;
what arrived before is copied over through the cap. Nothing else in hivemind changes: validation, replication and
the wire format are untouched, and a node without the cap still reads capped nodes' dictionaries.
"""

from __future__ import annotations

import functools
import math

import hivemind
from hivemind.dht.storage import DHTLocalStorage, DictionaryDHTValue

from dht.rules import MAX_SUBKEYS


class CappedStorage(DHTLocalStorage):
    """A ``DHTLocalStorage`` whose dictionaries hold at most ``max_subkeys`` entries (the ones expiring last)."""

    def __init__(self, maxsize: int | None = None, max_subkeys: int = MAX_SUBKEYS) -> None:
        super().__init__(maxsize=maxsize)
        self.max_subkeys = max_subkeys

    def _capped(self, value: object) -> object:
        if isinstance(value, DictionaryDHTValue) and value.maxsize > self.max_subkeys:
            value.maxsize = self.max_subkeys
            len(value)  # TimedStorage trims to maxsize on its next access
        return value

    def store(self, key, value, expiration_time, subkey=None) -> bool:
        if subkey is None:
            value = self._capped(value)  # a whole dictionary (the cache stores search results so)
        return super().store(key, value, expiration_time, subkey)

    def store_subkey(self, key, subkey, value, expiration_time) -> bool:
        stored = super().store_subkey(key, subkey, value, expiration_time)
        found = self.get(key)
        if found is not None and isinstance(found.value, DictionaryDHTValue):
            self._capped(found.value)
            stored = stored and subkey in found.value
        return stored


def _replace(old: DHTLocalStorage, max_subkeys: int) -> CappedStorage:
    maxsize = None if math.isinf(old.maxsize) else int(old.maxsize)
    new = CappedStorage(maxsize=maxsize, max_subkeys=max_subkeys)
    for key, item in list(old.items()):
        if isinstance(item.value, DictionaryDHTValue):
            for subkey, entry in list(item.value.items()):
                new.store_subkey(key, subkey, entry.value, entry.expiration_time)
        else:
            new.store(key, item.value, item.expiration_time)
    return new


async def _install(_dht: hivemind.DHT, node, max_subkeys: int) -> int:
    """Runs in the DHT's process (``DHT.run_coroutine``): swaps the node's storage and cache for capped ones."""
    protocol = node.protocol
    for name in ("storage", "cache"):
        old = getattr(protocol, name)
        if not isinstance(old, CappedStorage):
            setattr(protocol, name, _replace(old, max_subkeys))
    return max_subkeys


def cap_subkeys(dht: hivemind.DHT, max_subkeys: int = MAX_SUBKEYS, timeout: float = 30.0) -> None:
    """Caps every dictionary ``dht`` stores or caches at ``max_subkeys`` entries (call it once, right after the DHT
    started)."""
    future = dht.run_coroutine(functools.partial(_install, max_subkeys=max_subkeys), return_future=True)
    installed = future.result(timeout=timeout)
    if installed != max_subkeys:
        raise RuntimeError(f"the DHT did not take the subkey cap of {max_subkeys} (answered {installed})")
