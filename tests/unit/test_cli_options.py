"""The command line refuses values the processes could not use (a QA pass found each
accepted: ``--retention-seconds -1`` left the device failing every INFO, ``--port 99999``
bound another port than it printed, ``--principal-share 1.5`` was clamped in silence)."""

from __future__ import annotations

import pytest

from aotx.cli import build_parser


@pytest.mark.parametrize("command", ["serve", "device"])
@pytest.mark.parametrize("option, bad, good", [
    ("--retention-seconds", ["-1", "0", str(1 << 32), "x"], "1"),
    ("--retention-requests", ["0"], "4294967295"),
    ("--max-active", ["0"], "1"),
    ("--window-bytes", ["0", "65409"], "65408"),
    ("--media-pool-bytes", ["-5", "0"], "1"),
    ("--principal-share", ["0", "1.5", "-0.1", "nan", "half"], "1"),
    ("--mailboxes", ["0", "65535"], "65534"),
    ("--device-id", ["-1", "65536"], "65535"),
])
def test_out_of_range_values_are_refused(command: str, option: str, bad: list[str], good: str,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    for value in bad:
        with pytest.raises(SystemExit) as exit_:
            parser.parse_args([command, option, value])
        assert exit_.value.code == 2 and f"argument {option}:" in capsys.readouterr().err
    args = parser.parse_args([command, option, good])
    assert str(getattr(args, option[2:].replace("-", "_"))) in (good, str(float(good)))


def test_ports() -> None:
    parser = build_parser()
    for command in ("serve", "gateway"):
        for port in ("0", "65536", "99999"):
            with pytest.raises(SystemExit):
                parser.parse_args([command, "--port", port])
        assert parser.parse_args([command, "--port", "65535"]).port == 65535


def test_switches_and_log_levels_are_read_strictly(capsys: pytest.CaptureFixture[str]) -> None:
    """``AOTX_LOG_PROMPTS=yes`` read as off, ``--log-level LOUD`` as INFO: each now says so."""
    from aotx.config import ConfigError, Settings

    assert Settings.from_env({"AOTX_LOG_PROMPTS": "1", "AOTX_LOG_LEVEL": "debug"}) == \
        Settings(log_prompts=True, log_level="DEBUG")
    assert Settings.from_env({"AOTX_SHORT_SLICE": "0"}).short_slice is False
    for env in ({"AOTX_LOG_PROMPTS": "yes"}, {"AOTX_SHORT_SLICE": "off"},
                {"AOTX_LOG_LEVEL": "LOUD"}):
        with pytest.raises(ConfigError, match=next(iter(env))):
            Settings.from_env(env)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--log-level", "LOUD", "serve"])
    assert "give one of DEBUG" in capsys.readouterr().err
    assert build_parser().parse_args(["--log-level", "warning", "serve"]).log_level == "WARNING"
