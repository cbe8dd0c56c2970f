"""Tools for a template that renders them (``ToolFormat`` other than FALLBACK): the
submission's tools section and its messages' FIELDS parts, checked and turned into what
the template takes (docs/protocol.md section 5.4).

The template writes the tools, calls and call ids as markup, whose special-token texts
become control tokens (:mod:`.prompt`), so none of their strings may hold one: a tool
description with ``<|im_end|>`` would otherwise close the system turn.  Message texts
(a tool's result included) stay texts, as in any message.
"""

from __future__ import annotations

import json
from typing import Any

from .. import wire
from ..wire import Reason, Role, ToolFormat
from .errors import DeviceError
from .prompt import Specials
from .template import RESERVED

#: The fields a message's FIELDS part may hold, by role.
ALLOWED = {Role.ASSISTANT: {"tool_calls"}, Role.TOOL: {"tool_call_id"}}


def check_format(flags: int, model_format: ToolFormat, structured: bool) -> None:
    """A submission's tool format (its flags) against the model's template: the gateway
    names the model's format (for tools offered, or calls and results in the messages),
    or FALLBACK (tools written as text: the template sees none)."""
    named = wire.submit_tool_format(flags)
    if (named and named != model_format) or (structured and named is ToolFormat.FALLBACK):
        raise DeviceError(400, Reason.TOOL_FORMAT, int(model_format))


def tools(data: bytes) -> list[dict[str, Any]] | None:
    """The tools section: a JSON array of tool objects, or None when there is none."""
    if not data:
        return None
    value = _json(data)
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise DeviceError(400, Reason.MALFORMED)
    return value


def template_args(data: bytes, specials: Specials) -> dict[str, Any] | None:
    """A submission's template arguments (chat_template_kwargs): a JSON object whose
    names are not the template's own variables and whose strings hold no special-token
    text (the template writes them as markup, as it writes tools)."""
    if not data:
        return None
    value = _json(data)
    if not isinstance(value, dict):
        raise DeviceError(400, Reason.MALFORMED)
    if set(value) & RESERVED or any(specials(s) for s in _strings(value)):
        raise DeviceError(400, Reason.TEMPLATE_ARGS)
    return value


def _strings(value: Any) -> list[str]:
    """Every string in a JSON value, keys included."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in (k, *_strings(v))]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return []


def fields(role: Role, data: bytes) -> dict[str, Any]:
    """A FIELDS part of a message of ``role``: ``tool_calls`` (a list of call objects) in
    an assistant message, ``tool_call_id`` (a string) in a tool message."""
    value = _json(data)
    if not isinstance(value, dict) or not set(value) <= ALLOWED.get(role, set()):
        raise DeviceError(400, Reason.MALFORMED)
    calls = value.get("tool_calls", [])
    if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
        raise DeviceError(400, Reason.MALFORMED)
    if not isinstance(value.get("tool_call_id", ""), str):
        raise DeviceError(400, Reason.MALFORMED)
    return value


def check_text(tools_list: list[dict[str, Any]] | None, messages: list[dict[str, Any]],
               specials: Specials) -> None:
    """Refuse special-token text in what the template writes as markup: the tools, the
    calls, the call ids (detail: the message, or the message count for the tools)."""
    if tools_list and specials(json.dumps(tools_list, ensure_ascii=False)):
        raise DeviceError(400, Reason.TOOL_TEXT, len(messages))
    for i, m in enumerate(messages):
        extra = {k: v for k, v in m.items() if k not in ("role", "content")}
        if extra and specials(json.dumps(extra, ensure_ascii=False)):
            raise DeviceError(400, Reason.TOOL_TEXT, i)


def _json(data: bytes) -> Any:
    try:
        return json.loads(data)
    except ValueError:
        raise DeviceError(400, Reason.MALFORMED) from None
