"""Image and audio input through llama.cpp's multimodal library (libmtmd).

A model configured with a projector (``mmproj`` in the models file) gets one
:class:`MediaEncoder`.  It does two things:

* :meth:`MediaEncoder.tokenize` (control thread, at admission): the rendered
  prompt, with one ``<__media__>`` marker where each media part sits, plus the
  media bytes, become a token list in which every media position holds a
  *placeholder* (a negative number no real token has), and one
  :class:`MediaSegment` per media part: where it starts and how many positions
  it takes.  The image or audio is decoded and preprocessed here, so the
  admission knows the exact prompt length and a file that does not decode is a
  400 at once.
* :meth:`MediaEncoder.encode` (engine thread, when the scheduler reaches the
  segment): runs the projector's encoder and returns the embeddings, which the
  engine decodes into the request's sequence (``LlamaEngine.decode_embeddings``).

Every placeholder of one segment is the same negative number, and no two
segments ever share one, so prefix reuse (``Scheduler``) can never match a
cached image against a different one.

libmtmd keeps per-call state in its context; one lock serialises tokenize
and encode.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import threading
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("aotx.multimodal")

MARKER = "<__media__>"
_placeholders = itertools.count(1)


class MediaInputError(Exception):
    """The media could not be decoded or does not match the prompt (HTTP 400)."""


@dataclass(eq=False)
class MediaSegment:
    start: int  # first position in the prompt
    n_tokens: int  # positions it occupies (embeddings rows)
    kind: str  # "image" or "audio"
    chunk: Any = None  # owned mtmd_input_chunk copy until encoded or released
    non_causal: bool = False
    embeddings: Any = field(default=None, repr=False)  # ctypes float array once encoded

    def release(self) -> None:
        if self.chunk is not None:
            from llama_cpp import mtmd_cpp

            mtmd_cpp.mtmd_input_chunk_free(self.chunk)
            self.chunk = None


def release_all(segments: list[MediaSegment]) -> None:
    for seg in segments:
        seg.release()
        seg.embeddings = None


class MediaEncoder:
    """One model's projector."""

    def __init__(self, mmproj: str, model: Any, n_embd: int, threads: int,
                 use_gpu: bool = False) -> None:
        from llama_cpp import mtmd_cpp

        self.m = mtmd_cpp
        params = mtmd_cpp.mtmd_context_params_default()
        params.use_gpu = use_gpu
        params.print_timings = False
        params.n_threads = threads
        params.warmup = False
        params.media_marker = MARKER.encode()
        self.ctx = mtmd_cpp.mtmd_init_from_file(mmproj.encode(), model, params)
        if not self.ctx:
            raise MediaInputError(f"llama.cpp could not load the projector {mmproj}")
        if mtmd_cpp.mtmd_decode_use_mrope(self.ctx):
            self.close()
            raise MediaInputError(f"{mmproj}: projectors with M-RoPE positions (Qwen2-VL "
                                  "family) are not supported")
        self.vision = bool(mtmd_cpp.mtmd_support_vision(self.ctx))
        self.audio = bool(mtmd_cpp.mtmd_support_audio(self.ctx))
        self.n_embd = n_embd
        self.lock = threading.Lock()
        self.encoded = 0
        self.encode_seconds = 0.0

    def tokenize(self, text: str, media: list[tuple[str, bytes]],
                 add_special: bool) -> tuple[list[int], list[MediaSegment]]:
        """Tokens (with placeholders) and segments for ``text`` whose markers stand
        for ``media`` in order.  The caller owns the segments: release them when
        the request will not run (``release_all``)."""
        m = self.m
        for kind, _ in media:
            if (kind == "image" and not self.vision) or (kind == "audio" and not self.audio):
                raise MediaInputError(f"the projector does not accept {kind} input")
        with self.lock:
            bitmaps = []
            chunks = None
            try:
                for n, (kind, data) in enumerate(media):
                    buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
                    bmp = m.mtmd_helper_bitmap_init_from_buf(self.ctx, buf, len(data), False)
                    if not bmp:
                        raise MediaInputError(f"media part {n} ({kind}) could not be decoded")
                    bitmaps.append(bmp)
                raw = text.encode("utf-8")
                inp = m.mtmd_input_text(raw, len(raw), add_special, True)
                arr = (m.mtmd_bitmap_p_ctypes * max(1, len(bitmaps)))(*bitmaps)
                chunks = m.mtmd_input_chunks_init()
                rc = m.mtmd_tokenize(self.ctx, chunks, ctypes.byref(inp), arr, len(bitmaps))
                if rc == 1:
                    raise MediaInputError("the prompt's media markers do not match its media parts")
                if rc != 0:
                    raise MediaInputError(f"the media could not be preprocessed (mtmd {rc})")
                return self._flatten(chunks)
            finally:
                for bmp in bitmaps:
                    m.mtmd_bitmap_free(bmp)
                if chunks is not None:
                    m.mtmd_input_chunks_free(chunks)

    def _flatten(self, chunks: Any) -> tuple[list[int], list[MediaSegment]]:
        m = self.m
        tokens: list[int] = []
        segments: list[MediaSegment] = []
        try:
            for i in range(m.mtmd_input_chunks_size(chunks)):
                chunk = m.mtmd_input_chunks_get(chunks, i)
                ctype = m.mtmd_input_chunk_get_type(chunk)
                if ctype == m.MTMD_INPUT_CHUNK_TYPE_TEXT:
                    n = ctypes.c_size_t(0)
                    ptr = m.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n))
                    tokens += ptr[:n.value] if n.value else []
                    continue
                n_tok = int(m.mtmd_input_chunk_get_n_tokens(chunk))
                n_pos = int(m.mtmd_input_chunk_get_n_pos(chunk))
                if n_pos != n_tok:
                    raise MediaInputError("this projector's positions differ from its tokens; "
                                          "not supported")
                kind = "audio" if ctype == m.MTMD_INPUT_CHUNK_TYPE_AUDIO else "image"
                seg = MediaSegment(start=len(tokens), n_tokens=n_tok, kind=kind,
                                   chunk=m.mtmd_input_chunk_copy(chunk),
                                   non_causal=bool(m.mtmd_decode_use_non_causal(self.ctx, chunk)))
                segments.append(seg)
                tokens += [-next(_placeholders)] * n_tok
        except BaseException:
            release_all(segments)
            raise
        return tokens, segments

    def encode(self, seg: MediaSegment) -> Any:
        """The segment's embeddings (``n_tokens * n_embd`` floats); engine thread."""
        import time

        if seg.embeddings is not None:
            return seg.embeddings
        if seg.chunk is None:
            raise MediaInputError("the media segment was released")
        with self.lock:
            t0 = time.perf_counter()
            rc = self.m.mtmd_encode_chunk(self.ctx, seg.chunk)
            if rc != 0:
                raise MediaInputError(f"the projector failed to encode the {seg.kind} (mtmd {rc})")
            out = self.m.mtmd_get_output_embd(self.ctx)
            size = seg.n_tokens * self.n_embd
            embd = (ctypes.c_float * size)()
            ctypes.memmove(embd, out, size * ctypes.sizeof(ctypes.c_float))
            self.encoded += 1
            self.encode_seconds += time.perf_counter() - t0
        seg.embeddings = embd
        seg.release()
        return embd

    def close(self) -> None:
        if self.ctx:
            self.m.mtmd_free(self.ctx)
            self.ctx = None
