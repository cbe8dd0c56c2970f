"""Chat templates: the model's own Jinja template, rendered in a sandbox.

A GGUF's ``tokenizer.chat_template`` is untrusted input (llama-cpp-python had
a template-injection advisory), so it is compiled in jinja2's
``ImmutableSandboxedEnvironment``: no attribute access to internals, no
mutation of passed-in objects, and ``range`` is capped.  The template is
rendered over the whole message array on the device.

The environment is the one Hugging Face transformers gives templates (the reference
their authors test against): undefined names are falsy rather than errors (templates
test ``message.tool_calls`` on every message), ``{% break %}``/``{% continue %}``,
``tojson`` without HTML escaping (``<`` stays ``<``, as the model was trained), and
``strftime_now``.

A template that renders tools (``tools``, assistant ``tool_calls``, ``tool`` messages)
in a call format aotx can constrain and parse has that :class:`ToolFormat`
(:func:`tool_format`, found once at load by rendering a probe conversation); any other
has ``FALLBACK``, and the gateway writes the tools into the messages' text.
"""

from __future__ import annotations

import datetime
import json
import threading
import time
from collections.abc import Sequence
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..wire import ToolFormat

MAX_RANGE = 100_000
MAX_RENDERED = 4 * 1024 * 1024
RENDER_SECONDS = 1.0  # a render that takes longer is stopped (template denial of service)
#: The variables a template is given, which a request's template arguments may not replace.
RESERVED = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})


class TemplateError(Exception):
    """The template could not render the messages: ``refused`` when the template itself
    said no (its ``raise_exception``), not when a bound stopped it or it failed."""

    def __init__(self, message: str, refused: bool = False) -> None:
        super().__init__(message)
        self.refused = refused


def _raise_exception(message: str) -> None:
    raise TemplateError(f"chat template raised: {message}", refused=True)


class _TimedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, plus a render deadline checked on every call and attribute."""

    _local = threading.local()

    def _check(self) -> None:
        deadline = getattr(self._local, "deadline", None)
        if deadline is not None and time.monotonic() > deadline:
            raise TemplateError(f"chat template took longer than {RENDER_SECONDS:.0f} s")

    def call(self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        self._check()
        return super().call(__context, __obj, *args, **kwargs)

    def getattr(self, obj: Any, attribute: str) -> Any:
        self._check()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        self._check()
        return super().getitem(obj, argument)

    # Arithmetic that can build huge values in one step ("x" * 10**10, 10**100000000) is
    # checked before it runs; every such operation also checks the deadline.
    intercepted_binops = frozenset(["*", "**", "+"])

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        self._check()
        if operator == "**" and isinstance(left, int) and isinstance(right, int):
            if right > 0 and abs(left) > 1 and (abs(left).bit_length() - 1) * right > 4096:
                raise TemplateError("chat template computed a power too large")
        elif operator == "*":
            for seq, n in ((left, right), (right, left)):
                if (isinstance(seq, (str, list, tuple)) and isinstance(n, int)
                        and len(seq) * n > MAX_RENDERED):
                    raise TemplateError("chat template built a value too large")
        elif operator == "+" and isinstance(left, (str, list, tuple)) and isinstance(
                right, (str, list, tuple)) and len(left) + len(right) > MAX_RENDERED:
            raise TemplateError("chat template built a value too large")
        return super().call_binop(context, operator, left, right)


def _safe_range(*args: int) -> range:
    r = range(*args)
    if len(r) > MAX_RANGE:
        raise TemplateError(f"chat template asked for a range of {len(r)} items")
    return r


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """transformers' ``tojson``: jinja2's own escapes ``<``, ``>``, ``&`` and ``'``."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


class ChatTemplate:
    def __init__(self, source: str | None, bos_token: str = "", eos_token: str = "") -> None:
        if not source:
            raise TemplateError("the model has no chat template (tokenizer.chat_template)")
        env = _TimedSandbox(trim_blocks=True, lstrip_blocks=True,
                            extensions=[jinja2.ext.loopcontrols])
        self._env = env
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        env.globals["range"] = _safe_range
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as exc:
            raise TemplateError(f"chat template does not compile: {exc}") from None
        self.source = source
        # A reasoning model's template: its answers think first, between <think> and
        # </think> (Qwen 3, DeepSeek R1, QwQ), or in the analysis channel before the
        # final one (gpt-oss's harmony format: ``channels``).
        self.channels = "<|channel|>" in source and "<|message|>" in source
        self.thinks = self.channels or ("<think>" in source and "</think>" in source)
        self.bos_token = bos_token
        self.eos_token = eos_token
        # Probe once so a broken template is refused at load, not on the first request.
        self.render([{"role": "system", "content": "probe"}, {"role": "user", "content": "hi"}])
        self.tool_format = tool_format(self)

    def render(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
               tools: Sequence[dict[str, Any]] | None = None,
               args: dict[str, Any] | None = None) -> str:
        """``tools``: the functions offered, as OpenAI lists them (only where the template
        renders tools, :attr:`tool_format`); None renders as the template's no-tools case.
        ``args``: more variables (a request's ``chat_template_kwargs``); one may not
        replace the variables above (TemplateError)."""
        if args and (taken := sorted(set(args) & RESERVED)):
            raise TemplateError(f"template argument {taken[0]!r} is the template's own")
        local = _TimedSandbox._local
        local.deadline = time.monotonic() + RENDER_SECONDS
        try:
            text = self._template.render(**(args or {}), messages=list(messages),
                                         tools=tools or None,
                                         add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token, eos_token=self.eos_token)
        except TemplateError:
            raise
        except jinja2.exceptions.SecurityError as exc:
            raise TemplateError(f"chat template broke the sandbox rules: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - any template failure is a template error
            raise TemplateError(f"chat template failed to render: {type(exc).__name__}: {exc}") from None
        finally:
            local.deadline = None
        if len(text) > MAX_RENDERED:
            raise TemplateError("chat template output is too large")
        return text


# -- tool formats -------------------------------------------------------------------------------
_PROBE_NAME, _PROBE_RESULT = "aotx_probe_fn", "aotx-probe-result"
_PROBE_TOOLS = [{"type": "function", "function": {
    "name": _PROBE_NAME, "description": "A probe.",
    "parameters": {"type": "object", "properties": {"x": {"type": "integer"}},
                   "required": ["x"]}}}]
_PROBE_CALL = {"id": "call_aotxprobe", "type": "function",
               "function": {"name": _PROBE_NAME, "arguments": {"x": 7}}}
_PROBE: list[dict[str, Any]] = [{"role": "user", "content": "Call the probe."},
          {"role": "assistant", "content": "", "tool_calls": [_PROBE_CALL]},
          {"role": "tool", "tool_call_id": "call_aotxprobe", "content": _PROBE_RESULT},
          {"role": "user", "content": "Thanks."}]
#: What a template writes for the probe's call, by the format the output then follows
#: (every text of the tuple).  gpt-oss's template names the recipient in the message's
#: header, where the model writes it after the channel: either parses (gateway/tools.py).
_CALL_TEXT = {
    ToolFormat.HERMES: ('<tool_call>\n{"name": "aotx_probe_fn", "arguments": {"x": 7}}\n'
                        '</tool_call>',),
    ToolFormat.LLAMA3: ('{"name": "aotx_probe_fn", "parameters": {"x": 7}}',),
    ToolFormat.HARMONY: ("to=functions.aotx_probe_fn", '<|message|>{"x": 7}<|call|>'),
}


def tool_format(template: ChatTemplate) -> ToolFormat:
    """The format in which ``template`` renders tools: it must list the tools offered,
    write an assistant's call in a format of :data:`_CALL_TEXT` and render a tool's
    result; FALLBACK when it does not (or fails on the probe)."""
    try:
        offered = template.render(_PROBE[:1], tools=_PROBE_TOOLS)
        plain = template.render(_PROBE[:1])
        text = template.render(_PROBE, tools=_PROBE_TOOLS)
    except TemplateError:
        return ToolFormat.FALLBACK
    if _PROBE_NAME not in offered or _PROBE_NAME in plain or _PROBE_RESULT not in text:
        return ToolFormat.FALLBACK
    return next((f for f, call in _CALL_TEXT.items() if all(t in text for t in call)),
                ToolFormat.FALLBACK)
