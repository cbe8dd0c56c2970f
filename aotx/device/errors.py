"""The device's one error type.

A handler that refuses raises :class:`DeviceError`; the device catches it in one
place, where the reply is written (:meth:`aotx.device.runtime.Device.reply_to`), and
turns it into a reply header with the status, the :class:`~aotx.wire.Reason` and the
number the reason names.  No text crosses the wire: the gateway words the reason.
"""

from __future__ import annotations

from typing import Any

from ..wire import Reason


class DeviceError(Exception):
    """A refusal: ``status`` (HTTP-like) and ``reason`` go into the reply header with
    ``detail`` (offset 120) and, for 429, ``retry_after`` seconds (offset 104).
    ``fields`` are further reply fields (the state of the request a 409 concerns), and
    ``payload`` a reply payload where the operation defines one (the policy status)."""

    def __init__(self, status: int, reason: Reason, detail: int = 0, *, retry_after: int = 0,
                 payload: bytes = b"", fields: dict[str, Any] | None = None) -> None:
        super().__init__(f"{status} {reason.name}")
        self.status = status
        self.reason = reason
        self.detail = detail
        self.retry_after = retry_after
        self.payload = payload
        self.fields = fields or {}
