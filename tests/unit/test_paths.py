"""Where vLLM's sockets go (paths.vllm_sockets, paths.clear_vllm_sockets)."""

from __future__ import annotations

import os
import pathlib
import shutil
import socket
import tempfile
from collections.abc import Iterator

import pytest

from aotx.paths import RuntimePaths, clear_vllm_sockets, vllm_sockets


@pytest.fixture
def short_dir() -> Iterator[pathlib.Path]:
    """A state folder whose run/vllm/<uuid> fits a socket path.  pytest's tmp_path does
    not always: from its hundredth numbered folder on a machine ("pytest-104") this
    test's came to 108 characters, and vllm_sockets rightly left the path to vLLM."""
    folder = pathlib.Path(tempfile.mkdtemp(prefix="aotx-paths-"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def test_vllms_sockets_go_to_the_run_folder_and_are_cleared(
        short_dir: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # set, then removed: monkeypatch then restores the variable's absence afterwards, so
    # that what vllm_sockets sets does not reach the services later tests start
    monkeypatch.setenv("VLLM_RPC_BASE_PATH", "")
    monkeypatch.delenv("VLLM_RPC_BASE_PATH")
    paths = RuntimePaths(str(short_dir))
    paths.ensure()
    vllm_sockets(paths)
    assert os.environ["VLLM_RPC_BASE_PATH"] == paths.vllm_dir
    assert os.stat(paths.vllm_dir).st_mode & 0o777 == 0o700
    left = os.path.join(paths.vllm_dir, "3f1c2a9e-0000-4000-8000-000000000000")
    with socket.socket(socket.AF_UNIX) as s:  # as a killed engine core leaves one
        s.bind(left)
    clear_vllm_sockets(paths)
    assert os.listdir(paths.vllm_dir) == []


def test_a_path_set_or_too_long_is_left_to_vllm(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_RPC_BASE_PATH", "/elsewhere")
    paths = RuntimePaths(str(tmp_path))
    vllm_sockets(paths)
    assert os.environ["VLLM_RPC_BASE_PATH"] == "/elsewhere"
    monkeypatch.delenv("VLLM_RPC_BASE_PATH")
    deep = RuntimePaths(str(tmp_path / ("d" * 60)))  # run/vllm/<uuid> > 107
    vllm_sockets(deep)
    assert "VLLM_RPC_BASE_PATH" not in os.environ
    assert not os.path.exists(deep.vllm_dir)
    clear_vllm_sockets(deep)  # nothing there: no error
