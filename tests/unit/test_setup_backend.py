"""Which llama.cpp backend ``scripts/setup`` builds (``scripts/llama-build``, which it
sources): the CMake arguments and the wheel folder, for a PATH with or without a fake
``nvcc`` and ``nvidia-smi`` and each ``AOTX_LLAMA_BACKEND``.  Nothing is built."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BASH = shutil.which("bash") or "/bin/bash"
GPU_LIST = "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)"


def fake_path(tmp_path: Path, nvcc: bool, gpus: str | None) -> str:
    """A PATH of the tools llama-build runs, and a fake ``nvcc`` and ``nvidia-smi -L``
    (printing ``gpus``; None: no nvidia-smi; "": one that finds no device)."""
    bin_dir = Path(tempfile.mkdtemp(prefix="bin-", dir=tmp_path))
    for tool in ("sha256sum", "cut", "cat"):
        found = shutil.which(tool)
        assert found, tool
        (bin_dir / tool).symlink_to(found)

    def script(name: str, body: str) -> None:
        (bin_dir / name).write_text(f"#!{BASH}\n{body}\n")
        (bin_dir / name).chmod(0o755)

    if nvcc:
        script("nvcc", 'echo "Cuda compilation tools, release 13.0"')
    if gpus == "":
        script("nvidia-smi", 'echo "No devices were found"; exit 6')
    elif gpus is not None:
        script("nvidia-smi", f'[ "$1" = -L ] && echo "{gpus}"')
    return str(bin_dir)


def build(tmp_path: Path, nvcc: bool = False, gpus: str | None = None,
          **env: str) -> subprocess.CompletedProcess[str]:
    """``scripts/llama-build`` sourced as scripts/setup sources it (``set -euo
    pipefail``), printing its backend, CMake arguments, CFLAGS and wheel folder."""
    shown = 'printf "%s\\n" "$LLAMA_BACKEND" "$LLAMA_CMAKE_ARGS" "$LLAMA_CFLAGS" "$LLAMA_WHEELS"'
    return subprocess.run(
        [BASH, "-c", f"set -euo pipefail; source scripts/llama-build; {shown}"],
        cwd=REPO, capture_output=True, text=True, timeout=30, check=False,
        env={"PATH": fake_path(tmp_path, nvcc, gpus), "HOME": str(tmp_path), **env})


def chosen(tmp_path: Path, nvcc: bool = False, gpus: str | None = None,
           **env: str) -> tuple[str, list[str], str, str]:
    done = build(tmp_path, nvcc, gpus, **env)
    assert done.returncode == 0, done.stderr
    backend, args, cflags, wheels = done.stdout.splitlines()
    return backend, args.split(), cflags, wheels


#: The patches llama-build applies, in their order.
PATCHES = ("scripts/llama-flash-attention.patch", "scripts/llama-q4_1-rows.patch",
           "scripts/llama-prefetch.patch")


def llama_patches() -> tuple[str, ...]:
    """llama-build's ``LLAMA_PATCHES`` array, as written there."""
    found = re.search(r"^LLAMA_PATCHES=\(([^)]*)\)", (REPO / "scripts" / "llama-build").read_text(),
                      re.MULTILINE)
    assert found is not None
    return tuple(found.group(1).split())


def build_id(args: list[str], cflags: str) -> str:
    """The wheel folder's key as llama-build computes it: the flags and the patches."""
    patches = b"".join((REPO / name).read_bytes() for name in PATCHES)
    text = f"{' '.join(args)}\n{cflags}\n".encode() + patches
    return hashlib.sha256(text).hexdigest()[:12]


def version() -> str:
    for line in (REPO / "scripts" / "llama-build").read_text().splitlines():
        if line.startswith("LLAMA_VERSION="):
            return line.split("=", 1)[1]
    raise AssertionError("no LLAMA_VERSION")


def test_a_machine_without_cuda_builds_for_the_cpu_as_before(tmp_path: Path) -> None:
    backend, args, cflags, wheels = chosen(tmp_path)
    assert backend == "cpu"
    assert args == ["-DGGML_OPENMP=OFF"]
    # the folder's name, and so the cached CPU wheel, is the one it was before the choice
    expected = f"llama-cpp-python-{version()}-{build_id(args, cflags)}"
    assert wheels == f"{tmp_path}/.cache/aotx/wheels/{expected}"
    assert chosen(tmp_path, AOTX_WHEEL_DIR="/w")[3] == f"/w/{expected}"


@pytest.mark.parametrize("gpus", [None, ""])
def test_a_cuda_toolkit_without_a_gpu_keeps_the_cpu_build(tmp_path: Path,
                                                          gpus: str | None) -> None:
    assert chosen(tmp_path, nvcc=True, gpus=gpus)[:2] == ("cpu", ["-DGGML_OPENMP=OFF"])
    # and a GPU without the toolkit: nothing to build CUDA with
    assert chosen(tmp_path, nvcc=False, gpus=GPU_LIST)[0] == "cpu"


def test_nvcc_and_a_gpu_build_for_cuda_in_a_folder_of_its_own(tmp_path: Path) -> None:
    cpu = chosen(tmp_path)
    backend, args, cflags, wheels = chosen(tmp_path, nvcc=True, gpus=GPU_LIST)
    assert backend == "cuda"
    assert args == ["-DGGML_OPENMP=OFF", "-DGGML_CUDA=on"]
    assert cflags == cpu[2]  # the same CPU flags: the CPU backend is built beside CUDA
    assert wheels.endswith(f"/llama-cpp-python-{version()}-cuda-{build_id(args, cflags)}")
    assert wheels != cpu[3]


def test_aotx_llama_backend_decides(tmp_path: Path) -> None:
    # asked for CUDA (a build machine whose GPUs are elsewhere)
    backend, args, _, wheels = chosen(tmp_path, AOTX_LLAMA_BACKEND="cuda")
    assert backend == "cuda" and "-DGGML_CUDA=on" in args and "-cuda-" in wheels
    arch = chosen(tmp_path, AOTX_LLAMA_BACKEND="cuda", AOTX_CUDA_ARCHITECTURES="90")
    assert "-DCMAKE_CUDA_ARCHITECTURES=90" in arch[1] and arch[3] != wheels
    # asked for the CPU where CUDA would be found
    assert chosen(tmp_path, nvcc=True, gpus=GPU_LIST, AOTX_LLAMA_BACKEND="cpu")[:2] == (
        "cpu", ["-DGGML_OPENMP=OFF"])
    # the architectures are CUDA's alone
    assert chosen(tmp_path, AOTX_CUDA_ARCHITECTURES="90")[1] == ["-DGGML_OPENMP=OFF"]


def test_another_backend_stops_setup_with_the_reason(tmp_path: Path) -> None:
    done = build(tmp_path, AOTX_LLAMA_BACKEND="rocm")
    assert done.returncode != 0 and done.stdout == ""
    assert "AOTX_LLAMA_BACKEND is cpu or cuda, got 'rocm'" in done.stderr


def test_setup_builds_with_those_arguments_and_the_patches() -> None:
    """scripts/setup passes llama-build's CMake arguments to the build, applies its
    patches whatever the backend, and keeps the wheel in llama-build's folder."""
    setup = (REPO / "scripts" / "setup").read_text()
    assert "source scripts/llama-build" in setup
    assert 'CMAKE_ARGS="$LLAMA_CMAKE_ARGS"' in setup
    # $PWD quoted inside the substitution: an "&" in the checkout's path stays itself
    assert 'apply "${LLAMA_PATCHES[@]/#/"$PWD"/}"' in setup
    assert llama_patches() == PATCHES
    assert "wheels=$LLAMA_WHEELS" in setup
    assert os.access(REPO / "scripts" / "setup", os.X_OK)
