"""What a vLLM model takes beside chat prompts: embedding inputs on a pooling model
(:class:`VllmEmbeddings`, ``kind = "embedding"``) and decoded images on a multimodal
one (:class:`VllmMedia`), both on the runner's loop (engine/vllm.py)."""

from __future__ import annotations

import asyncio
import io
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..embedding import EmbedJob, Vectors
from ..interface import EngineError
from ..multimodal import MediaInputError, MediaProblem, MediaSegment, check_parts
from .client import EngineClient, Loop

log = logging.getLogger("aotx.engine")


def reason(exc: BaseException) -> str:
    """An exception's message, or its type's name when it has none (vLLM raises some
    without a message)."""
    return str(exc) or type(exc).__name__


class VllmEmbeddings:
    """``/v1/embeddings`` on a vLLM pooling model (``kind = "embedding"``) and
    ``/v1/rerank`` on a cross-encoder (``kind = "rerank"``): each EMBED call's inputs go
    to vLLM's ``encode`` together, on the runner's loop, and vLLM batches them with
    whatever else runs.  Vectors come back unit length, as llama.cpp's; a reranker's
    score (``pooling`` "rank") as its classifier head gives it.  It stands where
    :class:`~aotx.engine.embedding.EmbedQueue` stands for llama.cpp (the device reads
    ``embedder.dims`` and ``embedder.context``).  ``make_params`` gives an input's
    ``PoolingParams``, told where a reranker's input starts its second segment
    (``segments``: the document's token type, where the tokenizer gives types)."""

    def __init__(self, runner: Loop, client: EngineClient, dims: int, context: int,
                 pooling: str, make_params: Callable[[int | None], Any],
                 segments: Callable[[list[int]], int | None]) -> None:
        self.runner = runner
        self.client = client
        self.embedder = self  # (one object: no context of its own to close)
        self.dims = dims
        self.context = context
        self.pooling = pooling
        self.make_params = make_params
        self.segments = segments
        self.rank = pooling == "rank"  # a reranker: scores, and its inputs' token types
        self.calls = self.inputs = self.tokens = 0

    def submit(self, job: EmbedJob) -> None:
        """Embed ``job``'s inputs; ``job.done`` is called on the engine thread, with the
        lock held, once all are embedded or one failed (lock held)."""
        job.vectors = np.empty((len(job.inputs), self.dims), dtype=np.float32)
        self.runner.spawn(lambda: self._embed(job))

    def withdraw(self, job: EmbedJob) -> None:
        """Answer ``job`` now, without its vectors (lock held): its caller is gone.  Its
        inputs already handed to vLLM run to their end there; their vectors are dropped."""
        if not job.answered:
            job.withdrawn = True
            job.finish()

    async def _embed(self, job: EmbedJob) -> None:
        if job.withdrawn:  # (withdrawn before the loop came to it)
            return
        error = ""
        try:
            rows = await asyncio.gather(*(self._one(tokens) for tokens in job.inputs))
        except Exception as exc:  # vLLM's failure: the call fails, the device goes on
            log.exception("event=embed.failed inputs=%d", len(job.inputs))
            error, rows = reason(exc), []
        with self.runner.lock:
            for i, row in enumerate(rows):
                if row.shape != (self.dims,):
                    error = f"vLLM gave {row.shape[0]} floats, not {self.dims}"
                    break
                norm = 0.0 if self.rank else float(np.linalg.norm(row))
                job.vectors[i] = row / norm if norm > 0 else row
            job.error, job.next = error, len(job.inputs)
            self.calls += 1
            self.inputs += len(job.inputs)
            self.tokens += job.tokens
            job.finish()

    async def _one(self, tokens: list[int]) -> Vectors:
        rid = "embed-" + os.urandom(16).hex()
        last = None
        params = self.make_params(self.segments(tokens) if self.rank else None)
        async for out in self.client.encode({"prompt_token_ids": tokens}, params, rid):
            last = out
        if last is None:
            raise EngineError("vLLM ended an embedding without output")
        return np.asarray(last.outputs.data, dtype=np.float32).reshape(-1)

    def close(self) -> None:
        return None  # the engine is the model's, closed with it


class VllmMedia:
    """Image and audio input on a vLLM multimodal model.  A part is checked as for
    llama.cpp (multimodal.py: PNG, JPEG or GIF images of bounded size; WAV, MP3 or FLAC
    audio of bounded length) and decoded here: an image with PIL, audio with soundfile
    to mono at the processor's sampling rate (soxr: vLLM's own resampler needs
    torchaudio).  In the prompt a part is the processor's image or audio token, once,
    which vLLM's processor expands to the part's positions when the decoded media come
    with the prompt (``multi_modal_data``, :meth:`VllmRunner._generate`)."""

    def __init__(self, image_token: int = -1, audio_token: int = -1,
                 sampling_rate: int = 16000) -> None:
        self.tokens = {"image": image_token, "audio": audio_token}
        self.vision, self.audio = image_token >= 0, audio_token >= 0
        self.sampling_rate = sampling_rate

    def check(self, media: Sequence[tuple[str, bytes]]) -> None:
        check_parts(media, self.vision, self.audio)

    def tokenize_media(self, kind: str, data: bytes,
                       n: int) -> tuple[list[int], list[MediaSegment]]:
        try:
            decoded = _image(data) if kind == "image" else _audio(data, self.sampling_rate)
        except Exception as exc:  # what the decoders raise on bytes they cannot read
            problem = (MediaProblem.IMAGE_UNREADABLE if kind == "image"
                       else MediaProblem.AUDIO_UNREADABLE)
            raise MediaInputError(f"media part {n} ({kind}) could not be decoded: {exc}",
                                  problem, n) from None
        return [self.tokens[kind]], [MediaSegment(0, 1, kind, decoded=decoded)]

    def close(self) -> None:
        return None


def _image(data: bytes) -> Any:
    from PIL import Image

    with Image.open(io.BytesIO(data)) as img:
        return img.convert("RGB")  # (its first frame: a GIF's too)


def _audio(data: bytes, rate: int) -> tuple[Any, int]:
    """Mono float32 samples at ``rate``, and the rate (vLLM's audio item)."""
    import soundfile
    import soxr

    samples, found = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
    mono = samples.mean(axis=1)
    if found != rate:
        mono = soxr.resample(mono, found, rate)
    return np.ascontiguousarray(mono, dtype=np.float32), rate


def multi_modal_data(segments: Sequence[MediaSegment]) -> dict[str, list[Any]]:
    """The decoded media of a prompt, in order, as vLLM takes them with the prompt."""
    data: dict[str, list[Any]] = {}
    for seg in segments:
        data.setdefault(seg.kind, []).append(seg.decoded)
    return data


def pooling_params(second: int | None = None) -> Any:
    """vLLM's ``PoolingParams`` for one embedding input (``second``, a reranker's
    second segment, means nothing here)."""
    from vllm import PoolingParams

    return PoolingParams(task="embed")


def rank_params(second: int | None) -> Any:
    """vLLM's ``PoolingParams`` for one reranker input whose second segment (token type
    1) starts at ``second``: its classifier head's raw output, as llama.cpp's rank
    pooling gives it (vLLM's own scoring would squash it with a sigmoid)."""
    from vllm import PoolingParams

    extra = {"compressed_token_type_ids": second} if second is not None else None
    return PoolingParams(task="classify", use_activation=False, extra_kwargs=extra)
