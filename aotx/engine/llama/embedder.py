"""A second llama.cpp context on a loaded model, for embeddings.

:class:`Embedder` is a context of its own on the model the generation engine already
loaded (the weights are shared, not loaded twice), created with ``embeddings`` on and a
pooling type: the generation context's KV streams and sequences are never touched, so an
embedding batch cannot evict a cached prompt or take a slot.  Its KV cache holds exactly
one decode (``context`` tokens, one unified buffer) and is cleared before each one: an
input is embedded in a single ``llama_decode``, which pooling over a whole sequence (and
a non-causal encoder) needs.  The engine thread's queue (engine/embedding.py) decodes
through it.

A reranker (a cross-encoder: its GGUF declares rank pooling, and its classifier head
gives a score) is decoded alike: its "vector" is one float, the score of the input (a
query and a document joined, ``LlamaEngine.rank_prompt``), as llama-server reports it
(the head's first output, not normalized).
"""

from __future__ import annotations

import llama_cpp
import numpy as np

from ..embedding import MAX_SEQS, Vectors
from ..interface import EngineError
from .engine import LlamaEngine

#: Pooling names (the models file's and the capabilities') -> llama.cpp's pooling types.
POOLING = {"mean": llama_cpp.LLAMA_POOLING_TYPE_MEAN, "cls": llama_cpp.LLAMA_POOLING_TYPE_CLS,
           "last": llama_cpp.LLAMA_POOLING_TYPE_LAST, "rank": llama_cpp.LLAMA_POOLING_TYPE_RANK}


class Embedder:
    """An embedding context on ``engine``'s model: ``context`` tokens per decode (and so per
    input), ``pooling`` a name of :data:`POOLING`, or None for the pooling the GGUF file
    declares (mean when it declares none).  ``rank``: the model is a reranker, and its
    GGUF must declare rank pooling; else it must not."""

    def __init__(self, engine: LlamaEngine, context: int, pooling: str | None = "mean",
                 rank: bool = False) -> None:
        if llama_cpp.llama_model_has_encoder(engine.model):  # T5: llama_encode, not here
            raise EngineError("encoder-decoder models are not supported for embeddings")
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = params.n_batch = params.n_ubatch = context
        params.n_seq_max = MAX_SEQS
        params.n_threads = params.n_threads_batch = engine.threads
        params.embeddings = True
        params.kv_unified = True  # one decode's inputs share the cells; any length fits
        params.pooling_type = (llama_cpp.LLAMA_POOLING_TYPE_UNSPECIFIED if pooling is None
                               else POOLING[pooling])
        params.no_perf = True
        # Flash attention off: with it on, llama.cpp's CPU kernel gave an input's vector
        # 8e-3 apart (cosine 0.9995) beside other inputs; without, 2e-3 (cosine 0.99998).
        params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        self.ctx = llama_cpp.llama_init_from_model(engine.model, params)
        if not self.ctx:
            raise EngineError(f"llama.cpp could not create an embedding context of {context}")
        kind = int(llama_cpp.llama_pooling_type(self.ctx))
        if kind == llama_cpp.LLAMA_POOLING_TYPE_NONE:  # the GGUF names none: mean
            llama_cpp.llama_free(self.ctx)
            params.pooling_type = POOLING["mean"]
            self.ctx = llama_cpp.llama_init_from_model(engine.model, params)
            kind = int(llama_cpp.llama_pooling_type(self.ctx))
        names = {v: k for k, v in POOLING.items()}
        if kind not in names or rank != (kind == POOLING["rank"]):
            llama_cpp.llama_free(self.ctx)
            raise EngineError(_unfit(kind, rank))
        self.pooling = names[kind]
        engine.attach(self.ctx)  # the engine thread's pool: both contexts run on that thread
        self.engine = engine
        self.context = context
        self.dims = 1 if rank else int(llama_cpp.llama_model_n_embd(engine.model))
        self.memory = llama_cpp.llama_get_memory(self.ctx)  # None for an encoder without KV
        self.batch = llama_cpp.llama_batch_init(context, 0, 1)

    def embed(self, inputs: list[list[int]]) -> Vectors:
        """Unit vectors of ``inputs`` (a reranker: their scores; at most :data:`MAX_SEQS`,
        ``context`` tokens in all), one decode.  Raises EngineError when the decode fails."""
        b, n = self.batch, 0
        if len(inputs) > MAX_SEQS or sum(map(len, inputs)) > self.context:
            raise EngineError("embedding batch overflow")
        for seq, tokens in enumerate(inputs):
            for pos, token in enumerate(tokens):
                b.token[n], b.pos[n], b.n_seq_id[n] = token, pos, 1
                b.seq_id[n][0], b.logits[n] = seq, True
                n += 1
        b.n_tokens = n
        if self.memory:
            llama_cpp.llama_memory_clear(self.memory, True)
        status = self.engine.decode_batch(self.ctx, b)
        if status != 0:
            raise EngineError(f"llama_decode returned {status}")
        out = np.empty((len(inputs), self.dims), dtype=np.float32)
        for seq in range(len(inputs)):
            row = llama_cpp.llama_get_embeddings_seq(self.ctx, seq)
            if not row:
                raise EngineError(f"no embedding for sequence {seq}")
            out[seq] = np.ctypeslib.as_array(row, shape=(self.dims,))
        if self.pooling == "rank":  # a score per input: the classifier head's first output
            return out
        norms = np.linalg.norm(out, axis=1, keepdims=True)
        out /= np.where(norms > 0, norms, np.float32(1.0))  # unit length, as OpenAI's
        return out

    def close(self) -> None:
        if self.ctx:
            llama_cpp.llama_batch_free(self.batch)
            llama_cpp.llama_free(self.ctx)
            self.ctx = None


def _unfit(kind: int, rank: bool) -> str:
    """Why a context of pooling ``kind`` cannot serve (``rank``: as a reranker)."""
    if kind == POOLING["rank"]:
        return "its GGUF declares rank pooling: a reranker (kind = \"rerank\")"
    if rank:
        return "its GGUF does not declare rank pooling (a reranker's classifier head)"
    return f"pooling type {kind} does not give embeddings"
