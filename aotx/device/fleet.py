"""Which loaded models make room for another under a memory budget, and which have been
idle past their keep-alive: the residency rule, with no I/O (device/runtime.py applies
it to the models loaded on first use; those loaded at start count as fixed).

A model's memory is its estimate (engine/llama/describe.py).  To load a model of ``need``
bytes, :func:`plan_room` gives back the loaded models to unload first, least recently
used first, and as few as make it fit.  A model is never chosen when

* it is **pinned** (a keep-alive of -1): it counts against the budget, always;
* it is **busy**: a request of it is running or queued;
* **another principal** holds it: it used it within the keep-alive its last request
  asked (the model's own unless the request gave ``keep_alive``; :attr:`Resident.users`).
  One principal's traffic must not unload the model another is in the middle of using:
  the other principal's next request would wait for a load it did not cause.  This is
  the eviction row of the shared-resources table in docs/security.md.  The requester's
  own use does not protect a model from the requester; and a request's ``keep_alive: 0``
  unloads the model once idle only when no other principal holds it.

When no choice fits, the load waits (the device answers 503 with ``Retry-After`` once the
request's deadline passes); a model larger than the whole budget never fits.
:func:`expired` lists the models idle past their keep-alive (0: unloaded as soon as
idle) and held by no principal, which the device unloads without being asked.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

PINNED = -1.0  # a keep-alive that never expires


@dataclass
class Resident:
    """A loaded model as the rule sees it."""

    role: int
    bytes: int  # its estimated memory
    keep_alive: float  # the model's own: seconds it stays loaded once idle; PINNED: for ever
    busy: bool = False  # requests running or queued
    last_used: float = 0.0  # when its last request ended (or it was loaded)
    #: principal -> (its last use, the keep-alive its last request asked: the model's own
    #: unless the request gave one, Ollama's ``keep_alive``; PINNED: for ever)
    users: dict[int, tuple[float, float]] = field(default_factory=dict)

    @property
    def pinned(self) -> bool:
        """Its own keep-alive, or a request's (an admin's: ondemand.asked_keep_alive), is
        for ever: no load unloads it, its pinner's own neither."""
        return self.keep_alive < 0 or any(keep < 0 for _, keep in self.users.values())

    def held(self, now: float, but: int = -1) -> bool:
        """Whether a principal (other than ``but``) still holds it: its last use is
        within the keep-alive that use asked for."""
        return any(p != but and (keep < 0 or now - at < keep)
                   for p, (at, keep) in self.users.items())

    def protected_from(self, principal: int, now: float) -> bool:
        """Whether ``principal``'s load may not unload it: pinned, busy, or held by
        another principal."""
        return self.pinned or self.busy or self.held(now, but=principal)

    def expires_in(self, now: float) -> float | None:
        """Seconds until its keep-alive runs out (0: it has): the last of its principals'
        holds, or, used by none (an admin's load, the resident policy's work), the
        model's own since its last use; None: pinned."""
        if self.pinned:
            return None
        if self.users:
            return max(0.0, max(at + keep for at, keep in self.users.values()) - now)
        return max(0.0, self.keep_alive - (now - self.last_used))


class NeverFits(Exception):
    """The model is larger than the whole budget."""


def plan_room(need: int, budget: int, loaded: Sequence[Resident], principal: int,
              now: float) -> list[Resident] | None:
    """The models to unload, in order, so that a model of ``need`` bytes fits ``budget``
    beside the others; None when it cannot fit now (wait).  Raises NeverFits when it
    cannot fit however many are unloaded."""
    if need > budget:
        raise NeverFits(f"the model needs {need} bytes, the budget is {budget}")
    used = sum(r.bytes for r in loaded)
    if used + need <= budget:
        return []
    chosen: list[Resident] = []
    for r in sorted(loaded, key=lambda r: r.last_used):  # least recently used first
        if r.protected_from(principal, now):
            continue
        chosen.append(r)
        used -= r.bytes
        if used + need <= budget:
            return chosen
    return None


def expired(loaded: Sequence[Resident], now: float) -> list[Resident]:
    """The idle, unpinned models whose keep-alive has run out (:meth:`Resident.expires_in`)."""
    return [r for r in loaded if not r.busy and r.expires_in(now) == 0.0]


def default_budget(total_bytes: int) -> int:
    """Three quarters of the machine's memory: the rest for the system, the service's
    other processes and what the estimate leaves out."""
    return total_bytes * 3 // 4


def total_memory() -> int:
    """The machine's memory (MemTotal), or 8 GiB where /proc/meminfo cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 8 << 30
