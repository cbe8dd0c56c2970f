"""HTTP request bodies (pydantic).  They also produce the OpenAPI document.

The standard message envelope is shared by ``POST /v1/chat/completions`` and
``POST /aotx/v1/requests``.  A field aotx does not implement is refused with 400
naming it (as OpenAI refuses an argument it does not know), never silently dropped;
a message may carry what the SDK's own answer messages hold, so that a client can
append an answer to its messages.  ``response_format``, or ``tools`` with their ``tool_choice``
(gateway/tools.py), becomes the submission's constraint.  The sampler's
fields (penalties, logit bias, top-k, min-p) are applied on the device.
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Annotated, Any, Literal

from pydantic import (
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    field_validator,
    model_validator,
)

from ..wire import (
    MAX_BIAS,
    MAX_STOP_BYTES,
    MAX_TOP_LOGPROBS,
    Constraint,
    GrammarKind,
    Sampling,
    ToolFormat,
)
from . import tools as T
from .body import Body, KeepAlive
from .closed_objects import close_objects

MAX_STOP = 16
MAX_CHOICES = 8  # n: choices of one chat completion (each a device request)
MAX_INLINE_CHARS = 1 << 21  # longer than any body the gateway accepts (1 MiB)


class TextPart(Body):
    type: Literal["text"]
    text: str


class MediaPart(Body):
    """A reusable media source named by its digest (native route only)."""

    type: Literal["input_image", "input_audio"]
    digest: str = Field(pattern=r"^sha256:[0-9a-f]{64}$")

    @property
    def digest_bytes(self) -> bytes:
        return binascii.unhexlify(self.digest[7:])


class ImageUrl(Body):
    model_config = ConfigDict(extra="ignore")
    url: str = Field(max_length=MAX_INLINE_CHARS)
    detail: Literal["auto", "low", "high"] | None = None


class ImageUrlPart(Body):
    """OpenAI's inline image: ``{"type": "image_url", "image_url": {"url": "data:..."}}``.
    Only ``data:`` URLs (base64); aotx fetches nothing from the network."""

    type: Literal["image_url"]
    image_url: ImageUrl


class InputAudio(Body):
    data: str = Field(max_length=MAX_INLINE_CHARS)  # base64
    format: Literal["wav", "mp3", "flac"]


class InputAudioPart(Body):
    """OpenAI's inline audio: ``{"type": "input_audio", "input_audio": {"data", "format"}}``."""

    type: Literal["input_audio"]
    input_audio: InputAudio


InlinePart = ImageUrlPart | InputAudioPart


def _part_tag(v: Any) -> str | None:
    """Native digest parts and OpenAI's inline audio share the type ``input_audio``;
    the inline one carries an ``input_audio`` object, the native one a ``digest``."""
    if isinstance(v, dict):
        kind = v.get("type")
        if kind == "input_audio" and "input_audio" in v:
            return "inline_audio"
        return "digest" if kind in ("input_image", "input_audio") else kind
    if isinstance(v, InputAudioPart):
        return "inline_audio"
    if isinstance(v, MediaPart):
        return "digest"
    return getattr(v, "type", None)


ContentPart = Annotated[
    Annotated[TextPart, Tag("text")] | Annotated[MediaPart, Tag("digest")]
    | Annotated[ImageUrlPart, Tag("image_url")] | Annotated[InputAudioPart, Tag("inline_audio")],
    Discriminator(_part_tag)]


class ChatMessage(Body):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = Field(default=None, max_length=256)  # not rendered: see docs/api.md
    tool_calls: list[T.ToolCall] | None = Field(default=None, max_length=T.MAX_TOOLS)
    tool_call_id: str | None = Field(default=None, max_length=256)
    # What the SDK's own answer message holds, so that ``messages.append(message)``
    # works: a refusal is the assistant's text; the rest must be empty.
    refusal: str | None = None
    annotations: list[Any] | None = Field(default=None, max_length=0)
    audio: None = None
    function_call: None = None

    @model_validator(mode="after")
    def _shape(self) -> ChatMessage:
        if self.refusal is not None:
            if self.role != "assistant" or self.content is not None:
                raise ValueError("refusal is an assistant message's text, instead of content")
            self.content, self.refusal = self.refusal, None
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages have tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs tool_call_id")
        if (self.role == "tool" or self.tool_calls) and not all(
                isinstance(p, TextPart) for p in self.parts()):
            raise ValueError("tool messages and tool calls' messages hold text parts only")
        return self

    def parts(self) -> list[TextPart | MediaPart | ImageUrlPart | InputAudioPart]:
        if self.content is None:
            return []
        if isinstance(self.content, str):
            return [TextPart(type="text", text=self.content)]
        return list(self.content)

    def text(self) -> str:
        return "".join(p.text for p in self.parts() if isinstance(p, TextPart))


class StreamOptions(Body):
    include_usage: bool = False


class ChatRequest(Body):
    model: str = Field(min_length=1, max_length=256)
    messages: list[ChatMessage] = Field(min_length=1, max_length=4096)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=-(2**63), le=2**64 - 1)
    stop: str | list[str] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: int | None = Field(default=None, ge=1, le=MAX_CHOICES)
    memory: Literal["on", "off"] | None = None
    keep_alive: KeepAlive = None  # Ollama's: the model's idle time after this request
    # More variables for the chat template (llama-server's and vLLM's field), such as
    # Qwen 3's enable_thinking: the device refuses the template's own names.
    chat_template_kwargs: dict[str, Any] | None = None
    # A reasoning model's effort: the template's ``reasoning_effort`` (gpt-oss reads it);
    # "none" also turns thinking off (``enable_thinking: false``, Qwen 3's).
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    # llama-server's thinking budget (either name): the most tokens of the think block,
    # which the model must then close (the device's grammar makes it).
    reasoning_budget_tokens: int | None = Field(default=None, ge=1, lt=1 << 31)
    thinking_budget_tokens: int | None = Field(default=None, ge=1, lt=1 << 31)
    # The rest of the sampler (wire.Sampling): OpenAI's penalties and logit bias, and the
    # extensions llama.cpp's server and vLLM accept.
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = Field(default=None, max_length=MAX_BIAS)
    top_k: int | None = Field(default=None, ge=-1, le=1 << 20)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=10.0)
    repeat_last_n: int | None = Field(default=None, ge=-1, le=1 << 20)
    # Log-probabilities of the sampled tokens (the device's annotation stream).
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[T.ToolDef] | None = Field(default=None, max_length=T.MAX_TOOLS)
    tool_choice: T.ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # OpenAI's end-user tags: written to the gateway's request log (DEBUG), nowhere else.
    user: str | None = Field(default=None, max_length=256)
    safety_identifier: str | None = Field(default=None, max_length=256)
    service_tier: Literal["auto", "default"] | None = None  # the one tier there is
    modalities: list[Literal["text"]] | None = None
    store: Literal[False] | None = None  # chat completions are not stored for /v1/chat/...
    # Fields we refuse rather than silently ignore:
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stops(cls, v: Any) -> Any:
        # Before pydantic's own check of ``str | list[str]``, whose errors are located at
        # the union member it tried ("stop.str"): every bad stop here is located "stop".
        if v is None:
            return v
        return check_stops(v)

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        return check_bias(v)

    @property
    def sampling(self) -> Sampling:
        """The sampler beyond temperature and top-p, as the submission carries it."""
        return Sampling(top_k=max(0, self.top_k or 0), min_p=self.min_p or 0.0,
                        presence=self.presence_penalty or 0.0,
                        frequency=self.frequency_penalty or 0.0,
                        repetition=self.repetition_penalty or 1.0,
                        last_n=max(0, self.repeat_last_n or 0),
                        logprobs=(self.top_logprobs or 0) + 1 if self.logprobs else 0,
                        bias=tuple((int(t), b) for t, b in (self.logit_bias or {}).items()))

    @model_validator(mode="after")
    def _unsupported(self) -> ChatRequest:
        if self.functions or self.function_call is not None:
            raise ValueError("functions and function_call are deprecated and not supported: "
                             "use tools and tool_choice")
        T.validate(self.tools, self.tool_choice)
        if self.tool_mode and (self.response_format or {}).get("type", "text") != "text":
            raise ValueError("response_format cannot be combined with tools (except with "
                             "tool_choice none)")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream: true")
        _format_schema(self.response_format)
        if (self.max_tokens is not None and self.max_completion_tokens is not None
                and self.max_tokens != self.max_completion_tokens):
            raise ValueError("max_tokens and max_completion_tokens disagree")
        return self

    def constraint(self, fmt: ToolFormat) -> Constraint | None:
        """The grammar the output must follow (tools' calls in the model's format ``fmt``,
        or ``response_format``)."""
        if self.tool_mode:
            return Constraint(GrammarKind.LARK, T.grammar(
                self.tools or [], self.tool_choice, self.parallel_tool_calls is not False, fmt))
        schema = _format_schema(self.response_format)
        # Key order is kept: the output lists properties in the schema's order.
        return None if schema is None else Constraint(GrammarKind.JSON_SCHEMA, json.dumps(
            close_objects(schema), ensure_ascii=False, separators=(",", ":")))

    @property
    def thought_budget(self) -> int:
        """The think block's most tokens (0: no budget): the smaller, where both are named."""
        named = [b for b in (self.reasoning_budget_tokens, self.thinking_budget_tokens) if b]
        return min(named, default=0)

    def template_args(self) -> dict[str, Any] | None:
        """The chat template's more variables: chat_template_kwargs, and reasoning_effort
        (a kwarg of the same name wins)."""
        if self.reasoning_effort is None:
            return self.chat_template_kwargs
        effort: dict[str, Any] = {"reasoning_effort": self.reasoning_effort}
        if self.reasoning_effort == "none":
            effort["enable_thinking"] = False
        return {**effort, **(self.chat_template_kwargs or {})}

    @property
    def tool_mode(self) -> T.Mode | None:
        """``auto``, ``required`` (calls only) or None: no tools offered."""
        return T.mode(self.tools, self.tool_choice)

    @property
    def tool_names(self) -> tuple[str, ...]:
        """The functions the constraint's ``%json`` schemas are for, in order."""
        if not self.tool_mode:
            return ()
        return tuple(f.name for f in T.allowed(self.tools or [], self.tool_choice))

    @property
    def uses_tools(self) -> bool:
        """Tools offered, or tool calls or results in the messages."""
        return bool(self.tool_mode) or any(m.role == "tool" or m.tool_calls
                                           for m in self.messages)

    def envelope(self, fmt: ToolFormat) -> list[ChatMessage]:
        """The messages as the device gets them.  A template that renders tools (``fmt``
        not FALLBACK) gets them as they are; otherwise the tools offered, assistant
        messages' tool calls and tool results are text in the fallback format
        (gateway/tools.py)."""
        if fmt is not ToolFormat.FALLBACK:
            return self.messages
        out: list[ChatMessage] = []
        for i, msg in enumerate(self.messages):
            if msg.role == "tool":
                text = T.response_text(msg.text())
                if i and self.messages[i - 1].role == "tool":
                    text = out.pop().text() + "\n" + text
                out.append(ChatMessage.model_construct(role="user", content=text))
            elif msg.tool_calls or msg.content is None:
                out.append(ChatMessage.model_construct(role="assistant", content=T.assistant_text(
                    msg.text(), msg.tool_calls or [])))
            else:
                out.append(msg)
        if self.tool_mode:
            block = T.system_block(self.tools or [])
            if out and out[0].role in ("system", "developer"):
                parts = [*out[0].parts(), TextPart(type="text", text="\n\n" + block)]
                out[0] = ChatMessage.model_construct(role=out[0].role, content=parts)
            else:
                out.insert(0, ChatMessage.model_construct(role="system", content=block))
        return out

    def template_tools(self) -> str:
        """The tools section for a template that renders tools (JSON; empty when none
        are offered, as with ``tool_choice`` none)."""
        if not self.tool_mode:
            return ""
        return json.dumps([T.template_tool(t) for t in self.tools or []], ensure_ascii=False)

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


def check_stops(v: Any) -> Any:
    """``stop`` as OpenAI takes it (a string or a list), within aotx's limits; raises
    ValueError (400, ``param: "stop"``).  Shared by chat and text completions."""
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise ValueError("stop must be a string or an array of strings")
    if len(items) > MAX_STOP:
        raise ValueError(f"at most {MAX_STOP} stop sequences")
    if any(not s for s in items):
        raise ValueError("stop sequences must not be empty")
    if any(len(s.encode("utf-8", "surrogatepass")) > MAX_STOP_BYTES for s in items):
        raise ValueError(f"a stop sequence may have at most {MAX_STOP_BYTES} bytes (UTF-8)")
    return v


def check_bias(v: dict[str, float] | None) -> dict[str, float] | None:
    """``logit_bias``: token ids (decimal strings) to -100..100; raises ValueError."""
    for token, bias in (v or {}).items():
        # (at most 10 digits before int(): Python refuses to convert over 4,300, and
        # its own message would become the 400's)
        if (not token.isascii() or not token.isdigit() or len(token) > 10
                or int(token) >= 1 << 31):
            raise ValueError("logit_bias keys are token ids (decimal strings)")
        if not -100.0 <= bias <= 100.0:
            raise ValueError("a logit_bias value is between -100 and 100")
    return v


#: The fields of each kind of ``response_format``, and of its ``json_schema``.
_FORMAT_FIELDS = {"text": {"type"}, "json_object": {"type"}, "json_schema": {"type", "json_schema"}}
_SCHEMA_FIELDS = {"name", "schema", "strict", "description"}


def _format_schema(rf: dict[str, Any] | None) -> dict[str, Any] | None:
    """The schema OpenAI's ``response_format`` asks the output to follow: none for
    ``text``, any JSON object for ``json_object``, or ``json_schema``'s (``{"name",
    "schema", "strict", "description"}``; the output always follows the schema:
    ``strict`` false is not a looser mode here).  What the schema
    may use is the device's to say (400 naming the keyword).  A field it does not know
    is refused, as everywhere in a body: llama.cpp's ``{"type": "json_object", "schema":
    ...}`` would otherwise be served unconstrained by the schema it names."""
    if rf is None:
        return None
    kind = rf.get("type")
    if not isinstance(kind, str) or kind not in _FORMAT_FIELDS:
        raise ValueError("response_format.type must be text, json_object or json_schema")
    spec = rf.get("json_schema")
    unknown = sorted(set(rf) - _FORMAT_FIELDS[kind]) + sorted(
        f"json_schema.{k}" for k in (spec if isinstance(spec, dict) else {}).keys()
        - _SCHEMA_FIELDS)
    if unknown:
        hint = " (a schema goes in json_schema.schema, with type json_schema)" * (
            unknown[0] == "schema")
        raise ValueError(f"response_format.{unknown[0]} is not a field of a {kind} "
                         f"response_format{hint}")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise ValueError("response_format.json_schema needs a name and a schema")
    if not isinstance(spec.get("strict", False), bool):
        raise ValueError("response_format.json_schema.strict is true or false")
    if not T.NAME.fullmatch(spec["name"]):  # OpenAI's rule, as for function names
        raise ValueError("response_format.json_schema.name is 1-64 of a-z, A-Z, 0-9, _ and -")
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        raise ValueError("response_format.json_schema.schema must be a JSON object")
    return schema


class PolicyControlBody(Body):
    action: Literal["pause", "resume", "stop", "review-on", "review-off"]
    expected_revision: str = Field(pattern=r"^[0-9]{1,20}$")


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")
