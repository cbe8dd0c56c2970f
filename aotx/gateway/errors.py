"""Errors in the gateway: the standard error object, and the one table that words the
device's refusals.

The device and the broker answer with a status and a :class:`~aotx.wire.Reason` code,
never with text.  :data:`REASONS` turns the code (and the number its reply carries) into
the message, code and param of the standard error object; :data:`ERROR_TYPES` gives
the object's ``type`` and default ``code`` for each status (a status it does not list
gets its reason phrase as the code).  Errors found by the gateway itself (bad JSON,
no token, a bad cursor) are :class:`ApiError` with their own message.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

import orjson

from .. import config, wire
from ..wire import Reason

ERROR_TYPES: dict[int, tuple[str, str]] = {
    400: ("invalid_request_error", "invalid_request"),
    401: ("authentication_error", "invalid_api_key"),
    403: ("permission_error", "permission_denied"),
    404: ("not_found_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    408: ("invalid_request_error", "request_timeout"),
    409: ("conflict_error", "conflict"),
    410: ("gone_error", "epoch_ended"),
    413: ("invalid_request_error", "payload_too_large"),
    415: ("invalid_request_error", "unsupported_media_type"),
    421: ("invalid_request_error", "misdirected_request"),
    422: ("invalid_request_error", "unprocessable"),
    429: ("rate_limit_error", "rate_limited"),
    431: ("invalid_request_error", "headers_too_large"),
    499: ("invalid_request_error", "client_closed_request"),  # (nginx's: nobody reads it)
    500: ("internal_error", "internal_error"),
    501: ("invalid_request_error", "not_implemented"),
    502: ("internal_error", "bad_gateway"),
    503: ("service_unavailable", "unavailable"),
    505: ("internal_error", "protocol_version"),
    507: ("service_unavailable", "insufficient_storage"),
}


#: The message of an unexpected failure in the gateway (its detail goes to the log only).
INTERNAL = "internal error in the gateway; its log has the details"


def error_body(status: int, message: str, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    etype, default_code = ERROR_TYPES.get(status) or _unlisted(status)
    return {"error": {"message": message, "type": etype, "code": code or default_code,
                      "param": param}}


def _unlisted(status: int) -> tuple[str, str]:
    """The type and code of a status the table does not list (a device status the gateway
    does not know yet): the code is a word, its reason phrase, never the number."""
    server = status >= 500
    try:
        code = re.sub(r"[^a-z0-9]+", "_", HTTPStatus(status).phrase.lower()).strip("_")
    except ValueError:
        code = "internal_error" if server else "invalid_request"
    return ("internal_error" if server else "invalid_request_error"), code


class ApiError(Exception):
    """Raised anywhere in the gateway; rendered as the standard error object."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.code)


def guard_only(route: str) -> AssertionError:
    """What a route the guard answers raises if it is ever reached: its FastAPI
    declaration is its OpenAPI entry, the guard (guard.py) its one path."""
    return AssertionError(f"{route} is answered by the guard, not the framework's routes")


#: What a 400 for a JSON route's body that is not a JSON object says (before the token).
NOT_JSON = "the body is not valid JSON"
TOO_DEEP = "the body's JSON is nested too deeply to read"
NO_BODY = "the body is empty; send a JSON object"
NOT_AN_OBJECT = "the body must be a JSON object, not {kind}"

#: What a 413 for a submission past one packet says (after "the request" or "the prompt").
PAST_ONE_PACKET = ("does not fit one packet: its encoded content may be at most "
                   f"{wire.MAX_PAYLOAD} bytes (max_payload_bytes)")


@dataclass(frozen=True)
class Wording:
    message: str  #: ``str.format`` fields: see :func:`refusal`
    code: str | None = None
    param: str | None = None


#: An action as docs/api.md and ``aotx token create`` name it (``policy-read``).
ACTION_WORDS = {a: (a.name or "").lower().replace("_", "-") for a in wire.Action}

#: Reason -> the standard error object's message (and code, param).  Fields, in the
#: message and the param: {detail} (the reply's number), {cursor}, {total},
#: {prompt_tokens}, {model}, {max_tokens}, {limit_field} (the field that gave it),
#: {input_bytes}, {kind} (detail as a PartKind), {digest} (media part detail's digest),
#: {action} (detail as action names).
REASONS: dict[Reason, Wording] = {
    Reason.MALFORMED: Wording("the device refused a malformed packet (an aotx bug; see the "
                              "device log)"),
    Reason.VERSION: Wording("the device speaks another protocol version"),
    Reason.TOO_LARGE: Wording(f"the request {PAST_ONE_PACKET}"),
    Reason.NONZERO_FIELD: Wording("the device refused a packet whose unused header field at "
                                  "offset {detail} is not zero (an aotx bug)"),
    Reason.NOT_SUPPORTED: Wording("the device does not provide this operation"),
    Reason.NO_MAILBOX: Wording("the service is busy: no free mailbox; try again"),
    Reason.INTERNAL: Wording("internal device error"),
    Reason.NO_GRANT: Wording("no grant is installed for this principal"),
    Reason.ACTION: Wording("the grant does not include the {action} action"),
    Reason.NO_MODEL: Wording("the model does not exist", "model_not_found", "model"),
    Reason.NO_REQUEST: Wording("no such request"),
    Reason.EPOCH_ENDED: Wording("the request belongs to an ended runtime epoch"),
    Reason.EPOCH_MISMATCH: Wording("the frame epoch does not match the device's"),
    Reason.CURSOR: Wording("cursor {cursor} is past the {total} bytes produced so far",
                           param="cursor"),
    Reason.INPUT_BYTES: Wording("input of {input_bytes} bytes exceeds the grant's {detail}",
                                param="messages"),
    Reason.PROMPT_LENGTH: Wording("the prompt has {prompt_tokens} tokens; model {model} "
                                  "accepts at most {detail} so that one can be generated",
                                  "context_length_exceeded", "messages"),
    Reason.OUTPUT_TOKENS: Wording("{limit_field} {max_tokens} exceeds the limit of {detail}",
                                  param="{limit_field}"),
    Reason.DEVICE_BUSY: Wording("the service is at capacity; try again shortly",
                                "service_busy"),
    Reason.ACTIVE_LIMIT: Wording("you may hold {detail} active (queued or running) requests; "
                                 "wait for one to finish", "active_limit_exceeded"),
    Reason.RATE_LIMIT: Wording("the grant allows {detail} admissions a minute"),
    Reason.TEMPLATE: Wording("the model's chat template refused these messages",
                             param="messages"),
    Reason.TEMPLATE_FAILED: Wording("the model's chat template could not render these "
                                    "messages (it failed, or ran past its time or size "
                                    "bounds)", param="messages"),
    Reason.MODALITY: Wording("model {model} does not accept {kind} input", param="messages"),
    Reason.NO_SOURCE: Wording("no ready {kind_of_part} source with digest {digest}",
                              param="messages"),
    Reason.NO_PROJECTOR: Wording("model {model} has no multimodal projector",
                                 param="messages"),
    Reason.IMAGE_UNREADABLE: Wording("media part {detail} (image) could not be decoded: only "
                                     "PNG, JPEG and GIF images are read", param="messages"),
    Reason.IMAGE_PIXELS: Wording("media part {detail} (image) is too large: at most "
                                 f"{config.MAX_IMAGE_PIXELS} pixels are decoded",
                                 param="messages"),
    Reason.AUDIO_UNREADABLE: Wording("media part {detail} (audio) could not be decoded: only "
                                     "WAV, MP3 and FLAC audio is read", param="messages"),
    Reason.AUDIO_RATE: Wording(f"media part {{detail}} (audio) has a sample rate outside "
                               f"{config.AUDIO_RATES[0]} to {config.AUDIO_RATES[1]} Hz",
                               param="messages"),
    Reason.AUDIO_LENGTH: Wording(f"media part {{detail}} (audio) lasts longer than "
                                 f"{config.MAX_AUDIO_SECONDS} s, or its header does not say",
                                 param="messages"),
    Reason.MEDIA_LAST: Wording("a prompt must end with text after its last media part",
                               param="messages"),
    Reason.MEDIA_PREPARE: Wording("the media could not be prepared", param="messages"),
    Reason.GRAMMAR: Wording("the response_format schema cannot be enforced: {grammar}",
                            "invalid_schema", "response_format"),
    Reason.GRAMMAR_FAILED: Wording("the output could not be kept to the response_format "
                                   "schema (the matcher failed while generating)"),
    Reason.PROMPT_TOKEN: Wording("the prompt names token {detail}, which is not in model "
                                 "{model}'s vocabulary", param="prompt"),
    Reason.LOGIT_BIAS: Wording("logit_bias names token {detail}, which is not in the "
                               "model's vocabulary", param="logit_bias"),
    Reason.SPECIAL_TEXT: Wording("message {detail} holds special-token text (or a media "
                                 "marker) that model {model}'s chat template changes, so it "
                                 "cannot be kept as plain text", param="messages"),
    Reason.TOOL_FORMAT: Wording("model {model}'s chat template renders tools in another "
                                "format than this request was written for (was the model "
                                "reloaded?): send it again", param="tools"),
    Reason.TOOL_TEXT: Wording("the tools, or the tool calls of message {detail}, hold "
                              "special-token text, which model {model}'s chat template would "
                              "write as control tokens", param="tools"),
    Reason.TEMPLATE_ARGS: Wording("chat_template_kwargs name a variable the chat template "
                                  "is given already, or hold special-token text, which "
                                  "model {model}'s chat template would write as control "
                                  "tokens", param="chat_template_kwargs"),
    Reason.ENGINE_FEATURE: Wording("model {model}'s engine does not provide {feature} yet",
                                   "engine_feature_unsupported"),
    Reason.NO_SOURCE_ID: Wording("no such media source"),
    Reason.UPLOAD_OFFSET: Wording("the upload's chunks do not follow each other"),
    Reason.CONTENT_TYPE: Wording("unsupported content type"),
    Reason.SOURCE_COUNT: Wording("the grant allows {detail} media sources"),
    Reason.SOURCE_BYTES: Wording("a media source may have at most {detail} bytes"),
    Reason.MEDIA_SHARE: Wording("your media sources may hold {detail} bytes in all; remove "
                                "some first", "media_quota_exceeded"),
    Reason.MEDIA_POOL: Wording("the service's media storage is full; try again later",
                               "media_storage_full"),
    Reason.LEASED: Wording("the source is leased by {detail} request(s)"),
    Reason.EMPTY: Wording("the source is empty"),
    Reason.MAGIC: Wording("the bytes are not {content_type} (their magic number does not "
                          "match)"),
    Reason.POLICY_OFF: Wording("the resident policy is off: no loaded model is qualified "
                               "for automatic memory"),
    Reason.STALE_REVISION: Wording("stale control revision", param="expected_revision"),
    Reason.NO_DECISION: Wording("no such pending decision"),
    Reason.MEMORY_OP: Wording("unknown memory operation"),
    Reason.KV_FULL: Wording("the engine ran out of KV cache for this request"),
    Reason.DECODE: Wording("the engine failed while decoding this request"),
    Reason.MEDIA_ENCODE: Wording("the engine failed to encode this request's media"),
    Reason.WITHDRAWN: Wording("the device did not finish the embeddings in time; try again"),
    Reason.MODEL_LOAD: Wording("the model could not be loaded (the service's log says why)",
                               "model_load_failed", "model"),
    Reason.MODEL_ROOM: Wording("the model does not fit in memory beside the models in use "
                               "now; try again later", "model_memory_busy", "model"),
    Reason.MODEL_FIXED: Wording("the model is loaded at start, not on demand: it is not "
                                "loaded or unloaded", "model_not_on_demand", "model"),
    Reason.MODEL_UNLOADED: Wording("the model is still loading; try again",
                                   "model_not_loaded", "model"),
}


@dataclass(frozen=True)
class Call:
    """What the gateway knows of the call a refusal answers, for its wording."""

    model: str = ""
    max_tokens: int = 0
    input_bytes: int = 0
    media: tuple[str, ...] = field(default=())  #: the digests of its media parts, in order
    kinds: tuple[str, ...] = field(default=())  #: their kinds ("image", "audio")
    tools: tuple[str, ...] = field(default=())  #: the functions of its grammar's %json, in order
    limit_field: str = "max_tokens"  #: the field that gave max_tokens (max_completion_tokens)


NO_CALL = Call()


def _fields(h: wire.Header, call: Call, body: bytes = b"") -> dict[str, object]:
    d = h.detail
    return {
        "grammar": _grammar_why(body) if h.reason == wire.Reason.GRAMMAR else "",
        "detail": d, "cursor": h.cursor, "total": h.total, "prompt_tokens": h.prompt_tokens,
        "model": call.model, "max_tokens": call.max_tokens, "input_bytes": call.input_bytes,
        "limit_field": call.limit_field,
        "kind": wire.PART_MODALITY.get(d, str(d)),  # type: ignore[call-overload]
        "digest": call.media[d] if d < len(call.media) else "?",
        "kind_of_part": call.kinds[d] if d < len(call.kinds) else "media",
        "action": " or ".join(ACTION_WORDS[a] for a in wire.Action if d & a) or str(d),
        "content_type": wire.MEDIA_TYPES.get(h.content_type, "its content type"),
        "feature": _FEATURES.get(d, "this") if h.reason == wire.Reason.ENGINE_FEATURE else "",
    }


_FEATURES: dict[int, str] = {wire.EngineFeature.PENALTY_WINDOW: "a penalty window "
                             "(repeat_last_n)"}


def _grammar_why(body: bytes) -> str:
    """A GRAMMAR refusal's payload (UTF-8 JSON from device/constraints.py) in words."""
    try:
        why = orjson.loads(body)
        return str(why["detail"]) + (f" (at {why['where']})" if why.get("where") else "")
    except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError):
        return "it uses a feature that cannot be enforced"


def _tool_why(body: bytes, names: tuple[str, ...]) -> str:
    """A GRAMMAR refusal of a tools grammar: its ``where`` (``%json[i]#/pointer``) names
    the function whose parameters were refused."""
    try:
        why = orjson.loads(body)
        found = re.fullmatch(r"%json\[([0-9]+)\](.*)", str(why.get("where", "")))
        name = names[int(found.group(1))] if found else ""
        at = f" (at {found.group(2)})" if found and found.group(2) not in ("", "#") else ""
        what = f"function {name!r}'s parameters" if name else "the tools' parameters"
        return f"{what} cannot be enforced: {why['detail']}{at}"
    except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError, IndexError):
        return "the tools' parameters use a feature that cannot be enforced"


def wording(h: wire.Header, call: Call = NO_CALL, body: bytes = b""
            ) -> tuple[str, str | None, str | None]:
    """(message, code, param) for the reason in ``h`` (``body``: the reply's payload)."""
    w = REASONS.get(wire.Reason(h.reason)) if h.reason in wire.Reason._value2member_map_ \
        else None
    if w is None:
        return f"device status {h.status}", None, None
    fields = _fields(h, call, body)
    return w.message.format_map(fields), w.code, w.param and w.param.format_map(fields)


def failed(h: wire.Header, why: str | None = None) -> ApiError:
    """A request that failed on the device after admission, as the standard routes answer
    it: its failure status (500 or 503) and the wording of its reason (``why``: a failed
    load's reason, as the device's MODELS read says it)."""
    message, code, _ = wording(h)
    if why:
        message = f"{message}: {why}"
    # waited for memory that others held: worth another try soon
    headers = {"Retry-After": "5"} if h.reason == wire.Reason.MODEL_ROOM else None
    return ApiError(h.failure or 500, message, code=code, headers=headers)


def refusal(h: wire.Header, call: Call = NO_CALL, body: bytes = b"") -> ApiError:
    """The ApiError for a reply that refused (status >= 400)."""
    message, code, param = wording(h, call, body)
    if h.reason == wire.Reason.GRAMMAR and call.tools:
        message, param = _tool_why(body, call.tools), "tools"
    status = h.status if 400 <= h.status < 600 else 500
    # 429: when the principal's rate allows again; a 503 that names a time (a model whose
    # load failed, or that loads on demand): when to try again
    headers = ({"Retry-After": str(max(1, h.retry_after))}
               if status == 429 or (status == 503 and h.retry_after) else None)
    return ApiError(status, message, param=param, code=code, headers=headers)
