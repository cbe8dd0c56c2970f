"""The base of every request body the gateway reads, and the ``keep_alive`` field
the request routes share."""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict

from .. import wire


class Body(BaseModel):
    """A request body: fields it does not know are refused (OpenAI answers 400 to an
    argument it does not implement, and so does aotx, naming it), and every value is
    checked as the type it is given as.  Strict, because pydantic's lax mode would read
    ``"max_tokens": true`` as 1, ``"3"`` as 3 and ``"stream": "yes"`` as true, where
    OpenAI answers 400; an integer still passes for a number (``"temperature": 1``).
    A model that takes more than it reads (an SDK's whole output object sent back)
    says ``extra="ignore"`` itself; the rest of the config is inherited.  A number is
    finite: Python's JSON reader takes ``NaN`` and ``Infinity``, and a NaN fails every
    bound with a message that names the bound ("less than or equal to 2")."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


#: A duration as Ollama's ``keep_alive`` takes it: "1h30m", "10m", "45s", "500ms".
_DURATION = re.compile(r"(?:(\d+(?:\.\d+)?)(ms|s|m|h))+")
_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h)")
_UNIT = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
#: The longest keep-alive a request may name (a year: "for ever" is a negative one).
MAX_KEEP_ALIVE = 365 * 86400.0


def _keep_alive(v: Any) -> int | None:
    """Ollama's ``keep_alive`` as milliseconds: seconds (a number) or a duration string,
    0 to unload the model once idle, negative for ever (-1 here)."""
    if v is None:
        return None
    if isinstance(v, str):
        text = v.strip()
        negative = text.startswith("-")
        text = text.lstrip("-")
        if _DURATION.fullmatch(text):
            seconds = sum(float(n) * _UNIT[u] for n, u in _PART.findall(text))
        elif re.fullmatch(r"\d+(?:\.\d+)?", text):
            seconds = float(text)
        else:
            raise ValueError("keep_alive is seconds or a duration such as \"10m\", \"1h\"")
        seconds = -seconds if negative else seconds
    elif isinstance(v, int | float) and not isinstance(v, bool):
        seconds = float(v)
    else:
        raise ValueError("keep_alive is seconds or a duration such as \"10m\", \"1h\"")
    if seconds < 0:
        return -1
    if seconds > MAX_KEEP_ALIVE:
        raise ValueError("keep_alive is at most a year (a negative one: for ever)")
    return round(seconds * 1000)


#: ``keep_alive`` on a request (chat, completions, responses, native): how long the model,
#: when it is loaded on first use, stays loaded idle after it; milliseconds, -1 for ever.
KeepAlive = Annotated[int | None, BeforeValidator(_keep_alive)]


def keep_alive_header(ms: int | None) -> tuple[int, dict[str, int]]:
    """The SUBMIT flag and header field that carry a request's ``keep_alive`` (none when
    it has none)."""
    if ms is None:
        return 0, {}
    return wire.SUBMIT_FLAG_KEEP_ALIVE, {
        "keep_alive_ms": wire.KEEP_ALIVE_FOREVER if ms < 0 else ms}
