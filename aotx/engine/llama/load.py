"""A GGUF model loaded on llama.cpp (engine/load.py's factory for ``engine = "llama"``):
its engine, projector (``mmproj``), scheduler and embedding context, assembled here.

A chat model gets a scheduler over its sequences, mean-pooled embeddings in pieces
(embed_pieces.py) when its context allows them, and its projector's image and audio
input; an embedding model (``kind = "embedding"``) or a reranker (``"rerank"``) one slot
of its embedding context and the pooling its GGUF declares.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from ...wire import modality_names
from ..embedding import EmbedQueue
from ..interface import EngineError
from ..load import Loaded, modality_bits
from ..multimodal import MediaEncoder, MediaInputError
from ..request import Request
from ..spec import ModelSpec
from .chunking import apart_rows, chunk_cost
from .describe import gpu_layers
from .embed_pieces import PieceEmbedder
from .embedder import Embedder
from .engine import EngineConfig, LlamaEngine
from .sampling import Sampler
from .scheduler import Scheduler
from .spill import default_budget

log = logging.getLogger("aotx.device")


def load(spec: ModelSpec, lock: threading.Lock, on_step: Callable[[], None],
         on_terminal: Callable[[Request], None]) -> Loaded:
    chat = spec.kind == "chat"
    # An embedding model decodes no stream: one slot (models.py), of its embedding context.
    context = spec.context if chat else spec.embedding_context
    engine = LlamaEngine(EngineConfig(path=spec.path, slots=spec.slots, slot_context=context,
                                      kv_budget=max(0, spec.kv_budget) if chat else 0,
                                      unified=chat and spec.kv_budget != 0,
                                      kv_type=spec.kv_type, flash_attention=spec.flash_attention,
                                      batch=max(spec.batch, spec.slots),  # a step holds all
                                      threads=spec.threads, poll=spec.poll,
                                      gpu_layers=gpu_layers(spec), alone=not spec.on_demand))
    encoder, mods = _projector(spec, engine)
    scheduler = Scheduler(
        engine, spec.slots, engine.n_batch, lock,
        make_sampler=lambda r: Sampler(r.temperature, r.top_p, r.seed, r.sampling,
                                       r.max_tokens, engine.n_vocab),
        free_sampler=lambda s: s.free(),  # type: ignore[attr-defined]
        on_step=on_step, on_terminal=on_terminal,
        encode=encoder.encode if encoder is not None else None,
        prompts_per_step=spec.prompts_per_step, apart_rows=apart_rows(engine),
        spill_bytes=default_budget(spec.kv_spill) if chat else 0,
        chunk_cost=chunk_cost(engine) if chat else None)
    loaded = Loaded(spec, engine, scheduler,
                    bos=int(engine.metadata("tokenizer.ggml.bos_token_id") or 0),
                    eos=int(engine.metadata("tokenizer.ggml.eos_token_id") or 0),
                    modalities=mods, encoder=encoder)
    try:
        loaded.embeddings = _embeddings(spec, engine, scheduler, lock)
    except EngineError:
        loaded.close()
        raise
    loaded.facts = {"params_bytes": engine.model_bytes, "kv_bytes": engine.kv_bytes(),
                    "kv_cells": engine.kv_cells, "kv_type": spec.kv_type,
                    "flash_attention": engine.flash_attention, "threads": engine.threads,
                    "gpu_layers": engine.config.gpu_layers}
    return loaded


def _projector(spec: ModelSpec, engine: LlamaEngine) -> tuple[MediaEncoder | None, int]:
    """The model's projector and its input modality bits (text alone without one)."""
    if not spec.mmproj:
        try:
            return None, modality_bits(spec.modalities, None, "without mmproj it takes")
        except EngineError:
            engine.close()
            raise
    try:
        encoder = MediaEncoder(spec.mmproj, engine.model, engine.n_embd, engine.threads,
                               engine.n_batch, use_gpu=engine.config.gpu_layers > 0)
    except MediaInputError as exc:
        engine.close()
        raise EngineError(str(exc)) from None
    try:
        found = modality_bits(spec.modalities, encoder, f"{spec.mmproj} encodes")
    except EngineError:
        encoder.close()
        engine.close()
        raise
    log.info("event=model.projector alias=%s path=%s modalities=%s", spec.alias,
             spec.mmproj, ",".join(modality_names(found)))
    return encoder, found


def _embeddings(spec: ModelSpec, engine: LlamaEngine, scheduler: Scheduler,
                lock: threading.Lock) -> EmbedQueue | None:
    """The model's embedding context and its queue, run by the engine thread between steps:
    mean pooling for a chat model, the GGUF's own for an embedding model or a reranker
    (rank pooling).  A chat model that cannot have one still chats (its capabilities say
    no embeddings); an embedding model or a reranker cannot load (EngineError)."""
    try:
        # A chat model attends causally: its inputs are embedded in pieces, so that a long
        # one never holds the engine thread for a whole decode (embed_pieces.py).
        embedder: Embedder | PieceEmbedder = (
            PieceEmbedder(engine, spec.embedding_context) if spec.kind == "chat"
            else Embedder(engine, spec.embedding_context, None, rank=spec.kind == "rerank"))
    except EngineError as exc:
        if spec.kind == "chat":
            log.warning("event=model.no_embeddings alias=%s error=%s", spec.alias, exc)
            return None
        raise EngineError(f"no {'scores' if spec.kind == 'rerank' else 'embeddings'}: "
                          f"{exc}") from None
    queue = EmbedQueue(embedder, lock, scheduler.cond.notify)
    scheduler.side = queue
    log.info("event=model.embeddings alias=%s pooling=%s dims=%d context=%d", spec.alias,
             embedder.pooling, embedder.dims, embedder.context)
    return queue
