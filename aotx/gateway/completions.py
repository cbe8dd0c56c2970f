"""``POST /v1/completions``, OpenAI's legacy text completion: the request body, its raw
submissions, and the legacy ``logprobs`` object.

A prompt is not wrapped in the chat template: each one becomes a raw submission
(``SUBMIT_FLAG_RAW``, docs/protocol.md section 5.2) whose one part is the prompt text,
which the device tokenizes as text (special-token texts stay text), or its token ids.
Unknown fields answer 400, as OpenAI answers an unrecognized argument: every field the
body takes does something, or is refused with 400 naming it (``suffix``, ``best_of``
other than ``n``, ``echo`` where it cannot be honoured).

Legacy logprobs (``logprobs``: 0-5) come from the device's annotation stream, one line
per token (engine/logprobs.py).  A token's string is the characters whose **last** byte
is one of its bytes: a character split across tokens belongs to the token that completes
it, so the strings joined are the text exactly, and ``text_offset`` counts characters.
"""

from __future__ import annotations

import struct
from typing import Annotated, Any, Literal

from pydantic import Field, StrictInt, ValidationInfo, field_validator

from .. import seeds, wire
from .body import Body, KeepAlive, keep_alive_header
from .errors import PAST_ONE_PACKET, ApiError, Call
from .requests import MAX_CHOICES, StreamOptions, check_bias, check_stops
from .service import Principal

MAX_LOGPROBS = 5  # OpenAI's limit for the legacy route
MAX_PROMPTS = 64  # prompts in one body, and device requests (prompts x n) in all
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for this route
Prompt = str | list[int]  # one prompt: text, or token ids
# The prompt's forms as the OpenAPI document states them (the validator words the errors).
_Text = Annotated[str, Field(min_length=1)]
_Ids = Annotated[list[Annotated[StrictInt, Field(ge=0, lt=1 << 31)]], Field(min_length=1)]
_Prompts = (_Text | Annotated[list[_Text], Field(min_length=1, max_length=MAX_PROMPTS)] | _Ids
            | Annotated[list[_Ids], Field(min_length=1, max_length=MAX_PROMPTS)])


def _utf8(value: str, what: str) -> None:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate from a JSON \\ud800 escape
        raise ValueError(f"{what} is not valid Unicode (lone surrogate)") from None


class CompletionRequest(Body):
    """The body of ``POST /v1/completions``."""

    model: str = Field(min_length=1, max_length=256)
    prompt: _Prompts = Field(
        description="a string, an array of strings, an array of token ids, or an array of "
                    "token-id arrays; not wrapped in the chat template")
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int | None = Field(default=None, ge=1, le=MAX_CHOICES)
    best_of: int | None = Field(default=None, ge=1)
    seed: int | None = Field(default=None, ge=-(2**63), le=2**64 - 1)
    stop: str | list[str] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    echo: bool | None = None
    logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    suffix: Literal[""] | None = None
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = Field(default=None, max_length=wire.MAX_BIAS)
    user: str | None = Field(default=None, max_length=256)
    keep_alive: KeepAlive = None  # Ollama's: the model's idle time after this request
    # Extensions (llama.cpp's server, vLLM), as on chat completions.
    top_k: int | None = Field(default=None, ge=-1, le=1 << 20)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=10.0)
    repeat_last_n: int | None = Field(default=None, ge=-1, le=1 << 20)

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, v: Any) -> Any:
        # Before pydantic's union check, whose errors name the member it tried
        # ("prompt.list[int].0"): every bad prompt is located "prompt".
        items = v if isinstance(v, list) else [v]
        if isinstance(v, list) and v and all(_is_id(t) for t in v):
            items = [v]  # one token array
        if not items:
            raise ValueError("prompt must not be empty")
        if len(items) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts")
        texts = all(isinstance(p, str) for p in items)
        for p in items:
            if texts:
                _utf8(p, "prompt")
            elif not isinstance(p, list) or not all(_is_id(t) for t in p):
                raise ValueError("prompt must be a string, an array of strings, an array of "
                                 "token ids (integers from 0 below 2^31) or an array of such "
                                 "arrays (not a mix of strings and arrays)")
            if not p:
                raise ValueError("a prompt must not be empty (\"\" or [])")
        return v

    @field_validator("stop", mode="before")
    @classmethod
    def _stops(cls, v: Any) -> Any:
        if v is None:
            return v
        check_stops(v)
        for s in [v] if isinstance(v, str) else v:
            _utf8(s, "a stop sequence")  # a lone surrogate: 400 here, not at submission
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        return check_bias(v)

    @field_validator("suffix", mode="before")
    @classmethod
    def _suffix(cls, v: Any) -> Any:
        if v:  # (an empty suffix appends nothing: that one is honoured)
            raise ValueError("suffix (insertion) is not supported: the model has no "
                             "fill-in-the-middle mode here")
        return v

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, v: int | None, info: ValidationInfo) -> int | None:
        n = info.data.get("n") or 1
        if v is not None and v != n:
            raise ValueError(f"best_of {v} is not supported: only best_of equal to n ({n}) "
                             "is, which returns every choice generated")
        return v

    def check(self) -> None:
        """The checks across fields, each naming the field at fault (400)."""
        if self.echo and self.logprobs is not None:
            raise ApiError(400, "echo with logprobs is not supported: the device computes "
                                "no logprobs for the prompt's tokens", param="echo")
        if self.echo and not all(isinstance(p, str) for p in self.prompts):
            raise ApiError(400, "echo with a token-array prompt is not supported: the gateway "
                                "holds no tokenizer to give the prompt's text", param="echo")
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "stream_options is only allowed with stream: true",
                           param="stream_options")
        if len(self.prompts) * (self.n or 1) > MAX_PROMPTS:
            raise ApiError(400, f"prompts x n may be at most {MAX_PROMPTS}", param="n")

    @property
    def prompts(self) -> list[Prompt]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(t, int) for t in p):
            return [p]  # type: ignore[list-item]  # (one token array)
        return list(p)  # type: ignore[arg-type]

    @property
    def sampling(self) -> wire.Sampling:
        return wire.Sampling(top_k=max(0, self.top_k or 0), min_p=self.min_p or 0.0,
                             presence=self.presence_penalty or 0.0,
                             frequency=self.frequency_penalty or 0.0,
                             repetition=self.repetition_penalty or 1.0,
                             last_n=max(0, self.repeat_last_n or 0),
                             logprobs=0 if self.logprobs is None else self.logprobs + 1,
                             bias=tuple((int(t), b) for t, b in (self.logit_bias or {}).items()))

    @property
    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


def _is_id(t: Any) -> bool:
    return type(t) is int and 0 <= t < 1 << 31


def submission(body: CompletionRequest, prompt: Prompt, choice: int, m: wire.ModelInfo,
               principal: Principal) -> tuple[wire.Header, bytes, Call]:
    """The raw SUBMIT of one choice of one prompt (choice i samples with seed + i)."""
    if isinstance(prompt, str):
        part = wire.Part(wire.PartKind.TEXT, prompt.encode("utf-8"))
    else:
        part = wire.Part(wire.PartKind.TOKENS, struct.pack(f"<{len(prompt)}I", *prompt))
    try:
        payload = wire.encode_submission(wire.Submission(
            (wire.Message(wire.Role.USER, (part,)),), body.stops, body.sampling))
    except wire.WireError as exc:  # over one packet
        raise ApiError(exc.status, f"the prompt {PAST_ONE_PACKET}", param="prompt") from None
    limit = DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
    if limit >= 1 << 32:
        raise ApiError(400, "max_tokens is too large", param="max_tokens")
    keep, keep_fields = keep_alive_header(body.keep_alive)
    flags, seed = wire.SUBMIT_FLAG_RAW | keep, 0
    if body.seed is not None:
        flags |= wire.SUBMIT_FLAG_SEED
        seed = seeds.of_choice(body.seed, choice)
    h = wire.Header.request(
        wire.Op.SUBMIT, principal=principal.id, role=m.role, max_tokens=limit,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p, submit_flags=flags, seed=seed,
        **keep_fields)
    return h, payload, Call(m.alias, limit, len(payload))


class Cutter:
    """One choice's output as the texts of its chunks and, with ``logprobs`` (k), their
    legacy logprobs: a piece ends where a token ends, its text the characters its tokens
    complete (no I/O: the caller reads the bytes and the annotation lines)."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.data = bytearray()  # the output so far
        self.sent = 0  # bytes given out as text (a character boundary)
        self.chars = 0  # characters in them
        self.pending: list[dict[str, Any]] = []  # annotation lines not given out yet

    def add(self, data: bytes, notes: list[dict[str, Any]], final: bool = False
            ) -> tuple[str, dict[str, list[Any]]] | None:
        """The next piece: the tokens wholly in the output so far (with ``final``, every
        byte left too); None when no token has ended since the last."""
        self.data += data
        self.pending += notes
        end, take = len(self.data), 0
        while (take < len(self.pending) and int(self.pending[take]["offset"])
               + len(self.pending[take]["bytes"]) <= end):
            take += 1
        if not take and not (final and self.sent < end):
            return None
        lp: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                    "text_offset": []}
        cut = self.sent
        for n in self.pending[:take]:
            start = self._floor(int(n["offset"]))
            stop = self._floor(int(n["offset"]) + len(n["bytes"]))
            lp["tokens"].append(self._text(start, stop))
            lp["token_logprobs"].append(n["logprob"])
            lp["top_logprobs"].append(self._top(n))
            lp["text_offset"].append(self.chars + len(self._text(self.sent, start)))
            cut = max(cut, stop)
        del self.pending[:take]
        if final:
            cut = end
        text = self._text(self.sent, cut)
        self.sent, self.chars = cut, self.chars + len(text)
        return text, lp

    def _floor(self, p: int) -> int:
        """The character boundary at or before ``p`` (the output so far ends on one: the
        device holds an incomplete character back)."""
        back = 0
        while p < len(self.data) and back < 3 and self.data[p] & 0xC0 == 0x80:
            p, back = p - 1, back + 1
        return p

    def _text(self, start: int, stop: int) -> str:
        return bytes(self.data[start:stop]).decode("utf-8", errors="replace")

    def _top(self, n: dict[str, Any]) -> dict[str, float]:
        """The k likeliest tokens, each by its own bytes decoded (U+FFFD for a partial
        character), and the sampled token: up to k + 1 entries, as OpenAI gives them."""
        top: dict[str, float] = {}
        for _, logprob, raw in n["top"][:self.k]:
            top.setdefault(bytes(raw).decode("utf-8", errors="replace"), logprob)
        top.setdefault(bytes(n["bytes"]).decode("utf-8", errors="replace"), n["logprob"])
        return top
