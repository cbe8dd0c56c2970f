"""What the vLLM engine's modules need of vLLM and of each other, as protocols: vLLM's
``EngineClient`` (the part aotx drives) and the runner's event loop (:class:`Loop`: where
the embeddings' tasks run), so that ``inputs`` and ``runner`` need not import each other."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, Protocol


class EngineClient(Protocol):
    """The part of vLLM's ``vllm.engine.protocol.EngineClient`` aotx uses."""

    def generate(self, prompt: Any, sampling_params: Any, request_id: str, *,
                 lora_request: Any = None) -> AsyncIterator[Any]: ...
    def encode(self, prompt: Any, pooling_params: Any,
               request_id: str) -> AsyncIterator[Any]: ...
    async def abort(self, request_id: str) -> None: ...
    async def add_lora(self, lora_request: Any) -> bool: ...
    async def check_health(self) -> None: ...
    def shutdown(self) -> None: ...


class Loop(Protocol):
    """The runner's event loop, as other work on its thread sees it (VllmRunner)."""

    lock: threading.Lock

    def spawn(self, work: Callable[[], Coroutine[Any, Any, None]]) -> None: ...
