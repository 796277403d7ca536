"""What can go wrong on a hop, as exception classes a caller can act on, and their coded wire form.

A remote peer can only hand back a string, so every error crosses the wire as ``"<code>: <detail>"`` (for a failure
further down the chain: ``"downstream: <code>@<culprit peer>: <detail>"``) and is parsed back into the class here.
"""

from __future__ import annotations

import re
from typing import ClassVar

MAX_ERROR_CHARS = 600


class MalformedMessageError(ValueError):
    """A message (metadata, framing or tensors) that this node refuses to interpret; the text says what was wrong."""


class MalformedTensorError(MalformedMessageError):
    """A tensor on the wire is over a limit, of a refused dtype or compression, inconsistent or not as expected."""


class TruncatedStreamError(MalformedMessageError):
    """A stream ended before all the parts it announced: the sender died or gave up mid-way."""


class HopError(Exception):
    """A call to a peer failed.

    ``peer`` is the peer that was called (None while the error is being raised inside a handler, before it is
    sent back); ``culprit`` is the peer that actually failed, which differs from ``peer`` only for
    :class:`HopDownstreamFailed`. What a caller does about it is said by the class of :attr:`cause` (the failure
    itself, wherever along the route it happened):

    - ``retryable``: trying another candidate for the same hop makes sense;
    - ``avoid``: a new route for the microbatch should leave the culprit out;
    - ``unresponsive``: the culprit failed to answer, so it is suspended a while (the liveness blacklist);
    - ``view_behind``: the culprit refused because its view of the swarm, or the caller's, is behind.
    """

    code: ClassVar[str] = "internal"
    retryable: ClassVar[bool] = False
    avoid: ClassVar[bool] = False
    unresponsive: ClassVar[bool] = False
    view_behind: ClassVar[bool] = False

    def __init__(self, detail: str, *, peer: str | None = None, culprit: str | None = None) -> None:
        super().__init__(detail)
        self.detail = detail
        self.peer = peer
        self.culprit = culprit or peer
        self.failures: list[HopError] = []

    @property
    def cause(self) -> type[HopError]:
        """The class of the failure itself (for a downstream failure, the one further along the route)."""
        return type(self)

    def __str__(self) -> str:
        where = f" (peer {self.peer})" if self.peer else ""
        return f"{self.code}: {self.detail}{where}"


class HopRefused(HopError):
    """The peer will not serve this caller or this request (not on its route, wrong role, excluded)."""

    code = "refused"
    view_behind = True  # a peer that just joined, or was just banned: someone's view has to catch up


class HopBanned(HopRefused):
    """The peer has banned the caller."""

    code = "banned"


class HopMalformed(HopError):
    """The request (or the peer's reply) was malformed; another candidate would not do better."""

    code = "malformed"


class HopOverloaded(HopError):
    """The peer is busy and did no work: try another."""

    code = "overloaded"
    retryable = True
    avoid = True
    unresponsive = True


class HopUnavailable(HopError):
    """The peer could not be reached, went away, or died before finishing its answer."""

    code = "unavailable"
    retryable = True
    avoid = True
    unresponsive = True


class HopDeadlineExceeded(HopUnavailable):
    """The deadline passed before an answer came; no time is left to try anyone else."""

    code = "deadline"
    retryable = False


class HopInternal(HopError):
    """The peer failed in a way it did not classify (a bug, out of memory, an uncoded remote error)."""

    code = "internal"
    avoid = True


class HopDownstreamFailed(HopError):
    """The peer was fine but a hop further down its route failed; ``culprit`` and ``inner_code`` say which and how."""

    code = "downstream"

    def __init__(self, detail: str, *, inner_code: str, peer: str | None = None, culprit: str | None = None) -> None:
        super().__init__(detail, peer=peer, culprit=culprit)
        self.inner_code = inner_code

    @property
    def cause(self) -> type[HopError]:
        return _CLASSES.get(self.inner_code, HopInternal)

    def __str__(self) -> str:
        return f"downstream {self.inner_code} at {self.culprit}: {self.detail} (via peer {self.peer})"


_CLASSES: dict[str, type[HopError]] = {
    cls.code: cls
    for cls in (
        HopRefused,
        HopBanned,
        HopMalformed,
        HopOverloaded,
        HopUnavailable,
        HopDeadlineExceeded,
        HopInternal,
        HopDownstreamFailed,
    )
}
_CODES = "|".join(_CLASSES)
_CODED = re.compile(rf"\b(?P<code>{_CODES}): (?:(?P<inner>{_CODES})@(?P<culprit>[1-9A-HJ-NP-Za-km-z]+): )?")
_UNPRINTABLE = re.compile(r"[^ -~]")


def _clean(text: str) -> str:
    # Details may quote bytes from a hostile peer: keep them to one short printable line.
    return _UNPRINTABLE.sub("?", text)[:MAX_ERROR_CHARS]


def encode_error(error: HopError) -> str:
    """The wire form of an error raised in a handler (``peer`` None) or received from a downstream call."""
    if error.peer is None:
        return f"{error.code}: {_clean(error.detail)}"
    inner = error.inner_code if isinstance(error, HopDownstreamFailed) else error.code
    return f"downstream: {inner}@{error.culprit}: {_clean(error.detail)}"


def decode_error(text: str, peer: str) -> HopError:
    """Parses a coded error string (found anywhere in ``text``) sent back by ``peer`` into its class."""
    match = _CODED.search(text)
    if match is None:
        return HopInternal(_clean(text), peer=peer)
    detail = text[match.end() :]
    # A P2PHandlerError from the unary path wraps the message in repr(...): drop the closing quote and paren.
    if detail.endswith("')"):
        detail = detail[:-2]
    if match["code"] != "downstream":
        return _CLASSES[match["code"]](detail, peer=peer)
    if not match["inner"]:
        return HopInternal(_clean(text), peer=peer)
    return HopDownstreamFailed(detail, inner_code=match["inner"], peer=peer, culprit=match["culprit"])
