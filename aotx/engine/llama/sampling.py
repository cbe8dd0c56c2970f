"""Sampling: a request's temperature, top-p, seed and the rest of its sampler
(``wire.Sampling``: top-k, min-p, penalties, logit bias) as a llama.cpp sampler chain.

Greedy requests (temperature 0) need no chain: the engine takes the arg-max of the
logits row itself (:meth:`aotx.engine.llama.LlamaEngine.sample`).
"""

from __future__ import annotations

import llama_cpp

from ...seeds import fold
from ...wire import Sampling

PLAIN = Sampling()  # nothing beyond temperature, top-p and seed


class Sampler:
    """A llama.cpp sampler chain for one sequence.

    Temperature 0 (greedy) with nothing else asked needs no chain:
    :meth:`LlamaEngine.sample` takes the arg-max of the logits row directly (``ptr`` is
    None).  llama.cpp's greedy sampler first copies the whole vocabulary into a
    candidate array, about 0.12 ms a token here; the arg-max is a tenth of that, per
    sequence per step.  Both pick the first of equal maxima.

    The chain, in llama.cpp's own order (common/sampling.cpp): logit bias, penalties,
    top-k, top-p, min-p, temperature, then the seeded draw (or greedy).  The penalties
    count the tokens this request generated (OpenAI's definition: "how often the token
    was sampled so far"), the last ``last_n`` of them, all of them when ``last_n`` is 0.
    """

    def __init__(self, temperature: float, top_p: float, seed: int,
                 sampling: Sampling = PLAIN, max_tokens: int = 0, n_vocab: int = 0) -> None:
        self.ptr = None
        if temperature <= 0.0 and sampling._replace(logprobs=0) == PLAIN:
            return  # (logprobs are read from the logits row: engine/logprobs.py)
        params = llama_cpp.llama_sampler_chain_default_params()
        self.ptr = llama_cpp.llama_sampler_chain_init(params)
        for step in _steps(temperature, top_p, seed, sampling, max_tokens, n_vocab):
            llama_cpp.llama_sampler_chain_add(self.ptr, step)

    def free(self) -> None:
        if self.ptr is not None:
            llama_cpp.llama_sampler_free(self.ptr)
            self.ptr = None


def _steps(temperature: float, top_p: float, seed: int, s: Sampling, max_tokens: int,
           n_vocab: int) -> list[llama_cpp.llama_sampler_p]:
    steps = []
    if s.bias:
        arr = (llama_cpp.llama_logit_bias * len(s.bias))(
            *(llama_cpp.llama_logit_bias(t, b) for t, b in s.bias))
        steps.append(llama_cpp.llama_sampler_init_logit_bias(n_vocab, len(s.bias), arr))
    if s.presence or s.frequency or s.repetition != 1.0:
        last_n = s.last_n or max(1, max_tokens)
        steps.append(llama_cpp.llama_sampler_init_penalties(n_vocab, last_n, s.repetition,
                                                            s.frequency, s.presence))
    if temperature <= 0.0:
        return [*steps, llama_cpp.llama_sampler_init_greedy()]
    if s.top_k > 0:
        steps.append(llama_cpp.llama_sampler_init_top_k(s.top_k))
    if 0.0 < top_p < 1.0:
        steps.append(llama_cpp.llama_sampler_init_top_p(top_p, 1))
    if s.min_p > 0.0:
        steps.append(llama_cpp.llama_sampler_init_min_p(s.min_p, 1))
    steps.append(llama_cpp.llama_sampler_init_temp(temperature))
    steps.append(llama_cpp.llama_sampler_init_dist(fold(seed)))
    return steps
