"""What a model is, as the models file says (device/models.py parses it): the one value
an engine kind's factory (engine/load.py) loads a model from."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModelSpec:
    alias: str
    path: str
    role: int
    slots: int = 16
    context: int = 4096
    sha256: str | None = None
    modalities: tuple[str, ...] = ("text",)
    batch: int = 512
    threads: int = 0
    poll: int = 50  # ggml thread-pool polling level, 0-100, -1: no pool (EngineConfig.poll)
    mmproj: str | None = None  # multimodal projector (llama.cpp mtmd), None: text only
    kind: str = "chat"  # "chat"; "embedding": /v1/embeddings only (pooling from the GGUF);
    # "rerank": /v1/rerank only (a cross-encoder whose GGUF declares rank pooling)
    embedding_context: int = 512  # tokens of one embedding input (one decode's)
    chat_template: str | None = None  # a Jinja file used instead of the GGUF's template
    kv_budget: int = 0  # bytes of the KV pool the sequences share; -1: "auto"; 0: no pool
    kv_type: str = "f16"  # "f16" or "q8_0" (engine.llama.KV_TYPES)
    kv_spill: int = -1  # bytes of host memory for cached prefixes (engine/spill.py); -1: "auto"
    prompts_per_step: int = 1  # Scheduler.prompts_per_step: 0 evaluates all prompts at once
    flash_attention: bool = True  # EngineConfig.flash_attention
    gpu_layers: int = 0  # layers llama.cpp offloads to the GPU; -1: "auto" (llama/offload.py)
    engine: str = "llama"  # "llama" (llama.cpp, a GGUF file) or "vllm" (a model folder)
    vllm: tuple[tuple[str, Any], ...] = ()  # vLLM's own engine arguments, by name
    lora_of: str | None = None  # a LoRA adapter: the alias of the vLLM model it adapts
    on_demand: bool = False  # loaded when a request first names it (device/ondemand.py)
    keep_alive: float = 300.0  # on demand: seconds it stays loaded idle; 0: unloaded when
    # idle; -1: never unloaded (device/fleet.py)
