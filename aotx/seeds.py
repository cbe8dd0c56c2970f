"""A request's seed: 64 bits on the wire (OpenAI's ``seed`` is any integer from -2**63 to
2**64 - 1, sent as its two's complement), 32 in llama.cpp's sampler.  The gateway
derives the seeds of a request's choices here and the device folds a seed here, so
that both read a seed the same way.
"""

from __future__ import annotations

#: llama.cpp reads this 32-bit seed as "pick a random seed" (LLAMA_DEFAULT_SEED).
RANDOM32 = 0xFFFFFFFF
MASK64 = (1 << 64) - 1


def fold(seed: int) -> int:
    """A 64-bit request seed as llama.cpp's 32-bit sampler seed: the two halves
    xor-ed (seeds below 2**32 are unchanged, and seeds that differ only in their
    upper half stay apart), never the value llama.cpp takes for "random" (``seed``
    -1, sent as 2**64 - 1, folds to 0)."""
    seed &= MASK64
    s = (seed ^ (seed >> 32)) & 0xFFFFFFFF
    return s if s != RANDOM32 else RANDOM32 - 1


def of_choice(seed: int, i: int) -> int:
    """The seed of choice ``i`` of a request sent with ``seed``: ``seed + i`` counted
    after the fold, so that no two of a request's choices sample alike (``seed + i``
    in 64 bits would give seed -1's choices 0 and 1 the same fold, 0).  For a seed
    below 2**32 - 9, as OpenAI clients send them, it is ``seed + i``."""
    if i == 0:
        return seed & MASK64
    return (fold(seed) + i) % RANDOM32  # below 2**32 - 1: its own fold
