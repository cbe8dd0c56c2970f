"""Tools (function calling) in the standard message envelope: the request fields, the
prompt format, the grammar that constrains the output, and the parsing of the answer.

A model whose chat template renders tools (its ``ToolFormat``, in the model's
information row) gets them as they came: the tools, the assistant messages' calls and
the ``tool`` messages travel as structured fields (gateway/calls.py) and the template
writes them, as the model was trained.  Its calls are then parsed in that format:
``HERMES`` (Qwen 2.5 and 3, Hermes) as below; ``LLAMA3`` (Llama 3.1 to 3.3) one JSON
object ``{"name": ..., "parameters": {...}}`` as the whole answer (those templates
take one call a turn, so ``parallel_tool_calls`` yields one); ``HARMONY`` (gpt-oss)
one call a turn in the commentary channel after the analysis one,
``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}``, or
(``auto``) an answer in the final channel (the device puts the choice of channel after
the analysis channel's thinking: device/constraints.py).

A template that knows no tools (SmolLM2's plain ChatML) has ``FALLBACK``: the gateway
renders them in the format Hermes and Qwen 2.5 models are trained on (docs/api.md,
"Tools"), as ordinary message text; the wire and the device see plain system, user and
assistant messages:

- the tools, as JSON in ``<tools></tools>``, and the instruction to answer a call as
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, in a block after
  the first system message's text (or as a system message of its own);
- an assistant message's ``tool_calls`` in that format after its text, one per line;
- ``tool`` messages (a run of them) as one user message, each result in
  ``<tool_response>\\n...\\n</tool_response>``.

``tool_choice`` ``required`` or a named function constrains the output to one call (or,
with ``parallel_tool_calls``, up to :data:`MAX_PARALLEL`) of the allowed functions whose
arguments follow the function's ``parameters`` (an llguidance Lark grammar with one
``%json`` schema per function; the device checks each schema as it checks a
``response_format`` schema and refuses what it cannot enforce).  ``auto`` allows free
text that never contains ``<tool_call>``, or calls.  ``none`` offers no tools.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator, Sequence
from typing import Any, Literal

from pydantic import ConfigDict, Field

from ..wire import CHANNEL_CALL, CHANNEL_START, ToolFormat
from .body import Body
from .closed_objects import close_objects

MAX_TOOLS = 128
MAX_PARALLEL = 4  # calls in one answer with parallel_tool_calls
ARGUMENT_CHUNK = 24  # characters of arguments per streamed delta
NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(r"<tool_call>\n(.*?)\n</tool_call>", re.DOTALL)
#: gpt-oss's call, as the answer after the analysis channel (gateway/reasoning.py):
#: its recipient, then the arguments' JSON, up to ``<|call|>`` where the text shows it.
HARMONY_CALL = CHANNEL_CALL.removeprefix(CHANNEL_START)  # "<|channel|>commentary"
_HARMONY = re.compile(r"<\|channel\|>commentary to=functions\.([^\s<]+)\s*"
                      r"(?:<\|constrain\|>\s*json\s*)?<\|message\|>(.*?)(?:<\|call\|>)?\s*",
                      re.DOTALL)


class FunctionDef(Body):
    model_config = ConfigDict(extra="ignore")
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(Body):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: FunctionDef


class CalledFunction(Body):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(max_length=64)
    arguments: str


class ToolCall(Body):
    """A call in an input assistant message."""

    model_config = ConfigDict(extra="ignore")
    id: str = Field(max_length=256)
    type: Literal["function"] = "function"
    function: CalledFunction


class ChosenName(Body):
    name: str


class NamedChoice(Body):
    type: Literal["function"]
    function: ChosenName


ToolChoice = Literal["none", "auto", "required"] | NamedChoice
Mode = Literal["auto", "required"]


def validate(tools: Sequence[ToolDef] | None, choice: ToolChoice | None) -> None:
    """Names, duplicates, the parameters' top level, and a named choice that exists;
    raises ValueError (400).  The rest of each schema is the device's to check."""
    tools = tools or []
    if len(tools) > MAX_TOOLS:
        raise ValueError(f"at most {MAX_TOOLS} tools")
    seen: set[str] = set()
    for i, t in enumerate(tools):
        f = t.function
        if not NAME.fullmatch(f.name):
            raise ValueError(f"tools[{i}].function.name {f.name!r} is not 1-64 of a-z, A-Z, "
                             f"0-9, _ and -")
        if f.name in seen:
            raise ValueError(f"tools[{i}].function.name {f.name!r} is a duplicate")
        seen.add(f.name)
        if f.parameters is not None and f.parameters.get("type", "object") != "object":
            raise ValueError(f"tools[{i}].function.parameters must be an object schema "
                             f"(type \"object\")")
    if choice is not None and choice != "none" and not tools:
        raise ValueError("tool_choice needs tools")
    if isinstance(choice, NamedChoice) and choice.function.name not in seen:
        raise ValueError(f"tool_choice names function {choice.function.name!r}, which is "
                         f"not in tools")


def mode(tools: Sequence[ToolDef] | None, choice: ToolChoice | None) -> Mode | None:
    """``auto`` (text or calls), ``required`` (calls only) or None (no tools offered)."""
    if not tools or choice == "none":
        return None
    return "auto" if choice in (None, "auto") else "required"


def parameters(f: FunctionDef) -> dict[str, Any]:
    """The arguments' schema: ``parameters``, or no arguments at all without one."""
    if f.parameters is None:
        return {"type": "object", "properties": {}, "additionalProperties": False}
    return {"type": "object", **f.parameters}


# -- the prompt -------------------------------------------------------------------------------
def template_tool(t: ToolDef) -> dict[str, Any]:
    """A tool as a template that renders tools gets it (the parameters always given)."""
    f = t.function
    function = {"name": f.name, **({"description": f.description} if f.description else {}),
                "parameters": parameters(f)}
    return {"type": "function", "function": function}


def template_calls(calls: Sequence[ToolCall]) -> list[dict[str, Any]]:
    """An assistant message's calls as a template gets them: arguments that are a JSON
    object as that object (templates write them with ``tojson``), others as text."""
    out = []
    for c in calls:
        try:
            args: Any = json.loads(c.function.arguments)
        except ValueError:
            args = c.function.arguments
        out.append({"id": c.id, "type": "function",
                    "function": {"name": c.function.name,
                                 "arguments": args if isinstance(args, dict)
                                 else c.function.arguments}})
    return out


def system_block(tools: Sequence[ToolDef]) -> str:
    listed = "\n".join(json.dumps(t.model_dump(exclude_none=True), ensure_ascii=False)
                       for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{listed}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments "
            "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def call_text(name: str, arguments: str) -> str:
    """One call as the model writes it (arguments that are not JSON are kept as text)."""
    try:
        args = json.dumps(json.loads(arguments), ensure_ascii=False)
    except ValueError:
        args = arguments
    return f'{OPEN}\n{{"name": {json.dumps(name)}, "arguments": {args}}}\n{CLOSE}'


def assistant_text(content: str, calls: Sequence[ToolCall]) -> str:
    return "\n".join([content] * bool(content) + [call_text(c.function.name,
                                                            c.function.arguments)
                                                  for c in calls])


def response_text(content: str) -> str:
    return f"<tool_response>\n{content}\n</tool_response>"


# -- the grammar ------------------------------------------------------------------------------
def allowed(tools: Sequence[ToolDef], choice: ToolChoice | None) -> list[FunctionDef]:
    """The functions the model may call, in the order of the grammar's ``%json`` schemas
    (their names name a refused one)."""
    return [t.function for t in tools
            if not isinstance(choice, NamedChoice) or t.function.name == choice.function.name]


def grammar(tools: Sequence[ToolDef], choice: ToolChoice | None, parallel: bool,
            fmt: ToolFormat) -> str:
    """The Lark grammar for ``mode(tools, choice)`` (not None) in format ``fmt``, one
    ``%json`` schema for each of :func:`allowed`.

    ``auto``: plain text that never holds ``<tool_call>``, or text (possibly none) up
    to the first ``<tool_call>`` and then calls only.  The text before a call is a lazy
    lexeme (llguidance's docs/syntax.md, "Tool calling"): it ends at the first
    ``<tool_call>``, where a greedy one would swallow the marker's first bytes."""
    functions = allowed(tools, choice)
    if fmt is ToolFormat.LLAMA3:
        return _llama3_grammar(functions, mode(tools, choice) == "required")
    if fmt is ToolFormat.HARMONY:
        return _harmony_grammar(functions, mode(tools, choice) == "required")
    rules = _function_rules(functions, "arguments")
    repeat = f' ("\\n<tool_call>" body){{0,{MAX_PARALLEL - 1}}}' if parallel else ""
    start = ('start: "<tool_call>" calls' if mode(tools, choice) == "required"
             else "start: TEXT | head calls")
    lines = [start, f"calls: body{repeat}",
             'body: "\\n" (' + " | ".join(f"f{i}" for i in range(len(functions)))
             + ') "\\n</tool_call>"',
             "head[lazy]: /(.|\\n)*<tool_call>/",
             "TEXT: /(.|\\n)+/ & ~/(.|\\n)*<tool_call>(.|\\n)*/", *rules]
    return "\n".join(lines) + "\n"


def _function_rules(allowed: Sequence[FunctionDef], key: str) -> list[str]:
    """Rule ``fi`` per function: ``{"name": "<name>", "<key>": <its parameters>}``."""
    return [f'f{i}: "{{\\"name\\": \\"{f.name}\\", \\"{key}\\": " %json {_schema(f)} "}}"'
            for i, f in enumerate(allowed)]


def _schema(f: FunctionDef) -> str:
    """The function's arguments' schema, as its grammar's ``%json`` takes it."""
    return json.dumps(close_objects(parameters(f)), ensure_ascii=False, separators=(",", ":"))


def _llama3_grammar(allowed: Sequence[FunctionDef], required: bool) -> str:
    """Llama 3's: one call object as the whole answer, or (``auto``) text that does not
    begin with ``{``, which would begin a call."""
    rules = _function_rules(allowed, "parameters")
    call = "call: " + " | ".join(f"f{i}" for i in range(len(allowed)))
    # TEXT begins with neither "{" nor white space: the parser and the stream read an
    # answer that begins with "{" as a call, so no text may reach one unconstrained
    start = "start: call" if required else "start: TEXT | call\nTEXT: /[^{\\s](.|\\n)*/"
    return "\n".join([start, call, *rules]) + "\n"


def _harmony_grammar(allowed: Sequence[FunctionDef], required: bool) -> str:
    """gpt-oss's: what follows ``<|start|>assistant<|channel|>`` after the thinking (the
    device wraps it so): one call in the commentary channel, or (``auto``) the final
    channel's text."""
    rules = [f'f{i}: {json.dumps(f.name + " <|constrain|>json<|message|>")} %json {_schema(f)}'
             for i, f in enumerate(allowed)]
    call = ('call: "commentary to=functions." ('
            + " | ".join(f"f{i}" for i in range(len(allowed))) + ")")
    start = ("start: call" if required
             else 'start: "final<|message|>" TEXT | call\nTEXT: /(.|\\n)+/')
    return "\n".join([start, call, *rules]) + "\n"


# -- the answer -------------------------------------------------------------------------------
def call_id(identity: bytes, index: int) -> str:
    """The id of a request's ``index``-th call: derived from the request, so that its
    standard answer, its stream and its native tool-call document name it alike."""
    return "call_" + hashlib.sha256(identity + index.to_bytes(4, "little")).hexdigest()[:24]


def parse(text: str, identity: bytes, fmt: ToolFormat
          ) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of the finished output of request ``identity`` in format
    ``fmt``: the text before the first call (None if empty) and each complete call, with
    its id and its arguments as a JSON string.  An output with no complete call is all
    content."""
    if fmt is ToolFormat.LLAMA3:
        return _parse_llama3(text, identity)
    if fmt is ToolFormat.HARMONY:
        return _parse_harmony(text, identity)
    calls: list[dict[str, Any]] = []
    for found in _CALL.finditer(text):
        try:
            call = json.loads(found.group(1))
            name, args = call["name"], call["arguments"]
        except (ValueError, KeyError, TypeError):
            continue
        calls.append(_call(identity, len(calls), str(name), args))
    if not calls:
        return text, []
    return text[:text.find(OPEN)].rstrip() or None, calls


def _parse_llama3(text: str, identity: bytes) -> tuple[str | None, list[dict[str, Any]]]:
    if not text.startswith("{"):
        return text, []
    try:
        call = json.loads(text)
        name, args = call["name"], call["parameters"]
    except (ValueError, KeyError, TypeError, AttributeError):
        return text, []
    if not isinstance(name, str) or not isinstance(args, dict):
        return text, []
    return None, [_call(identity, 0, name, args)]


def _parse_harmony(text: str, identity: bytes) -> tuple[str | None, list[dict[str, Any]]]:
    found = _HARMONY.fullmatch(text)
    if found is None:
        return text, []
    try:
        args = json.loads(found.group(2))
    except ValueError:
        return text, []
    if not isinstance(args, dict):
        return text, []
    return None, [_call(identity, 0, found.group(1), args)]


def _call(identity: bytes, index: int, name: str, args: Any) -> dict[str, Any]:
    """A parsed call as ``tool_calls`` lists it: its id, its name, its arguments as JSON."""
    return {"id": call_id(identity, index), "type": "function",
            "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}


def message(text: str, finish: str, active: Mode | None, identity: bytes, fmt: ToolFormat
            ) -> tuple[dict[str, Any], str]:
    """The non-streaming ``message`` and ``finish_reason`` for a finished output."""
    content, calls = parse(text, identity, fmt) if active else (text, [])
    if not calls:
        return {"role": "assistant", "content": text}, finish
    return ({"role": "assistant", "content": content, "tool_calls": calls},
            "tool_calls" if finish == "stop" else finish)


class ToolStream:
    """A stream's text, split into the content that streams at once and the calls, held
    until the output ends.  Content streams until ``<tool_call>``; what could still
    begin one (a prefix of it at the end) and trailing whitespace (the non-streaming
    content is right-stripped before a call) wait for the next characters."""

    def __init__(self, active: Mode, identity: bytes, fmt: ToolFormat) -> None:
        self.held = ""
        self.identity = identity
        self.fmt = fmt
        self.calls = active == "required"  # past the first <tool_call>: all is held
        self.text = False  # LLAMA3: the answer began with other than "{": all is content

    def feed(self, text: str) -> str:
        """The content to stream now for ``text``, the output's next characters."""
        if self.text:
            return text
        self.held += text
        if self.calls:
            return ""
        if self.fmt in (ToolFormat.LLAMA3, ToolFormat.HARMONY):
            # a call is the whole answer: what it begins with
            mark = "{" if self.fmt is ToolFormat.LLAMA3 else HARMONY_CALL
            self.calls = self.held.startswith(mark)
            self.text = not self.calls and not mark.startswith(self.held)
            out, self.held = (self.held, "") if self.text else ("", self.held)
            return out
        at = self.held.find(OPEN)
        self.calls = at >= 0
        if not self.calls:
            at = len(self.held) - _opening(self.held)
        cut = len(self.held[:at].rstrip())
        out, self.held = self.held[:cut], self.held[cut:]
        return out

    def end(self, finish: str) -> tuple[str, list[dict[str, Any]], str]:
        """(the content still to send, the calls' deltas, the finish_reason)."""
        content, calls = parse(self.held, self.identity, self.fmt)
        if not calls:
            return self.held, [], finish
        return content or "", list(deltas(calls)), "tool_calls" if finish == "stop" else finish


def _opening(text: str) -> int:
    """The length of the longest end of ``text`` that could still begin ``<tool_call>``."""
    return next((k for k in range(min(len(OPEN) - 1, len(text)), 0, -1)
                 if text.endswith(OPEN[:k])), 0)


def deltas(calls: Sequence[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """``delta.tool_calls`` as OpenAI streams them: per call one delta with its index,
    id, type, name and arguments "", then its arguments in fragments."""
    for i, c in enumerate(calls):
        f = c["function"]
        yield {"tool_calls": [{"index": i, "id": c["id"], "type": "function",
                               "function": {"name": f["name"], "arguments": ""}}]}
        args = f["arguments"]
        for at in range(0, len(args), ARGUMENT_CHUNK):
            yield {"tool_calls": [{"index": i,
                                   "function": {"arguments": args[at:at + ARGUMENT_CHUNK]}}]}
