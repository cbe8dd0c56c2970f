"""What a GGUF model is before it is loaded: its metadata read through llama.cpp with
``vocab_only`` (the tokenizer and the key-value header, no weights: about 0.1-0.3 s for a
small model), and an estimate of the memory it takes once loaded.

The estimate is what a memory budget compares (models on demand, issue 41):

* **weights**: the tensors' bytes as llama.cpp counts them (``llama_model_size``, the
  figure the loaded engine reports as ``params_bytes``);
* **KV**: the cells the models file's settings give (``pool_cells``: a stream of
  ``context`` per sequence, or a shared pool), padded as llama.cpp pads them, at the
  engine's bytes per cell; plus the embedding context's cells of a chat model.  It is
  the reservation, an upper bound: aotx commits KV pages as they are written
  (residency.py), and a sliding-window model's window layers hold fewer cells;
* **compute**: an allowance for llama.cpp's output and compute buffers: a row of logits
  per sequence (aotx asks one per sequence a step) plus :data:`COMPUTE_ALLOWANCE`.  llama.cpp sizes them when the context is made
  and has no API that tells; the allowance is meant to be generous, not exact.

``memory_bytes`` is their sum, wherever they live.  With layers offloaded to the GPU
(``gpu_layers``; ``"auto"`` decided here, offload.py), ``vram_bytes`` is the part of it on
the GPU: those layers' share of the weights and of the KV.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import llama_cpp

from ..interface import EngineError
from ..spec import ModelSpec
from .engine import KV_TYPES, MIN_POOL_CELLS, EngineConfig, model_metadata, pool_cells
from .offload import AUTO, auto_layers, vram_free, vram_share

#: Bytes allowed for llama.cpp's compute graph buffers beside the logits rows.
COMPUTE_ALLOWANCE = 64 << 20
_PAD = 256  # llama.cpp pads a context's cells to a multiple of this


@dataclass(frozen=True)
class Description:
    chat_template: str | None
    bos_text: str
    eos_text: str
    n_ctx_train: int
    n_vocab: int
    n_embd: int  # the width of a hidden state (an embedding's dimensions)
    file_bytes: int  # the model file (a split model: every shard) and its projector
    weights_bytes: int
    kv_bytes: int
    compute_bytes: int
    n_layer: int = 0  # the model's repeating layers (blocks)
    gpu_layers: int = 0  # the layers offloaded: the spec's, "auto" decided when described
    vram_bytes: int = 0  # the part of memory_bytes on the GPU (offload.vram_share)
    kind: str = "chat"  # the spec's, "auto" decided when described (kind_of)

    @property
    def memory_bytes(self) -> int:
        return self.weights_bytes + self.kv_bytes + self.compute_bytes


def _int(model: llama_cpp.llama_model_p, key: str, default: int = 0) -> int:
    """An integer key; an array key (per-layer values) by its largest element."""
    value = model_metadata(model, key)
    if value is None:
        return default
    numbers = [int(x) for x in value.strip("[]").replace(",", " ").split() if x.isdigit()]
    return max(numbers) if numbers else default


def _token_text(vocab: llama_cpp.llama_vocab_p, token: int) -> str:
    if token < 0:
        return ""
    text = llama_cpp.llama_vocab_get_text(vocab, token)
    return bytes(text or b"").decode("utf-8", errors="replace")


def file_bytes(spec: ModelSpec) -> int:
    """The bytes on disk of the model (every shard of a split one) and its projector."""
    folder = os.path.dirname(spec.path)
    name = os.path.basename(spec.path)
    paths = [spec.path]
    if "-00001-of-" in name:
        stem = name.split("-00001-of-")[0]
        paths = [os.path.join(folder, n) for n in os.listdir(folder)
                 if n.startswith(stem + "-") and "-of-" in n]
    if spec.mmproj:
        paths.append(spec.mmproj)
    return sum(os.path.getsize(p) for p in paths)


def cell_bytes(model: llama_cpp.llama_model_p, arch: str, kv_type: str) -> float:
    """K and V bytes of one cell, all layers (LlamaEngine's count, from the header)."""
    n_layer = _int(model, f"{arch}.block_count")
    n_embd = _int(model, f"{arch}.embedding_length")
    n_head = _int(model, f"{arch}.attention.head_count", 1) or 1
    n_head_kv = _int(model, f"{arch}.attention.head_count_kv", n_head) or n_head
    return 2 * n_layer * (n_embd // n_head) * n_head_kv * KV_TYPES[kv_type][1]


def kind_of(model: llama_cpp.llama_model_p, arch: str) -> str:
    """What a GGUF is for, by the pooling it declares (``<arch>.pooling_type``): rank, a
    reranker; mean, CLS or last, an embedding model; none (a chat model's file declares
    none), a chat model."""
    pooling = _int(model, f"{arch}.pooling_type", llama_cpp.LLAMA_POOLING_TYPE_NONE)
    if pooling == llama_cpp.LLAMA_POOLING_TYPE_RANK:
        return "rerank"
    return "chat" if pooling == llama_cpp.LLAMA_POOLING_TYPE_NONE else "embedding"


def describe(spec: ModelSpec) -> Description:
    """Read ``spec``'s GGUF file's header (EngineError when llama.cpp cannot)."""
    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    model = llama_cpp.llama_model_load_from_file(spec.path.encode(), params)
    if not model:
        raise EngineError(f"llama.cpp could not read {spec.path}")
    try:
        vocab = llama_cpp.llama_model_get_vocab(model)
        arch = model_metadata(model, "general.architecture") or ""
        n_ctx_train = _int(model, f"{arch}.context_length")
        n_vocab = int(llama_cpp.llama_vocab_n_tokens(vocab))
        per_cell = cell_bytes(model, arch, spec.kv_type)
        kind = kind_of(model, arch) if spec.kind == "auto" else spec.kind
        chat = kind == "chat"
        context = spec.context if chat else spec.embedding_context
        config = EngineConfig(path=spec.path, slots=spec.slots, slot_context=context,
                              kv_budget=max(0, spec.kv_budget) if chat else 0,
                              unified=chat and spec.kv_budget != 0, kv_type=spec.kv_type)
        cells = max(MIN_POOL_CELLS, pool_cells(config, per_cell, n_ctx_train))
        cells = -(-cells // _PAD) * _PAD
        embedding_cells = 2 * spec.embedding_context if chat else 0
        f16_cell = cell_bytes(model, arch, "f16")
        weights = int(llama_cpp.llama_model_size(model))
        kv = int(per_cell * cells + f16_cell * embedding_cells)
        compute = 4 * n_vocab * spec.slots + COMPUTE_ALLOWANCE
        n_layer = _int(model, f"{arch}.block_count")
        offload = bool(llama_cpp.llama_supports_gpu_offload())
        layers = spec.gpu_layers if offload else 0  # (a CPU build: none on a GPU)
        if layers == AUTO:
            layers = auto_layers(offload, vram_free(), (weights + kv) / max(1, n_layer),
                                 n_layer, reserve=compute)
        return Description(
            chat_template=model_metadata(model, "tokenizer.chat_template"),
            bos_text=_token_text(vocab, int(llama_cpp.llama_vocab_bos(vocab))),
            eos_text=_token_text(vocab, int(llama_cpp.llama_vocab_eos(vocab))),
            n_ctx_train=n_ctx_train, n_vocab=n_vocab,
            n_embd=_int(model, f"{arch}.embedding_length"), file_bytes=file_bytes(spec),
            weights_bytes=weights, kv_bytes=kv, compute_bytes=compute, n_layer=n_layer,
            gpu_layers=layers, vram_bytes=vram_share(weights, kv, n_layer, layers),
            kind=kind)
    finally:
        llama_cpp.llama_model_free(model)


def gpu_layers(spec: ModelSpec) -> int:
    """The layers ``spec``'s model offloads when it is loaded now: its ``gpu_layers``, or
    ``"auto"`` decided from its description and the VRAM free now (0 on a build that
    cannot offload, without reading the file)."""
    if not spec.gpu_layers or not llama_cpp.llama_supports_gpu_offload():
        return 0  # (a CPU build runs every layer on the CPU, as with 0)
    if spec.gpu_layers != AUTO:
        return spec.gpu_layers
    return describe(spec).gpu_layers
