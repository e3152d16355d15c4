"""The direct call channel's wire: calls an ingress places on an engine replica over its own
TCP connection instead of a Ray Serve handle call (`call_channel: socket`, docs/serving.md).

One connection per (ingress, replica) pair; the ingress sends its token first, then frames
of `Submit` / `Cancel` / `Deliver`; the replica answers each call with `Accepted` (or
`Ended` with a `ReplicaBusy` error when it has no room) and later `Ended`. Frames use the
delta channel's framing (a 4-byte length and a pickled list, `delta_wire`), so the same
trust rule holds: both ends are processes of one Ray cluster. The deltas of an accepted
call still travel over the delta channel to the ingress's inbox; this channel carries only
the call itself (and what is delivered to it).

Only calls whose arguments and result are plain data go this way: a Ray `ObjectRef`
pickled outside Ray would be pinned for its owner's life. So the disaggregated calls carry
no refs: a prefill result with KV chunk refs is posted to the store's hand-off box and the
decode replica takes it there (app/kvstore/handoff.py); one whose KV travels in-band (a
short prompt's partial chunk) comes back to the ingress, which `Deliver`s it to the
decode call it placed (docs/serving.md "The prefill -> decode hand-off").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# The calls a direct call may name (each also a Serve method of the deployment) -> the
# replica method that runs it once the call has its slot (`Slots`; the Serve method waits
# for one itself).
DIRECT_METHODS = {"generate_to": "run_generate_to", "prefill_to": "run_prefill_to"}


class ReplicaBusy(RuntimeError):
    """The replica has no free slot (`max_ongoing_requests`, shared with Serve's calls): the
    ingress places the call through Serve instead (which queues it, or answers 429)."""


@dataclass(frozen=True, slots=True)
class CallAddress:
    """Where a replica takes direct calls; advertised in its routing stats."""

    host: str
    port: int
    token: bytes = field(repr=False)  # the first bytes every connection must send

    def to_stats(self) -> dict[str, Any]:
        return {"host": self.host, "port": self.port, "token": self.token.hex()}

    @classmethod
    def from_stats(cls, stats: dict[str, Any] | None) -> CallAddress | None:
        if not stats:
            return None
        return cls(stats["host"], int(stats["port"]), bytes.fromhex(stats["token"]))


@dataclass(frozen=True, slots=True)
class Submit:
    call_id: int  # unique per connection
    method: str  # one of DIRECT_METHODS
    args: tuple[Any, ...]


@dataclass(frozen=True, slots=True)
class Cancel:
    call_id: int


@dataclass(frozen=True, slots=True)
class Deliver:
    """A value for a running call, which awaits it (`call_port.call_mail`); dropped if the
    call has ended or already has one."""

    call_id: int
    value: Any


@dataclass(frozen=True, slots=True)
class Accepted:
    call_id: int


@dataclass(frozen=True, slots=True)
class Ended:
    call_id: int
    result: Any = None
    error: BaseException | None = None  # set: the call failed with it
