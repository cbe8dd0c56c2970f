"""The gateway's deadline table: every operation has one, each a few seconds, a media
submission's longer than a text one's, a WAIT's past its own wait time."""

from __future__ import annotations

import pytest

from aotx import wire
from aotx.config import ConfigError, Settings
from aotx.gateway.deadlines import DEADLINES, Budget, Deadlines


def test_every_operation_has_a_deadline() -> None:
    assert set(DEADLINES) == set(wire.Op)
    d = Deadlines()
    for op in wire.Op:
        seconds = d.of(wire.Header(op=op))
        # a silent device costs a caller seconds, not minutes; an EMBED is engine work,
        # as a media submission is the media worker's
        assert 0 < seconds <= (d.media if op is wire.Op.EMBED else 10), op


def test_media_submissions_and_waits_get_their_own_time() -> None:
    d = Deadlines()
    submit = wire.Header.request(wire.Op.SUBMIT)
    assert d.of(submit, media=True) > d.of(submit) == d.control
    assert d.of(wire.Header.request(wire.Op.WAIT, wait_ms=10_000)) == 10 + d.wait_margin
    assert d.of(wire.Header.request(wire.Op.WAIT, wait_ms=250)) == 0.25 + d.wait_margin
    assert DEADLINES[wire.Op.SUBMIT] is Budget.ADMIT and DEADLINES[wire.Op.WAIT] is Budget.WAIT
    assert d.of(wire.Header(op=wire.Op.READ), media=True) == d.control  # only SUBMIT has media


def test_the_deadlines_come_from_the_environment() -> None:
    s = Settings.from_env({"AOTX_CALL_DEADLINE": "2", "AOTX_MEDIA_DEADLINE": "45",
                           "AOTX_WAIT_MARGIN": "1.5", "AOTX_HANG_SECONDS": "20"})
    d = Deadlines.from_settings(s)
    assert (d.control, d.media, d.wait_margin, s.hang_seconds) == (2, 45, 1.5, 20)
    assert Deadlines.from_settings(Settings()) == Deadlines()
    with pytest.raises(ConfigError):
        Settings.from_env({"AOTX_CALL_DEADLINE": "0"})
