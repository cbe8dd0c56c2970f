"""The models folder's watch (device/watch.py): a new file is described once it has kept
its size across two looks, gets a role kept by alias, and a file that went away marks
its unloaded model failed."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

from aotx import wire
from aotx.device.ondemand import FAILED, LOADED, UNLOADED, OnDemand
from aotx.device.watch import GONE, Watch
from aotx.engine.spec import ModelSpec


@pytest.fixture
def watch(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> tuple[Watch, list[list[str]]]:
    folder = tmp_path / "models"
    folder.mkdir()
    w = Watch(str(folder), str(tmp_path), [], lambda: None)
    described: list[list[str]] = []
    monkeypatch.setattr(w, "_describe", lambda specs: described.append([s.alias for s in specs]))
    return w, described


def test_a_new_file_is_described_once_it_has_settled(tmp_path: Any, watch: Any) -> None:
    w, described = watch
    path = tmp_path / "models" / "late.gguf"
    path.write_bytes(b"GGUF" + bytes(60))
    w.tick(0.0, {}, set())
    assert described == []  # first seen: it may still be being copied
    with open(path, "ab") as f:
        f.write(b"more")  # still growing
    w.tick(5.0, {}, set())
    assert described == []
    w.tick(10.0, {}, set())
    assert described == [["late"]]
    with open(tmp_path / "model-roles.json") as f:
        assert json.load(f) == {"late": 1}  # kept by alias, as at start
    w.tick(15.0, {}, set())
    assert described == [["late"]]  # once


def test_a_model_whose_file_went_away_fails_unless_loaded(tmp_path: Any, watch: Any) -> None:
    w, _ = watch
    entries = {}
    for role, state in ((1, UNLOADED), (2, LOADED)):
        spec = ModelSpec(alias=f"m{role}", path=str(tmp_path / f"m{role}.gguf"), role=role,
                         on_demand=True)
        info = wire.ModelInfo(role, spec.alias, bytes(32), wire.MOD_TEXT, 0, 4096)
        entries[role] = OnDemand(spec, info, 0, state=state)
    w.tick(0.0, entries, {"m1", "m2"})
    assert (entries[1].state, entries[1].reason) == (FAILED, GONE)
    assert entries[2].state == LOADED  # (its mapping stays)
    (tmp_path / "m1.gguf").write_bytes(b"back")
    assert entries[1].retry() and entries[1].state == UNLOADED


def test_the_links_of_one_file_are_hashed_once(tmp_path: Any) -> None:
    from aotx.device.models import file_sha256

    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    a.write_bytes(b"GGUF" + bytes(100))
    os.link(a, b)
    cache = str(tmp_path / "hashes.json")
    assert file_sha256(str(a), cache) == file_sha256(str(b), cache)
    with open(cache) as f:
        assert len(json.load(f)) == 1  # one file identity, one entry


def test_a_model_a_request_waits_for_is_left_to_its_load(tmp_path: Any, watch: Any) -> None:
    w, _ = watch
    spec = ModelSpec(alias="m", path=str(tmp_path / "m.gguf"), role=1, on_demand=True)
    od = OnDemand(spec, wire.ModelInfo(1, "m", bytes(32), wire.MOD_TEXT, 0, 4096), 0)
    od.waiting.append(object())  # type: ignore[arg-type]
    w.tick(0.0, {1: od}, {"m"})
    assert od.state == UNLOADED  # its load fails, and fails the waiting request


def test_a_replaced_file_is_described_again_while_unloaded(tmp_path: Any, watch: Any) -> None:
    """Another pull under the same name: the unloaded model's estimate, row and digest
    were the old file's; once the new file has settled it is described again, and the
    new description keeps the model's counters."""
    from aotx.device.watch import _installs

    w, described = watch
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF" + bytes(60))
    spec = ModelSpec(alias="m", path=str(path), role=1, on_demand=True)
    info = wire.ModelInfo(1, "m", bytes(32), wire.MOD_TEXT, 0, 4096)
    st = os.stat(path)
    od = OnDemand(spec, info, 10, state=UNLOADED, loads=3, described=(st.st_size, st.st_mtime_ns))
    w.tick(0.0, {1: od}, {"m"})
    assert described == []  # unchanged
    path.write_bytes(b"GGUF" + bytes(600))  # replaced
    w.tick(5.0, {1: od}, {"m"})
    assert described == []  # not settled yet
    od.state = LOADED
    w.tick(10.0, {1: od}, {"m"})
    assert described == []  # loaded: left until it is unloaded
    od.state = UNLOADED
    w.tick(15.0, {1: od}, {"m"})
    assert described == [["m"]]
    fresh = OnDemand(spec, info, 20)
    assert _installs(od, fresh) and fresh.loads == 3
    od.waiting.append(object())  # type: ignore[arg-type]
    assert not _installs(od, OnDemand(spec, info, 20))  # a load waits: the next look
