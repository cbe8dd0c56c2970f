"""How many of a model's layers llama.cpp puts on the GPU: the models file's
``gpu_layers``, a count or ``"auto"`` (:data:`AUTO` in a ``ModelSpec``).

``"auto"`` is decided when the model is described or loaded (describe.py): none where
the llama.cpp build cannot offload (a CPU build: ``scripts/setup`` builds for CUDA only
where it finds ``nvcc`` and a GPU, or ``AOTX_LLAMA_BACKEND=cuda``); else as many as fit
the VRAM free now (``nvidia-smi``) at the size of one layer (its weights and its KV);
every layer where the free VRAM cannot be read.  :func:`auto_layers` decides from the
numbers alone; :func:`vram_free` reads them.
"""

from __future__ import annotations

import shutil
import subprocess

#: ``gpu_layers = "auto"`` in a ModelSpec.
AUTO = -1
#: Every layer and the output (llama.cpp's ``-ngl 999``).
ALL_LAYERS = 999


def auto_layers(offload: bool, free: int | None, layer_bytes: float, n_layer: int,
                reserve: int = 0) -> int:
    """The layers ``"auto"`` offloads: 0 where the build cannot (``offload`` false);
    :data:`ALL_LAYERS` where the free VRAM is unknown (``free`` None), a layer's size
    is, or every layer fits; else as many layers of ``layer_bytes`` as fit ``free``
    bytes less ``reserve`` (the compute buffers)."""
    if not offload:
        return 0
    if free is None or layer_bytes <= 0:
        return ALL_LAYERS
    fit = int(max(0, free - reserve) // layer_bytes)
    # llama.cpp counts the output as one more layer: n_layer + 1 offloads everything
    return ALL_LAYERS if fit > n_layer else fit


def vram_share(weights: int, kv: int, n_layer: int, gpu_layers: int) -> int:
    """The bytes of a model's estimate that live on the GPU with ``gpu_layers`` offloaded:
    that share of its layers' weights and of their KV (the whole weights once the output
    goes too; the token embeddings stay on the host, which this counts on the GPU)."""
    if gpu_layers <= 0 or n_layer <= 0:
        return 0
    if gpu_layers > n_layer:
        return weights + kv
    return (weights + kv) * gpu_layers // n_layer


def parse_free(text: str) -> int | None:
    """Bytes free on all GPUs from ``nvidia-smi --query-gpu=memory.free --format=csv,
    noheader,nounits`` (MiB, a line a GPU; llama.cpp spreads the layers over them); None
    when it lists none or a line is not a number ("[N/A]")."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines or not all(line.isdigit() for line in lines):
        return None
    return sum(int(line) for line in lines) << 20


def vram_free() -> int | None:
    """The VRAM free now, as ``nvidia-smi`` reports it (None: no nvidia-smi, or no answer
    within 10 s)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        done = subprocess.run([exe, "--query-gpu=memory.free", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return parse_free(done.stdout) if done.returncode == 0 else None
