"""GPU offload's plumbing, on a CPU: the models file's ``gpu_layers`` (device/models.py),
``"auto"`` decided from numbers (engine/llama/offload.py), the part of a description on
the GPU (``vram_bytes``, engine/llama/describe.py), and the count reaching llama.cpp's
``n_gpu_layers`` and the projector's ``use_gpu`` (engine/llama/load.py, engine.py).  No GPU
runs here: a GPU build's behaviour is untested."""

from __future__ import annotations

import dataclasses
import os
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import llama_cpp
import pytest

from aotx.device.models import ModelConfigError, default_model_path, load_specs
from aotx.engine.interface import EngineError
from aotx.engine.llama import describe as describe_module
from aotx.engine.llama import engine as engine_module
from aotx.engine.llama import load as load_module
from aotx.engine.llama import offload
from aotx.engine.llama.describe import describe, gpu_layers
from aotx.engine.llama.engine import EngineConfig, LlamaEngine
from aotx.engine.llama.offload import ALL_LAYERS, AUTO, auto_layers, parse_free, vram_share
from aotx.engine.multimodal import MediaInputError
from aotx.engine.spec import ModelSpec

needs_model = pytest.mark.skipif(os.environ.get("AOTX_SKIP_MODEL") == "1",
                                 reason="AOTX_SKIP_MODEL=1")
MiB = 1 << 20


def specs(tmp_path: Path, text: str) -> list[ModelSpec]:
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    (tmp_path / "models.toml").write_text(text)
    return load_specs(str(tmp_path))


def test_the_models_file_takes_a_count_or_auto(tmp_path: Path) -> None:
    assert specs(tmp_path, "")[0].gpu_layers == 0  # the CPU only, as before
    (default, model) = specs(tmp_path, '[default]\ngpu_layers = "auto"\n'
                             '[[model]]\nalias = "m"\npath = "m.gguf"\ngpu_layers = 12\n')
    assert (default.gpu_layers, model.gpu_layers) == (AUTO, 12)
    assert specs(tmp_path, '[[model]]\nalias = "m"\npath = "m.gguf"\n')[1].gpu_layers == 0
    assert specs(tmp_path, "[default]\ngpu_layers = 0\n")[0].gpu_layers == 0
    for bad in ("-1", '"all"', "1.5", "true", '"12"', "[1]"):
        with pytest.raises(ModelConfigError, match=r"\[default\]: gpu_layers is a count of "
                                                   r"layers \(0: none, the CPU only\) or "
                                                   r"\"auto\", got"):
            specs(tmp_path, f"[default]\ngpu_layers = {bad}\n")
    with pytest.raises(ModelConfigError, match="model 0: gpu_layers is a count"):
        specs(tmp_path, '[[model]]\nalias = "m"\npath = "m.gguf"\ngpu_layers = -3\n')


def test_a_vllm_model_takes_no_gpu_layers(tmp_path: Path) -> None:
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    with pytest.raises(ModelConfigError, match="gpu_layers is a llama.cpp setting"):
        specs(tmp_path, '[[model]]\nalias = "v"\nengine = "vllm"\npath = "hf"\n'
                        "gpu_layers = 4\n")


def test_auto_offloads_what_fits_the_free_vram() -> None:
    layer = 100 * MiB
    # a build that cannot offload: none, whatever the GPU has
    assert auto_layers(False, 80 << 30, layer, 30) == 0
    assert auto_layers(False, None, layer, 30) == 0
    # the free VRAM unknown (no nvidia-smi): every layer, as llama.cpp's -ngl 999
    assert auto_layers(True, None, layer, 30) == ALL_LAYERS
    # as many layers as fit, after the compute buffers
    assert auto_layers(True, 1000 * MiB, layer, 30) == 10
    assert auto_layers(True, 1000 * MiB, layer, 30, reserve=150 * MiB) == 8
    assert auto_layers(True, 50 * MiB, layer, 30) == 0
    assert auto_layers(True, 100 * MiB, layer, 30, reserve=200 * MiB) == 0
    # the layers and the output: everything
    assert auto_layers(True, 30 * layer, layer, 30) == 30
    assert auto_layers(True, 31 * layer, layer, 30) == ALL_LAYERS
    assert auto_layers(True, 80 << 30, layer, 30) == ALL_LAYERS
    # a layer's size unknown: every layer
    assert auto_layers(True, 1000 * MiB, 0, 0) == ALL_LAYERS


def test_the_share_of_the_estimate_on_the_gpu() -> None:
    assert vram_share(3000, 600, 30, 0) == 0
    assert vram_share(3000, 600, 30, 10) == 1200
    assert vram_share(3000, 600, 30, 30) == 3600
    assert vram_share(3000, 600, 30, ALL_LAYERS) == 3600
    assert vram_share(3000, 600, 0, 10) == 0  # no layer count: nothing known on the GPU


def test_nvidia_smi_s_free_memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_free("81000\n") == 81000 * MiB
    assert parse_free("1000\n2000\n") == 3000 * MiB  # llama.cpp spreads layers over both
    assert parse_free("") is None
    assert parse_free("[N/A]\n") is None
    assert parse_free("No devices were found\n") is None
    monkeypatch.setenv("PATH", str(tmp_path))
    assert offload.vram_free() is None  # no nvidia-smi
    smi = tmp_path / "nvidia-smi"
    smi.write_text('#!/bin/sh\n[ "$1 $2" = "--query-gpu=memory.free '
                   '--format=csv,noheader,nounits" ] && echo " 40000" && exit 0\nexit 9\n')
    smi.chmod(0o755)
    assert offload.vram_free() == 40000 * MiB
    smi.write_text("#!/bin/sh\necho 'Failed to initialize NVML'\nexit 9\n")
    assert offload.vram_free() is None


@needs_model
def test_the_description_s_vram_part(monkeypatch: pytest.MonkeyPatch) -> None:
    """The embedded model described with layers on the GPU: their share of its weights
    and KV; the total stays what it is."""
    base = ModelSpec(alias="s", path=default_model_path(), role=1, slots=2, context=1024)
    cpu = describe(base)
    assert (cpu.gpu_layers, cpu.vram_bytes) == (0, 0)
    assert cpu.n_layer == 30  # SmolLM2-135M's blocks
    n = cpu.n_layer
    # this CPU build of llama.cpp offloads nothing, whatever the count
    assert not llama_cpp.llama_supports_gpu_offload()
    on_cpu = describe(dataclasses.replace(base, gpu_layers=n // 2))
    assert (on_cpu.gpu_layers, on_cpu.vram_bytes) == (0, 0)
    monkeypatch.setattr(llama_cpp, "llama_supports_gpu_offload", lambda: True)  # (a CUDA one)
    half = describe(dataclasses.replace(base, gpu_layers=n // 2))
    whole = describe(dataclasses.replace(base, gpu_layers=ALL_LAYERS))
    assert half.memory_bytes == whole.memory_bytes == cpu.memory_bytes
    assert half.vram_bytes == (cpu.weights_bytes + cpu.kv_bytes) // 2
    assert whole.vram_bytes == cpu.weights_bytes + cpu.kv_bytes
    assert 0 < half.vram_bytes < whole.vram_bytes < whole.memory_bytes
    auto = dataclasses.replace(base, gpu_layers=AUTO)
    monkeypatch.setattr(llama_cpp, "llama_supports_gpu_offload", lambda: False)
    assert (describe(auto).gpu_layers, describe(auto).vram_bytes) == (0, 0)
    # on a build that offloads, with 8 layers' worth free beyond the compute buffers
    monkeypatch.setattr(llama_cpp, "llama_supports_gpu_offload", lambda: True)
    layer = (cpu.weights_bytes + cpu.kv_bytes) / n
    monkeypatch.setattr(describe_module, "vram_free",
                        lambda: int(cpu.compute_bytes + 8.5 * layer))
    got = describe(auto)
    assert got.gpu_layers == 8
    assert got.vram_bytes == (cpu.weights_bytes + cpu.kv_bytes) * 8 // n
    monkeypatch.setattr(describe_module, "vram_free", lambda: None)
    assert describe(auto).gpu_layers == ALL_LAYERS


def test_a_load_decides_auto_without_reading_the_file_on_a_cpu_build(
        monkeypatch: pytest.MonkeyPatch) -> None:
    spec = ModelSpec(alias="s", path="/nonexistent.gguf", role=1, gpu_layers=AUTO)

    def unread(spec: ModelSpec) -> object:
        raise AssertionError("described")

    monkeypatch.setattr(describe_module, "describe", unread)
    monkeypatch.setattr(llama_cpp, "llama_supports_gpu_offload", lambda: False)
    assert gpu_layers(spec) == 0
    assert gpu_layers(ModelSpec(alias="s", path="/x.gguf", role=1, gpu_layers=7)) == 0
    monkeypatch.setattr(llama_cpp, "llama_supports_gpu_offload", lambda: True)
    assert gpu_layers(ModelSpec(alias="s", path="/x.gguf", role=1, gpu_layers=7)) == 7
    monkeypatch.setattr(describe_module, "describe",
                        lambda spec: SimpleNamespace(gpu_layers=11))
    assert gpu_layers(spec) == 11


def test_gpu_layers_reach_llama_cpp(monkeypatch: pytest.MonkeyPatch) -> None:
    """The spec's count goes into the engine's config (load.py) and from it into the
    model parameters llama.cpp loads with (``n_gpu_layers``)."""
    seen: dict[str, Any] = {}

    def load_from_file(path: bytes, params: Any) -> None:
        seen["n_gpu_layers"] = params.n_gpu_layers
        return None  # llama.cpp's failure: the engine says so

    monkeypatch.setattr(engine_module.llama_cpp, "llama_model_load_from_file", load_from_file)
    with pytest.raises(EngineError, match="could not load"):
        LlamaEngine(EngineConfig(path="/x.gguf", gpu_layers=17))
    assert seen["n_gpu_layers"] == 17
    with pytest.raises(EngineError):
        LlamaEngine(EngineConfig(path="/x.gguf"))
    assert seen["n_gpu_layers"] == 0

    configs: list[EngineConfig] = []

    def engine(config: EngineConfig) -> None:
        configs.append(config)
        raise EngineError("stop here")

    monkeypatch.setattr(load_module, "LlamaEngine", engine)
    monkeypatch.setattr(llama_cpp, "llama_supports_gpu_offload", lambda: True)  # (CUDA's)
    for layers in (0, 5, ALL_LAYERS):
        spec = ModelSpec(alias="s", path="/x.gguf", role=1, gpu_layers=layers)
        with pytest.raises(EngineError, match="stop here"):
            load_module.load(spec, threading.Lock(), lambda: None, lambda r: None)
    assert [c.gpu_layers for c in configs] == [0, 5, ALL_LAYERS]
    monkeypatch.setattr(load_module, "gpu_layers", lambda spec: 9)  # "auto", decided
    with pytest.raises(EngineError, match="stop here"):
        load_module.load(ModelSpec(alias="s", path="/x.gguf", role=1, gpu_layers=AUTO),
                         threading.Lock(), lambda: None, lambda r: None)
    assert configs[-1].gpu_layers == 9


@pytest.mark.parametrize("layers", [0, 4])
def test_the_projector_runs_on_the_gpu_with_the_layers(monkeypatch: pytest.MonkeyPatch,
                                                       layers: int) -> None:
    seen: dict[str, Any] = {}

    def encoder(*args: Any, **kwargs: Any) -> None:
        seen.update(kwargs)
        raise MediaInputError("stop here")

    monkeypatch.setattr(load_module, "MediaEncoder", encoder)
    engine = SimpleNamespace(model=None, n_embd=576, threads=2, n_batch=512,
                             config=EngineConfig(path="/x.gguf", gpu_layers=layers),
                             close=lambda: None)
    spec = ModelSpec(alias="v", path="/x.gguf", role=1, mmproj="/mmproj.gguf")
    with pytest.raises(EngineError, match="stop here"):
        load_module._projector(spec, engine)  # type: ignore[arg-type]
    assert seen["use_gpu"] is (layers > 0)
