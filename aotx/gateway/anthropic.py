"""Anthropic's Messages API on the chat path: the request body, its chat envelope, the
answer, and the error envelope.

A ``POST /v1/messages`` body becomes a :class:`~aotx.gateway.requests.ChatRequest`
(:meth:`MessagesRequest.chat`), so it reaches the device as a chat completion's request
does: the same template, tools and their grammar, grants and limits.

- ``system`` (a string or text blocks) is the first system message.
- A user turn's ``tool_result`` blocks become ``tool`` messages, before the turn's
  text and images (a user message; an image is a base64 source).
- An assistant turn's ``tool_use`` blocks become its ``tool_calls``.  Its
  ``thinking`` blocks are not rendered: a thinking template drops earlier turns'
  thinking too.
- ``tools`` are functions; ``tool_choice`` ``auto``, ``any`` (a call is required),
  ``tool`` (that one) and ``none`` are chat's ``auto``, ``required``, the named
  function and ``none``; ``disable_parallel_tool_use`` is ``parallel_tool_calls``
  false.

Fields are refused when unknown (400, naming them), as on the chat route, except those
Claude Code sends with every request: ``cache_control`` on any block or tool (aotx
caches every prompt's prefix by itself), ``context_management`` (it edits earlier
thinking, which is not rendered), ``output_config`` and ``thinking`` (a model that does
not think writes no thinking whatever they say) and ``metadata.user_id`` (logged).
"""

from __future__ import annotations

import json
from http import HTTPStatus
from typing import Annotated, Any, Literal

import orjson
from pydantic import ConfigDict, Discriminator, Field, Tag, field_validator
from starlette import types

from .body import Body
from .dialect import Dialect
from .errors import ApiError
from .render import dumps
from .requests import MAX_INLINE_CHARS, MAX_STOP, ChatRequest, check_stops

#: Anthropic's error types by status (its envelope: ``{"type": "error", "error": ...}``).
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 413: "request_too_large",
               429: "rate_limit_error", 500: "api_error", 503: "overloaded_error",
               529: "overloaded_error"}
#: The paths whose errors are in Anthropic's envelope.
PATHS = ("/v1/messages", "/v1/messages/count_tokens")


class Cached(Body):
    """A block or tool that may carry ``cache_control`` (accepted: aotx caches every
    prompt's prefix by itself)."""

    cache_control: dict[str, Any] | None = None


class TextBlock(Cached):
    type: Literal["text"]
    text: str


class Base64Source(Body):
    type: Literal["base64"]
    media_type: Literal["image/png", "image/jpeg", "image/gif", "image/webp"]
    data: str = Field(max_length=MAX_INLINE_CHARS)


class ImageBlock(Cached):
    type: Literal["image"]
    source: Base64Source


class ToolUseBlock(Cached):
    type: Literal["tool_use"]
    id: str = Field(min_length=1, max_length=256)
    name: str = Field(max_length=64)
    input: dict[str, Any]


class ToolResultBlock(Cached):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1, max_length=256)
    content: str | list[TextBlock | ImageBlock] = ""
    is_error: bool = False

    def text(self) -> str:
        text = (self.content if isinstance(self.content, str)
                else "".join(b.text for b in self.content if isinstance(b, TextBlock)))
        return f"Error: {text}" if self.is_error else text

    def images(self) -> list[ImageBlock]:
        """Its images (a screenshot, a file read): a tool message holds text only, so
        they go in the user message that follows the results."""
        return [] if isinstance(self.content, str) else [
            b for b in self.content if isinstance(b, ImageBlock)]


class ThinkingBlock(Body):
    """An earlier turn's thinking, sent back by the client: not rendered."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["thinking", "redacted_thinking"]


def _block_tag(v: Any) -> str | None:
    kind = v.get("type") if isinstance(v, dict) else getattr(v, "type", None)
    return "thinking" if kind == "redacted_thinking" else kind


Block = Annotated[
    Annotated[TextBlock, Tag("text")] | Annotated[ImageBlock, Tag("image")]
    | Annotated[ToolUseBlock, Tag("tool_use")] | Annotated[ToolResultBlock, Tag("tool_result")]
    | Annotated[ThinkingBlock, Tag("thinking")],
    Discriminator(_block_tag)]


class Message(Body):
    role: Literal["user", "assistant"]
    content: str | list[Block]

    def blocks(self) -> list[Any]:
        return ([TextBlock(type="text", text=self.content)] if isinstance(self.content, str)
                else list(self.content))


class Tool(Cached):
    type: Literal["custom"] | None = None  # server tools (web search, ...) are not run here
    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    strict: bool | None = None  # (the input always follows the schema: its grammar)
    eager_input_streaming: bool | None = None  # (the input streams in fragments anyway)


class ToolChoice(Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(Body):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(default=None, ge=1, lt=1 << 31)
    display: Literal["summarized", "omitted"] | None = None


class OutputFormat(Body):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(Body):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: OutputFormat | None = None


class Metadata(Body):
    user_id: str | None = Field(default=None, max_length=512)


class CountRequest(Body):
    """``POST /v1/messages/count_tokens``: what the prompt is made of."""

    model: str = Field(min_length=1, max_length=256)
    messages: list[Message] = Field(min_length=1, max_length=4096)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    context_management: dict[str, Any] | None = None
    output_config: OutputConfig | None = None
    cache_control: dict[str, Any] | None = None

    def chat(self, extra: dict[str, Any] | None = None) -> ChatRequest:
        """The chat envelope of this body (``extra``: the output's fields); 400 naming
        this body's field when chat's checks refuse it."""
        body: dict[str, Any] = {"model": self.model, "messages": self._messages(), **(extra or {})}
        if self.tools:
            body["tools"] = [{"type": "function", "function": {
                "name": t.name, "description": t.description, "parameters": t.input_schema}}
                for t in self.tools]
        if self.tool_choice is not None:
            body.update(_choice(self.tool_choice))
        effort = self.output_config.effort if self.output_config else None
        if effort is not None:  # (the template's reasoning_effort: low, medium, high)
            body["reasoning_effort"] = {"xhigh": "high", "max": "high"}.get(effort, effort)
        if self.thinking is not None and self.thinking.type == "disabled":
            body["chat_template_kwargs"] = {"enable_thinking": False}
        elif self.thinking is not None and self.thinking.budget_tokens:
            body["reasoning_budget_tokens"] = self.thinking.budget_tokens
        if self.output_config is not None and self.output_config.format is not None:
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "output", "schema": self.output_config.format.schema_}}
        return MESSAGES.chat(body)

    def _messages(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if self.system:
            system = (self.system if isinstance(self.system, str)
                      else "\n\n".join(b.text for b in self.system))
            out.append({"role": "system", "content": system})
        for m in self.messages:
            out += _turn(m)
        return out


class MessagesRequest(CountRequest):
    """``POST /v1/messages``."""

    @property
    def omits_thinking(self) -> bool:
        """``thinking.display: "omitted"``: thinking blocks without their text."""
        return self.thinking is not None and self.thinking.display == "omitted"

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = Field(default=None, max_length=MAX_STOP)
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0, le=1 << 20)
    stream: bool | None = None
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None  # the one tier there is

    _stops = field_validator("stop_sequences", mode="before")(check_stops)

    def chat_request(self, cap: int) -> ChatRequest:
        """The chat envelope, asking at most ``cap`` tokens: ``max_tokens`` is a ceiling
        (Claude Code asks for 32,000), held to what this caller may ask."""
        if self.messages[-1].role == "assistant":
            raise ApiError(400, "prefill is not supported: the last message must be the "
                                "user's", param="messages")
        return self.chat({"max_tokens": min(self.max_tokens, cap or self.max_tokens),
                          "stop": self.stop_sequences,
                          "temperature": self.temperature, "top_p": self.top_p,
                          "top_k": self.top_k})


def _turn(m: Message) -> list[dict[str, Any]]:
    """One Anthropic turn as chat messages."""
    blocks = m.blocks()
    if m.role == "assistant":
        text = "".join(b.text for b in blocks if isinstance(b, TextBlock))
        calls = [{"id": b.id, "type": "function", "function": {
            "name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}}
            for b in blocks if isinstance(b, ToolUseBlock)]
        if any(isinstance(b, ImageBlock | ToolResultBlock) for b in blocks):
            raise ApiError(400, "an assistant turn holds text, tool_use and thinking blocks "
                                "only", param="messages")
        return [{"role": "assistant", "content": text or (None if calls else ""),
                 **({"tool_calls": calls} if calls else {})}]
    if any(isinstance(b, ToolUseBlock) for b in blocks):
        raise ApiError(400, "tool_use blocks belong to assistant turns", param="messages")
    out: list[dict[str, Any]] = [{"role": "tool", "tool_call_id": b.tool_use_id,
                                  "content": b.text()}
                                 for b in blocks if isinstance(b, ToolResultBlock)]
    parts: list[dict[str, Any]] = []
    for b in [i for r in blocks if isinstance(r, ToolResultBlock) for i in r.images()] + blocks:
        if isinstance(b, TextBlock):
            parts.append({"type": "text", "text": b.text})
        elif isinstance(b, ImageBlock):
            parts.append({"type": "image_url", "image_url": {
                "url": f"data:{b.source.media_type};base64,{b.source.data}"}})
    if parts or not out:
        out.append({"role": "user", "content": parts})
    return out


def _choice(c: ToolChoice) -> dict[str, Any]:
    if (c.type == "tool") != (c.name is not None):
        raise ApiError(400, "tool_choice names a tool exactly when its type is \"tool\"",
                       param="tool_choice")
    choice: Any = {"auto": "auto", "any": "required", "none": "none"}.get(c.type) or {
        "type": "function", "function": {"name": c.name}}
    out: dict[str, Any] = {"tool_choice": choice}
    if c.disable_parallel_tool_use is not None:
        out["parallel_tool_calls"] = not c.disable_parallel_tool_use
    return out


#: chat's refusals worded for this body's fields
MESSAGES = Dialect({"stop": "stop_sequences"},
                   (("function.parameters", "input_schema"), ("function.name", "name"),
                    ("tool_calls", "tool_use blocks")))
reworded = MESSAGES.reworded


# -- the answer -------------------------------------------------------------------------
def stop_reason(finish: str, stop_hit: int, stops: list[str] | None
                ) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) for chat's finish_reason and the state's stop_hit."""
    if finish == "tool_calls":
        return "tool_use", None
    if finish == "length":
        return "max_tokens", None
    if stop_hit and stops and stop_hit <= len(stops):
        return "stop_sequence", stops[stop_hit - 1]
    return "end_turn", None


def content(message: dict[str, Any], omit: bool = False) -> list[dict[str, Any]]:
    """A chat message's thinking, text and calls as content blocks.  A thinking block's
    ``signature`` is empty: aotx does not sign thinking (it renders none back).  ``omit``
    (``thinking.display: "omitted"``): the thinking block is there, its text empty."""
    calls = message.get("tool_calls") or []
    text = message.get("content") or ""
    thought = message.get("reasoning_content")
    out = [{"type": "thinking", "thinking": "" if omit else thought, "signature": ""}
           ] if thought else []
    out += [{"type": "text", "text": text}] if text else []
    return out + [tool_use(c) for c in calls]


def tool_use(call: dict[str, Any]) -> dict[str, Any]:
    f = call["function"]
    return {"type": "tool_use", "id": call["id"], "name": f["name"],
            "input": json.loads(f["arguments"] or "{}")}


def usage(prompt_tokens: int, output_tokens: int) -> dict[str, int]:
    return {"input_tokens": prompt_tokens, "output_tokens": output_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}


def error_envelope(status: int, body: dict[str, Any]) -> dict[str, Any]:
    """The standard error object ``body`` in Anthropic's envelope."""
    error = body.get("error")
    message = error.get("message") if isinstance(error, dict) else None
    if not isinstance(message, str) or not message:
        message = _phrase(status)
    kind = ERROR_TYPES.get(status) or ("api_error" if status >= 500
                                       else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def _phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:  # (499: the client closed the connection)
        return "error"


def enveloped(send: types.Send) -> types.Send:
    """``send`` for a Messages path: an error answer (status >= 400, the standard error
    object), whoever gives it (the guard, authentication, validation, the route), goes
    out in Anthropic's envelope."""
    start: types.Message | None = None
    body = b""

    async def sending(message: types.Message) -> None:
        nonlocal start, body
        if message["type"] == "http.response.start" and message["status"] >= 400:
            start = message
            return
        if start is None or message["type"] != "http.response.body":
            await send(message)
            return
        body += message.get("body", b"")
        if message.get("more_body"):
            return
        out = _converted(start["status"], body)
        size = str(len(out)).encode()
        await send({**start, "headers": [(k, size if k == b"content-length" else v)
                                         for k, v in start["headers"]]})
        await send({"type": "http.response.body", "body": out})

    return sending


def _converted(status: int, body: bytes) -> bytes:
    """The error answer ``body`` in the envelope (one that is not the standard object,
    as a plain-text 500, with its status's phrase)."""
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        obj = {}
    return dumps(error_envelope(status, obj if isinstance(obj, dict) else {}))
