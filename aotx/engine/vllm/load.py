"""A model folder loaded on vLLM (engine/load.py's factory for ``engine = "vllm"``): its
tokenizer and template here, its batching and KV there; an embedding model or a
reranker is vLLM's pooling runner, image and audio parts are decoded here (inputs.py).
vLLM settles the context (``max_model_len``) and the sequences (``max_num_seqs``)
itself."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable

from ...wire import MOD_TEXT
from ..interface import EngineError
from ..load import Loaded, modality_bits
from ..request import Request
from ..spec import ModelSpec
from .inputs import VllmEmbeddings, VllmMedia, pooling_params, rank_params
from .model import VllmModel, start
from .runner import VllmRunner, sampling_params


def load(spec: ModelSpec, lock: threading.Lock, on_step: Callable[[], None],
         on_terminal: Callable[[Request], None]) -> Loaded:
    engine = start(spec.path, dict(spec.vllm), spec.kind)
    chat = spec.kind == "chat"
    runner = VllmRunner(engine.client, engine, lock, sampling_params, on_step, on_terminal)
    embeddings = None if chat else VllmEmbeddings(
        runner, engine.client, engine.embedding_dims, engine.slot_context, engine.pooling,
        rank_params if engine.pooling == "rank" else pooling_params, engine.second_segment)
    media, mods = _media(spec, engine) if chat else (None, MOD_TEXT)
    # (an embedding model decodes no stream: one slot, as on llama.cpp)
    spec = dataclasses.replace(spec, context=engine.slot_context,
                               slots=engine.max_sequences if chat else 1)
    return Loaded(spec, engine, runner, bos=engine.bos, eos=engine.eos, modalities=mods,
                  encoder=media, embeddings=embeddings,
                  facts={"engine": "vllm", "kind": spec.kind, "context": engine.slot_context,
                         "embedding_dims": engine.embedding_dims,
                         "pooling": engine.pooling or "-"})


def _media(spec: ModelSpec, engine: VllmModel) -> tuple[VllmMedia | None, int]:
    """A chat model's media input (its processor's image and audio tokens) and its modality
    bits.  A part's place in the rendering is aotx's marker, as for llama.cpp; its token
    is the processor's for its kind (VllmMedia.tokenize_media)."""
    media = (VllmMedia(engine.media.get("image", -1), engine.media.get("audio", -1),
                       engine.sampling_rate) if engine.media else None)
    try:
        return media, modality_bits(spec.modalities, media, "vLLM's model takes")
    except EngineError:
        engine.close()
        raise
