"""``gpu_layers`` on this CPU build of llama.cpp (engine/llama/engine.py): the model loads
and computes as with none, since a build without a GPU backend has nowhere to offload to.
A CUDA build's offload itself is not run by these tests (no GPU here)."""

from __future__ import annotations

import os

import llama_cpp
import pytest

from aotx.device.models import default_model_path
from aotx.engine.interface import BatchEntry
from aotx.engine.llama.engine import EngineConfig, LlamaEngine
from aotx.engine.llama.offload import ALL_LAYERS
from aotx.engine.llama.sampling import Sampler

from ..helpers import in_fresh_process

pytestmark = pytest.mark.skipif(os.environ.get("AOTX_SKIP_MODEL") == "1",
                                reason="model tests disabled")


def greedy(layers: int) -> tuple[list[int], int]:
    """Eight greedy tokens after a prompt, and the KV bytes handed back at creation."""
    engine = LlamaEngine(EngineConfig(path=default_model_path(), slots=1, slot_context=256,
                                      batch=64, gpu_layers=layers))
    try:
        assert engine.config.gpu_layers == layers
        prompt = engine.tokenize("The capital of France is", False)
        engine.clear_sequence(0)
        assert engine.decode([BatchEntry(t, i, 0, i == len(prompt) - 1)
                              for i, t in enumerate(prompt)]) == 0
        fast, out, pos, idx = Sampler(0.0, 1.0, 0), [], len(prompt), len(prompt) - 1
        for _ in range(8):
            out.append(engine.sample(fast, idx))
            assert engine.decode([BatchEntry(out[-1], pos, 0, True)]) == 0
            pos, idx = pos + 1, 0
        return out, engine.kv_released
    finally:
        engine.close()


def fresh(layers: int) -> tuple[list[int], int]:
    """:func:`greedy` in a process of its own, as the device creates its contexts: in this
    one, freed heap memory of earlier tests may hold the KV buffer (glibc serves a large
    block from freed memory before it maps a new one), and only new mappings are handed
    back, so what is released would depend on the tests before."""
    tokens, released = in_fresh_process("import json; from tests.e2e.test_e2e_gpu_layers "
                                        f"import greedy; print(json.dumps(greedy({layers})))")
    return tokens, released


def test_a_cpu_build_loads_and_answers_alike_with_gpu_layers() -> None:
    assert not llama_cpp.llama_supports_gpu_offload()
    on_cpu, released = fresh(0)
    offloaded, none_released = fresh(ALL_LAYERS)
    assert offloaded == on_cpu
    # KV pages are handed back (residency.py) only without layers on a GPU
    assert released > 0 and none_released == 0
