"""A model described before it is loaded (engine/llama/describe.py) agrees with the same
model loaded: SmolLM2 and Gemma 3, two architectures and vocabularies."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from aotx.device.models import default_model_path
from aotx.engine.interface import EngineError
from aotx.engine.llama.describe import COMPUTE_ALLOWANCE
from aotx.engine.llama.load import load
from aotx.engine.load import describe
from aotx.engine.spec import ModelSpec

from ..helpers import GEMMA_TEMPLATE, gemma_path

pytestmark = pytest.mark.skipif(os.environ.get("AOTX_SKIP_MODEL") == "1",
                                reason="AOTX_SKIP_MODEL=1")


@pytest.mark.parametrize("which", ["smollm2", "gemma3"])
@pytest.mark.parametrize("kv", [{}, {"kv_budget": 64 << 20, "kv_type": "q8_0"}])
def test_the_description_is_what_the_load_reserves(which: str, kv: dict[str, object]) -> None:
    import threading

    path = default_model_path() if which == "smollm2" else gemma_path()
    spec = ModelSpec(alias=which, path=path, role=1, slots=4, context=2048,
                     chat_template=GEMMA_TEMPLATE if which == "gemma3" else None,
                     **kv)  # type: ignore[arg-type]
    d = describe(spec)
    got = load(spec, threading.Lock(), lambda: None, lambda r: None)
    try:
        engine = got.engine
        assert d.weights_bytes == engine.model_bytes
        embedding = got.embeddings
        assert embedding is not None
        cells = embedding.embedder.cells  # type: ignore[attr-defined]
        # the sequences' KV (stream or pool) and the embedding context's, as reserved
        f16_cell = 2 * engine._cell_elements()  # type: ignore[attr-defined]  # (the embedder's)
        assert d.kv_bytes == engine.kv_bytes() + cells * f16_cell
        assert d.n_vocab == engine.n_vocab and d.n_ctx_train == engine.n_ctx_train
        assert d.n_embd == embedding.embedder.dims
        assert d.compute_bytes == 4 * engine.n_vocab * spec.slots + COMPUTE_ALLOWANCE
        assert d.bos_text == engine.token_text(got.bos)
        assert d.eos_text == engine.token_text(got.eos)
        assert d.file_bytes == os.path.getsize(path)
        # SmolLM2's file carries its template; the Gemma base model's does not
        assert (d.chat_template is not None) == (which == "smollm2")
        assert d.chat_template == engine.metadata("tokenizer.chat_template")
    finally:
        got.close()


def test_what_llama_cpp_cannot_read_says_so(tmp_path: Path) -> None:
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + os.urandom(4096))
    with pytest.raises(EngineError, match="could not read"):
        describe(ModelSpec(alias="b", path=str(broken), role=1))
    with pytest.raises(EngineError, match="described once loaded"):
        describe(ModelSpec(alias="v", path=str(tmp_path), role=1, engine="vllm"))
