"""The build's weights fetched ahead (scripts/llama-prefetch.patch).

A prefetch changes no result (the invariance and chunking tests hold the bits); it
changes how long one stream's step waits on memory, which ``bench/bench_decode.py``
measures.  What a test can hold is that the engine runs on a build that carries it:
upstream's matrix product (``ggml_compute_forward_mul_mat``, its row loop inlined there)
issues no software prefetch on x86; the patch's issues one in its row loops."""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess

import pytest

from aotx.engine.llama.libs import loaded_library

pytestmark = [
    pytest.mark.skipif(os.environ.get("AOTX_SKIP_MODEL") == "1", reason="model tests disabled"),
    pytest.mark.skipif(platform.machine() != "x86_64", reason="x86's prefetch instruction"),
    pytest.mark.skipif(shutil.which("objdump") is None, reason="needs binutils' objdump"),
]


def test_the_cpu_backend_fetches_weights_ahead() -> None:
    import llama_cpp  # noqa: F401  (maps libggml-cpu as libllama's dependency)

    path = loaded_library("libggml-cpu.so")
    code = subprocess.run(["objdump", "-d", "--no-show-raw-insn", path], capture_output=True,
                          text=True, check=True).stdout
    # __builtin_prefetch(p, 0, 3) is prefetcht0, counted within the matrix product's code
    # only (upstream's q4_0 kernel for SSSE3 prefetches on its own)
    fetches = sum(body.count("prefetcht0") for name, body in _functions(code)
                  if name.startswith("ggml_compute_forward_mul_mat"))
    assert fetches >= 1, f"{path} was built without scripts/llama-prefetch.patch"


def _functions(code: str) -> list[tuple[str, str]]:
    """objdump's listing cut into (symbol, its instructions)."""
    found = re.split(r"^[0-9a-f]+ <([^>]+)>:$", code, flags=re.MULTILINE)
    return list(zip(found[1::2], found[2::2], strict=True))
