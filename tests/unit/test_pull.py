"""Which files ``aotx pull`` takes from a reference (aotx/pull.py, the pure part)."""

from __future__ import annotations

import pytest

from aotx.pull import PullError, Ref, choose_files, parse_ref

FILES = ["README.md", "model-Q4_K_M.gguf", "model-Q8_0.gguf", "mmproj-model-f16.gguf",
         "mmproj-model-q8_0.gguf"]
SPLIT = ["big/big-Q4_K_M-00001-of-00002.gguf", "big/big-Q4_K_M-00002-of-00002.gguf",
         "big/big-Q8_0-00001-of-00002.gguf", "big/big-Q8_0-00002-of-00002.gguf"]


def test_references() -> None:
    assert parse_ref("ggml-org/gemma-3-4b-it-GGUF") == Ref(repo="ggml-org/gemma-3-4b-it-GGUF")
    assert parse_ref("o/r:Q8_0") == Ref(repo="o/r", choose="Q8_0")
    assert parse_ref("o/r:model-Q8_0.gguf") == Ref(repo="o/r", choose="model-Q8_0.gguf")
    assert parse_ref("https://example.org/x/m.gguf?download=1") == Ref(
        url="https://example.org/x/m.gguf?download=1")
    for bad in ("no-slash", "a/b/c", "https://example.org/model.bin", "o/r name"):
        with pytest.raises(PullError):
            parse_ref(bad)


def test_the_file_a_reference_chooses() -> None:
    assert choose_files(FILES, "", False) == (["model-Q4_K_M.gguf"], None)  # llama-server's
    assert choose_files(FILES, "q8_0", True) == (["model-Q8_0.gguf"], "mmproj-model-f16.gguf")
    assert choose_files(FILES, "model-Q8_0.gguf", False) == (["model-Q8_0.gguf"], None)
    assert choose_files(["a-f16.gguf", "b-Q2_K.gguf"], "", False) == (["a-f16.gguf"], None)


def test_a_split_model_comes_with_every_shard() -> None:
    files, _ = choose_files(SPLIT, "Q4_K_M", False)
    assert files == ["big/big-Q4_K_M-00001-of-00002.gguf", "big/big-Q4_K_M-00002-of-00002.gguf"]


def test_what_cannot_be_chosen_says_why() -> None:
    with pytest.raises(PullError, match="IQ1_S.*model-Q4_K_M.gguf"):
        choose_files(FILES, "IQ1_S", False)
    with pytest.raises(PullError, match="no projector"):
        choose_files(["m-Q4_K_M.gguf"], "", True)
    with pytest.raises(PullError, match="no GGUF files"):
        choose_files(["README.md"], "", False)
