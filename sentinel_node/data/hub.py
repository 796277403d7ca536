"""Telling a local path from a Hugging Face hub id, and failing fast when the hub cannot be reached.

``transformers`` and ``datasets`` retry an unreachable hub for a minute or more (measured here, with no route to
it: 25 s for a dataset, 53 s for a tokenizer) before they raise. A volunteer whose config names a hub id should
learn at once that the machine cannot reach it, so before any hub call we resolve and dial the endpoint ourselves,
with a short deadline. With ``HF_HUB_OFFLINE=1`` the libraries look only in their local cache, which fails at once
when the files are not there, so no probe is made.
"""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path
from urllib.parse import urlparse

from sentinel_node.data.errors import DataError

PROBE_TIMEOUT_S = 8.0


def is_local(name: str) -> bool:
    """Whether ``name`` names something on this machine (an existing path, or one written as a path)."""
    return Path(name).expanduser().exists() or name.startswith(("/", "./", "../", "~"))


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")


def require_hub(what: str, name: str, timeout: float = PROBE_TIMEOUT_S) -> None:
    """Raises :class:`DataError` within ``timeout`` seconds when the hub cannot be dialled (what, e.g.
    "data.dataset", and name say what needed it); returns at once in offline mode."""
    if offline():
        return
    url = urlparse(endpoint())
    host, port = url.hostname or "", url.port or (80 if url.scheme == "http" else 443)
    outcome: list[BaseException | None] = []

    def dial() -> None:
        try:
            with socket.create_connection((host, port), timeout=timeout):
                outcome.append(None)
        except BaseException as e:  # noqa: BLE001 - reported below
            outcome.append(e)

    thread = threading.Thread(target=dial, name="hub-probe", daemon=True)  # a resolver can outlast any timeout
    thread.start()
    thread.join(timeout)
    error = outcome[0] if outcome else TimeoutError(f"no answer in {timeout:.0f}s")
    if error is not None:
        raise DataError(
            f"{what} {name!r} is not a path on this machine, and the Hugging Face hub ({endpoint()}) cannot be "
            f"reached ({type(error).__name__}: {error}). Download it on a machine that can reach the hub and point "
            f"{what} at the local copy, or set HF_ENDPOINT to a mirror (HF_HUB_OFFLINE=1 uses only the local cache)"
        )
