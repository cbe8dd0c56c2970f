"""Operation 22 (MODELS, device/residency.py) on a scripted device: the read lists every
model with its residency, and a control is an admin's, checked before it is carried out."""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Iterator

import orjson
import pytest

from aotx import wire
from aotx.device.ondemand import FAILED, LOADED, UNLOADED, OnDemand
from aotx.device.runtime import Device
from aotx.engine.spec import ModelSpec

from .devices import call, scripted_device


@pytest.fixture
def dev() -> Iterator[Device]:
    with scripted_device() as (d, _sched):
        path = os.path.join(d.paths.state_dir, "lazy.gguf")
        with open(path, "wb") as f:
            f.write(b"GGUF" + bytes(60))  # not a model: its load fails
        spec = ModelSpec(alias="lazy", path=path, role=2, on_demand=True, keep_alive=30)
        info = wire.ModelInfo(2, "lazy", bytes(32), wire.MOD_TEXT, 0, 4096)
        d.state.on_demand[2] = OnDemand(spec, info, 5 << 20)
        d.state.unassigned = [("extra", path)]
        d.state.budget = 1 << 30
        d.state.grants[8] = wire.Grant(principal=8, actions=int(wire.Action.SUBMIT),
                                       model_mask=0b110, revision=1)
        yield d


def models(d: Device, payload: bytes = b"", principal: int = 7,
           epoch: int = 0) -> tuple[wire.Header, bytes]:
    h = wire.Header(op=wire.Op.MODELS, principal=principal,
                    epoch=epoch or (d.epoch if payload else 0))
    with d.state.lock:
        out = d.respond(0, h, payload)
    assert out is not None
    return out


def control(alias: str, action: str, **more: object) -> bytes:
    return orjson.dumps({"alias": alias, "action": action, **more})


def test_the_read_lists_every_model_with_its_residency(dev: Device) -> None:
    h, body = call(dev, wire.Header(op=wire.Op.MODELS))
    assert h.status == 200
    doc = orjson.loads(body)
    rows = {m["alias"]: m for m in doc["models"]}
    assert rows["vision"]["state"] == "loaded" and rows["vision"]["on_demand"] is False
    assert rows["vision"]["keep_alive"] == -1  # loaded at start: pinned
    lazy = rows["lazy"]
    assert (lazy["state"], lazy["on_demand"], lazy["file_bytes"]) == ("unloaded", True, 64)
    assert lazy["memory_bytes"] == 5 << 20 and lazy["sha256"] is None
    assert lazy["keep_alive"] == 30 and lazy["expires_in"] is None
    assert doc["unassigned"][0]["alias"] == "extra" and doc["budget_bytes"] == 1 << 30
    assert doc["used_bytes"] == rows["vision"]["memory_bytes"]  # not the unloaded one's


def test_a_control_is_an_admins_in_the_devices_epoch(dev: Device) -> None:
    refused, _ = models(dev, control("lazy", "load"), principal=8)
    assert (refused.status, refused.reason) == (403, wire.Reason.ACTION)
    stale, _ = models(dev, control("lazy", "load"), epoch=dev.epoch + 1)
    assert (stale.status, stale.reason) == (400, wire.Reason.EPOCH_MISMATCH)
    for bad in (b"{", b"[]", control("lazy", "evict"), control("lazy", "load", cancel=1),
                control("lazy", "load", extra=True), orjson.dumps({"action": "load"})):
        h, _ = models(dev, bad)
        assert (h.status, h.reason) == (400, wire.Reason.MALFORMED), bad
    assert models(dev, control("nothing", "load"))[0].status == 404
    fixed, _ = models(dev, control("vision", "unload"))
    assert (fixed.status, fixed.reason) == (409, wire.Reason.MODEL_FIXED)
    assert not dev.state.on_demand[2].asked  # nothing refused was carried out


def test_an_admins_load_starts_one_and_retries_a_failed_model(dev: Device) -> None:
    h, body = models(dev, control("lazy", "load"))
    assert h.status == 200 and orjson.loads(body)["state"] == UNLOADED
    od = dev.state.on_demand[2]
    assert od.asked and od.asked_by == 7
    with dev.state.lock:
        dev._on_demand()  # the runtime's pass: the load starts (and fails: not a model)
    assert od.state == "loading"
    for t in dev.loader.threads:
        t.join(60)
    with dev.state.lock:
        dev._on_demand()
    assert od.state == FAILED and od.reason and not od.asked
    assert od.loads == 1
    # a failed model stays failed until its file changes, or an admin asks again
    h, body = models(dev, control("lazy", "load"))
    assert orjson.loads(body)["state"] == UNLOADED and od.asked


def test_an_unload_asked_of_an_unloaded_model_asks_nothing(dev: Device) -> None:
    models(dev, control("lazy", "load"))
    h, body = models(dev, control("lazy", "unload", cancel=True))
    entry = orjson.loads(body)
    assert h.status == 200 and entry["state"] == UNLOADED
    assert entry["unload_asked"] is False and not dev.state.on_demand[2].asked


def test_the_hasher_fills_in_each_files_digest(dev: Device) -> None:
    dev.hasher = type(dev.hasher)(list(dev.state.on_demand.values()),
                                  os.path.join(dev.paths.state_dir, "hashes.json"))
    dev.hasher.start()
    dev.hasher.thread.join(30)
    h, body = call(dev, wire.Header(op=wire.Op.MODELS))
    lazy = next(m for m in orjson.loads(body)["models"] if m["alias"] == "lazy")
    with open(dev.state.on_demand[2].spec.path, "rb") as f:
        assert lazy["sha256"] == hashlib.sha256(f.read()).hexdigest()


def test_a_model_the_media_worker_uses_is_busy(dev: Device) -> None:
    """A submission with media or a constraint is tokenized by the media worker without
    the lock: until it is admitted its model must not be unloaded, even idle past a
    keep-alive of 0."""
    od = dev.state.on_demand.pop(2)
    spec = dataclasses.replace(od.spec, role=1, alias="vision", keep_alive=0)
    loaded = OnDemand(spec, od.info._replace(role=1), 5 << 20, state=LOADED)
    dev.state.on_demand[1] = loaded
    dev.state.preparing[1] = 1
    assert dev._resident(loaded).busy
    with dev.state.lock:
        dev._on_demand()
    assert loaded.state == LOADED and 1 in dev.state.models
    dev.state.preparing[1] = 0
    assert not dev._resident(loaded).busy


def test_an_unload_asked_defers_new_requests_and_a_load_while_unloading_is_kept(
        dev: Device) -> None:
    od = dev.state.on_demand[2]
    od.state, od.unload_asked = LOADED, True
    assert not dev.state.loaded(2)  # a SUBMIT now waits for the unload, then reloads it
    od.state = "unloading"
    h, body = models(dev, control("lazy", "load"))
    assert h.status == 200 and od.asked and not od.unload_asked


def test_a_load_of_a_failed_model_whose_file_is_gone_is_refused(dev: Device) -> None:
    od = dev.state.on_demand[2]
    od.state, od.reason = FAILED, "gone"
    os.remove(od.spec.path)
    h, _ = models(dev, control("lazy", "load"))
    assert (h.status, h.reason) == (503, wire.Reason.MODEL_LOAD)
    assert not od.asked
