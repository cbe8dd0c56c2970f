"""``aotx pull`` against a local server posing as the Hugging Face hub (``HF_ENDPOINT``):
the real CLI in a process of its own, huggingface_hub, real HTTP with ranges."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

from aotx.device.catalog import Found, scan

from .. import hub

# more than twice huggingface_hub's 10 MiB write chunk: half of it reaches the disk
MODEL = os.urandom(24 << 20)
PROJECTOR = os.urandom(200_000)
REPO = {"owner/tiny-GGUF": {"tiny-Q4_K_M.gguf": MODEL, "tiny-Q8_0.gguf": b"GGUF" * 10,
                            "mmproj-tiny-f16.gguf": PROJECTOR}}


def pull_command(state: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "aotx", "--log-level", "WARNING", "pull",
            "--state-dir", str(state), *args]


def run_pull(h: hub.FakeHub, state: Path, *args: str,
             env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(pull_command(state, *args), capture_output=True, text=True,
                          timeout=120, env={**os.environ, "HF_ENDPOINT": h.url, **(env or {})})


def test_a_model_and_its_projector_land_as_the_catalog_reads_them(tmp_path: Path) -> None:
    with hub.serving(REPO) as h:
        got = run_pull(h, tmp_path, "owner/tiny-GGUF", "--mmproj", env={"HF_TOKEN": "hf_x1"})
    assert got.returncode == 0, got.stderr
    folder = tmp_path / "models" / "tiny-Q4_K_M"
    assert got.stdout.split() == [str(folder / "tiny-Q4_K_M.gguf"),
                                  str(folder / "mmproj-tiny-f16.gguf")]
    assert (folder / "tiny-Q4_K_M.gguf").read_bytes() == MODEL
    assert scan(str(tmp_path / "models")) == ([Found("tiny-Q4_K_M",
                                                     str(folder / "tiny-Q4_K_M.gguf"),
                                                     str(folder / "mmproj-tiny-f16.gguf"))], [])
    assert "Bearer hf_x1" in h.tokens  # HF_TOKEN reached the hub


def written(staging: Path) -> Path:
    """The part file a transfer writes, once it holds bytes (within 60 s)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        parts = [p for p in staging.rglob("*.part") if p.stat().st_size]
        if parts:
            return parts[0]
        time.sleep(0.05)
    raise AssertionError("no part file was written")


def test_an_interrupted_pull_resumes_where_it_stopped(tmp_path: Path) -> None:
    with hub.serving(REPO) as h:
        h.stall = "tiny-Q4_K_M.gguf"
        first = subprocess.Popen(pull_command(tmp_path, "owner/tiny-GGUF"),
                                 env={**os.environ, "HF_ENDPOINT": h.url},
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            assert h.halfway.wait(60)
            part = written(tmp_path / "models" / ".pull")
        finally:
            first.kill()
            first.wait()
        held = part.stat().st_size
        assert 0 < held <= len(MODEL) // 2
        assert not (tmp_path / "models" / "tiny-Q4_K_M.gguf").exists()  # not in place half
        h.stall = ""
        again = run_pull(h, tmp_path, "owner/tiny-GGUF")
        assert again.returncode == 0, again.stderr
        assert h.ranges == [("tiny-Q4_K_M.gguf", 0), ("tiny-Q4_K_M.gguf", held)]
    model = tmp_path / "models" / "tiny-Q4_K_M.gguf"
    assert hashlib.sha256(model.read_bytes()).digest() == hashlib.sha256(MODEL).digest()
    assert not list((tmp_path / "models" / ".pull").rglob("*.part"))


def test_a_file_that_is_not_what_the_hub_lists_is_refused(tmp_path: Path) -> None:
    with hub.serving(REPO) as h:
        h.wrong_sha = True
        got = run_pull(h, tmp_path, "owner/tiny-GGUF:Q8_0")
    assert got.returncode == 1 and "SHA-256" in got.stderr and "removed" in got.stderr
    assert scan(str(tmp_path / "models")) == ([], [])
    assert not list((tmp_path / "models").rglob("*.part"))


def test_a_url_and_the_errors_a_user_sees(tmp_path: Path) -> None:
    with hub.serving(REPO) as h:
        got = run_pull(h, tmp_path, f"{h.url}/files/tiny-Q8_0.gguf")
        assert got.returncode == 0, got.stderr
        assert (tmp_path / "models" / "tiny-Q8_0.gguf").read_bytes() == b"GGUF" * 10
        missing = run_pull(h, tmp_path, "owner/tiny-GGUF:IQ1_S")
        assert missing.returncode == 1 and "IQ1_S" in missing.stderr
        unknown = run_pull(h, tmp_path, "owner/nothing-here")
        assert unknown.returncode == 1 and "owner/nothing-here" in unknown.stderr
