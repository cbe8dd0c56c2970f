"""Models loaded on first use: a model of the models folder (or one the models file marks
``on_demand``) is described at start and loaded when a request first names it.

Until it is loaded a model is listed from its description (engine/llama/describe.py): its
context, its template's tool format, text input.  A SUBMIT for it is answered at once
with a request in the seed's ``preparing`` phase (:class:`Deferred`: the header and
payload kept, the principal's active count taken), and the load starts on a thread of
its own (:class:`Loader`), one per model however many requests wait.  When the load
ends, the control thread installs the model and admits the waiting requests as if they
had just come (``Admission.admit_deferred``): a refusal then fails the request with the
refusal's status and reason.  A load that fails fails every waiting request (503,
``MODEL_LOAD``), and the model shows ``failed`` until its file changes.

A load must fit the memory budget beside the models loaded (device/fleet.py's rule,
applied by the runtime): it unloads idle models first (:meth:`Loader.unload`, on a
thread of its own), or waits; a model idle past its keep-alive is unloaded too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import queue
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .. import wire
from ..engine.interface import EngineError
from ..engine.load import describe
from ..engine.request import Request
from ..engine.spec import ModelSpec
from ..wire import Header, Reason
from .errors import DeviceError
from .fleet import Resident
from .loading import NO_CHAT, LoadedModel, read_template
from .models import file_sha256
from .template import ChatTemplate, TemplateError

log = logging.getLogger("aotx.device")

UNLOADED, LOADING, LOADED, UNLOADING, FAILED = (
    "unloaded", "loading", "loaded", "unloading", "failed")


@dataclass
class Deferred:
    """A SUBMIT admitted while its model loads: its request (``preparing``) and what the
    admission needs once the model is there."""

    req: Request
    header: Header
    payload: bytes
    since: float = field(default_factory=time.monotonic)  # when it came


@dataclass
class OnDemand:
    spec: ModelSpec
    info: wire.ModelInfo  # what INFO lists while it is not loaded
    memory_bytes: int  # the description's estimate
    vram_bytes: int = 0  # the part of it on the GPU (gpu_layers; engine/llama/offload.py)
    state: str = UNLOADED
    reason: str = ""  # why it failed (the device's log says it too)
    waiting: list[Deferred] = field(default_factory=list)
    loads: int = 0
    load_seconds: float = 0.0
    failed_file: tuple[int, int] = (0, 0)  # the file's size and mtime when its load failed
    described: tuple[int, int] = (0, 0)  # the file's size and mtime when it was described
    evictions: int = 0  # unloads to make room for another model
    last_used: float = 0.0  # monotonic: its last request's admission or end, or its load
    #: principal -> (its last use, the keep-alive its last request asked: fleet.Resident)
    users: dict[int, tuple[float, float]] = field(default_factory=dict)
    sha256: bytes | None = None  # its file's, once hashed (:class:`Hasher`) or loaded
    asked: float = 0.0  # monotonic: when an admin asked for its load (0: not asked)
    asked_by: int = 0  # that admin's principal
    unload_asked: bool = False  # an admin asked for its unload: once its requests end

    def used(self, principal: int, now: float, keep_alive: float | None = None) -> None:
        """A request of ``principal`` was admitted (``keep_alive``: what it asked, None:
        the model's) or ended (None: what its principal's last request asked)."""
        self.last_used = now
        if principal:  # (the resident policy's own work is nobody's)
            if keep_alive is None:
                keep_alive = self.users.get(principal, (0.0, self.spec.keep_alive))[1]
            self.users[principal] = (now, keep_alive)

    def unclaimed(self) -> bool:
        """Unloaded (or failed), and no request or admin waits for its load: the models
        folder's watch may change its entry (its file gone, or replaced)."""
        return self.state in (UNLOADED, FAILED) and not self.waiting and not self.asked

    def resident(self, busy: bool = False) -> Resident:
        """The model as the residency rule sees it (device/fleet.py)."""
        return Resident(self.spec.role, self.memory_bytes, self.spec.keep_alive, busy,
                        self.last_used, dict(self.users))

    def asked_keep_alive(self, h: Header, admin: bool) -> float:
        """The keep-alive a SUBMIT asks (``SUBMIT_FLAG_KEEP_ALIVE``), else the model's.
        Only an admin's may be longer than the model's own (or pin it): one principal's
        requests cannot hold the memory the others' models need past what the operator
        set (docs/security.md)."""
        own = self.spec.keep_alive
        if not h.submit_flags & wire.SUBMIT_FLAG_KEEP_ALIVE:
            return own
        asked = -1.0 if h.keep_alive_ms == wire.KEEP_ALIVE_FOREVER else h.keep_alive_ms / 1000
        if admin or own < 0 or 0 <= asked <= own:
            return asked
        return own

    def retry(self, force: bool = False) -> bool:
        """Whether a failed model's file has changed since, or an admin asks (``force``):
        then it may load again."""
        file = file_identity(self.spec.path)
        if file == (0, 0) or (file == self.failed_file and not force):
            return False
        self.state, self.reason = UNLOADED, ""
        return True

    def ask_load(self, principal: int, now: float, force: bool = False) -> None:
        """Ask for its load, as an admin does (``force``: a failed one too, its file
        unchanged) or an EMBED does: it loads once there is room, and again once
        unloaded; 503 MODEL_LOAD for a failed one that may not load again."""
        if self.state == FAILED and not self.retry(force):
            raise DeviceError(503, Reason.MODEL_LOAD, retry_after=60)
        if self.state in (UNLOADED, UNLOADING) and not self.asked:
            self.asked, self.asked_by = now, principal


#: An absolute path in a message: the folders before its last part.
_FOLDERS = re.compile(r"/(?:[^/\s'\"]+/)+(?=[^/\s'\"])")


def why(spec: ModelSpec, exc: BaseException) -> str:
    """A failed load's reason as principals may read it (/v1/models, a failed request's
    error): every path's folders left out, the model's own files' and any other (the
    device's log has them whole)."""
    text = str(exc)
    for path in (spec.path, spec.mmproj, spec.chat_template):
        if path:
            text = text.replace(path, os.path.basename(path))
    return _FOLDERS.sub("", text)


def listed(spec: ModelSpec) -> OnDemand:
    """``spec`` described, as INFO lists it until it is loaded (EngineError, TemplateError
    when its file or template cannot be read).  A models folder's model (kind "auto")
    takes the kind its file declares: an embedding model or a reranker gets one slot."""
    file = file_identity(spec.path)  # (before the read: a change meanwhile shows later)
    d = describe(spec)
    if spec.kind == "auto":
        spec = dataclasses.replace(spec, kind=d.kind,
                                   slots=spec.slots if d.kind == "chat" else 1)
    chat = spec.kind == "chat"
    source = read_template(spec.chat_template) if spec.chat_template else d.chat_template
    # (an embedding model or a reranker renders no chat: its file may have no template)
    template = ChatTemplate(source if chat else NO_CHAT, bos_token=d.bos_text,
                            eos_token=d.eos_text)
    rerank = spec.kind == "rerank"  # (a score per document)
    info = wire.ModelInfo(spec.role, spec.alias, bytes(32), wire.MOD_TEXT, 0,
                          spec.context if chat else 0, embedding_dims=1 if rerank else d.n_embd,
                          embedding_tokens=spec.embedding_context,
                          tool_format=template.tool_format, rerank=rerank)
    return OnDemand(spec, info, d.memory_bytes, d.vram_bytes, described=file)


def file_identity(path: str) -> tuple[int, int]:
    """A file's size and modification time; (0, 0) when it cannot be read."""
    try:
        st = os.stat(path)
    except OSError:
        return (0, 0)
    return (st.st_size, st.st_mtime_ns)


def describe_all(specs: list[ModelSpec]) -> dict[int, OnDemand]:
    """The on-demand models, by role; one that cannot be described is listed ``failed``."""
    out = {}
    for spec in specs:
        try:
            out[spec.role] = listed(spec)
        except (EngineError, TemplateError, OSError) as exc:
            log.warning("event=model.undescribed alias=%s error=%s", spec.alias, exc)
            if spec.kind == "auto":  # (described again once its file changes)
                spec = dataclasses.replace(spec, kind="chat")
            info = wire.ModelInfo(spec.role, spec.alias, bytes(32), wire.MOD_TEXT, 0,
                                  spec.context, rerank=spec.kind == "rerank")
            out[spec.role] = OnDemand(spec, info, 0, 0, FAILED, why(spec, exc))
    return out


class Hasher:
    """Hashes the on-demand models' files on a thread of its own, at the lowest CPU
    priority, so that a start never waits for a folder of multi-GB files: each entry's
    ``sha256`` is set once known (the cache in the state folder makes it once per file
    identity; a load hashes the file itself when it comes first, and checks a pinned
    ``sha256`` then)."""

    def __init__(self, entries: list[OnDemand], cache_path: str) -> None:
        self.thread = threading.Thread(target=self._run, args=(entries, cache_path),
                                       name="hash-models", daemon=True)

    def start(self) -> None:
        self.thread.start()

    @staticmethod
    def _run(entries: list[OnDemand], cache_path: str) -> None:
        with contextlib.suppress(OSError):  # (Linux: a thread's own nice value)
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        for od in entries:
            if os.path.isfile(od.spec.path) and od.sha256 is None:
                try:
                    od.sha256 = file_sha256(od.spec.path, cache_path)
                except OSError as exc:
                    log.warning("event=model.hash_failed alias=%s error=%s", od.spec.alias, exc)


class Loader:
    """Loads on-demand models, each on a thread of its own; the control thread takes the
    results (:meth:`finished`) when ``ring`` wakes it."""

    def __init__(self, load: Callable[[ModelSpec], LoadedModel], ring: Callable[[], None]) -> None:
        self._load, self._ring = load, ring
        self._done: queue.Queue[tuple[OnDemand, LoadedModel | Exception | None, float]] = (
            queue.Queue())
        self.threads: list[threading.Thread] = []

    def start(self, entry: OnDemand) -> None:
        """Begin loading ``entry`` (control thread, lock held): its state is ``loading``."""
        entry.state = LOADING
        log.info("event=model.load_on_demand alias=%s waiting=%d", entry.spec.alias,
                 len(entry.waiting))
        t = threading.Thread(target=self._run, args=(entry,), name=f"load-{entry.spec.alias}",
                             daemon=True)
        self.threads.append(t)
        t.start()

    def _run(self, entry: OnDemand) -> None:
        t0 = time.monotonic()
        try:
            result: LoadedModel | Exception = self._load(entry.spec)
        except Exception as exc:  # any failure of a load is the model's, reported to its waiters
            log.warning("event=model.load_failed alias=%s error=%s", entry.spec.alias, exc)
            result = exc
        self._done.put((entry, result, time.monotonic() - t0))
        self._ring()

    def unload(self, entry: OnDemand, model: LoadedModel) -> None:
        """Stop ``model``'s engine thread and give back what it holds, on a thread of its
        own (its ``stop`` takes the lock the control thread holds); :meth:`finished`
        reports it with None."""
        entry.state = UNLOADING

        def run() -> None:
            t0 = time.monotonic()
            model.scheduler.stop()
            if model.thread is not None:
                model.thread.join()
            model.close()
            log.info("event=model.unloaded alias=%s", entry.spec.alias)
            self._done.put((entry, None, time.monotonic() - t0))
            self._ring()

        t = threading.Thread(target=run, name=f"unload-{entry.spec.alias}", daemon=True)
        self.threads.append(t)
        t.start()

    def finished(self) -> list[tuple[OnDemand, LoadedModel | Exception | None, float]]:
        out = []
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                return out
