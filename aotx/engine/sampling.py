"""Sampling: a request's temperature, top-p and seed as a llama.cpp sampler chain.

Greedy requests (temperature 0) need no chain: the engine takes the arg-max of the
logits row itself (:meth:`aotx.engine.llama.LlamaEngine.sample`).
"""

from __future__ import annotations

import llama_cpp

#: llama.cpp reads this 32-bit seed as "pick a random seed" (LLAMA_DEFAULT_SEED).
_RANDOM_SEED = 0xFFFFFFFF


def seed32(seed: int) -> int:
    """A 64-bit request seed as llama.cpp's 32-bit sampler seed: the two halves
    xor-ed (seeds below 2**32 are unchanged, and seeds that differ only in their
    upper half stay apart), never the value llama.cpp takes for "random" (``seed``
    -1, sent as 2**64 - 1, folds to 0)."""
    s = (seed ^ (seed >> 32)) & 0xFFFFFFFF
    return s if s != _RANDOM_SEED else _RANDOM_SEED - 1


class Sampler:
    """A llama.cpp sampler chain for one sequence.

    Temperature 0 (greedy) needs no chain: :meth:`LlamaEngine.sample` takes the
    arg-max of the logits row directly (``ptr`` is None).  llama.cpp's greedy
    sampler first copies the whole vocabulary into a candidate array, about
    0.12 ms a token here; the arg-max is a tenth of that, per sequence per step.
    Both pick the first of equal maxima.
    """

    def __init__(self, temperature: float, top_p: float, seed: int) -> None:
        self.ptr = None
        if temperature > 0.0:
            params = llama_cpp.llama_sampler_chain_default_params()
            self.ptr = llama_cpp.llama_sampler_chain_init(params)
            if 0.0 < top_p < 1.0:
                llama_cpp.llama_sampler_chain_add(self.ptr,
                                                  llama_cpp.llama_sampler_init_top_p(top_p, 1))
            llama_cpp.llama_sampler_chain_add(self.ptr,
                                              llama_cpp.llama_sampler_init_temp(temperature))
            llama_cpp.llama_sampler_chain_add(self.ptr,
                                              llama_cpp.llama_sampler_init_dist(seed32(seed)))

    def free(self) -> None:
        if self.ptr is not None:
            llama_cpp.llama_sampler_free(self.ptr)
            self.ptr = None
