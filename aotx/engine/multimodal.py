"""Image and audio input through llama.cpp's multimodal library (libmtmd).

A model configured with a projector (``mmproj`` in the models file) gets one
:class:`MediaEncoder`.  It does two things:

* :meth:`MediaEncoder.tokenize_media` (media worker, at admission): one media
  part's bytes become its tokens, in which every media position holds a
  *placeholder* (a negative number no real token has), and a
  :class:`MediaSegment` per chunk the projector makes of it: where it starts and
  how many positions it takes.  The device puts them between the tokens of the
  prompt's text (``aotx.device.prompt``), where the part sits.  The image or
  audio is decoded and preprocessed here, so the admission knows the exact
  prompt length and a file that does not decode is a 400 at once.
* :meth:`MediaEncoder.encode` (engine thread, when the scheduler reaches the
  segment): runs the projector's encoder and returns the embeddings, which the
  engine decodes into the request's sequence (``LlamaEngine.decode_embeddings``).

Every placeholder of one segment is the same negative number, and no two
segments ever share one, so prefix reuse (``Scheduler``) can never match a
cached image against a different one.

``mtmd_tokenize`` is thread-safe on a shared context; ``encode`` keeps state
in the context (its output buffer), so a lock serialises encodes only.

Only formats the bundled decoders read are handed to libmtmd: PNG, JPEG and
GIF images (stb_image) of at most ``MAX_PIXELS``, and WAV, MP3 and FLAC audio
(miniaudio).  Anything else is refused before libmtmd sees it: its helper would
otherwise fall through to video decoding, which starts ffmpeg on the bytes.
"""

from __future__ import annotations

import ctypes
import enum
import itertools
import logging
import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ..config import AUDIO_RATES, MAX_AUDIO_SECONDS, MAX_IMAGE_PIXELS

log = logging.getLogger("aotx.multimodal")

MARKER = "<__media__>"
# The decoders' bounds are part of the service's contract (the gateway words them in
# its refusals), so they live in aotx.config, which every process reads.
MAX_PIXELS = MAX_IMAGE_PIXELS
_placeholders = itertools.count(1)
_log_callback: Any = None  # kept alive: libmtmd holds the pointer


def image_size(data: bytes) -> tuple[str, int, int] | None:
    """(format, width, height) read from a PNG, GIF or JPEG header; None otherwise."""
    if data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) >= 24 and data[12:16] == b"IHDR":
        w, h = struct.unpack(">II", data[16:24])
        return "png", w, h
    if data[:6] in (b"GIF87a", b"GIF89a") and len(data) >= 10:
        w, h = struct.unpack("<HH", data[6:10])
        return "gif", w, h
    if data.startswith(b"\xff\xd8"):
        # The segments before the frame header, read as stb_image reads them: a marker
        # is 0xFF, any number of 0xFF fill bytes, then its code.  Only the codes stb
        # handles there are skipped; anything else is refused (stb would fail on it).
        i = 2
        while i + 9 <= len(data):
            if data[i] != 0xFF:
                return None
            while i + 1 < len(data) and data[i + 1] == 0xFF:
                i += 1  # fill byte
            if i + 9 > len(data):
                return None
            marker = data[i + 1]
            (length,) = struct.unpack(">H", data[i + 2:i + 4])
            if marker in (0xC0, 0xC1, 0xC2):  # the frame header stb decodes
                h, w = struct.unpack(">HH", data[i + 5:i + 9])
                return "jpeg", w, h
            if not (marker in (0xC4, 0xDB, 0xDD, 0xFE) or 0xE0 <= marker <= 0xEF):
                return None
            i += 2 + length
    return None


def audio_format(data: bytes) -> str | None:
    if data[:4] == b"RIFF" and data[8:12] == b"WAVE":
        return "wav"
    if data.startswith(b"fLaC"):
        return "flac"
    if data.startswith(b"ID3") or (len(data) > 1 and data[0] == 0xFF and data[1] & 0xE0 == 0xE0):
        return "mp3"
    return None


_NO_FFMPEG_DIR = b"/dev/null/"  # not a directory: no ffprobe or ffmpeg can be found in it

#: Audio is decoded whole, resampled to the projector's rate (16 kHz: 64 KB a second
#: as float32); a header may claim any length or a sample rate of 1 Hz.


def audio_header(data: bytes) -> tuple[int, float | None] | None:
    """(sample rate, seconds or None where the header does not say) of a WAV or FLAC
    file; None when its header cannot be read."""
    if data[:4] == b"RIFF" and data[8:12] == b"WAVE":
        rate = byte_rate = 0
        i = 12
        while i + 8 <= len(data):
            cid, size = data[i:i + 4], struct.unpack("<I", data[i + 4:i + 8])[0]
            if cid == b"fmt " and size >= 16 and i + 24 <= len(data):
                _, _, rate, byte_rate = struct.unpack("<HHII", data[i + 8:i + 20])
            elif cid == b"data":
                if not rate or not byte_rate:
                    return None
                return rate, min(size, len(data) - i - 8) / byte_rate
            i += 8 + size + (size & 1)
        return None
    if data.startswith(b"fLaC"):
        if len(data) < 42 or data[4] & 0x7F != 0:  # STREAMINFO must come first
            return None
        x = int.from_bytes(data[18:26], "big")
        rate, total = x >> 44, x & ((1 << 36) - 1)
        return rate, (total / rate if total and rate else None)
    return None


class MediaTokenizer(Protocol):
    """What the device needs of a model's media input: :class:`MediaEncoder` (llama.cpp's
    projector) or ``VllmMedia`` (engine/vllm_inputs.py)."""

    vision: bool
    audio: bool

    def check(self, media: Sequence[tuple[str, bytes]]) -> None: ...
    def tokenize_media(self, kind: str, data: bytes,
                       n: int) -> tuple[list[int], list[MediaSegment]]: ...
    def close(self) -> None: ...


def check_parts(media: Sequence[tuple[str, bytes]], vision: bool, audio: bool) -> None:
    """Refuse, before any is decoded, a part of a kind the model does not take or that
    the bundled decoders cannot read."""
    for n, (kind, data) in enumerate(media):
        if (kind == "image" and not vision) or (kind == "audio" and not audio):
            raise MediaInputError(f"the projector does not accept {kind} input",
                                  MediaProblem.MODALITY, n)
        check_media(kind, data, n)


def check_media(kind: str, data: bytes, n: int) -> None:
    """Refuse what the bundled decoders cannot read, or an image too large to decode."""
    if kind == "image":
        _check_image(data, n)
    else:
        _check_audio(data, n)


def _check_image(data: bytes, n: int) -> None:
    size = image_size(data)
    if size is None:
        raise MediaInputError(f"media part {n} (image) could not be decoded: only PNG, "
                              "JPEG and GIF images are read", MediaProblem.IMAGE_UNREADABLE, n)
    fmt, w, h = size
    if not w or not h or w * h > MAX_PIXELS:
        raise MediaInputError(f"media part {n} (image) is {w}x{h} {fmt}; at most "
                              f"{MAX_PIXELS} pixels are decoded", MediaProblem.IMAGE_PIXELS, n)


def _check_audio(data: bytes, n: int) -> None:
    fmt = audio_format(data)
    if fmt is None:
        raise MediaInputError(f"media part {n} (audio) could not be decoded: only WAV, "
                              "MP3 and FLAC audio is read", MediaProblem.AUDIO_UNREADABLE, n)
    if fmt == "mp3":
        return  # no length in the header; an MP3 decodes to ~16 samples a byte at most
    head = audio_header(data)
    if head is None:
        raise MediaInputError(f"media part {n} ({fmt}) has no readable header",
                              MediaProblem.AUDIO_UNREADABLE, n)
    rate, seconds = head
    if not AUDIO_RATES[0] <= rate <= AUDIO_RATES[1]:
        raise MediaInputError(f"media part {n} ({fmt}) has a sample rate of {rate} Hz; "
                              f"{AUDIO_RATES[0]} to {AUDIO_RATES[1]} Hz are read",
                              MediaProblem.AUDIO_RATE, n)
    if seconds is None or seconds > MAX_AUDIO_SECONDS:
        length = "an unstated time" if seconds is None else f"{seconds:.0f} s"
        raise MediaInputError(f"media part {n} ({fmt}) lasts {length}; at most "
                              f"{MAX_AUDIO_SECONDS} s of audio are decoded",
                              MediaProblem.AUDIO_LENGTH, n)


def quiet_logs() -> None:
    """Send libmtmd's messages to the aotx log, warnings and errors only: its debug
    output echoes prompt text, which the device does not log unless asked."""
    global _log_callback
    if _log_callback is not None:
        return
    import llama_cpp
    from llama_cpp import mtmd_cpp

    @llama_cpp.llama_log_callback
    def _cb(level: int, text: bytes, user_data: Any) -> None:
        if level in (2, 3):  # GGML_LOG_LEVEL_WARN, GGML_LOG_LEVEL_ERROR
            msg = text.decode("utf-8", errors="replace").strip()
            if msg:
                log.warning("event=mtmd.log message=%r", msg)

    _log_callback = _cb
    mtmd_cpp.mtmd_helper_log_set(_cb, None)


class MediaProblem(enum.Enum):
    """What is wrong with a media part (the device turns it into a refusal)."""

    IMAGE_UNREADABLE = enum.auto()
    IMAGE_PIXELS = enum.auto()
    AUDIO_UNREADABLE = enum.auto()
    AUDIO_RATE = enum.auto()
    AUDIO_LENGTH = enum.auto()
    MODALITY = enum.auto()  # the projector does not encode this kind
    PREPARE = enum.auto()  # libmtmd could not preprocess or encode it


class MediaInputError(Exception):
    """The media could not be decoded or does not match the prompt: ``problem`` says
    what, ``part`` which media part (in prompt order); the message is for the log."""

    def __init__(self, message: str, problem: MediaProblem = MediaProblem.PREPARE,
                 part: int = 0) -> None:
        super().__init__(message)
        self.problem = problem
        self.part = part


@dataclass(eq=False)
class MediaSegment:
    start: int  # first position in the prompt
    n_tokens: int  # positions it occupies (embeddings rows)
    kind: str  # "image" or "audio"
    chunk: Any = None  # owned mtmd_input_chunk copy until encoded or released
    decoded: Any = None  # the decoded media, for an engine that takes it whole (vLLM)
    non_causal: bool = False

    def release(self) -> None:
        if self.chunk is not None:
            from llama_cpp import mtmd_cpp

            mtmd_cpp.mtmd_input_chunk_free(self.chunk)
            self.chunk = None


def release_all(segments: list[MediaSegment]) -> None:
    for seg in segments:
        seg.release()


class MediaEncoder:
    """One model's projector."""

    def __init__(self, mmproj: str, model: Any, n_embd: int, threads: int,
                 batch: int, use_gpu: bool = False) -> None:
        from llama_cpp import mtmd_cpp

        quiet_logs()
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
        self.batch = batch  # a non-causal segment must fit one llama_decode call
        self.lock = threading.Lock()

    def check(self, media: Sequence[tuple[str, bytes]]) -> None:
        check_parts(media, self.vision, self.audio)

    def tokenize_media(self, kind: str, data: bytes,
                       n: int) -> tuple[list[int], list[MediaSegment]]:
        """The tokens (with placeholders) and segments of media part ``n`` alone, starting
        at position 0: libmtmd's tokenization of one marker with its bitmap, which adds
        the tokens the projector puts around the media (an image's begin and end tokens)
        and splits it where the projector does.  The prompt's text is not given to libmtmd:
        it would take every marker text in it for a media part (the device tokenizes the
        text itself, ``device.prompt``).  The caller owns the segments: release them when
        the request will not run (``release_all``)."""
        m = self.m
        unreadable = {"image": MediaProblem.IMAGE_UNREADABLE,
                      "audio": MediaProblem.AUDIO_UNREADABLE}
        bitmap = chunks = None
        try:
            buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
            opt = m.mtmd_helper_init_opt_default()
            # Bytes stb_image cannot decode fall through to libmtmd's video path,
            # which runs ffprobe/ffmpeg on them: point it at a "directory" that
            # cannot hold them, so untrusted bytes never reach an ffmpeg.
            opt.video_params.ffmpeg_bin_dir = _NO_FFMPEG_DIR
            got = m.mtmd_helper_bitmap_init_from_buf_wrapper(self.ctx, buf, len(data), False, opt)
            bitmap = got.bitmap  # freed below, whatever happens
            if got.video_ctx:  # never asked for; free it rather than leak it
                m.mtmd_helper_video_free(got.video_ctx)
            if got.video_ctx or not bitmap:
                raise MediaInputError(f"media part {n} ({kind}) could not be decoded",
                                      unreadable[kind], n)
            raw = MARKER.encode()
            inp = m.mtmd_input_text(raw, len(raw), False, True)
            arr = (m.mtmd_bitmap_p_ctypes * 1)(bitmap)
            chunks = m.mtmd_input_chunks_init()
            rc = m.mtmd_tokenize(self.ctx, chunks, ctypes.byref(inp), arr, 1)
            if rc != 0:
                raise MediaInputError(f"media part {n} ({kind}) could not be preprocessed "
                                      f"(mtmd {rc})", MediaProblem.PREPARE, n)
            return self._flatten(chunks)
        finally:
            if bitmap:
                m.mtmd_bitmap_free(bitmap)
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
                non_causal = bool(m.mtmd_decode_use_non_causal(self.ctx, chunk))
                if non_causal and n_tok > self.batch:
                    # split over several decode calls, its positions would stop seeing
                    # each other: refuse rather than compute something else
                    raise MediaInputError(f"the {kind} takes {n_tok} positions, more than "
                                          f"one batch of {self.batch}")
                seg = MediaSegment(start=len(tokens), n_tokens=n_tok, kind=kind,
                                   chunk=m.mtmd_input_chunk_copy(chunk), non_causal=non_causal)
                segments.append(seg)
                tokens += [-next(_placeholders)] * n_tok
        except BaseException:
            release_all(segments)
            raise
        return tokens, segments

    def encode(self, seg: MediaSegment) -> Any:
        """The segment's embeddings (``n_tokens * n_embd`` floats, a copy: libmtmd's
        buffer is reused by the next encode); engine thread.  Frees the segment's chunk."""
        if seg.chunk is None:
            raise MediaInputError("the media segment was released")
        with self.lock:
            rc = self.m.mtmd_encode_chunk(self.ctx, seg.chunk)
            if rc != 0:
                raise MediaInputError(f"the projector failed to encode the {seg.kind} (mtmd {rc})")
            out = self.m.mtmd_get_output_embd(self.ctx)
            size = seg.n_tokens * self.n_embd
            embd = (ctypes.c_float * size)()
            ctypes.memmove(embd, out, size * ctypes.sizeof(ctypes.c_float))
        seg.release()
        return embd

    def close(self) -> None:
        if self.ctx:
            self.m.mtmd_free(self.ctx)
            self.ctx = None
