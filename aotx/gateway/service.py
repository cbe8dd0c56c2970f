"""The gateway object: its connection to the device, what it learned from INFO, the
credentials it checks and the grants it installs.

It keeps only transport conveniences: the model list and the current runtime epoch
from the device's information payload (when a reply shows a new epoch, the device has
restarted: it re-reads INFO and reinstalls grants), and the grant rows it installed.
Routes reach it through :func:`gateway` (a FastAPI dependency on ``app.state``) and
the caller through :func:`authenticated`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import orjson
from fastapi import Depends
from starlette.requests import Request

from .. import ids, wire
from ..config import Settings
from ..mailbox import mailbox_share
from ..paths import RuntimePaths
from .broker_client import BrokerClient, BrokerUnavailable, DeviceSilent
from .credentials import (
    ADMIN,
    CredentialStore,
    PrincipalGrant,
    ensure_admin_token,
    token_hash,
)
from .deadlines import Deadlines
from .errors import NO_CALL, ApiError, Call, failed, refusal

log = logging.getLogger("aotx.gateway")
T = TypeVar("T")

UNREACHABLE = "the device is not reachable; try again"
SILENT = "the device did not answer in time; try again"
#: How long the poll loop's own INFO may wait: it holds no caller, and one packet that
#: waits out a model load (or a restart) takes one mailbox, where one per deadline
#: would take a mailbox every few seconds until the device answers them all.
POLL_WAIT = 60.0


def unavailable(exc: BrokerUnavailable) -> ApiError:
    """The 503 for a failed broker call: a fixed message, the detail in the log only."""
    log.info("event=gateway.device_unreachable error=%s", exc)
    return ApiError(503, SILENT if isinstance(exc, DeviceSilent) else UNREACHABLE)


@dataclass(frozen=True)
class Principal:
    id: int
    name: str
    grant: PrincipalGrant


class Gateway:
    def __init__(self, paths: RuntimePaths, settings: Settings | None = None,
                 broker: BrokerClient | None = None) -> None:
        self.paths = paths
        self.settings = settings or Settings()
        self.broker = broker or BrokerClient(paths.socket)
        self.deadlines = Deadlines.from_settings(self.settings)
        self.info: wire.Info | None = None
        self.epoch = 0
        self.models: dict[str, wire.ModelInfo] = {}
        #: The device's MODELS read (device/residency.py): the budget, and each model's
        #: residency by alias; read with INFO, and at each poll while a model loads on demand.
        self.residency: dict[str, Any] = {}
        self.by_role: dict[int, wire.ModelInfo] = {}
        self._refresh_lock = asyncio.Lock()
        self.store = CredentialStore(paths.state_dir)
        self.store.ensure_token(ADMIN, ensure_admin_token(paths.admin_token),
                                int(wire.Action.all()))
        self.generation = -1
        self.tokens: dict[bytes, int] = {}
        self.principals: dict[int, PrincipalGrant] = {}
        self.installed: dict[int, wire.Grant] = {}  # what the device holds, less revisions
        self._sync_lock = asyncio.Lock()
        # True from a credential change until its rows are on the device: a failed
        # install (broker busy or restarting) is tried again, by the next request or
        # the poll loop, and requests wait for it rather than run under old grants.
        self.grants_dirty = False
        self.parked: dict[int, int] = {}  # principal id -> WAITs it has in flight
        # principal id -> (its share of the mailboxes, the semaphore that enforces it)
        self._mailboxes: dict[int, tuple[int, asyncio.Semaphore]] = {}
        self.embed_turns: dict[int, asyncio.Semaphore] = {}  # one /v1/embeddings call each
        self.background: set[asyncio.Future[Any]] = set()  # tasks nobody awaits (unparks)
        self._load_credentials()

    # -- authentication --------------------------------------------------------------------
    def _load_credentials(self) -> bool:
        gen = self.store.generation()
        if gen == self.generation:
            return False
        self.tokens, self.principals = self.store.snapshot()
        self.generation = gen
        self.grants_dirty = True
        return True

    async def authenticate(self, request: Request) -> Principal:
        """Map the bearer token (or, without an Authorization header, the ``x-api-key``
        that Anthropic's clients send) to a principal, with the credential store's latest
        state.

        The store's generation is checked on every call (one indexed SQLite read), so a
        revoked token is refused at once and a changed grant is installed on the device
        before this request goes on.
        """
        auth = request.headers.get("authorization")
        if auth is None and "x-api-key" in request.headers:
            auth = "Bearer " + request.headers["x-api-key"]  # Anthropic's clients' header
        scheme, _, token = (auth or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise ApiError(401, "missing bearer token", headers={"WWW-Authenticate": "Bearer"})
        self._load_credentials()
        if self.grants_dirty and self.info is not None:
            try:
                await self.sync_grants()
            except BrokerUnavailable as exc:
                log.info("event=gateway.grants_pending error=%s", exc)
                raise unavailable(exc) from None
        # The lookup is keyed by SHA-256 of the presented token, never by the token:
        # timing can at most reveal something about a hash, which does not help anyone
        # forge a 256-bit token (the timing-safe design of hashed lookup).
        pid = self.tokens.get(token_hash(token.strip()))
        if pid is None:
            raise ApiError(401, "invalid bearer token", headers={"WWW-Authenticate": "Bearer"})
        grant = self.principals[pid]
        return Principal(pid, grant.name, grant)

    # -- grants ------------------------------------------------------------------------------
    def grants(self) -> list[wire.Grant]:
        """Rows for every principal: those without a live token get no actions at all."""
        roles = {m.alias: m.role for m in self.models.values()}
        return [p.row(roles) if p.id in self.principals
                else wire.Grant(principal=p.id, actions=0, model_mask=0)
                for p in self.store.principals()]

    async def sync_grants(self) -> None:
        """Install the grant rows that differ from what the device holds."""
        async with self._sync_lock:
            generation = self.generation
            rows = [g for g in self.grants() if self.installed.get(g.principal) != g]
            for i in range(0, len(rows), wire.GRANT_PAGE):
                chunk = rows[i:i + wire.GRANT_PAGE]
                h = wire.Header(op=wire.Op.GRANT_INSTALL, total=len(chunk))
                gh, _ = await self.broker.call(h, wire.encode_grants(chunk), self.deadlines.of(h))
                if gh.status != 200:
                    raise BrokerUnavailable(f"grant installation refused: {gh.status}")
                for g in chunk:
                    self.installed[g.principal] = g
            # Clean unless the credentials changed again while these were installed.
            self.grants_dirty = self.generation != generation
            if rows:
                log.info("event=gateway.grants_installed rows=%d generation=%d", len(rows),
                         generation)

    async def read_grants(self) -> list[wire.Grant]:
        """Every row the device holds, a page (``GRANT_PAGE`` rows) at a time."""
        held: list[wire.Grant] = []
        while True:
            start = held[-1].principal + 1 if held else 0
            h = wire.Header(op=wire.Op.GRANT_READ, cursor=start)
            rh, rows = await self.broker.call(h, timeout=self.deadlines.of(h))
            if rh.status != 200:
                raise BrokerUnavailable(f"grant read refused: {rh.status}")
            page = wire.decode_grants(rows, rh.row_count)
            held += page
            if len(page) < wire.GRANT_PAGE:
                return held

    # -- the device --------------------------------------------------------------------------
    async def refresh(self, info_timeout: float | None = None) -> None:
        """Learn the device's models and epoch; install grants when the epoch is new.

        Grants are installed once per epoch only: installing bumps revisions, and a bumped
        revision hides results admitted under the previous one.  ``info_timeout``: how
        long the INFO may wait (its deadline unless given).
        """
        async with self._refresh_lock:
            info_h = wire.Header(op=wire.Op.INFO)
            h, body = await self.broker.call(info_h, timeout=info_timeout
                                             or self.deadlines.of(info_h))
            if h.status != 200:
                raise BrokerUnavailable(f"device information refused: {h.status}")
            info = wire.decode_info(body)
            new_epoch = self.info is None or info.epoch != self.epoch
            self.models = {m.alias: m for m in info.models}
            self.by_role = {m.role: m for m in info.models}
            if new_epoch:
                # Start from what the device already holds (a gateway restart must not bump
                # revisions: that would hide every result admitted before it).  A refused
                # read is not "nothing held": fail, and try the epoch again.
                held = await self.read_grants()
                # (revisions are the device's; the gateway compares rows without them)
                self.installed = {g.principal: g._replace(revision=0) for g in held}
                self.grants_dirty = True
                await self.sync_grants()
            # The epoch counts as known only once its grants are installed: a failure
            # above leaves it new, so the next call or poll installs them again.
            self.info = info
            self.epoch = info.epoch
            await self.read_residency(info_timeout or self.deadlines.of(info_h))
            if new_epoch:
                log.info("event=gateway.device_epoch epoch=%d models=%s", info.epoch,
                         ",".join(m.alias for m in info.models))

    async def ensure_ready(self) -> None:
        if self.info is None:
            try:
                # The whole refresh within INFO's deadline, waiting for the lock included:
                # the poll loop may hold it for a while, its INFO waiting out a model load.
                async with asyncio.timeout(self.deadlines.of(wire.Header(op=wire.Op.INFO))):
                    await self.refresh()
            except TimeoutError:
                raise unavailable(DeviceSilent("no device information in time")) from None
            except BrokerUnavailable as exc:
                raise unavailable(exc) from None

    def mailbox_share(self) -> int:
        """How many mailboxes one principal's calls may hold at once (its further calls
        wait in the gateway, so the others always find one)."""
        return mailbox_share(self.info.mailboxes) if self.info else 2

    async def call(self, h: wire.Header, payload: bytes = b"", timeout: float | None = None,
                   settled: Callable[[], None] | None = None) -> tuple[wire.Header, bytes]:
        """One broker call within ``timeout`` (the operation's deadline unless given);
        503 when the broker is unreachable or the device does not answer in time.  A
        principal's calls hold at most its share of the mailboxes at once, counted until
        the device has answered them: a call given up on (its deadline passed, its
        client gone) still counts while the device holds its packet.  ``settled`` is
        called once then (also when the packet was never sent)."""
        rh, body = await self._held(h, payload, timeout, settled)
        if rh.epoch and rh.epoch != self.epoch:
            # The device restarted: reinstall grants, then retry a refusal once, within
            # the principal's share as the first was.
            try:
                await self.refresh()
            except BrokerUnavailable as exc:
                raise unavailable(exc) from None
            if rh.status == 403:
                rh, body = await self._held(h, payload, timeout, None)
        return rh, body

    async def _held(self, h: wire.Header, payload: bytes, timeout: float | None,
                    settled: Callable[[], None] | None) -> tuple[wire.Header, bytes]:
        """One packet sent while the principal holds a place in its share."""
        release = Once(settled)
        try:
            await self.ensure_ready()  # (the share is a part of the mailboxes INFO reports)
            if h.principal and h.op != wire.Op.UNPARK:  # (the gateway's own; an UNPARK frees one)
                size = self.mailbox_share()
                held = self._mailboxes.get(h.principal)
                if held is None or held[0] != size:  # (a new epoch may have other mailboxes)
                    held = self._mailboxes[h.principal] = (size, asyncio.Semaphore(size))
                await held[1].acquire()
                release.fns.append(held[1].release)
            release.handed = True
            try:
                return await self.broker.call(h, payload, self.deadlines.of(h)
                                              if timeout is None else timeout, release)
            except BrokerUnavailable as exc:
                raise unavailable(exc) from None
        finally:
            if not release.handed:  # (the broker was never asked)
                release()

    def withdraw(self, h: wire.Header) -> None:
        """Have the device withdraw the call ``h`` (an EMBED whose caller gave up or
        left) now, in the background: UNPARK with its identity frees its mailbox."""
        unpark = wire.Header(op=wire.Op.UNPARK, principal=h.principal, identity=h.identity)
        task = asyncio.ensure_future(self.call(unpark))
        self.background.add(task)
        task.add_done_callback(self._background_done)

    def _background_done(self, task: asyncio.Future[Any]) -> None:
        self.background.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: nobody waits for its answer

    async def ask(self, h: wire.Header, payload: bytes = b"", ok: tuple[int, ...] = (200,),
                  context: Call = NO_CALL, timeout: float | None = None,
                  ) -> tuple[wire.Header, bytes]:
        """One operation; a refusal becomes the ApiError the errors table words."""
        rh, body = await self.call(h, payload, timeout)
        if rh.status not in ok:
            raise refusal(rh, context, body)
        return rh, body

    async def poll_loop(self) -> None:
        """Notice device restarts while idle, so grants are back before the next call."""
        while True:
            try:
                if self.info is None:
                    await self.refresh(info_timeout=POLL_WAIT)
                else:
                    h, body = await self.broker.call(wire.Header(op=wire.Op.INFO),
                                                     timeout=POLL_WAIT)
                    if h.epoch != self.epoch:
                        await self.refresh()
                    else:
                        changed = h.status == 200 and self._models_changed(
                            wire.decode_info(body))
                        if changed or any(e["on_demand"]
                                          for e in self.residency.get("models", ())):
                            await self.read_residency(POLL_WAIT)
                        if self._load_credentials() or self.grants_dirty:
                            await self.sync_grants()
            except (BrokerUnavailable, wire.WireError) as exc:
                log.debug("event=gateway.device_unreachable error=%s", exc)
            await asyncio.sleep(0.5 if self.info is not None else 0.2)

    def _models_changed(self, info: wire.Info) -> bool:
        """Take the rows of the same epoch's INFO when they changed: a model loaded on
        first use is listed from its description until it is loaded (device/ondemand.py),
        and one put in the models folder is listed once described (device/watch.py)."""
        if self.info is not None and info.models != self.info.models:
            self.models = {m.alias: m for m in info.models}
            self.by_role = {m.role: m for m in info.models}
            self.info = info
            # a model found in the folder since has a role now: a grant that names it
            # gets its bit (grants' rows are built from the roles: credentials.py)
            self.grants_dirty = True
            log.info("event=gateway.models_changed models=%s",
                     ",".join(m.alias for m in info.models))
            return True
        return False

    async def read_residency(self, timeout: float) -> dict[str, Any]:
        """The device's MODELS read, kept in :attr:`residency` (unchanged when refused)."""
        h, body = await self.broker.call(wire.Header(op=wire.Op.MODELS), timeout=timeout)
        if h.status == 200:
            self.residency = orjson.loads(body)
        return self.residency

    async def failure(self, h: wire.Header) -> ApiError:
        """The error of a request that failed after admission (``failed``); a failed
        load's names the model and why it failed."""
        m = self.by_role.get(h.role)
        if h.reason != wire.Reason.MODEL_LOAD or m is None:
            return failed(h)
        with contextlib.suppress(BrokerUnavailable, wire.WireError, orjson.JSONDecodeError):
            await self.read_residency(self.deadlines.of(wire.Header(op=wire.Op.MODELS)))
        entry = self.model_state(m.alias) or {}
        return failed(h, f"{m.alias}: {entry.get('reason') or 'see the service log'}")

    def model_state(self, alias: str) -> dict[str, Any] | None:
        """A model's residency entry, as the last MODELS read said."""
        return next((e for e in self.residency.get("models", ()) if e["alias"] == alias),
                    None)

    # -- models and handles ------------------------------------------------------------------
    def visible_models(self, principal: Principal) -> list[wire.ModelInfo]:
        return [m for m in self.models.values() if principal.grant.allows_model(m.alias)]

    def model_for(self, alias: str, principal: Principal) -> wire.ModelInfo:
        m = self.models.get(alias)
        if m is None or not principal.grant.allows_model(alias):
            raise ApiError(404, f"the model {alias!r} does not exist", param="model",
                           code="model_not_found")
        return m


class Once:
    """Callbacks that run once however often this is called (``fns`` is empty once they
    have); ``handed``: the broker client has taken it (it calls it when the device no
    longer holds the packet)."""

    def __init__(self, fn: Callable[[], None] | None) -> None:
        self.fns: list[Callable[[], None]] = [fn] if fn is not None else []
        self.handed = False

    def __call__(self) -> None:
        fns, self.fns = self.fns, []
        for fn in fns:
            fn()


def parse_id(rid: str) -> tuple[int, bytes]:
    """(epoch, identity) of a request id; 404 when malformed (a handle that names nothing)."""
    parsed = ids.parse_request_id(rid)
    if parsed is None:
        raise ApiError(404, "no such request")
    return parsed


async def until_disconnected(request: Request, work: Coroutine[Any, Any, T]) -> T:
    """``work``'s result, or 499 once the client has closed the connection: ``work`` is
    then cancelled, and what it asked of the device is withdrawn as it unwinds."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        task.cancel()  # (nothing when it is done)
    try:
        return await task
    except asyncio.CancelledError:
        if not gone.done() or gone.cancelled():
            raise  # this route was cancelled, not the work
        raise ApiError(499, "the client closed the connection") from None


async def _disconnected(request: Request) -> None:
    """Return when the client closes the connection (the body has been read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


# -- FastAPI dependencies -----------------------------------------------------------------------
def gateway(request: Request) -> Gateway:
    """The gateway object on ``app.state`` (set by the app's lifespan)."""
    g: Gateway = request.app.state.gateway
    return g


async def authenticated(request: Request) -> Principal:
    """The caller.  As a dependency it runs before FastAPI validates the body: no token,
    no validation details."""
    return await gateway(request).authenticate(request)


#: The dependencies as route defaults: ``principal: Principal = Caller, g: Gateway = Service``.
Caller = Depends(authenticated)
Service = Depends(gateway)
