"""Loading one model of the models file: its digest (a GGUF file's, or a model folder's)
and pin, its engine kind's factory (engine/load.py: the engine, its runner, projector and
embeddings, behind the engines' contract), its chat template, the runner's warm start,
and whether the whole profile is qualified for automatic memory.

A model that cannot be served as configured stops the device at start
(``ModelConfigError`` with the reason: the device exits with EX_CONFIG, and ``aotx serve``
stops rather than start it again): a pinned digest that differs, a missing or broken chat
template, a projector that does not load or encodes other modalities than the models file
says.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .. import wire
from ..engine.embedding import Embeddings
from ..engine.fair import common_prefix
from ..engine.grammar import GrammarCompiler
from ..engine.interface import EngineError, Model, Runner
from ..engine.load import Loaded, factory
from ..engine.multimodal import MARKER, MediaTokenizer
from ..engine.request import Request
from ..engine.spec import ModelSpec
from .memory import qualified
from .models import ModelConfigError, file_sha256, folder_sha256
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
    built: Loaded | None = None  # what the factory built (None: a LoRA adapter, its base's)

    def close(self) -> None:
        """Give back what the load built, once its engine thread has ended (the device
        stops, or the model is unloaded).  An adapter's engine is its base model's."""
        if self.built is not None:
            self.built.close()
            self.built = None


#: The template of an embedding model: it takes no chat request, so it renders nothing.
NO_CHAT = "{% for m in messages %}{% endfor %}"
MAX_TEMPLATE_BYTES = 1024 * 1024  # a models file's chat_template file


def load_model(spec: ModelSpec, state_dir: str, lock: threading.Lock,
               on_step: Callable[[], None],
               on_terminal: Callable[[Request], None],
               loaded: Sequence[LoadedModel] = ()) -> LoadedModel:
    """Load ``spec`` through its engine kind's factory (engine/load.py), build its chat
    template and warm its runner; the runner shares the device's ``lock``.  A LoRA
    adapter is served by its base model's engine, among ``loaded``."""
    log.info("event=model.load alias=%s role=%d path=%s slots=%d context=%d",
             spec.alias, spec.role, spec.path, spec.slots, spec.context)
    if spec.lora_of:
        return _load_lora(spec, state_dir, next(m for m in loaded if m.spec.alias == spec.lora_of))
    t0 = time.monotonic()
    hashes = os.path.join(state_dir, "model-hashes.json")
    # a GGUF file, or a model folder (vLLM's)
    digest = (folder_sha256 if os.path.isdir(spec.path) else file_sha256)(spec.path, hashes)
    _check_pin(spec, digest)
    try:
        got = factory(spec.engine)(spec, lock, on_step, on_terminal)
    except EngineError as exc:
        raise ModelConfigError(f"model {spec.alias}: {exc}") from None
    chat = spec.kind == "chat"
    template = _template(spec, got) if chat else ChatTemplate(NO_CHAT)
    if chat:
        got.runner.warm(template_prefix(got.engine, template))
    projector = file_sha256(spec.mmproj, hashes) if spec.mmproj else None
    model = LoadedModel(got.spec, got.engine, template, got.runner, digest,
                        int(os.stat(spec.path).st_mtime), modalities=got.modalities,
                        encoder=got.encoder, embeddings=got.embeddings, chat=chat,
                        automatic_memory=chat and qualified(digest, template.source, projector),
                        built=got)
    log.info("event=model.ready alias=%s role=%d sha256=%s %s automatic_memory=%s "
             "tool_format=%s seconds=%.1f", spec.alias, spec.role, digest.hex(),
             " ".join(f"{k}={v}" for k, v in got.facts.items()), model.automatic_memory,
             template.tool_format.name.lower(), time.monotonic() - t0)
    return model


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


def _check_pin(spec: ModelSpec, digest: bytes) -> None:
    """A models file's ``sha256`` pin: a model (file or folder) that differs stops the load."""
    if spec.sha256 and digest.hex() != spec.sha256:
        raise ModelConfigError(f"model {spec.alias}: {spec.path} has SHA-256 {digest.hex()}, "
                         f"the models file pins {spec.sha256}")


def _template(spec: ModelSpec, got: Loaded) -> ChatTemplate:
    """The model's chat template (the models file's, else its own), with the texts of its
    BOS and EOS tokens; a template refused at load stops the load."""
    try:
        source = got.engine.metadata("tokenizer.chat_template")
        if spec.chat_template:
            source = read_template(spec.chat_template)
        return ChatTemplate(source, bos_token=got.engine.token_text(got.bos),
                            eos_token=got.engine.token_text(got.eos))
    except TemplateError as exc:
        got.close()
        raise ModelConfigError(f"model {spec.alias} ({spec.path}) refused: {exc}") from None


def read_template(path: str) -> str:
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


def template_prefix(engine: Model, template: ChatTemplate) -> list[int]:
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
