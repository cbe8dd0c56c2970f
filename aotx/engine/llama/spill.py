"""Cached prefixes kept in host memory once their sequence is given to another request.

A free sequence still holds the cells of the conversation that last ran on it.  When
a new request takes the sequence and would discard many of them (another user's
history), the scheduler first copies the sequence's state out of llama.cpp
(``llama_state_seq_get_data``) into this store, with its tokens and the principal
whose request computed them.  A later request whose prompt continues that history
(the next turn) gets it back into its sequence (``llama_state_seq_set_data``) instead
of evaluating the history again.  Restoring is bounded by the same rule as reusing a
sequence (``fair.usable_prefix``): another principal's entry gives at most the public
prefix, so it is never worth restoring for them.

The store holds at most ``budget`` bytes, the least recently stored entry first out
(a restored entry leaves the store: its sequence holds it now); an entry that another
of the same principal extends is dropped (the longer one serves every prompt the
shorter one would).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

from ..fair import usable_prefix
from .residency import available_bytes

#: A sequence's cached tokens are saved when a new request would discard at least this
#: many of them: fewer cost little to evaluate again (~0.2 s on this machine).
SPILL_MIN_TOKENS = 64
#: A restore is worth it from this many tokens saved (and one per 256 the entry holds).
RESTORE_MIN_TOKENS = 4


def default_budget(setting: int) -> int:
    """The store's bytes for a models-file ``kv_spill``: as set, or for "auto" (-1) an
    eighth of the memory available at load, at most 1 GiB (llama-server keeps up to
    8 GiB of prompt cache in RAM by default; aotx also holds results and media)."""
    return setting if setting >= 0 else min(1 << 30, available_bytes() // 8)


@dataclass
class Spilled:
    tokens: list[int]  # what the saved cells hold, position 0 onwards
    owner: int  # fair.owner_of the request that computed them
    data: bytearray  # llama_state_seq_get_data's bytes (LlamaEngine.save_sequence)


class SpillStore:
    def __init__(self, budget: int) -> None:
        self.budget = budget  # bytes; 0: nothing is kept
        self.entries: collections.OrderedDict[int, Spilled] = collections.OrderedDict()
        self.bytes = 0
        self.spills = 0  # entries stored
        self.restores = 0  # entries given back to a sequence (llama.cpp took them)
        self.dropped = 0  # entries let go for room, or superseded
        self._next = 0

    def worth(self, tokens: int) -> bool:
        return self.budget > 0 and tokens >= SPILL_MIN_TOKENS

    def put(self, tokens: list[int], owner: int, data: bytearray) -> None:
        if not data or len(data) > self.budget:
            return
        for key, e in list(self.entries.items()):
            if e.owner == owner and tokens[:len(e.tokens)] == e.tokens:
                self._drop(key)  # the new entry extends it
        while self.bytes + len(data) > self.budget:
            self._drop(next(iter(self.entries)))
        self._next += 1
        self.entries[self._next] = Spilled(list(tokens), owner, data)
        self.bytes += len(data)
        self.spills += 1

    def worth_restoring(self, key: int, gain: int) -> bool:
        """Whether restoring entry ``key`` beats evaluating the ``gain`` tokens it saves:
        a restore costs ~3 ms per 1000 tokens held, a token's evaluation ~2.7 ms here."""
        return gain >= max(RESTORE_MIN_TOKENS, len(self.entries[key].tokens) // 256)

    def best(self, prompt: list[int], who: int, public: list[int]) -> tuple[int, int]:
        """(key, tokens of ``prompt`` it gives ``who``) of the most useful entry; (0, 0)."""
        found, most = 0, 0
        for key, e in self.entries.items():
            n = usable_prefix(e.tokens, e.owner, prompt, who, public)
            if n > most:
                found, most = key, n
        return found, most

    def take(self, key: int) -> Spilled:
        """Remove entry ``key`` for a restore (the caller counts ``restores`` if it takes)."""
        e = self.entries.pop(key)
        self.bytes -= len(e.data)
        return e

    def _drop(self, key: int) -> None:
        self.bytes -= len(self.entries.pop(key).data)
        self.dropped += 1
