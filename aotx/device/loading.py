"""Loading one model of the models file: the file's digest, the llama.cpp engine, its chat
template, its projector (``mmproj``), its scheduler, and whether the whole profile is
qualified for automatic memory.

A model that cannot be served as configured stops the device at start
(``ModelConfigError`` with the reason: the device exits with EX_CONFIG, and ``aotx serve``
stops rather than start it again): a pinned digest that differs, a missing or broken chat
template, a projector that does not load or encodes other modalities than the models file
says.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import operator
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .. import wire
from ..engine.chunking import apart_rows, chunk_cost
from ..engine.embed_pieces import PieceEmbedder
from ..engine.embedding import Embedder, Embeddings, EmbedQueue
from ..engine.fair import common_prefix
from ..engine.grammar import GrammarCompiler
from ..engine.interface import EngineError, Model, Runner
from ..engine.llama import EngineConfig, LlamaEngine
from ..engine.multimodal import MARKER, MediaEncoder, MediaInputError, MediaTokenizer
from ..engine.sampling import Sampler
from ..engine.scheduler import Request, Scheduler
from ..engine.spill import default_budget
from ..engine.vllm import VllmModel, VllmRunner, sampling_params
from ..engine.vllm import start as vllm_start
from ..engine.vllm_inputs import VllmEmbeddings, VllmMedia, pooling_params
from .memory import qualified
from .models import ModelConfigError, ModelSpec, file_sha256, folder_sha256
from .prompt import TextRefused, split, text_tokens
from .template import ChatTemplate, TemplateError

log = logging.getLogger("aotx.device")


@dataclass
class LoadedModel:
    spec: ModelSpec
    engine: Model
    template: ChatTemplate
    scheduler: Runner
    sha256: bytes
    published_at: int
    thread: threading.Thread | None = None
    modalities: int = wire.MOD_TEXT
    media_marker: str = MARKER  # where a media part sits in the rendered prompt
    encoder: MediaTokenizer | None = None  # image/audio input: a projector, or vLLM's
    automatic_memory: bool = False  # model, template, projector and source profile qualified
    grammars: GrammarCompiler | None = None  # built on the first constrained request
    embeddings: Embeddings | None = None  # /v1/embeddings (engine thread)
    chat: bool = True  # False: an embedding model (kind = "embedding"), no SUBMIT
    shares_engine: bool = False  # a LoRA adapter: its base model's thread runs the engine


#: The template of an embedding model: it takes no chat request, so it renders nothing.
NO_CHAT = "{% for m in messages %}{% endfor %}"
MAX_TEMPLATE_BYTES = 1024 * 1024  # a models file's chat_template file


def load_model(spec: ModelSpec, state_dir: str, lock: threading.Lock,
               on_step: Callable[[], None],
               on_terminal: Callable[[Request], None],
               loaded: Sequence[LoadedModel] = ()) -> LoadedModel:
    """Load ``spec`` and warm its scheduler; the scheduler shares the device's ``lock``.
    A LoRA adapter is served by its base model's engine, among ``loaded``."""
    log.info("event=model.load alias=%s role=%d path=%s slots=%d context=%d",
             spec.alias, spec.role, spec.path, spec.slots, spec.context)
    if spec.lora_of:
        return _load_lora(spec, state_dir, next(m for m in loaded if m.spec.alias == spec.lora_of))
    if spec.engine == "vllm":
        return _load_vllm(spec, state_dir, lock, on_step, on_terminal)
    t0 = time.monotonic()
    hashes = os.path.join(state_dir, "model-hashes.json")
    digest = file_sha256(spec.path, hashes)
    _check_pin(spec, digest)
    chat = spec.kind == "chat"
    # An embedding model decodes no stream: one slot (models.py), of its embedding context.
    context = spec.context if chat else spec.embedding_context
    batch = max(spec.batch, spec.slots)  # every running sequence fits one step
    engine = LlamaEngine(EngineConfig(path=spec.path, slots=spec.slots, slot_context=context,
                                      kv_budget=max(0, spec.kv_budget) if chat else 0,
                                      unified=chat and spec.kv_budget != 0,
                                      kv_type=spec.kv_type, flash_attention=spec.flash_attention,
                                      batch=batch, threads=spec.threads, poll=spec.poll))
    template = llama_template(spec, engine) if chat else ChatTemplate(NO_CHAT)
    encoder, mods = _projector(spec, engine, engine.n_batch)
    projector = file_sha256(spec.mmproj, hashes) if spec.mmproj else None
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
    if chat:
        scheduler.warm(template_prefix(engine, template))
    model = LoadedModel(spec, engine, template, scheduler, digest,
                        int(os.stat(spec.path).st_mtime), modalities=mods, encoder=encoder,
                        automatic_memory=chat and qualified(digest, template.source, projector),
                        embeddings=_embeddings(spec, engine, scheduler, lock), chat=chat)
    log.info("event=model.ready alias=%s role=%d sha256=%s params_bytes=%d kv_bytes=%d "
             "kv_cells=%d kv_type=%s flash_attention=%s "
             "threads=%d automatic_memory=%s tool_format=%s seconds=%.1f", spec.alias,
             spec.role, digest.hex(), engine.model_bytes, engine.kv_bytes(), engine.kv_cells,
             spec.kv_type, engine.flash_attention, engine.threads,
             model.automatic_memory, template.tool_format.name.lower(), time.monotonic() - t0)
    return model


def _load_vllm(spec: ModelSpec, state_dir: str, lock: threading.Lock,
               on_step: Callable[[], None],
               on_terminal: Callable[[Request], None]) -> LoadedModel:
    """A model vLLM serves (engine/vllm.py): its tokenizer and template here, its
    batching and KV there; an embedding model is vLLM's pooling runner, image and audio
    parts are decoded here (engine/vllm_inputs.py).  No automatic memory on it."""
    t0 = time.monotonic()
    digest = folder_sha256(spec.path, os.path.join(state_dir, "model-hashes.json"))
    _check_pin(spec, digest)
    try:
        engine = vllm_start(spec.path, dict(spec.vllm))
    except EngineError as exc:
        raise ModelConfigError(f"model {spec.alias}: {exc}") from None
    chat = spec.kind == "chat"
    template = (_template(spec, engine, engine.bos, engine.eos) if chat
                else ChatTemplate(NO_CHAT))
    runner = VllmRunner(engine.client, engine, lock, sampling_params, on_step, on_terminal)
    embeddings = None if chat else VllmEmbeddings(
        runner, engine.client, engine.embedding_dims, engine.slot_context, engine.pooling,
        pooling_params)
    media, mods = _vllm_media(spec, engine) if chat else (None, wire.MOD_TEXT)
    # (an embedding model decodes no stream: one slot, as on llama.cpp)
    spec = dataclasses.replace(spec, context=engine.slot_context,
                               slots=engine.max_sequences if chat else 1)
    log.info("event=model.ready alias=%s role=%d engine=vllm kind=%s sha256=%s context=%d "
             "embedding_dims=%d pooling=%s seconds=%.1f", spec.alias, spec.role, spec.kind,
             digest.hex(), engine.slot_context, engine.embedding_dims, engine.pooling or "-",
             time.monotonic() - t0)
    return LoadedModel(spec, engine, template, runner, digest, int(os.stat(spec.path).st_mtime),
                       modalities=mods, encoder=media,
                       embeddings=embeddings, chat=chat)


def _vllm_media(spec: ModelSpec, engine: VllmModel) -> tuple[VllmMedia | None, int]:
    """A vLLM chat model's media input (its processor's image and audio tokens) and its
    modality bits.  A part's place in the rendering is aotx's marker, as for llama.cpp;
    its token is the processor's for its kind (VllmMedia.tokenize_media)."""
    media = (VllmMedia(engine.media.get("image", -1), engine.media.get("audio", -1),
                       engine.sampling_rate) if engine.media else None)
    return media, _modality_bits(spec, media, "vLLM's model takes", engine.close)


def _modality_bits(spec: ModelSpec, media: MediaTokenizer | None, source: str,
                   close: Callable[[], None]) -> int:
    """The input modalities ``media`` takes (text alone without it), which the models
    file's ``modalities``, when given, must match: else ``close`` and stop the load."""
    found = (wire.MOD_TEXT | (wire.MOD_IMAGE if media is not None and media.vision else 0)
             | (wire.MOD_AUDIO if media is not None and media.audio else 0))
    declared = functools.reduce(operator.or_, (wire.MODALITY_BITS[m] for m in spec.modalities),
                                0)
    if spec.modalities and declared != found:
        close()
        raise ModelConfigError(f"model {spec.alias}: the models file declares modalities "
                         f"{list(spec.modalities)}, but {source} "
                         f"{wire.modality_names(found)}")
    return found


def _load_lora(spec: ModelSpec, state_dir: str, base: LoadedModel) -> LoadedModel:
    """A LoRA adapter as a model of its own alias: its base's engine, runner and template;
    its requests name the adapter to vLLM (VllmRunner.loras)."""
    digest = hashlib.sha256(base.sha256 + folder_sha256(
        spec.path, os.path.join(state_dir, "model-hashes.json"))).digest()
    try:
        base.scheduler.add_adapter(spec.role, spec.alias, spec.path)
    except EngineError as exc:
        raise ModelConfigError(f"model {spec.alias}: {exc}") from None
    log.info("event=model.ready alias=%s role=%d engine=vllm lora_of=%s sha256=%s",
             spec.alias, spec.role, spec.lora_of, digest.hex())
    spec = dataclasses.replace(spec, context=base.spec.context, slots=base.spec.slots)
    return LoadedModel(spec, base.engine, base.template, base.scheduler, digest,
                       int(os.stat(spec.path).st_mtime), modalities=base.modalities,
                       encoder=base.encoder, shares_engine=True)


def _embeddings(spec: ModelSpec, engine: LlamaEngine, scheduler: Scheduler,
                lock: threading.Lock) -> EmbedQueue | None:
    """The model's embedding context and its queue, run by the engine thread between steps:
    mean pooling for a chat model, the GGUF's own for an embedding model.  A chat model
    that cannot have one still chats (its capabilities say no embeddings); an embedding
    model stops the device."""
    try:
        # A chat model attends causally: its inputs are embedded in pieces, so that a long
        # one never holds the engine thread for a whole decode (engine/embed_pieces.py).
        embedder: Embedder | PieceEmbedder = (
            PieceEmbedder(engine, spec.embedding_context) if spec.kind == "chat"
            else Embedder(engine, spec.embedding_context, None))
    except EngineError as exc:
        if spec.kind == "chat":
            log.warning("event=model.no_embeddings alias=%s error=%s", spec.alias, exc)
            return None
        engine.close()
        raise ModelConfigError(f"model {spec.alias}: no embeddings: {exc}") from None
    queue = EmbedQueue(embedder, lock, scheduler.cond.notify)
    scheduler.side = queue
    log.info("event=model.embeddings alias=%s pooling=%s dims=%d context=%d", spec.alias,
             embedder.pooling, embedder.dims, embedder.context)
    return queue


def _check_pin(spec: ModelSpec, digest: bytes) -> None:
    """A models file's ``sha256`` pin: a model (file or folder) that differs stops the load."""
    if spec.sha256 and digest.hex() != spec.sha256:
        raise ModelConfigError(f"model {spec.alias}: {spec.path} has SHA-256 {digest.hex()}, "
                         f"the models file pins {spec.sha256}")


def llama_template(spec: ModelSpec, engine: LlamaEngine) -> ChatTemplate:
    """A GGUF model's chat template (:func:`_template`), its BOS and EOS from the GGUF."""
    return _template(spec, engine, int(engine.metadata("tokenizer.ggml.bos_token_id") or 0),
                     int(engine.metadata("tokenizer.ggml.eos_token_id") or 0))


def _template(spec: ModelSpec, engine: LlamaEngine | VllmModel, bos: int,
              eos: int) -> ChatTemplate:
    """The model's chat template (the models file's, else its own), with the texts of its
    ``bos`` and ``eos`` tokens; a template refused at load stops the load."""
    try:
        source = engine.metadata("tokenizer.chat_template")
        if spec.chat_template:
            source = _read_template(spec.chat_template)
        return ChatTemplate(source, bos_token=engine.token_text(bos),
                            eos_token=engine.token_text(eos))
    except TemplateError as exc:
        engine.close()
        raise ModelConfigError(f"model {spec.alias} ({spec.path}) refused: {exc}") from None


def _read_template(path: str) -> str:
    """A models file's ``chat_template``: a UTF-8 Jinja file of at most 1 MiB."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_TEMPLATE_BYTES + 1)
    except OSError as exc:
        raise TemplateError(f"chat_template {path}: {exc}") from None
    if len(data) > MAX_TEMPLATE_BYTES:
        raise TemplateError(f"chat_template {path} is larger than {MAX_TEMPLATE_BYTES} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise TemplateError(f"chat_template {path} is not UTF-8") from None


def _projector(spec: ModelSpec, engine: LlamaEngine,
               batch: int) -> tuple[MediaEncoder | None, int]:
    """The model's projector and its input modality bits (text alone without one)."""
    if not spec.mmproj:
        return None, _modality_bits(spec, None, "without mmproj it takes", engine.close)
    try:
        encoder = MediaEncoder(spec.mmproj, engine.model, engine.n_embd, engine.threads, batch)
    except MediaInputError as exc:
        engine.close()
        raise ModelConfigError(f"model {spec.alias}: {exc}") from None

    def close() -> None:
        encoder.close()
        engine.close()
    found = _modality_bits(spec, encoder, f"{spec.mmproj} encodes", close)
    log.info("event=model.projector alias=%s path=%s modalities=%s", spec.alias,
             spec.mmproj, ",".join(wire.modality_names(found)))
    return encoder, found


def template_prefix(engine: LlamaEngine, template: ChatTemplate) -> list[int]:
    """The tokens every one-user-message chat starts with (for SmolLM2: its default
    system prompt and the user's header), found by rendering two different
    conversations and keeping what their tokens have in common."""
    try:
        a, b = (text_tokens(engine, split(template, [{"role": "user", "content": c}],
                                          engine.specials), add_special=engine.add_bos)
                for c in ("Hi.", "What?"))
    except (TemplateError, TextRefused):
        return []
    n = common_prefix(a, b)
    return a[:n] if n >= 8 else []
