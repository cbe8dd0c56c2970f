"""Loading a model: one factory per engine kind, chosen by the models file's ``engine``.

A factory takes the model's spec and returns it loaded behind the engines' contract
(:class:`Loaded`): the model, the runner of its engine thread, its media input, its
embeddings, and what the device needs to build its chat template.  The device calls
:func:`factory` once per model (and, for models that come and go, once per load); which
engine is behind it is this package's business.  A kind's package is imported when a
model of that kind is loaded, never before: a device that serves vLLM models alone does
not import llama.cpp, nor one that serves GGUF models vLLM.

A factory raises :class:`~aotx.engine.interface.EngineError` when the model cannot be
served as its spec says; what it had built by then is closed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from ..wire import MOD_AUDIO, MOD_IMAGE, MOD_TEXT, MODALITY_BITS, modality_names
from .embedding import Embeddings
from .interface import EngineError, Model, Runner
from .multimodal import MediaTokenizer
from .request import Request
from .spec import ModelSpec

if TYPE_CHECKING:
    from .llama.describe import Description


@dataclass
class Loaded:
    """A model loaded behind the contract, not yet serving (its engine thread starts when
    the device starts it)."""

    spec: ModelSpec  # as loaded: a kind may settle the context and sequences itself
    engine: Model
    runner: Runner
    bos: int  # the token ids whose texts the chat template is given
    eos: int
    modalities: int = MOD_TEXT
    encoder: MediaTokenizer | None = None  # image and audio input
    embeddings: Embeddings | None = None  # /v1/embeddings, on the engine thread
    facts: dict[str, object] = field(default_factory=dict)  # for the model.ready log line

    def close(self) -> None:
        """Give back what the load built (its template was refused, the device stops)."""
        if self.embeddings is not None:
            self.embeddings.embedder.close()
        if self.encoder is not None:
            self.encoder.close()
        self.engine.close()


class Factory(Protocol):
    def __call__(self, spec: ModelSpec, lock: threading.Lock, on_step: Callable[[], None],
                 on_terminal: Callable[[Request], None]) -> Loaded: ...


def factory(kind: str) -> Factory:
    """The factory of engine kind ``kind`` (a models file's ``engine``: "llama", "vllm")."""
    if kind == "vllm":
        from .vllm.load import load as vllm_load
        return vllm_load
    if kind == "llama":
        from .llama.load import load as llama_load
        return llama_load
    raise ValueError(f"no engine kind {kind!r}")


def describe(spec: ModelSpec) -> Description:
    """What ``spec``'s model is before it is loaded, and the memory it will take
    (engine/llama/describe.py); EngineError for a kind that cannot tell before loading."""
    if spec.engine != "llama":
        raise EngineError(f"a model of engine {spec.engine!r} is described once loaded")
    from .llama.describe import describe as llama_describe
    return llama_describe(spec)


def modality_bits(declared: tuple[str, ...], media: MediaTokenizer | None,
                  source: str) -> int:
    """The input modalities ``media`` takes (text alone without it), which the models
    file's ``modalities`` (``declared``), when given, must match (else EngineError)."""
    found = (MOD_TEXT | (MOD_IMAGE if media is not None and media.vision else 0)
             | (MOD_AUDIO if media is not None and media.audio else 0))
    want = 0
    for m in declared:
        want |= MODALITY_BITS[m]
    if declared and want != found:
        raise EngineError(f"the models file declares modalities {list(declared)}, but "
                          f"{source} {modality_names(found)}")
    return found
