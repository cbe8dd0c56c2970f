"""Another API's body on the chat path: the chat request it makes, and chat's refusals
worded for that body's fields (the Responses API, Anthropic's Messages)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from .errors import ApiError
from .requests import ChatRequest
from .validation import explain


@dataclass(frozen=True)
class Dialect:
    fields: Mapping[str, str]  #: chat's field -> this body's (a refusal's param)
    words: tuple[tuple[str, str], ...]  #: chat's words -> this body's, in a message

    def text(self, message: str) -> str:
        for chat, ours in self.words:
            message = message.replace(chat, ours)
        return message

    def reworded(self, exc: ApiError) -> ApiError:
        """A refusal worded for chat's fields, naming this body's."""
        exc.message = self.text(exc.message)
        if exc.param is not None:
            exc.param = self.fields.get(exc.param.split(".")[0], exc.param)
        return exc

    def chat(self, body: dict[str, Any]) -> ChatRequest:
        """The chat request of ``body`` (chat's fields); 400 naming this body's field
        when chat's checks refuse it."""
        try:
            return ChatRequest.model_validate(body)
        except ValidationError as exc:
            message, at = explain(ChatRequest, exc.errors())
            field = at.split(".")[0] if at else None
            raise ApiError(400, self.text(message), param=self.fields.get(field, field)
                           if field else None) from None
