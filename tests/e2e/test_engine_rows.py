"""The build's Q4_1 matrix rows four at a time (scripts/llama-q4_1-rows.patch): each row
is the bits the one-row kernel gives it, so a row's result, and so a greedy answer, does
not depend on which rows a thread's share of a product starts at, and that share follows
the thread count, which follows the free cores (engine/llama/cores.py)."""

from __future__ import annotations

import ctypes
import os
import platform

import numpy as np
import pytest

from aotx.engine.llama.libs import loaded_library

pytestmark = pytest.mark.skipif(os.environ.get("AOTX_SKIP_MODEL") == "1",
                                reason="model tests disabled")

QK = 32
Q4_1_BLOCK, Q8_1_BLOCK = 20, 36  # bytes a block of 32: two halves and 16 bytes; 32


def _avx2_fma() -> bool:
    if platform.machine() != "x86_64":
        return False
    with open("/proc/cpuinfo") as f:
        flags = next((line for line in f if line.startswith("flags")), "").split()
    return "avx2" in flags and "fma" in flags


def _ggml_cpu() -> ctypes.CDLL:
    import llama_cpp  # noqa: F401  (maps libggml-cpu as libllama's dependency)

    lib = ctypes.CDLL(loaded_library("libggml-cpu.so"))
    lib.ggml_cpu_init()  # its half-to-float table, which the kernels read
    for name in ("quantize_row_q4_1", "quantize_row_q8_1"):
        getattr(lib, name).argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    lib.ggml_vec_dot_q4_1_q8_1.argtypes = [
        ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
        ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return lib


@pytest.mark.skipif(not _avx2_fma(), reason="the four-row kernel is built for AVX2 and FMA")
def test_four_q4_1_rows_are_each_the_bits_of_one() -> None:
    lib = _ggml_cpu()
    x4 = lib.ggml_vec_dot_q4_1_q8_1_x4  # an AttributeError: the build lacks the patch
    x4.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                   ctypes.c_void_p]
    rng = np.random.default_rng(7)
    for n in (576, 1536, 96):  # the model's widths, and a row of three blocks
        rows = 64
        weights = (rng.standard_normal((rows, n)) * rng.uniform(0.01, 3, (rows, 1)))
        weights = weights.astype(np.float32)
        x = rng.standard_normal(n).astype(np.float32)
        row_bytes = n // QK * Q4_1_BLOCK
        w = np.zeros(rows * row_bytes, dtype=np.uint8)
        for r in range(rows):
            lib.quantize_row_q4_1(weights[r].ctypes.data, w[r * row_bytes:].ctypes.data, n)
        y = np.zeros(n // QK * Q8_1_BLOCK, dtype=np.uint8)
        lib.quantize_row_q8_1(x.ctypes.data, y.ctypes.data, n)

        alone = np.zeros(rows, dtype=np.float32)
        for r in range(rows):
            lib.ggml_vec_dot_q4_1_q8_1(n, alone[r:].ctypes.data, 0,
                                       w[r * row_bytes:].ctypes.data, 0, y.ctypes.data, 0, 1)
        four = np.zeros(rows, dtype=np.float32)
        for r in range(0, rows, 4):
            x4(n, four[r:].ctypes.data, w[r * row_bytes:].ctypes.data, row_bytes, y.ctypes.data)

        assert np.array_equal(four.view(np.uint32), alone.view(np.uint32)), n
        # and both are the product of the blocks' values (Q8_1 keeps its block sums as
        # halves, hence the tolerance)
        exact = _q4_1_values(w, rows, n) @ _q8_1_values(y, n)
        assert np.abs(alone - exact).max() < 1e-3 * np.abs(exact).max(), n


def _q4_1_values(w: np.ndarray, rows: int, n: int) -> np.ndarray:
    """The values of ``rows`` Q4_1 rows of ``n``: a block's d and m (halves), then 16
    bytes whose low nibbles are its first 16 values' q and high nibbles the last 16's;
    a value is d * q + m."""
    blocks = w.reshape(rows * n // QK, Q4_1_BLOCK)
    d, m = (blocks[:, :4].copy().view(np.float16).astype(np.float64).T)
    q = np.concatenate([blocks[:, 4:] & 15, blocks[:, 4:] >> 4], axis=1).astype(np.float64)
    return (d[:, None] * q + m[:, None]).reshape(rows, n)


def _q8_1_values(y: np.ndarray, n: int) -> np.ndarray:
    """A Q8_1 row's values: a block's d (a half; then its sum, unused here) and 32 int8."""
    blocks = y.reshape(n // QK, Q8_1_BLOCK)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float64)[:, 0]
    return (d[:, None] * blocks[:, 4:].view(np.int8).astype(np.float64)).reshape(n)


def test_a_models_logits_are_the_same_bits_on_one_thread_or_five() -> None:
    """The embedded model's Q4_1 products, a prompt's rows and a decode step's, on one
    thread and on five: with five, the K and V projections' 192 rows (Q4_1 in this
    model) split at 39 and the rows at a share's end take the one-row kernel where one
    thread takes four.  (The other products' shares start at multiples of four.)"""
    from aotx.device.models import default_model_path
    from aotx.engine.interface import BatchEntry
    from aotx.engine.llama.engine import EngineConfig, LlamaEngine

    got = []
    for threads in (1, 5):
        engine = LlamaEngine(EngineConfig(path=default_model_path(), slots=1,
                                          slot_context=256, threads=threads, poll=0))
        try:
            assert engine.threads == threads
            tokens = engine.tokenize("The keeper of the lighthouse counted the ships and",
                                     False)
            n = len(tokens)
            assert engine.decode([BatchEntry(t, i, 0, i == n - 1)
                                  for i, t in enumerate(tokens)]) == 0
            prompt = engine.logits_rows([n - 1])
            assert engine.decode([BatchEntry(int(prompt.argmax()), n, 0, True)]) == 0
            got.append((prompt, engine.logits_rows([0])))
        finally:
            engine.close()
    (prompt1, step1), (prompt5, step5) = got
    assert np.array_equal(prompt1.view(np.uint32), prompt5.view(np.uint32))
    assert np.array_equal(step1.view(np.uint32), step5.view(np.uint32))
    assert np.isfinite(step1).all() and step1.std() > 0
