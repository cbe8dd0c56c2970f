"""OpenAI's Responses API on device requests: the ``POST /v1/responses`` body, its mapping
onto the chat envelope (gateway/requests.py, gateway/tools.py), response ids and the
response object.

A response IS a device request: ``resp_<16 hex epoch><32 hex identity>`` names the same
request as ``req-<epoch>-<identity>``, so the native routes read it and a response's
state, output and usage come from the device alone.  What the device does not hold (the
input items, the instructions, the echo fields) the gateway keeps in its SQLite state
(gateway/response_store.py) when ``store`` is not false.

The body becomes a :class:`~aotx.gateway.requests.ChatRequest`: ``instructions`` a first
system message, input messages chat messages, ``function_call`` items an assistant
message's ``tool_calls`` and ``function_call_output`` items ``tool`` messages, function
tools chat tools, ``text.format`` chat's ``response_format``.  The checks of that envelope
(tools, schemas, media) are chat's, their messages reworded to name this body's fields.
"""

from __future__ import annotations

import hashlib
import time
from typing import Annotated, Any, Literal

from pydantic import (
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    field_validator,
    model_validator,
)

from .. import wire
from . import reasoning
from . import tools as T
from .body import Body, KeepAlive
from .dialect import Dialect
from .errors import ApiError, wording
from .requests import MAX_INLINE_CHARS, ChatRequest, InputAudio

_HEX = frozenset("0123456789abcdef")
_ID_LEN = 5 + 16 + 32


# -- ids --------------------------------------------------------------------------------------
def response_id(epoch: int, identity: bytes) -> str:
    """The response id of the device request ``req-<epoch>-<identity>`` (reversible)."""
    return f"resp_{epoch:016x}{identity.hex()}"


def parse_response_id(text: str, param: str | None = None) -> tuple[int, bytes]:
    """(epoch, identity) of a response id; 404 when malformed, as a native id."""
    if len(text) != _ID_LEN or not text.startswith("resp_") or not set(text[5:]) <= _HEX:
        raise ApiError(404, f"no response with id {text[:80]!r}", param=param)
    return int(text[5:21], 16), bytes.fromhex(text[21:])


def _item_id(prefix: str, identity: bytes, n: int) -> str:
    return f"{prefix}_" + hashlib.sha256(identity + n.to_bytes(4, "little")).hexdigest()[:32]


# -- the body ---------------------------------------------------------------------------------
class InputText(Body):
    type: Literal["input_text"]
    text: str


class OutputText(Body):
    """An assistant message's text, as a response's output item holds it (a client
    passes earlier output back as input)."""

    type: Literal["output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class InputImage(Body):
    """An image by ``data:`` URL (``image_url``) or, an aotx extension, by the digest of
    one of the caller's media sources (``digest``, as native parts name it)."""

    type: Literal["input_image"]
    image_url: str | None = Field(default=None, max_length=MAX_INLINE_CHARS)
    digest: str | None = Field(default=None, pattern=r"^sha256:[0-9a-f]{64}$")
    detail: Literal["auto", "low", "high"] | None = None

    @model_validator(mode="after")
    def _one(self) -> InputImage:
        if (self.image_url is None) == (self.digest is None):
            raise ValueError("an input_image needs image_url (a data: URL) or digest "
                             "(file_id is not supported: upload to /aotx/v1/media)")
        return self


class InputAudioPart(Body):
    type: Literal["input_audio"]
    input_audio: InputAudio


Part = Annotated[InputText | OutputText | InputImage | InputAudioPart, Field(discriminator="type")]


class MessageItem(Body):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[Part]
    id: str | None = Field(default=None, max_length=256)  # an earlier output item's
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallItem(Body):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=256)
    name: str = Field(max_length=64)
    arguments: str
    id: str | None = Field(default=None, max_length=256)
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(Body):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=256)
    output: str | list[InputText]
    id: str | None = Field(default=None, max_length=256)
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class ReasoningItem(Body):
    """An earlier output's reasoning, sent back (the Agents SDK does): kept with the
    conversation, not rendered (a thinking template drops earlier turns' thinking)."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["reasoning"]


class ReasoningConfig(Body):
    effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None  # (none is written)


def _item_tag(v: Any) -> str | None:
    kind = v.get("type", "message") if isinstance(v, dict) else getattr(v, "type", None)
    return kind if kind in ("message", "function_call", "function_call_output",
                            "reasoning") else None


Item = Annotated[Annotated[MessageItem, Tag("message")]
                 | Annotated[FunctionCallItem, Tag("function_call")]
                 | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
                 | Annotated[ReasoningItem, Tag("reasoning")],
                 Discriminator(_item_tag)]


class FunctionTool(Body):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(Body):
    type: Literal["function"]
    name: str


class TextFormat(Body):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(Body):
    format: TextFormat | None = None


class ResponseRequest(Body):
    """The fields aotx serves (docs/api.md, "POST /v1/responses"); any other answers 400
    naming it: a field that is not served is never silently dropped."""

    model: str = Field(min_length=1, max_length=256)
    input: str | list[Item]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stream: bool | None = None
    background: bool | None = None
    store: bool | None = None
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = Field(default=None, max_length=T.MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = Field(default=None, max_length=16)
    truncation: Literal["disabled"] | None = None  # "auto" would drop input: not served
    include: list[str] | None = Field(default=None, max_length=0)
    user: str | None = Field(default=None, max_length=256)  # logged, as chat's
    keep_alive: KeepAlive = None  # Ollama's: the model's idle time after this request
    safety_identifier: str | None = Field(default=None, max_length=256)
    reasoning: ReasoningConfig | None = None  # a thinking model's effort (its template's)

    @field_validator("input")
    @classmethod
    def _some_input(cls, v: str | list[Any]) -> str | list[Any]:
        if isinstance(v, list) and not v:
            raise ValueError("input must not be empty")
        return v

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        for k, value in (v or {}).items():
            if len(k) > 64 or len(value) > 512:
                raise ValueError("metadata keys are at most 64 characters, values 512")
        return v

    @model_validator(mode="after")
    def _check(self) -> ResponseRequest:
        if self.background and self.store is False:
            raise ValueError("background needs store: a background response is read later")
        return self

    @property
    def stored(self) -> bool:
        return self.store is not False

    def items(self) -> list[dict[str, Any]]:
        """This response's own input, as items (a string is one user message)."""
        if isinstance(self.input, str):
            return [{"type": "message", "role": "user",
                     "content": [{"type": "input_text", "text": self.input}]}]
        return [i.model_dump(exclude_none=True, by_alias=True) for i in self.input]

    def echo(self) -> dict[str, Any]:
        """The fields a response object repeats (kept with a stored response)."""
        fmt = (self.text.format if self.text and self.text.format else None)
        return {"instructions": self.instructions, "metadata": self.metadata or {},
                "max_output_tokens": self.max_output_tokens,
                # what sampling used: 1.0 when not given (OpenAI shows it so too)
                "temperature": 1.0 if self.temperature is None else self.temperature,
                "top_p": 1.0 if self.top_p is None else self.top_p,
                "tools": [t.model_dump(exclude_none=True) for t in self.tools or []],
                "tool_choice": (self.tool_choice.model_dump()
                                if isinstance(self.tool_choice, NamedFunction)
                                else self.tool_choice or "auto"),
                "parallel_tool_calls": self.parallel_tool_calls is not False,
                "text": {"format": fmt.model_dump(exclude_none=True, by_alias=True)
                         if fmt else {"type": "text"}},
                "previous_response_id": self.previous_response_id,
                "background": bool(self.background), "store": self.stored,
                "truncation": "disabled"}

    def chat(self, context: list[dict[str, Any]]) -> ChatRequest:
        """The chat envelope of ``context`` (earlier turns, as items) and this input; 400
        naming this body's field when chat's checks refuse it."""
        items = [*context, *self.items()]
        messages = ([{"role": "system", "content": self.instructions}]
                    if self.instructions is not None else []) + messages_of(items)
        body: dict[str, Any] = {"model": self.model, "messages": messages,
                                "max_tokens": self.max_output_tokens,
                                "temperature": self.temperature, "top_p": self.top_p,
                                "parallel_tool_calls": self.parallel_tool_calls,
                                "reasoning_effort": self.reasoning.effort if self.reasoning
                                else None}
        if self.tools is not None:
            body["tools"] = [{"type": "function", "function": t.model_dump(
                exclude={"type"}, exclude_none=True)} for t in self.tools]
        if isinstance(self.tool_choice, NamedFunction):
            body["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice
        fmt = self.text.format if self.text else None
        if fmt is not None and fmt.type == "json_schema":
            body["response_format"] = {"type": "json_schema", "json_schema": fmt.model_dump(
                exclude={"type"}, exclude_none=True, by_alias=True)}
        elif fmt is not None:
            body["response_format"] = {"type": fmt.type}
        chat = RESPONSES.chat(body)
        chat.keep_alive = self.keep_alive  # (milliseconds already)
        return chat


#: chat's field -> this body's, for the messages and params of chat's checks
#: chat's refusals worded for this body's fields
RESPONSES = Dialect(
    {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format",
     "tools": "tools", "tool_choice": "tool_choice"},
    (("response_format.json_schema.", "text.format."), ("response_format", "text.format"),
     ("max_tokens", "max_output_tokens"), ("messages", "input"), ("function.name", "name"),
     ("function.parameters", "parameters")))
reworded = RESPONSES.reworded


def messages_of(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Items as chat messages: a run of ``function_call`` items joins the assistant
    message before it (the model wrote its text, then its calls) or makes one."""
    out: list[dict[str, Any]] = []
    for item in items:
        kind = item.get("type", "message")
        if kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item["output"]
            text = output if isinstance(output, str) else "".join(p["text"] for p in output)
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": text})
        elif kind == "reasoning":
            continue  # (not rendered back: see ReasoningItem)
        else:
            out.append({"role": item["role"], "content": _content(item)})
    return out


def _content(item: dict[str, Any]) -> str | list[dict[str, Any]]:
    content = item["content"]
    if isinstance(content, str):
        return content
    if item["role"] == "assistant" or all(p["type"] in ("input_text", "output_text")
                                          for p in content):
        # Text only: one string (an assistant message with tool calls must be text).
        if any(p["type"] not in ("input_text", "output_text") for p in content):
            raise ApiError(400, "an assistant message holds text parts only", param="input")
        return "".join(p["text"] for p in content)
    parts: list[dict[str, Any]] = []
    for p in content:
        if p["type"] in ("input_text", "output_text"):
            parts.append({"type": "text", "text": p["text"]})
        elif p["type"] == "input_image" and "digest" in p:
            parts.append({"type": "input_image", "digest": p["digest"]})
        elif p["type"] == "input_image":
            parts.append({"type": "image_url", "image_url": {
                "url": p["image_url"], **({"detail": p["detail"]} if "detail" in p else {})}})
        else:
            parts.append({"type": "input_audio", "input_audio": p["input_audio"]})
    return parts


# -- the response object ----------------------------------------------------------------------
_DEFAULT_ECHO: dict[str, Any] = {
    "instructions": None, "metadata": {}, "max_output_tokens": None, "temperature": 1.0,
    "top_p": 1.0, "tools": [], "tool_choice": "auto", "parallel_tool_calls": True,
    "text": {"format": {"type": "text"}}, "previous_response_id": None, "background": False,
    "store": False, "truncation": "disabled"}


def status(h: wire.Header) -> str:
    phase = wire.Phase(h.phase)
    if phase is wire.Phase.QUEUED:
        return "queued"
    if not phase.terminal:
        return "in_progress"
    if phase is wire.Phase.COMPLETED:
        return "incomplete" if h.finish == wire.Finish.LENGTH else "completed"
    return "cancelled" if phase is wire.Phase.CANCELLED else "failed"


def usage(h: wire.Header) -> dict[str, Any]:
    return {"input_tokens": h.prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": h.sampled_tokens,
            "output_tokens_details": {"reasoning_tokens": h.reasoning_tokens},
            "total_tokens": h.prompt_tokens + h.sampled_tokens}


def item_status(h: wire.Header) -> str:
    st = status(h)
    return "completed" if st == "completed" else "in_progress" if st in (
        "queued", "in_progress") else "incomplete"


def message_item(identity: bytes, text: str, state: str) -> dict[str, Any]:
    return {"id": "msg_" + identity.hex(), "type": "message", "role": "assistant",
            "status": state,
            "content": [{"type": "output_text", "text": text, "annotations": [],
                         "logprobs": []}]}


def call_item(call: dict[str, Any], state: str = "completed") -> dict[str, Any]:
    f = call["function"]
    return {"id": "fc_" + call["id"][5:], "type": "function_call", "call_id": call["id"],
            "name": f["name"], "arguments": f["arguments"], "status": state}


def reasoning_item(identity: bytes, text: str, state: str) -> dict[str, Any]:
    return {"id": "rs_" + identity.hex(), "type": "reasoning", "status": state, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def output_items(h: wire.Header, data: bytes) -> list[dict[str, Any]]:
    """The output of request ``h`` whose bytes are ``data``: a thinking model's thinking
    as a ``reasoning`` item first; then a text request's one message (none while it is
    queued); with tools, the text before the first call as a message (none when empty)
    and each complete call as a ``function_call`` item."""
    raw = data.decode("utf-8", errors="replace")
    state = item_status(h)
    thinks = reasoning.mode(h.submit_flags)
    thought, text = thinks.split(raw) if thinks else (None, raw)
    # (a think block that closed is done, whatever became of the answer after it)
    done = "completed" if thinks and thinks.closing(raw)[0] >= 0 else state
    out = [] if thought is None else [reasoning_item(h.identity, thought, done)]
    if not h.submit_flags & wire.SUBMIT_FLAG_TOOLS:
        if h.phase == wire.Phase.QUEUED:
            return []
        return [*out, message_item(h.identity, text, state)]
    content, calls = T.parse(text, h.identity, wire.submit_tool_format(h.submit_flags))
    out += [message_item(h.identity, content, state)] if content else []
    return out + [call_item(c) for c in calls]


def response_object(h: wire.Header, data: bytes, alias: str | None,
                    echo: dict[str, Any] | None, created_at: float | None,
                    snapshot: str | None = None) -> dict[str, Any]:
    """The response object of request ``h`` (output bytes ``data``).  ``snapshot``: a
    stream's opening snapshot with that status, before any output (its content depends
    on nothing that changes)."""
    st = snapshot or status(h)
    error = None
    if st == "failed":
        message, _, _ = wording(h)
        error = {"code": "server_error", "message": message}
    return {"id": response_id(h.epoch, h.identity), "object": "response",
            "created_at": int(created_at if created_at is not None else time.time()),
            "status": st, "error": error,
            "incomplete_details": ({"reason": "max_output_tokens"} if st == "incomplete"
                                   else None),
            "model": alias or "", **(echo or _DEFAULT_ECHO),
            "output": [] if snapshot else output_items(h, data),
            "usage": None if snapshot else usage(h)}


def input_item_ids(identity: bytes, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Stored input items with the ids ``input_items`` lists them by (derived from the
    response and the item's place, so every listing names an item alike)."""
    prefix = {"message": "msg", "function_call": "fc", "function_call_output": "fco",
              "reasoning": "rs"}
    out = []
    for n, item in enumerate(items):
        kind = item.get("type", "message")
        # Always the derived id: a client's item may repeat an earlier output's id.
        listed = {**item, "id": _item_id(prefix[kind], identity, n), "type": kind}
        if kind == "message" and isinstance(listed["content"], str):
            part = "output_text" if listed["role"] == "assistant" else "input_text"
            listed["content"] = [{"type": part, "text": listed["content"]}]
        out.append(listed)
    return out
