"""The models folder and the roles kept across restarts (device/catalog.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from aotx.device import catalog
from aotx.device.catalog import Found, alias_of, assign_roles, scan, settle_roles
from aotx.device.models import ModelConfigError
from aotx.engine.spec import ModelSpec


def touch(path: Path) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"GGUF")
    return str(path)


def test_aliases_from_file_names() -> None:
    assert alias_of("qwen2.5-0.5b-instruct-q4_k_m.gguf") == "qwen2.5-0.5b-instruct-q4_k_m"
    assert alias_of("big-model-00001-of-00003.gguf") == "big-model"
    assert alias_of("my model (v2).GGUF") == "my-model--v2-"
    assert len(alias_of("x" * 300 + ".gguf")) == 128


def test_a_folder_in_llama_servers_layout(tmp_path: Path) -> None:
    a = touch(tmp_path / "alpha.gguf")
    a_proj = touch(tmp_path / "mmproj-alpha.gguf")
    touch(tmp_path / "beta-00001-of-00002.gguf")
    touch(tmp_path / "beta-00002-of-00002.gguf")
    vis = touch(tmp_path / "vision" / "model-q4.gguf")
    vis_proj = touch(tmp_path / "vision" / "mmproj-f16.gguf")
    touch(tmp_path / "two" / "a.gguf")
    touch(tmp_path / "two" / "b.gguf")
    touch(tmp_path / "mmproj-orphan.gguf")
    touch(tmp_path / ".downloading" / "x.gguf")
    touch(tmp_path / ".half.gguf")
    (tmp_path / "notes.txt").write_text("not a model")
    found, skipped = scan(str(tmp_path))
    assert found == [Found("alpha", a, a_proj),
                     Found("beta", str(tmp_path / "beta-00001-of-00002.gguf")),
                     Found("vision", vis, vis_proj)]
    assert {(Path(s.path).name, s.reason.split(";")[0]) for s in skipped} == {
        ("two", "a model folder holds one model"),
        ("mmproj-orphan.gguf", "a projector without its model (name it mmproj-MODEL.gguf, "
                               "or put both in a folder)")}
    assert scan(str(tmp_path / "missing")) == ([], [])


def test_roles_are_kept_by_alias_and_never_reused() -> None:
    roles, over = assign_roles({}, ["a", "b", "c"])
    assert (roles, over) == ({"a": 1, "b": 2, "c": 3}, [])
    # b is gone, d is new: d takes a free role, b's stays reserved
    roles, over = assign_roles(roles, ["c", "a", "d"])
    assert roles == {"a": 1, "b": 2, "c": 3, "d": 4} and over == []
    full = {f"m{i}": i for i in range(1, catalog.MAX_ROLE + 1)}
    roles, over = assign_roles(full, ["m3", "new1", "new2"])
    assert roles == full and over == ["new1", "new2"]


def spec(alias: str) -> ModelSpec:
    return ModelSpec(alias=alias, path="/m.gguf", role=0)


def test_settled_roles_survive_a_reordered_models_file(tmp_path: Path) -> None:
    first = settle_roles(str(tmp_path), [spec("smollm2"), spec("qwen"), spec("bge")])
    assert [s.role for s in first] == [1, 2, 3]  # a first start: the file's order
    again = settle_roles(str(tmp_path), [spec("bge"), spec("smollm2"), spec("coder")])
    assert [(s.alias, s.role) for s in again] == [("bge", 3), ("smollm2", 1), ("coder", 4)]
    kept = json.loads((tmp_path / catalog.ROLES_FILE).read_text())
    assert kept == {"smollm2": 1, "qwen": 2, "bge": 3, "coder": 4}


def test_a_damaged_roles_file_stops_the_start(tmp_path: Path) -> None:
    for text in ("{not json", '{"a": 1, "b": 1}', '{"a": 40}', '["a"]'):
        (tmp_path / catalog.ROLES_FILE).write_text(text)
        with pytest.raises(ModelConfigError, match="roles"):
            settle_roles(str(tmp_path), [spec("a")])


def test_more_declared_models_than_roles_stop_the_start(tmp_path: Path) -> None:
    (tmp_path / catalog.ROLES_FILE).write_text(json.dumps(
        {f"old{i}": i for i in range(1, catalog.MAX_ROLE + 1)}))
    with pytest.raises(ModelConfigError, match="no role is left for \\['new'\\]"):
        settle_roles(str(tmp_path), [spec("old1"), spec("new")])


def test_on_demand_and_keep_alive_in_the_models_file(tmp_path: Path) -> None:
    from aotx.device.models import load_specs

    model = touch(tmp_path / "models" / "m.gguf")
    for keep, want in (("", 300.0), ("keep_alive = 0\n", 0.0), ("keep_alive = -1\n", -1.0),
                       ("keep_alive = 12.5\n", 12.5)):
        (tmp_path / "models.toml").write_text(
            f'[[model]]\nalias = "m"\npath = "{model}"\non_demand = true\n{keep}')
        spec = load_specs(str(tmp_path))[-1]
        assert (spec.on_demand, spec.keep_alive) == (True, want)
    for bad in ("keep_alive = -2", 'keep_alive = "5m"', "keep_alive = true",
                'on_demand = "yes"'):
        (tmp_path / "models.toml").write_text(
            f'[[model]]\nalias = "m"\npath = "{model}"\non_demand = true\n{bad}\n')
        with pytest.raises(ModelConfigError):
            load_specs(str(tmp_path))


def test_the_folder_adds_what_the_models_file_does_not_declare(tmp_path: Path) -> None:
    declared = touch(tmp_path / "declared.gguf")
    touch(tmp_path / "found.gguf")
    touch(tmp_path / "same-alias.gguf")
    specs = catalog.folder_specs(str(tmp_path), [
        ModelSpec(alias="mine", path=declared, role=1),
        ModelSpec(alias="same-alias", path="/elsewhere.gguf", role=2)])
    assert [(s.alias, s.on_demand, s.slots, s.context) for s in specs] == [
        ("found", True, 8, 4096)]


def test_two_models_of_one_alias_keep_the_first(tmp_path: Path) -> None:
    """``foo.gguf`` and a folder ``foo/`` (or two names that read as one alias) would
    share a role: the file is served, the folder is left out and the log says why."""
    foo = touch(tmp_path / "foo.gguf")
    touch(tmp_path / "foo" / "model.gguf")
    touch(tmp_path / "my model.gguf")
    touch(tmp_path / "my(model.gguf")
    found, skipped = scan(str(tmp_path))
    assert [f.alias for f in found] == ["foo", "my-model"]
    assert found[0].path == foo
    assert sorted(str(Path(s.path).relative_to(tmp_path)) for s in skipped) == [
        "foo/model.gguf", "my(model.gguf"]
    assert all("has the alias" in s.reason for s in skipped)
