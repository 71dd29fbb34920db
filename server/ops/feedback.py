"""Feedback tied to what produced it: the cost record of every recent request (`RequestRecords`, kept in
memory for a bounded window) and the ratings users give them (`FeedbackStore`, SQLite on disk, one row
per rated choice with the request's model, version, LoRA adapter, lane and cost record copied in).

A record belongs to its owner (`RecordKey.owner`: a hash of the API key and the body's `user`, see
server/serving/dispatch.py request_owner) and is found only by that owner: another key asking for it
finds nothing, as for an id never seen. One HTTP request with several choices (a prompt list, n > 1)
leaves one record per choice, under the response id the client saw and the choice's index.

The store runs every SQLite call on one thread of its own (the event loop never waits on the disk)
with `synchronous=FULL`: a rating the API answered 201 for survives a crash or restart.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

RATINGS = (-1, 1, 2, 3, 4, 5)  # thumbs (-1, 1) or stars (1-5)


@dataclass(frozen=True)
class RecordKey:
    """How feedback finds a request's record: whose it is, and the ids the client saw."""

    owner: str  # a hash of the API key and `user` ("" when the server has no keys and the body no user)
    request_id: str  # the response's id (one per HTTP request, whatever its number of choices)
    choice: int = 0  # the choice's index in that response


@dataclass(frozen=True)
class RequestRecord:
    """One finished request's (one choice's) cost record."""

    request_id: str  # the response's id, as the client saw it
    model: str
    version: str
    lane: str
    status: str  # ok, timeout, cancelled, error (the request log's)
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens found in the prefix cache
    queue_s: float | None  # seconds from arrival: left the queue, first token, end
    ttft_s: float | None
    e2e_s: float | None
    kv_blocks_peak: int
    preemptions: int
    response_cached: bool  # answered from the response cache
    ended_at: float  # unix time
    owner: str = ""  # RecordKey.owner
    choice: int = 0  # the choice's index in its response
    lora: str | None = None  # the LoRA adapter it ran on (its `model`); None: the base model
    tenant: str = "default"  # who it was billed to (server/config/tenants.py)

    @property
    def key(self) -> RecordKey:
        return RecordKey(self.owner, self.request_id, self.choice)


class AlreadyRated(Exception):
    pass


class RequestRecords:
    """The most recent `max_records` requests that ended within `ttl_s`. Thread-safe: workers write, the
    event loop reads."""

    def __init__(self, max_records: int, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_records = max_records
        self.ttl_s = ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        self._records: OrderedDict[RecordKey, tuple[RequestRecord, float]] = OrderedDict()  # oldest first

    def __len__(self) -> int:
        with self._lock:
            return len(self._records)

    def put(self, record: RequestRecord) -> None:
        now = self._clock()
        with self._lock:
            self._records.pop(record.key, None)  # an owner's reused client id: its newest request wins
            self._records[record.key] = (record, now)
            while self._records and (len(self._records) > self.max_records
                                     or now - next(iter(self._records.values()))[1] > self.ttl_s):  # fmt: skip
                self._records.popitem(last=False)

    def get(self, key: RecordKey) -> RequestRecord | None:
        """The record under `key` (owner included), or None: never seen, expired, or someone else's."""
        with self._lock:
            found = self._records.get(key)
        if found is None or self._clock() - found[1] > self.ttl_s:
            return None
        return found[0]


# Version 3 (PRAGMA user_version): tenant, who the request was billed to ('default' before).
# Version 2: lora, the adapter the request ran on (NULL: the base model).
# Version 1: owner and choice; one rating per (owner, request_id, choice); _migrate adds lora.
# Version 0 had request_id UNIQUE and neither column: _migrate rebuilds it.
_SCHEMA_VERSION = 3
_TABLE = """
CREATE TABLE IF NOT EXISTS feedback (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    rating INTEGER NOT NULL,
    comment TEXT,
    rated_at REAL NOT NULL,  -- unix time
    request_id TEXT NOT NULL,
    model TEXT NOT NULL,
    version TEXT NOT NULL,
    lane TEXT NOT NULL,
    status TEXT NOT NULL,
    finish_reason TEXT,
    prompt_tokens INTEGER NOT NULL,
    completion_tokens INTEGER NOT NULL,
    cached_tokens INTEGER NOT NULL,
    queue_s REAL,
    ttft_s REAL,
    e2e_s REAL,
    kv_blocks_peak INTEGER NOT NULL,
    preemptions INTEGER NOT NULL,
    response_cached INTEGER NOT NULL,
    ended_at REAL NOT NULL,
    owner TEXT NOT NULL DEFAULT '',
    choice INTEGER NOT NULL DEFAULT 0,
    lora TEXT,
    tenant TEXT NOT NULL DEFAULT 'default',
    UNIQUE (owner, request_id, choice)
);
"""
_INDEX = "CREATE INDEX IF NOT EXISTS feedback_by_version ON feedback (model, version);"


class FeedbackStore:
    """Ratings in one SQLite file. Build it with `open()`; every method but close() is awaited."""

    def __init__(self, path: str, conn: sqlite3.Connection, pool: ThreadPoolExecutor) -> None:
        self.path = path
        self._conn = conn
        self._pool = pool

    @classmethod
    def open(cls, path: str) -> FeedbackStore:
        """Open (creating it and its folder when missing) the database at `path`."""
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenmill-feedback")
        conn = pool.submit(_connect, path).result()
        return cls(path, conn, pool)

    async def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, self._conn, *args)

    async def rated(self, key: RecordKey) -> bool:
        """Whether the choice under `key` (owner included) has a rating."""
        return bool(await self._run(_count, key))

    async def add(self, record: RequestRecord, rating: int, comment: str | None) -> dict[str, Any]:
        """Store a rating of `record`; raises AlreadyRated when that choice has one."""
        row = {"rating": rating, "comment": comment, "rated_at": time.time(), **asdict(record)}
        row["response_cached"] = int(record.response_cached)
        row_id = await self._run(_insert, row)
        return {"id": row_id, **row, "response_cached": record.response_cached}

    async def export(self, model: str | None, version: str | None, limit: int,
                     lora: str | None = None) -> list[dict[str, Any]]:  # fmt: skip
        """Ratings, newest first, optionally of one model, version and/or LoRA adapter."""
        return await self._run(_select, model, version, limit, lora)

    def close(self) -> None:
        self._pool.submit(self._conn.close).result()
        self._pool.shutdown(wait=True)


# -- on the store's thread ------------------------------------------------------------------------------
def _connect(path: str) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None)  # autocommit: each insert is its own transaction
    conn.row_factory = sqlite3.Row
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    if conn.execute("PRAGMA user_version").fetchone()[0] < _SCHEMA_VERSION:
        _migrate(conn)
    conn.executescript(_TABLE + _INDEX)
    return conn


def _migrate(conn: sqlite3.Connection) -> None:
    """Bring a database of an older version to _SCHEMA_VERSION in one transaction. Version 0 rows keep
    their ids and columns and get owner '' and choice 0 (whose they were was not stored); rows of
    versions 0 and 1 get lora NULL (adapters were not served then: the base model's), and rows before
    version 3 tenant 'default'."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        columns = [row[1] for row in conn.execute("PRAGMA table_info(feedback)")]
        if columns and "owner" not in columns:
            conn.execute("ALTER TABLE feedback RENAME TO feedback_v0")
            conn.execute("DROP INDEX IF EXISTS feedback_by_version")
            conn.execute(_TABLE)
            names = ", ".join(columns)
            conn.execute(f"INSERT INTO feedback ({names}) SELECT {names} FROM feedback_v0")
            conn.execute("DROP TABLE feedback_v0")
        else:
            if columns and "lora" not in columns:
                conn.execute("ALTER TABLE feedback ADD COLUMN lora TEXT")
            if columns and "tenant" not in columns:
                conn.execute("ALTER TABLE feedback ADD COLUMN tenant TEXT NOT NULL DEFAULT 'default'")
        conn.execute(f"PRAGMA user_version = {_SCHEMA_VERSION}")
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise


def _count(conn: sqlite3.Connection, key: RecordKey) -> int:
    sql = "SELECT COUNT(*) FROM feedback WHERE owner = ? AND request_id = ? AND choice = ?"
    return conn.execute(sql, (key.owner, key.request_id, key.choice)).fetchone()[0]


def _insert(conn: sqlite3.Connection, row: dict[str, Any]) -> int:
    names = ", ".join(row)
    marks = ", ".join("?" for _ in row)
    try:
        cursor = conn.execute(f"INSERT INTO feedback ({names}) VALUES ({marks})", tuple(row.values()))
    except sqlite3.IntegrityError:
        raise AlreadyRated(row["request_id"]) from None
    return int(cursor.lastrowid or 0)


def _select(conn: sqlite3.Connection, model: str | None, version: str | None, limit: int,
            lora: str | None) -> list[dict[str, Any]]:  # fmt: skip
    where, args = [], []
    for column, value in (("model", model), ("version", version), ("lora", lora)):
        if value is not None:
            where.append(f"{column} = ?")
            args.append(value)
    sql = "SELECT * FROM feedback" + (f" WHERE {' AND '.join(where)}" if where else "") + " ORDER BY id DESC LIMIT ?"
    rows = conn.execute(sql, (*args, limit)).fetchall()
    out = []
    for row in rows:
        item = dict(row)
        item["response_cached"] = bool(item["response_cached"])
        out.append(item)
    return out
