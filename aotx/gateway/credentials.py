"""Credentials and grant definitions, in SQLite in the state folder (``DIR/aotx.db``).

Tokens are 256-bit random strings shown once; only their SHA-256 is stored.
Each token maps to a principal; each principal has one grant definition
(actions, model aliases, limits).  The gateway turns these into 64-byte grant
rows for the device; the device never sees a token or a hash.

Every change bumps ``meta.generation``; a running gateway polls that number
(twice a second) and applies changes without a restart.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import sqlite3
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from .. import wire

ACTION_NAMES: dict[str, int] = {
    "submit": wire.Action.SUBMIT, "read": wire.Action.READ, "cancel": wire.Action.CANCEL,
    "policy-read": wire.Action.POLICY_READ, "telemetry": wire.Action.TELEMETRY,
    "media": wire.Action.MEDIA, "admin": wire.Action.ADMIN,
    "policy-control": wire.Action.POLICY_CONTROL,
}
DEFAULT_ACTIONS = ("submit", "read", "cancel", "media")
LIMIT_KEYS = ("active", "output_tokens", "input_bytes", "media_sources", "media_bytes", "rate")
#: The largest value each limit's field in the device's grant row holds.
LIMIT_MAX = {k: (1 << (64 if k == "media_bytes" else 32)) - 1 for k in LIMIT_KEYS}
#: The principal of the admin token file; every gateway start sets its grant (all actions).
ADMIN = "admin"
TOKEN_PREFIX = "aotx-"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS principals (
    id INTEGER PRIMARY KEY,
    name TEXT NOT NULL UNIQUE,
    actions INTEGER NOT NULL,
    models TEXT NOT NULL,
    limits TEXT NOT NULL,
    memory INTEGER NOT NULL DEFAULT 0,
    updated_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS tokens (
    id INTEGER PRIMARY KEY,
    hash BLOB NOT NULL UNIQUE,
    principal_id INTEGER NOT NULL REFERENCES principals(id),
    created_at REAL NOT NULL,
    revoked_at REAL
);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
INSERT OR IGNORE INTO meta VALUES ('generation', 0);
"""


class CredentialError(Exception):
    pass


def token_hash(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def parse_actions(text: str) -> int:
    mask = 0
    for name in (t.strip() for t in text.split(",")):
        if not name:
            continue
        if name not in ACTION_NAMES:
            raise CredentialError(f"unknown action {name!r}; known: {', '.join(ACTION_NAMES)}")
        mask |= ACTION_NAMES[name]
    return mask


def action_names(mask: int) -> list[str]:
    return [n for n, bit in ACTION_NAMES.items() if mask & bit]


def parse_limits(items: list[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or key not in LIMIT_KEYS or not value.isdigit():
            raise CredentialError(f"bad limit {item!r}; use KEY=N with KEY in {', '.join(LIMIT_KEYS)}")
        if int(value) > LIMIT_MAX[key]:
            raise CredentialError(f"limit {key} must be below 2^{LIMIT_MAX[key].bit_length()}")
        if int(value) == 0:  # the device's row reads 0 as "not set": no limit at all
            raise CredentialError(f"limit {key} must be 1 or more (leave it out for the "
                                  "default; to allow none, leave out the action)")
        out[key] = int(value)
    return out


@dataclass(frozen=True)
class PrincipalGrant:
    id: int
    name: str
    actions: int
    models: tuple[str, ...]  # ("*",) for all
    limits: dict[str, int] = field(default_factory=dict)
    memory: bool = False

    def row(self, roles: dict[str, int]) -> wire.Grant:
        if "*" in self.models:
            mask = (1 << 64) - 1
        else:
            mask = 0
            for alias in self.models:
                if alias in roles:
                    mask |= 1 << roles[alias]
        # Clamped to the row's fields (parse_limits refuses wider values; a database
        # written before it checked may hold some): a wider value would fail the install.
        lim = {k: min(v, LIMIT_MAX.get(k, v)) for k, v in self.limits.items()}
        return wire.Grant(principal=self.id, actions=self.actions, model_mask=mask,
                          flags=wire.GRANT_FLAG_MEMORY if self.memory else 0,
                          max_active=lim.get("active", 0),
                          max_output_tokens=lim.get("output_tokens", 0),
                          max_input_bytes=lim.get("input_bytes", 0),
                          max_media_sources=lim.get("media_sources", 0),
                          max_media_bytes=lim.get("media_bytes", 0),
                          rate_per_minute=lim.get("rate", 0))

    def allows_model(self, alias: str) -> bool:
        return "*" in self.models or alias in self.models


class CredentialStore:
    def __init__(self, state_dir: str) -> None:
        self.path = os.path.join(state_dir, "aotx.db")
        if not os.path.exists(self.path):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            os.close(fd)
        self.db = sqlite3.connect(self.path, timeout=10, isolation_level=None,
                                  check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.executescript(_SCHEMA)
        for suffix in ("-wal", "-shm"):
            if os.path.exists(self.path + suffix):
                os.chmod(self.path + suffix, 0o600)

    def close(self) -> None:
        self.db.close()

    def generation(self) -> int:
        return int(self.db.execute("SELECT value FROM meta WHERE key='generation'").fetchone()[0])

    def _bump(self) -> None:
        self.db.execute("UPDATE meta SET value = value + 1 WHERE key='generation'")

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        """A change and its generation bump commit together or not at all: a running
        gateway that saw the change without the bump would never reload it."""
        self.db.execute("BEGIN IMMEDIATE")
        try:
            yield
            self.db.execute("COMMIT")
        except BaseException:
            self.db.execute("ROLLBACK")
            raise

    def set_principal(self, name: str, actions: int, models: tuple[str, ...],
                      limits: dict[str, int], memory: bool = False) -> int:
        if not name or len(name) > 128:
            raise CredentialError("principal names are 1 to 128 characters")
        with self._transaction():
            row = self.db.execute("SELECT id, actions, models, limits, memory FROM principals "
                                  "WHERE name=?", (name,)).fetchone()
            enc = (actions, ",".join(models), json.dumps(limits, sort_keys=True), int(memory))
            if row is None:
                cur = self.db.execute(
                    "INSERT INTO principals (name, actions, models, limits, memory, updated_at) "
                    "VALUES (?, ?, ?, ?, ?, ?)", (name, *enc, time.time()))
                pid = int(cur.lastrowid or 0)
                self._bump()
            else:
                pid = int(row[0])
                if tuple(row[1:]) != enc:
                    self.db.execute("UPDATE principals SET actions=?, models=?, limits=?, "
                                    "memory=?, updated_at=? WHERE id=?", (*enc, time.time(), pid))
                    self._bump()
        return pid

    def create_token(self, principal: str, actions: int | None = None,
                     models: tuple[str, ...] = ("*",), limits: dict[str, int] | None = None,
                     memory: bool = False, token: str | None = None) -> tuple[int, str]:
        """Create a token for ``principal`` (creating or replacing its grant); return (id, token)."""
        pid = self.set_principal(principal, parse_actions(",".join(DEFAULT_ACTIONS))
                                 if actions is None else actions, models, limits or {}, memory)
        token = token or TOKEN_PREFIX + secrets.token_urlsafe(32)  # 256 bits
        with self._transaction():
            cur = self.db.execute("INSERT INTO tokens (hash, principal_id, created_at) "
                                  "VALUES (?, ?, ?)", (token_hash(token), pid, time.time()))
            self._bump()
        return int(cur.lastrowid or 0), token

    def ensure_token(self, principal: str, token: str, actions: int) -> None:
        """Register an existing token (the admin token file) if it is not known yet."""
        row = self.db.execute("SELECT id FROM tokens WHERE hash=?", (token_hash(token),)).fetchone()
        self.set_principal(principal, actions, ("*",), {}, False)
        if row is None:
            self.create_token(principal, actions, ("*",), {}, False, token=token)

    def revoke(self, token_id: int) -> bool:
        with self._transaction():
            cur = self.db.execute("UPDATE tokens SET revoked_at=? WHERE id=? AND "
                                  "revoked_at IS NULL", (time.time(), token_id))
            if cur.rowcount:
                self._bump()
        return bool(cur.rowcount)

    def tokens(self) -> list[dict[str, object]]:
        rows = self.db.execute(
            "SELECT t.id, p.name, t.created_at, t.revoked_at FROM tokens t "
            "JOIN principals p ON p.id = t.principal_id ORDER BY t.id").fetchall()
        return [{"id": r[0], "principal": r[1], "created_at": r[2], "revoked": r[3] is not None}
                for r in rows]

    def principals(self) -> list[PrincipalGrant]:
        rows = self.db.execute("SELECT id, name, actions, models, limits, memory FROM principals "
                               "ORDER BY id").fetchall()
        return [PrincipalGrant(r[0], r[1], r[2], tuple(m for m in r[3].split(",") if m),
                               json.loads(r[4]), bool(r[5])) for r in rows]

    def snapshot(self) -> tuple[dict[bytes, int], dict[int, PrincipalGrant]]:
        """(token hash -> principal id for live tokens, principal id -> grant for principals
        that hold at least one live token)."""
        live = self.db.execute("SELECT hash, principal_id FROM tokens "
                               "WHERE revoked_at IS NULL").fetchall()
        by_hash = {bytes(h): int(p) for h, p in live}
        holders = set(by_hash.values())
        grants = {p.id: p for p in self.principals() if p.id in holders}
        return by_hash, grants


def ensure_admin_token(path: str) -> str:
    """Create ``DIR/admin.token`` (0600) on first start; return the token."""
    try:
        with open(path) as f:
            token = f.read().strip()
        if token:
            return token
    except FileNotFoundError:
        pass
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token
