"""Configuration from the environment, read once at start-up and passed down.

Every environment variable aotx reads is here, with its default.  The command line
(:mod:`aotx.cli`) reads them with :meth:`Settings.from_env` before anything else runs,
and hands the values to the component it starts; no module reads ``os.environ`` at
import time or in a handler.  Flags on the command line win over the environment.

| Variable | Default | Meaning |
|---|---|---|
| ``AOTX_STATE_DIR`` | ``./state`` | the state folder (``--state-dir`` wins) |
| ``AOTX_LOG_LEVEL`` | ``INFO`` | log level (``--log-level`` wins) |
| ``AOTX_HEADER_TIMEOUT`` | ``10`` | seconds for a request's line and headers (then 408) |
| ``AOTX_BODY_TIMEOUT`` | ``30`` | seconds between two chunks of a request body (then 408) |
| ``AOTX_SHORT_SLICE`` | ``1`` | ``0``: path threads keep the kernel's default time slice |
| ``AOTX_LOG_PROMPTS`` | ``0`` | ``1``: the device logs each admitted prompt's text |
| ``AOTX_CALL_DEADLINE`` | ``5`` | seconds the gateway waits for a device operation (then 503) |
| ``AOTX_MEDIA_DEADLINE`` | ``30`` | the same for a submission with media parts |
| ``AOTX_WAIT_MARGIN`` | ``5`` | seconds past a WAIT's own wait time (then 503) |
| ``AOTX_HANG_SECONDS`` | ``10`` | seconds a live device may stay silent before it is restarted |
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

#: Largest JSON body any route takes (media uploads stream, and are bounded by the device).
MAX_BODY = 1 << 20

# What the device takes of a medium or a constraint: its policy, not the wire format.
# The gateway words them in its refusals and the capabilities document, so they are here,
# where every process reads them.
MAX_IMAGE_PIXELS = 16 * 1024 * 1024  # decoded at 3 bytes a pixel: 48 MiB at most
AUDIO_RATES = (8000, 384000)  # sample rates (Hz); a header may claim 1 Hz and grow 16000-fold
MAX_AUDIO_SECONDS = 600  # decoded as float32 at the projector's rate
MAX_CONSTRAINT_BYTES = 64 * 1024  # a constraint's canonical text (the engine's limit)
MAX_SCHEMA_DEPTH = 32  # nested schema objects


class ConfigError(Exception):
    pass


@dataclass(frozen=True)
class Settings:
    state_dir: str = "./state"
    log_level: str = "INFO"
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    short_slice: bool = True
    log_prompts: bool = False
    max_body: int = MAX_BODY
    # Deadlines of the gateway's device calls (see aotx/gateway/deadlines.py): a device
    # that stopped answering costs a caller seconds, not minutes.
    call_deadline: float = 5.0
    media_deadline: float = 30.0  # the media worker prepares these one at a time
    wait_margin: float = 5.0
    # The supervisor's health check (aotx/watchdog.py).
    hang_seconds: float = 10.0

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if env is None else env
        d = cls()
        return cls(
            state_dir=env.get("AOTX_STATE_DIR", d.state_dir),
            log_level=log_level(env.get("AOTX_LOG_LEVEL", d.log_level), "AOTX_LOG_LEVEL"),
            header_timeout=_seconds(env, "AOTX_HEADER_TIMEOUT", d.header_timeout),
            body_timeout=_seconds(env, "AOTX_BODY_TIMEOUT", d.body_timeout),
            short_slice=_switch(env, "AOTX_SHORT_SLICE", d.short_slice),
            log_prompts=_switch(env, "AOTX_LOG_PROMPTS", d.log_prompts),
            call_deadline=_seconds(env, "AOTX_CALL_DEADLINE", d.call_deadline),
            media_deadline=_seconds(env, "AOTX_MEDIA_DEADLINE", d.media_deadline),
            wait_margin=_seconds(env, "AOTX_WAIT_MARGIN", d.wait_margin),
            hang_seconds=_seconds(env, "AOTX_HANG_SECONDS", d.hang_seconds),
        )


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def log_level(raw: str, name: str) -> str:
    """A Python log level's name (any case): another word would log at INFO unseen."""
    if raw.upper() not in LOG_LEVELS:
        raise ConfigError(f"{name}={raw!r}: give one of {', '.join(LOG_LEVELS)}")
    return raw.upper()


def _switch(env: Mapping[str, str], name: str, default: bool) -> bool:
    """``1`` or ``0``: ``yes`` or ``true`` would be read as one or the other unseen."""
    raw = env.get(name)
    if raw is None:
        return default
    if raw not in ("0", "1"):
        raise ConfigError(f"{name}={raw!r}: give 1 (on) or 0 (off)")
    return raw == "1"


def _seconds(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number of seconds") from None
    if not 0 < value <= 3600:
        raise ConfigError(f"{name}={raw!r}: give 0 < seconds <= 3600")
    return value
