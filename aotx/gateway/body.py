"""The base of every request body the gateway reads."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


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
