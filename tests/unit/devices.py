"""A device for unit tests: its real tables, mailbox region and doorbells, with a scripted
model (``ScriptedEngine`` and a fake projector) in place of llama.cpp."""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator, Sequence

from aotx import wire
from aotx.device.loading import LoadedModel
from aotx.device.runtime import Device
from aotx.device.template import ChatTemplate
from aotx.engine.llama.scheduler import Scheduler
from aotx.engine.multimodal import MediaSegment
from aotx.engine.spec import ModelSpec
from aotx.paths import RuntimePaths

from ..helpers import short_tmpdir
from .test_scheduler import ScriptedEngine


class FakeEncoder:
    """Each media part takes two placeholder positions."""

    vision, audio = True, False

    def check(self, media: Sequence[tuple[str, bytes]]) -> None:
        pass

    def tokenize_media(self, kind: str, data: bytes,
                       n: int) -> tuple[list[int], list[MediaSegment]]:
        return [-(n + 1)] * 2, [MediaSegment(start=0, n_tokens=2, kind=kind)]

    def encode(self, seg: MediaSegment) -> str:
        return "embeddings"

    def close(self) -> None:
        pass


class TokenizingEngine(ScriptedEngine):
    """A token a byte; no special tokens."""

    add_bos = False
    n_vocab = 150  # the tokens it makes are 100..149
    special_ids: frozenset[int] = frozenset()
    model_bytes = 0  # (the telemetry's allocation counts requests and media alone)
    closes_slowly = False
    applies_grammar = False

    def kv_bytes(self) -> int:
        return 0

    def tokenize_pieces(self, pieces: Sequence[tuple[str, bool]], add_special: bool = True,
                        start: bool = True, end: bool = True) -> list[int]:
        return [100 + (b % 50) for text, _ in pieces for b in text.encode()][:64]

    def specials(self, text: str) -> list[int]:
        return []

    def token_bytes(self, token: int) -> bytes:
        return f"<{token}>".encode()

    def close(self) -> None:
        pass


@contextlib.contextmanager
def scripted_device() -> Iterator[tuple[Device, Scheduler]]:
    """A device (real tables, mailbox region and doorbells, no worker threads) with one
    scripted image-capable model (role 1) and principal 7 holding every action."""
    state = short_tmpdir()
    dev = Device(RuntimePaths(state), [], mailboxes=4)
    engine = TokenizingEngine()
    encoder = FakeEncoder()
    sched = Scheduler(engine, 2, 64, dev.state.lock, make_sampler=lambda r: r,
                      free_sampler=lambda s: None, on_terminal=dev.on_terminal,
                      encode=encoder.encode)
    tmpl = ChatTemplate("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    spec = ModelSpec(alias="vision", path="/dev/null", role=1, modalities=("text", "image"))
    dev.state.models[1] = LoadedModel(spec, engine, tmpl, sched, bytes(32), 0,  # type: ignore[arg-type]
                                modalities=wire.MOD_TEXT | wire.MOD_IMAGE,
                                encoder=encoder)  # type: ignore[arg-type]
    dev.state.grants[7] = wire.Grant(principal=7, actions=int(wire.Action.all()), model_mask=2,
                               revision=1)
    dev.state.grant_revision = 1
    try:
        yield dev, sched
    finally:
        dev.region.close()
        shutil.rmtree(state, ignore_errors=True)


def call(dev: Device, h: wire.Header, payload: bytes = b"") -> tuple[wire.Header, bytes]:
    """As principal 7, and in the device's epoch where the operation names one."""
    used = wire.REQUEST_FIELDS[wire.Op(h.op)]
    if "principal" in used:
        h = h._replace(principal=7)
    if "epoch" in used:
        h = h._replace(epoch=h.epoch or dev.epoch)
    with dev.state.lock:
        out = dev.respond(0, h, payload)
    assert out is not None
    return out
