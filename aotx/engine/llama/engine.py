"""The model engine: llama.cpp through llama-cpp-python's low-level batch API.

One :class:`LlamaEngine` owns one model, one context and one batch.  It knows
nothing about requests: the scheduler (``aotx.engine.llama.scheduler``) decides which
tokens of which sequences go into each ``llama_decode`` call.  Every ctypes
call into llama.cpp releases the GIL, so the device's control thread keeps
answering the mailboxes while a decode step runs.

By default the context has one KV stream per sequence (``kv_unified`` off): each
sequence attends only to its own cells, which sit in position order, so its
arithmetic does not depend on the other sequences (a seed reproduces its output).
With a budget (``unified``) it has one KV pool that every sequence shares, sized
in bytes (:func:`pool_cells`): a sequence takes cells as it grows, and the
scheduler keeps the pool from overflowing (``engine/kvpool.py``).  Flash attention
is on, so that in the pool each sequence's attention skips the others' cells.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import llama_cpp
import numpy as np
from llama_cpp import _logger as _llama_logger

from ..grammar import GrammarCompiler
from ..interface import BatchEntry, EngineError
from ..masks import apply_mask
from .cores import FreeCores
from .libs import ThreadpoolParams, ggml_libs
from .rank import rank_prompt
from .residency import available_bytes, create_uncommitted
from .sampling import Sampler

log = logging.getLogger("aotx.engine")

_llama_logger.set_verbose(False)
_backend_ready = False
#: The tokens of this many distinct prompt pieces (between special tokens) are cached.
FRAGMENT_CACHE = 1024
#: Pieces longer than this (bytes) are tokenized every time, not cached.
MAX_CACHED_FRAGMENT = 4096
#: Vocabularies with more special tokens than this tokenize a whole text (``tokenize``)
#: through llama.cpp (splitting on each of them would cost more than it saves).
MAX_SPECIALS = 256


#: KV cache types (the models file's ``kv_type``): ggml type and bytes per element.
KV_TYPES = {"f16": (1, 2.0), "q8_0": (8, 34 / 32)}


@dataclass(frozen=True)
class EngineConfig:
    path: str
    slots: int = 16  # sequences decoded together
    slot_context: int = 4096  # the most KV cells (tokens) one sequence may hold
    kv_budget: int = 0  # bytes of the shared pool; 0: pool_cells' default
    kv_cells: int = 0  # the pool's cells, when given (tests, benchmarks): over kv_budget
    kv_type: str = "f16"  # KV_TYPES
    unified: bool = False  # one KV pool (False: a stream of slot_context per sequence)
    batch: int = 512  # tokens per llama_decode call
    threads: int = 0  # 0: all cores
    # A persistent ggml thread pool, as llama.cpp's own tools attach.  Without one, ggml
    # starts and joins its worker threads for every graph (every llama_decode, every
    # micro-batch).  ``poll`` is how long an idle worker spins for the next graph before
    # it sleeps (0-100, llama.cpp's default 50); -1: no pool (per-graph threads).
    poll: int = 50
    gpu_layers: int = 0  # layers offloaded to the GPU (a CUDA build; offload.py decides "auto")
    # Flash attention with a stream per sequence and an f16 cache (a pool or a q8_0 cache
    # always has it): docs/performance.md, "Flash attention, or not".
    flash_attention: bool = True
    alone: bool = True  # created while no other thread runs (residency.create_uncommitted)


#: The fewest cells a pool has (llama.cpp pads the KV cache to 256 cells).
MIN_POOL_CELLS = 256


def pool_cells(config: EngineConfig, cell_bytes: float, n_ctx_train: int) -> int:
    """The KV pool's cells: ``kv_cells``, else ``kv_budget``'s worth, else the default:
    as many as the model was trained for (llama-server's default context) or one whole
    context if more, never more than every sequence's whole context nor a quarter of
    the memory available now.  Without a pool, a stream of ``slot_context`` each."""
    whole = config.slots * config.slot_context
    if not config.unified:
        return whole
    if config.kv_cells:
        return config.kv_cells
    if config.kv_budget:
        return max(MIN_POOL_CELLS, min(whole, int(config.kv_budget // cell_bytes)))
    default = min(whole, max(config.slot_context, n_ctx_train or 0),
                  int(available_bytes() / 4 // cell_bytes))
    return max(MIN_POOL_CELLS, default)


def model_metadata(model: llama_cpp.llama_model_p, key: str) -> str | None:
    """A GGUF key's value as text (None when the file has no such key), however long."""
    size = 1 << 16
    while True:
        buf = ctypes.create_string_buffer(size)
        n = llama_cpp.llama_model_meta_val_str(model, key.encode(), buf, size)
        if n < 0:
            return None
        if n < size:
            return buf.raw[:n].decode("utf-8", errors="replace")
        size = n + 1


class LlamaEngine:
    closes_slowly = False  # (interface.Model)
    applies_grammar = False  # aotx's scheduler fills the masks (engine/grammar.py)

    def __init__(self, config: EngineConfig) -> None:
        global _backend_ready
        if not _backend_ready:
            llama_cpp.llama_backend_init()
            _backend_ready = True
        self.config = config
        mparams = llama_cpp.llama_model_default_params()
        mparams.n_gpu_layers = config.gpu_layers
        self.model = llama_cpp.llama_model_load_from_file(config.path.encode(), mparams)
        if not self.model:
            raise EngineError(f"llama.cpp could not load {config.path}")
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.n_ctx_train = int(llama_cpp.llama_model_n_ctx_train(self.model))
        threads = config.threads or (os.cpu_count() or 1)
        cparams = llama_cpp.llama_context_default_params()
        kv_type, self.kv_element_bytes = KV_TYPES[config.kv_type]
        self.kv_cell_bytes = self._cell_elements() * self.kv_element_bytes
        cells = pool_cells(config, self.kv_cell_bytes, self.n_ctx_train)
        cparams.n_ctx = cells
        cparams.n_batch = config.batch
        cparams.n_ubatch = config.batch
        cparams.n_seq_max = config.slots
        cparams.n_threads = threads
        cparams.n_threads_batch = threads
        cparams.kv_unified = config.unified
        cparams.type_k = cparams.type_v = kv_type
        # a pool's attention skips the others' cells with it; V is quantized only with it
        required = config.unified or config.kv_type != "f16"
        self.flash_attention = required or config.flash_attention
        cparams.flash_attn_type = 1 if required else -1 if config.flash_attention else 0  # -1: auto
        cparams.no_perf = False
        # the KV buffer llama.cpp clears is committed as cells are written (residency.py);
        # not with layers on the GPU: their KV is there, and the GPU backend's host buffers
        # (pinned, read by the device) are no pages to hand back
        def create() -> Any:  # (a llama_context_p, None when it fails)
            return llama_cpp.llama_init_from_model(self.model, cparams)
        self.ctx, self.kv_released = ((create(), 0) if config.gpu_layers else create_uncommitted(
            create, int(self.kv_cell_bytes * cells), config.alone))
        if not self.ctx:
            llama_cpp.llama_model_free(self.model)
            raise EngineError(f"llama.cpp could not create a context ({cells} KV cells of "
                              f"{config.kv_type}, {config.slots} sequences)")
        self.kv_cells = int(llama_cpp.llama_n_ctx(self.ctx))
        self.threadpool: int | None = None
        if config.poll >= 0 and threads > 1:
            self._attach_threadpool(threads, config.poll)
        self.memory = llama_cpp.llama_get_memory(self.ctx)
        self.unified = config.unified
        # llama.cpp caps a batch at the context's cells: a pool smaller than ``batch``
        # takes smaller batches (a larger one would abort in llama_decode)
        self.n_batch = int(llama_cpp.llama_n_batch(self.ctx))
        self.slot_context = min(config.slot_context, int(llama_cpp.llama_n_ctx_seq(self.ctx)))
        self.n_swa = int(llama_cpp.llama_model_n_swa(self.model))  # 0: no sliding window
        if 0 < self.n_ctx_train < self.slot_context:
            # Served as configured (llama.cpp does the same), but positions past the
            # training context are outside what the model learned.
            log.warning("event=engine.context_beyond_training context=%d n_ctx_train=%d",
                        self.slot_context, self.n_ctx_train)
        self.batch = llama_cpp.llama_batch_init(config.batch, 0, 1)
        self._piece_cache: dict[int, bytes] = {}
        self._piece_buf = ctypes.create_string_buffer(256)
        self.model_bytes = int(llama_cpp.llama_model_size(self.model))
        self.threads = threads
        #: the count follows the free cores when the models file names none (cores.py)
        self.free_cores = FreeCores(threads) if not config.threads else None
        self._ctx_threads: dict[llama_cpp.llama_context_p, int] = {}  # each context's last
        # the width of one input embedding row (what a projector must produce)
        self.n_embd = int(llama_cpp.llama_model_n_embd_inp(self.model))
        self._embd_batch: llama_cpp.llama_batch | None = None
        self._init_vocab()

    def _init_vocab(self) -> None:
        """The vocabulary's facts, and the tokenizer's caches."""
        self.add_bos = bool(llama_cpp.llama_vocab_get_add_bos(self.vocab))
        self.add_eos = bool(llama_cpp.llama_vocab_get_add_eos(self.vocab))
        self.bos = int(llama_cpp.llama_vocab_bos(self.vocab))
        self.eos = int(llama_cpp.llama_vocab_eos(self.vocab))
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(self.vocab))
        self._logits_row = ctypes.POINTER(ctypes.c_float * self.n_vocab)
        self._specials, self._lstrip, self._rstrip = self._special_texts()
        #: every token special parsing can produce (control, user-defined, unknown)
        self.special_ids = frozenset(t for _, t in self._specials)
        # llama.cpp's own tokenization of a whole text is matched here (and cheaper) for a
        # BPE vocabulary with few special tokens, none of which strips whitespace.
        self._fast = (llama_cpp.llama_vocab_type(self.vocab) == llama_cpp.LLAMA_VOCAB_TYPE_BPE
                      and not (self._lstrip or self._rstrip) and len(self._specials) <= MAX_SPECIALS)
        self._fragment = functools.lru_cache(maxsize=FRAGMENT_CACHE)(self._tokenize_text)
        self._markup_cached = functools.lru_cache(maxsize=FRAGMENT_CACHE)(self._split_specials)

    def _special_texts(self) -> tuple[list[tuple[bytes, int]], frozenset[int], frozenset[int]]:
        """The texts llama.cpp splits a prompt on before tokenizing its pieces (its
        special-token cache: control, user-defined and unknown tokens), longest first,
        and which of those tokens strip the whitespace before (LSTRIP) or after (RSTRIP)
        them."""
        special = (llama_cpp.LLAMA_TOKEN_ATTR_CONTROL | llama_cpp.LLAMA_TOKEN_ATTR_USER_DEFINED
                   | llama_cpp.LLAMA_TOKEN_ATTR_UNKNOWN)
        found, lstrip, rstrip = [], set(), set()
        for t in range(self.n_vocab):
            attr = int(llama_cpp.llama_vocab_get_attr(self.vocab, t))
            if attr & special:
                text = llama_cpp.llama_vocab_get_text(self.vocab, t) or b""
                if text:
                    found.append((bytes(text), t))
                    if attr & llama_cpp.LLAMA_TOKEN_ATTR_LSTRIP:
                        lstrip.add(t)
                    if attr & llama_cpp.LLAMA_TOKEN_ATTR_RSTRIP:
                        rstrip.add(t)
        found.sort(key=lambda x: -len(x[0]))  # stable: equal lengths in token order
        return found, frozenset(lstrip), frozenset(rstrip)

    def _attach_threadpool(self, threads: int, poll: int) -> None:
        """One pool for single-token and batch decodes alike (the same thread count)."""
        base, cpu = ggml_libs()
        params = ThreadpoolParams()
        base.ggml_threadpool_params_init(ctypes.byref(params), threads)
        params.poll = poll
        pool = cpu.ggml_threadpool_new(ctypes.byref(params))
        if not pool:
            log.warning("event=engine.threadpool_failed threads=%d: ggml uses per-graph threads",
                        threads)
            return
        self.threadpool = pool
        self.attach(self.ctx)

    # -- metadata ------------------------------------------------------------
    def metadata(self, key: str) -> str | None:
        return model_metadata(self.model, key)

    def token_text(self, token: int) -> str:
        return self.token_bytes(token).decode("utf-8", errors="replace")

    def token_bytes(self, token: int) -> bytes:
        """A token's bytes, a special token's text included (llama-server's pieces)."""
        return self.piece(token, special=True)

    # -- tokens --------------------------------------------------------------
    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        """``text``'s tokens, every special-token text in it parsed as that token (as
        llama.cpp's ``llama_tokenize`` with ``parse_special``).  For a chat prompt use
        :meth:`tokenize_pieces`: a message's text must not be parsed so.

        llama.cpp splits the text on every special token's text (longest first),
        then tokenizes each piece between them on its own.  With a BPE vocabulary
        that is done here too, and the pieces' tokens are cached: a chat prompt's
        system prompt and role headers are the same pieces every time, and each
        llama.cpp call costs a fixed ~35 us (it compiles its pre-tokenizer regex),
        so a SmolLM2 chat prompt takes ~100 us instead of ~340 us.  The result is
        the same as ``_tokenize_llama`` (tests/e2e/test_engine.py compares them)."""
        if not self._fast:
            return list(self._tokenize_llama(text.encode("utf-8"), add_special))
        return self.tokenize_pieces([(text, True)], add_special)

    def tokenize_pieces(self, pieces: Sequence[tuple[str, bool]], add_special: bool = True,
                        start: bool = True, end: bool = True) -> list[int]:
        """The tokens of the pieces' texts joined, special-token texts parsed as those
        tokens only inside the pieces marked True (a chat template's own markup); in the
        others (a message's text) they are text, whatever the text holds.

        This is llama.cpp's own procedure with the special texts looked for in the markup
        alone: it splits a text on the special texts, then tokenizes each run of text
        between two special tokens on its own, for every vocabulary type (SentencePiece's
        space prefix too goes at the start of each run); here a run may join markup and
        message text, and is tokenized without special parsing.  Runs and markup splits
        are cached.  ``start`` and ``end``: whether the pieces open and close the prompt
        (the BOS and EOS go there, where ``add_special`` and the vocabulary say so)."""
        # runs: text, token, text, ..., text (a text may be empty)
        runs: list[bytes | int] = []
        text_run: list[bytes] = []
        for text, markup in pieces:
            if not markup:
                text_run.append(text.encode("utf-8"))
                continue
            for part in self._markup_parts(text):
                if isinstance(part, int):
                    runs += (b"".join(text_run), part)
                    text_run = []
                else:
                    text_run.append(part)
        runs.append(b"".join(text_run))
        if self._lstrip or self._rstrip:
            self._strip_around(runs)
        out: list[int] = []
        if add_special and start and self.add_bos:
            out.append(self.bos)
        for i, p in enumerate(runs):
            if i % 2:
                out.append(p)  # type: ignore[arg-type]
            elif len(p) <= MAX_CACHED_FRAGMENT:  # type: ignore[arg-type]
                out += self._fragment(p)
            else:
                out += self._tokenize_text(p)  # type: ignore[arg-type]
        if add_special and end and self.add_eos:
            out.append(self.eos)
        return out

    def rank_prompt(self, query: str, document: str) -> list[int]:
        """A reranker's input for ``query`` and ``document`` (rank.py)."""
        return rank_prompt(self, query, document)

    def specials(self, text: str) -> list[int]:
        """The special tokens that special parsing finds in ``text``, in order."""
        return [p for p in self._markup_parts(text) if isinstance(p, int)]

    def _markup_parts(self, text: str) -> tuple[bytes | int, ...]:
        if len(text) <= MAX_CACHED_FRAGMENT:
            return self._markup_cached(text)
        return self._split_specials(text)

    def _split_specials(self, text: str) -> tuple[bytes | int, ...]:
        """``text`` split on the special texts as llama.cpp splits it: each special
        text in turn, longest first, in every piece of text still left."""
        parts: list[bytes | int] = [text.encode("utf-8")]
        for st, tid in self._specials:
            if not any(isinstance(p, bytes) and st in p for p in parts):
                continue
            split: list[bytes | int] = []
            for p in parts:
                if isinstance(p, int) or st not in p:
                    split.append(p)
                    continue
                for k, piece in enumerate(p.split(st)):
                    if k:
                        split.append(tid)
                    if piece:
                        split.append(piece)
            parts = split
        return tuple(parts)

    def _strip_around(self, runs: list[bytes | int]) -> None:
        """Drop the whitespace that an LSTRIP token takes before it and an RSTRIP token
        after it (llama.cpp strips the text run next to the token, as here).  ``runs``
        alternates text and token."""
        for i in range(1, len(runs), 2):
            if runs[i] in self._lstrip:
                runs[i - 1] = runs[i - 1].rstrip()  # type: ignore[union-attr]
            if runs[i] in self._rstrip:
                runs[i + 1] = runs[i + 1].lstrip()  # type: ignore[union-attr]

    def _tokenize_text(self, data: bytes) -> tuple[int, ...]:
        """llama.cpp's tokenization of ``data`` as text (no special parsing, no BOS)."""
        return self._tokenize_llama(data, False, parse_special=False)

    def _tokenize_llama(self, data: bytes, add_special: bool = False,
                        parse_special: bool = True) -> tuple[int, ...]:
        """llama.cpp's own tokenization of ``data``."""
        if not data and not add_special:
            return ()
        cap = len(data) + 8
        arr = (llama_cpp.llama_token * cap)()
        n = llama_cpp.llama_tokenize(self.vocab, data, len(data), arr, cap, add_special,
                                     parse_special)
        if n < 0:
            cap = -n
            arr = (llama_cpp.llama_token * cap)()
            n = llama_cpp.llama_tokenize(self.vocab, data, len(data), arr, cap, add_special,
                                         parse_special)
        if n < 0:
            raise EngineError("tokenization failed")
        return tuple(arr[:n])

    def piece(self, token: int, special: bool = False) -> bytes:
        """The exact bytes of one token (special tokens render as nothing)."""
        if not special:
            cached = self._piece_cache.get(token)
            if cached is not None:
                return cached
        buf = self._piece_buf
        n = llama_cpp.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = llama_cpp.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
        out = buf.raw[:n]
        if not special:
            self._piece_cache[token] = out
        return out

    def grammar_compiler(self) -> GrammarCompiler:
        """A grammar compiler on this vocabulary (~0.4 s for 49k tokens: once per model);
        every end-of-generation token counts as EOS to the grammar."""
        from llguidance.llamacpp import lltokenizer_from_vocab

        eog = [t for t in range(self.n_vocab) if self.is_eog(t)] or [self.eos]
        with warnings.catch_warnings():  # the helper calls a llama_cpp alias deprecated
            warnings.simplefilter("ignore", DeprecationWarning)  # once per token
            return GrammarCompiler(lltokenizer_from_vocab(self.vocab, n_vocab=self.n_vocab,
                                                          eos_token=eog))

    def is_eog(self, token: int) -> bool:
        return bool(llama_cpp.llama_vocab_is_eog(self.vocab, token))

    # -- decoding ------------------------------------------------------------
    def decode(self, entries: list[BatchEntry]) -> int:
        """Decode one batch.  Returns llama_decode's status (0 = success)."""
        b = self.batch
        if len(entries) > self.n_batch:
            raise EngineError("batch overflow")
        for i, e in enumerate(entries):
            b.token[i] = e.token
            b.pos[i] = e.pos
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = e.seq
            b.logits[i] = e.logits
        b.n_tokens = len(entries)
        return self.decode_batch(self.ctx, b)

    def decode_batch(self, ctx: llama_cpp.llama_context_p, batch: llama_cpp.llama_batch) -> int:
        """``llama_decode`` on this engine's thread count for now (cores.py): its own
        context, or an embedding context attached to its pool (:meth:`attach`)."""
        n = self.free_cores.threads() if self.free_cores is not None else self.threads
        if self._ctx_threads.get(ctx) != n:
            self._ctx_threads[ctx] = n
            if self.threadpool:
                # One thread runs on the calling thread without the pool: an idle pool
                # worker would still be woken (and poll) at every graph.
                if n == 1:
                    llama_cpp.llama_cpp._lib.llama_detach_threadpool(ctypes.c_void_p(ctx))
                else:
                    self.attach(ctx)
            llama_cpp.llama_set_n_threads(ctx, n, n)
        return int(llama_cpp.llama_decode(ctx, batch))

    def thread_figures(self) -> tuple[int, int]:
        """The thread count decodes run on now, and how often it has changed."""
        cores = self.free_cores
        return (cores.current, cores.changes) if cores is not None else (self.threads, 0)

    def attach(self, ctx: llama_cpp.llama_context_p) -> None:
        """Run another context's graphs (an embedding context: it decodes on the engine
        thread too) on this engine's thread pool."""
        if self.threadpool:
            llama_cpp.llama_cpp._lib.llama_attach_threadpool(
                ctypes.c_void_p(ctx), ctypes.c_void_p(self.threadpool),
                ctypes.c_void_p(self.threadpool))

    def decode_embeddings(self, embd: ctypes.Array[ctypes.c_float], n_tokens: int, pos: int,
                          seq: int, non_causal: bool = False) -> int:
        """Decode ``n_tokens`` rows of input embeddings (an image or audio segment from
        the projector) into ``seq`` at positions ``pos``...; no logits are kept (a
        prompt always ends in text).  Returns llama_decode's status."""
        n_embd = self.n_embd
        if self._embd_batch is None:
            self._embd_batch = llama_cpp.llama_batch_init(self.config.batch, n_embd, 1)
        b = self._embd_batch
        row = n_embd * ctypes.sizeof(ctypes.c_float)
        base = ctypes.addressof(embd)
        if non_causal:
            llama_cpp.llama_set_causal_attn(self.ctx, False)
        try:
            done = 0
            while done < n_tokens:
                n = min(self.n_batch, n_tokens - done)
                ctypes.memmove(b.embd, base + done * row, n * row)
                for i in range(n):
                    b.pos[i] = pos + done + i
                    b.n_seq_id[i] = 1
                    b.seq_id[i][0] = seq
                    b.logits[i] = False
                b.n_tokens = n
                status = self.decode_batch(self.ctx, b)
                if status != 0:
                    return status
                done += n
        finally:
            if non_causal:
                llama_cpp.llama_set_causal_attn(self.ctx, True)
        return 0

    def sample(self, sampler: Sampler, index: int,
               mask: np.ndarray[Any, np.dtype[np.int32]] | None = None) -> int:
        """The next token from the logits of batch entry ``index`` of the last decode.

        ``mask`` (a grammar's bitmask row, grammar.Matcher.fill) first sets the logits
        of disallowed tokens to -inf, in llama.cpp's own logits buffer, which is what
        ``llama_sampler_sample`` reads: one numpy pass (~30 us for 49k tokens), cheaper
        than a custom sampler stage (a ctypes callback per token, over the candidate
        array llama.cpp builds) or a logit-bias stage rebuilt with every step's mask."""
        if sampler.ptr is not None and mask is None:
            return int(llama_cpp.llama_sampler_sample(sampler.ptr, self.ctx, index))
        row = llama_cpp.llama_get_logits_ith(self.ctx, index)
        if not row:
            raise EngineError(f"no logits for batch entry {index}")
        logits = np.ctypeslib.as_array(ctypes.cast(row, self._logits_row).contents)
        if mask is not None:
            apply_mask(logits, mask)
            if sampler.ptr is not None:
                return int(llama_cpp.llama_sampler_sample(sampler.ptr, self.ctx, index))
        return int(logits.argmax())

    def logits_rows(self, indices: Sequence[int]) -> np.ndarray[Any, np.dtype[np.float32]]:
        """A copy of the logits rows of these batch entries of the last decode, as the
        sampler left them (a grammar's mask applied: :meth:`sample`; llama.cpp's sampler
        chain reads the row and changes only its own copy)."""
        out = np.empty((len(indices), self.n_vocab), dtype=np.float32)
        for i, index in enumerate(indices):
            row = llama_cpp.llama_get_logits_ith(self.ctx, index)
            if not row:
                raise EngineError(f"no logits for batch entry {index}")
            out[i] = np.ctypeslib.as_array(ctypes.cast(row, self._logits_row).contents)
        return out

    def clear_sequence(self, seq: int) -> None:
        llama_cpp.llama_memory_seq_rm(self.memory, seq, -1, -1)

    def copy_sequence(self, src: int, dst: int) -> None:
        """Make ``dst`` hold everything ``src`` holds, far cheaper than evaluating a
        shared prompt prefix again.  In a pool the cells are shared.  With a stream per
        sequence llama.cpp's copy is of the whole stream, which commits all its pages
        (engine/residency.py): the written cells are carried instead, as a spill is
        (3 ms for 30 tokens against 14 for the stream, 30 against 14 for 2,000)."""
        if self.unified or not self.restore_sequence(dst, self.save_sequence(src)):
            llama_cpp.llama_memory_seq_cp(self.memory, src, dst, -1, -1)

    def save_sequence(self, seq: int) -> bytearray:
        """The sequence's cells as llama.cpp serializes them (positions, tokens, K and V),
        written straight into the bytearray kept: 23 MB for 1000 SmolLM2 tokens in ~60 ms
        here, nearly all of it fresh memory's page faults (a ctypes array costs as much again)."""
        size = int(llama_cpp.llama_state_seq_get_size(self.ctx, seq))
        data = bytearray(size)
        buf = (ctypes.c_uint8 * size).from_buffer(data)
        n = int(llama_cpp.llama_state_seq_get_data(self.ctx, buf, size, seq))
        del buf
        if n != size:
            raise EngineError(f"llama_state_seq_get_data wrote {n} of {size} bytes")
        return data

    def restore_sequence(self, seq: int, data: bytearray) -> bool:
        """Put ``save_sequence``'s bytes into ``seq``, emptied first (3 ms for 1000 tokens);
        False, ``seq`` left empty, when llama.cpp refuses them (no cells free in a pool)."""
        self.clear_sequence(seq)
        buf = (ctypes.c_uint8 * len(data)).from_buffer(data)
        ok = int(llama_cpp.llama_state_seq_set_data(self.ctx, buf, len(data), seq)) != 0
        del buf  # (the export ends: the store may let the bytes go)
        if not ok:
            self.clear_sequence(seq)
        return ok

    def trim_sequence(self, seq: int, keep: int) -> bool:
        """Drop the sequence's cells at positions >= keep.  False when what is left
        is not a usable prefix of ``keep`` tokens: a recurrent or hybrid model's state
        cannot be cut back partway (nothing was removed), or a sliding-window model's
        cache has already dropped cells that position ``keep`` still attends to
        (llama-server's ``pos_min`` check).  The caller then clears the sequence."""
        if not llama_cpp.llama_memory_seq_rm(self.memory, seq, keep, -1):
            return False
        if self.n_swa > 0 and keep > 0:
            lowest = int(llama_cpp.llama_memory_seq_pos_min(self.memory, seq))
            if lowest > max(0, keep - self.n_swa):
                return False
        return True

    def perf(self) -> tuple[int, int]:
        """(prompt tokens evaluated, tokens generated) since start."""
        data = llama_cpp.llama_perf_context(self.ctx)
        return int(data.n_p_eval), int(data.n_eval)

    def _cell_elements(self) -> int:
        """K and V elements of one cell (one token of one sequence), all layers."""
        n_layer = int(llama_cpp.llama_model_n_layer(self.model))
        n_embd = int(llama_cpp.llama_model_n_embd(self.model))
        n_head = int(llama_cpp.llama_model_n_head(self.model)) or 1
        n_head_kv = int(llama_cpp.llama_model_n_head_kv(self.model)) or n_head
        return 2 * n_layer * (n_embd // n_head) * n_head_kv

    def kv_bytes(self) -> int:
        return int(self.kv_cell_bytes * self.kv_cells)

    def close(self) -> None:
        if self.ctx:
            llama_cpp.llama_batch_free(self.batch)
            if self._embd_batch is not None:
                llama_cpp.llama_batch_free(self._embd_batch)
            llama_cpp.llama_free(self.ctx)
            if self.threadpool:
                ggml_libs()[1].ggml_threadpool_free(ctypes.c_void_p(self.threadpool))
                self.threadpool = None
            llama_cpp.llama_model_free(self.model)
            self.ctx = None
