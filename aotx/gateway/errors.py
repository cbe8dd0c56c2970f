"""The standard error object and the status -> type table, shared by every route."""

from __future__ import annotations

from typing import Any

ERROR_TYPES: dict[int, tuple[str, str]] = {
    400: ("invalid_request_error", "invalid_request"),
    401: ("authentication_error", "invalid_api_key"),
    403: ("permission_error", "permission_denied"),
    404: ("not_found_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    409: ("conflict_error", "conflict"),
    410: ("gone_error", "epoch_ended"),
    413: ("invalid_request_error", "payload_too_large"),
    415: ("invalid_request_error", "unsupported_media_type"),
    421: ("invalid_request_error", "misdirected_request"),
    422: ("invalid_request_error", "unprocessable"),
    429: ("rate_limit_error", "rate_limited"),
    431: ("invalid_request_error", "headers_too_large"),
    500: ("internal_error", "internal_error"),
    501: ("invalid_request_error", "not_implemented"),
    503: ("service_unavailable", "unavailable"),
    505: ("internal_error", "protocol_version"),
}


def error_body(status: int, message: str, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    etype, default_code = ERROR_TYPES.get(status, ("internal_error" if status >= 500
                                                   else "invalid_request_error", str(status)))
    return {"error": {"message": message, "type": etype, "code": code or default_code,
                      "param": param}}


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
