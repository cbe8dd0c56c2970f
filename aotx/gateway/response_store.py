"""What the gateway keeps of a response that the device does not hold: its input items,
the conversation before them (for ``previous_response_id``), the fields its response
object repeats (of a response not stored, only its creation time), and the tombstone of
a deleted response.  SQLite, ``DIR/responses.db``
(0600, WAL), beside the credentials.

Access: every row carries its principal, and a row is read only after the device has
answered a READ of the same request for the same principal (ownership, grant revision,
epoch: the device's rule), so a row never shows what the device would hide.

Retention follows the device's: rows of an ended epoch go (the device lost the request:
410), and a row older than the device's retention is checked with a READ once a minute
and removed when the device answers 404 (reclaimed).  A tombstone stays while the device
may still hold its request, so that a deleted response answers 404 across gateway
restarts; a tombstone of an ended epoch goes after the retention time.
"""

from __future__ import annotations

import os
import sqlite3
import time
from dataclasses import dataclass
from typing import Any

import orjson

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    epoch INTEGER NOT NULL,
    identity BLOB NOT NULL,
    principal INTEGER NOT NULL,
    created_at REAL NOT NULL,
    checked_at REAL NOT NULL,
    deleted_at REAL,
    echo TEXT,
    input TEXT,
    context TEXT,
    PRIMARY KEY (epoch, identity)
);
CREATE INDEX IF NOT EXISTS responses_age ON responses (checked_at);
"""
SWEEP_ROWS = 64  # rows read from the table at once; a sweep checks every due row
RECHECK_S = 60.0
_U64 = 1 << 64


def _i64(epoch: int) -> int:
    """An epoch (u64: device id << 48 | count, so 2^63 and above for device ids from
    0x8000, and any 16 hex digits of an id) as the signed 64-bit integer SQLite holds:
    the same bits, so an epoch below 2^63 is stored as itself."""
    return epoch - _U64 if epoch >= 1 << 63 else epoch


def _u64(stored: int) -> int:
    return stored + _U64 if stored < 0 else stored


@dataclass(frozen=True)
class Stored:
    created_at: float
    echo: dict[str, Any] | None  # None: a tombstone; {}: not stored (only its creation time)
    input: list[dict[str, Any]]
    context: list[dict[str, Any]]


class ResponseStore:
    def __init__(self, state_dir: str) -> None:
        self.path = os.path.join(state_dir, "responses.db")
        if not os.path.exists(self.path):
            os.close(os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600))
        self.db = sqlite3.connect(self.path, timeout=10, isolation_level=None,
                                  check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        # NORMAL: a commit survives the gateway's crash, not the machine's power loss;
        # a lost row loses a response's input, never its output (the device's).
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.executescript(_SCHEMA)
        for suffix in ("-wal", "-shm"):
            if os.path.exists(self.path + suffix):
                os.chmod(self.path + suffix, 0o600)
        self.last_sweep = 0.0

    def close(self) -> None:
        self.db.close()

    def put(self, principal: int, epoch: int, identity: bytes, created_at: float,
            echo: dict[str, Any], items: list[dict[str, Any]],
            context: list[dict[str, Any]]) -> Stored:
        self.db.execute("INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?, NULL, ?, ?, ?)",
                        (_i64(epoch), identity, principal, created_at, created_at,
                         orjson.dumps(echo).decode(),
                         orjson.dumps(items).decode(), orjson.dumps(context).decode()))
        return Stored(created_at, echo, items, context)

    def seen(self, principal: int, epoch: int, identity: bytes, created_at: float) -> Stored:
        """A response not stored (``store: false``, or a chat completion's request read
        as a response): a row with its creation time only, kept as a stored one is."""
        self.db.execute("INSERT OR IGNORE INTO responses VALUES (?, ?, ?, ?, ?, NULL, '{}', "
                        "'[]', '[]')", (_i64(epoch), identity, principal, created_at, created_at))
        got = self.get(principal, epoch, identity)
        return got if got is not None else Stored(created_at, {}, [], [])

    def get(self, principal: int, epoch: int, identity: bytes) -> Stored | None:
        row = self.db.execute("SELECT created_at, echo, input, context FROM responses "
                              "WHERE epoch=? AND identity=? AND principal=?",
                              (_i64(epoch), identity, principal)).fetchone()
        if row is None:
            return None
        if row[1] is None:
            return Stored(row[0], None, [], [])
        return Stored(row[0], orjson.loads(row[1]), orjson.loads(row[2]), orjson.loads(row[3]))

    def deleted(self, principal: int, epoch: int, identity: bytes) -> bool:
        got = self.get(principal, epoch, identity)
        return got is not None and got.echo is None

    def delete(self, principal: int, epoch: int, identity: bytes) -> None:
        """Forget the response's input and fields; keep a tombstone (see the module)."""
        now = time.time()
        self.db.execute("INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?, ?, NULL, NULL, "
                        "NULL)", (_i64(epoch), identity, principal, now, now, now))

    def due(self, epoch: int, retention_s: float) -> list[tuple[int, int, bytes]]:
        """Drop what an ended epoch leaves; (principal, epoch, identity) of the rows to
        check with the device now (older than its retention, not checked lately)."""
        now = time.time()
        # (Every other epoch is an ended one: a gateway's store holds its device's rows
        # only, and a device id changed between activations changes the epoch's order.)
        self.db.execute("DELETE FROM responses WHERE epoch != ? AND (deleted_at IS NULL OR "
                        "deleted_at < ?)", (_i64(epoch), now - retention_s))
        rows = self.db.execute("SELECT principal, epoch, identity FROM responses "
                               "WHERE epoch = ? AND created_at < ? AND checked_at < ? "
                               "ORDER BY checked_at LIMIT ?",
                               (_i64(epoch), now - retention_s, now - RECHECK_S, SWEEP_ROWS))
        return [(int(p), _u64(int(e)), bytes(i)) for p, e, i in rows.fetchall()]

    def checked(self, epoch: int, identity: bytes, gone: bool) -> None:
        if gone:
            self.db.execute("DELETE FROM responses WHERE epoch=? AND identity=?",
                            (_i64(epoch), identity))
        else:
            self.db.execute("UPDATE responses SET checked_at=? WHERE epoch=? AND identity=?",
                            (time.time(), _i64(epoch), identity))

    def count(self) -> int:
        return int(self.db.execute("SELECT COUNT(*) FROM responses").fetchone()[0])
