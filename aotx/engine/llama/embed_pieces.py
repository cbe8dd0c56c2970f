"""A chat model's embeddings in pieces: an input is embedded over several decodes.

:class:`~aotx.engine.embedding.Embedder` pools in llama.cpp, which needs an input's
tokens in one decode: one long input then holds the engine thread for a whole decode
(2.5 s for 512 tokens of SmolLM2-135M on two cores), and every other principal's call,
and every stream, waits for it.  A chat model attends causally, so a token's hidden
state depends only on the tokens before it: :class:`PieceEmbedder` decodes an input a
piece at a time, its earlier pieces kept in the KV cache under the input's own
sequence, reads every token's hidden state (pooling ``NONE``) and pools them itself.
The vector is llama.cpp's mean pooling of the whole input, to float rounding (cosine
1 - 6e-8 for 512 tokens in pieces of 4 to 512: bench figures in docs/engine.md,
"Embeddings").  A piece's cost is nearly its tokens' (SmolLM2-135M, two cores: 4
tokens 28 ms, 8 50 ms, 64 350 ms, 512 2.5 s), so small decodes cost little throughput
and bound what another caller waits for.

The KV cache holds ``2 × context`` cells: an input's cells are reserved when its first
piece is planned (engine/embedding.py), a principal's inputs in progress reserve at most
``context``, so a second principal's input always finds room (a third's may wait for one
in progress to end).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import llama_cpp
import numpy as np

from ..embedding import MAX_SEQS, Vectors
from ..interface import EngineError
from .engine import LlamaEngine


@dataclass
class _Pooled:
    """What one input in progress has given so far."""

    total: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float64))
    count: int = 0


class PieceEmbedder:
    """Mean-pooled embeddings of ``engine``'s (causal) model, in pieces of inputs of at
    most ``context`` tokens each; :meth:`run` decodes one batch of pieces."""

    chunked = True
    pooling = "mean"

    def __init__(self, engine: LlamaEngine, context: int) -> None:
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = 2 * context  # see the module: an input's cells are reserved whole
        params.n_batch = params.n_ubatch = context
        params.n_seq_max = MAX_SEQS
        params.n_threads = params.n_threads_batch = engine.threads
        params.embeddings = True
        params.kv_unified = True
        params.pooling_type = llama_cpp.LLAMA_POOLING_TYPE_NONE  # every token's state
        params.no_perf = True
        # Flash attention off, as the whole-input embedder (its vectors beside others'
        # are closer to an input's alone).
        params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        self.ctx = llama_cpp.llama_init_from_model(engine.model, params)
        if not self.ctx:
            raise EngineError(f"llama.cpp could not create an embedding context of {context}")
        engine.attach(self.ctx)  # the engine thread's pool: both contexts run on that thread
        self.engine = engine
        self.context = context
        self.cells = 2 * context
        self.dims = int(llama_cpp.llama_model_n_embd(engine.model))
        self.memory = llama_cpp.llama_get_memory(self.ctx)
        self.batch = llama_cpp.llama_batch_init(context, 0, 1)
        self._pooled: dict[int, _Pooled] = {}

    def run(self, pieces: list[tuple[int, list[int], int, bool]]) -> dict[int, Vectors]:
        """Decode ``pieces`` (sequence, tokens, position of the first, last piece of its
        input?) in one batch; the unit vectors of the inputs whose last piece it was, by
        sequence (their cells are freed).  Raises EngineError when the decode fails; every
        input in progress is then dropped."""
        b, n = self.batch, 0
        if len(pieces) > MAX_SEQS or sum(len(t) for _, t, _, _ in pieces) > self.context:
            raise EngineError("embedding batch overflow")
        for seq, tokens, start, _ in pieces:
            for k, token in enumerate(tokens):
                b.token[n], b.pos[n], b.n_seq_id[n] = token, start + k, 1
                b.seq_id[n][0], b.logits[n] = seq, True
                n += 1
        b.n_tokens = n
        status = self.engine.decode_batch(self.ctx, b)
        if status != 0:
            self.reset()
            raise EngineError(f"llama_decode returned {status}")
        rows = np.ctypeslib.as_array(llama_cpp.llama_get_embeddings(self.ctx),
                                     shape=(n, self.dims))
        out: dict[int, Vectors] = {}
        at = 0
        for seq, tokens, start, last in pieces:
            pooled = self._pooled.setdefault(seq, _Pooled(np.zeros(self.dims, np.float64)))
            if start == 0:
                pooled.total[:], pooled.count = 0.0, 0
            pooled.total += rows[at:at + len(tokens)].sum(axis=0, dtype=np.float64)
            pooled.count += len(tokens)
            at += len(tokens)
            if last:
                vector = (pooled.total / pooled.count).astype(np.float32)
                norm = np.linalg.norm(vector)
                out[seq] = vector / norm if norm > 0 else vector  # unit length, as OpenAI's
                self.drop(seq)
        return out

    def drop(self, seq: int) -> None:
        """Forget the input in progress under ``seq`` (its cells too)."""
        self._pooled.pop(seq, None)
        llama_cpp.llama_memory_seq_rm(self.memory, seq, -1, -1)

    def reset(self) -> None:
        self._pooled.clear()
        llama_cpp.llama_memory_clear(self.memory, True)

    def close(self) -> None:
        if self.ctx:
            llama_cpp.llama_batch_free(self.batch)
            llama_cpp.llama_free(self.ctx)
            self.ctx = None
