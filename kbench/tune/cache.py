"""The persistent kernel cache: winners of the search (with their CUBIN, so a new process compiles
nothing) and the record of every candidate tried, in one SQLite file shared by concurrent processes.

A cache is never trusted blindly: a winner and a stored capture are used only when signed with the
user's key (kbench.keyfile), a file that is not ours is set aside and replaced (by optimize(); the
CLI refuses it and leaves it alone), a read-only one is read without a lock file, an unusable
location degrades to an in-memory cache, and no key or row holds an absolute path."""
from __future__ import annotations

import argparse
import base64
import contextlib
import hashlib
import json
import os
import re
import sqlite3
import sys
import threading
import time
import urllib.parse
import warnings
from dataclasses import dataclass, field

from .. import keyfile
from ..version import __version__

SCHEMA_VERSION = 1
MAGIC = "kbench kernel cache"
BUSY_TIMEOUT_S = 30.0  # a writer waits this long for another process's (short) transaction

KEY_FIELDS = ("region_sig", "dtypes", "shape_class", "gpu_name", "gpu_arch", "driver", "nvrtc",
              "torch_version", "kbench_version")
LAUNCH_FIELDS = ("block", "smem", "grid_units", "units_per_block", "max_blocks", "nkernels", "workspace",
                 "workspace_per_block")
# and, for a kernel with vectors along a varying last dim, "last_multiple" and "last_dim" (the sizes
# it runs at: tuner.stored_launch); an entry without them runs at every size
WINNER_FIELDS = ("genome", "source_hash", "cubin", "entries", "launch", "envelope", "best_ms", "search_s",
                 "ncandidates", "created", "eager_ms", "kernel_ms", "eager_sig")
# Winner columns added after schema version 1 was released: a file without them gets them on open
# (NULL in old rows), so an older cache keeps its entries; older kbench versions ignore them.
# mac: the row's signature (a row without one, or with another user's, is never used).
ADDED_WINNER_COLUMNS = {"eager_ms": "REAL", "kernel_ms": "REAL", "eager_sig": "TEXT", "mac": "TEXT"}
# what a winner's signature covers: everything a launch trusts (times are the report's only)
SIGNED_FIELDS = ("genome", "source_hash", "cubin", "entries", "launch", "envelope")
SEAL = b"kbench-signed-1\n"   # a stored capture: SEAL, its signature (64 hex digits), the capture
CANDIDATE_FIELDS = ("genome", "compile_status", "compile_log", "regs", "spills", "time_ms", "verify",
                    "generation", "seed")

_KEY_COLS = ", ".join(f"{f} TEXT NOT NULL" for f in KEY_FIELDS)
_SCHEMA = f"""
CREATE TABLE meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE winners (
    id INTEGER PRIMARY KEY, {_KEY_COLS},
    genome TEXT NOT NULL, source_hash TEXT NOT NULL, cubin BLOB, entries TEXT NOT NULL,
    launch TEXT NOT NULL, envelope TEXT NOT NULL, best_ms REAL, search_s REAL, ncandidates INTEGER,
    created REAL NOT NULL, eager_ms REAL, kernel_ms REAL, eager_sig TEXT, mac TEXT,
    UNIQUE ({", ".join(KEY_FIELDS)}));
CREATE TABLE candidates (
    id INTEGER PRIMARY KEY, {_KEY_COLS},
    genome TEXT NOT NULL, compile_status TEXT, compile_log TEXT, regs INTEGER, spills INTEGER,
    time_ms REAL, verify TEXT, generation INTEGER, seed INTEGER, extra TEXT, created REAL NOT NULL);
CREATE INDEX candidates_region ON candidates (region_sig);
CREATE TABLE captures (key TEXT PRIMARY KEY, blob BLOB NOT NULL, created REAL NOT NULL);
CREATE TABLE agent_record (id INTEGER PRIMARY KEY, task TEXT NOT NULL, key TEXT NOT NULL, body TEXT NOT NULL,
    created REAL NOT NULL);
CREATE TABLE gate_verdicts (key TEXT PRIMARY KEY, body TEXT NOT NULL, mac TEXT, created REAL NOT NULL);
"""
# Tables added after schema version 1 was released: created on open where missing. agent_record:
# the agentic loop's candidates (kbench.agent.loop), a JSON body each, exported with the rest.
# gate_verdicts: the model gate's measurements (kbench/tune/gate.py), a signed JSON body each.
ADDED_TABLES = {"captures": "CREATE TABLE captures (key TEXT PRIMARY KEY, blob BLOB NOT NULL, created REAL NOT NULL)",
                "agent_record": "CREATE TABLE agent_record (id INTEGER PRIMARY KEY, task TEXT NOT NULL, "
                                "key TEXT NOT NULL, body TEXT NOT NULL, created REAL NOT NULL)",
                "gate_verdicts": "CREATE TABLE gate_verdicts (key TEXT PRIMARY KEY, body TEXT NOT NULL, mac TEXT, "
                                 "created REAL NOT NULL)"}
_TABLES = {"meta", "winners", "candidates"}
_TEXT_FIELDS = ("genome", "compile_status", "compile_log", "verify")  # free text: scrubbed of paths

# An absolute path: a "/" (or "~/") at the start of a token followed by at least one more "/".
# NOTE: caches are copied between machines and shared in bug reports; paths leak user names and
# make keys machine-specific, so key fields refuse them and free text is scrubbed to basenames.
_ABS_PATH = re.compile(r"(?:^|(?<=[\s(\"'=:,\[]))~?/(?:[\w.+@-]+/)+([\w.+@-]*)")


def _scrub(text):
    return None if text is None else _ABS_PATH.sub(lambda m: m.group(1) or ".", str(text))


def default_path() -> str:
    return os.path.join(keyfile.cache_root(), "kbench.sqlite")


class CacheError(Exception):
    """What the CLI reports: a file that is not a kbench cache (left untouched), or an operation
    this cache cannot do (a read-only file to clear, a database error)."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


NOT_A_CACHE = 3   # exit codes of `python -m kbench cache` (argparse's usage errors are 2)
CANNOT = 1


# ---------------------------------------------------------------------------------------- keys

@dataclass(frozen=True)
class CacheKey:
    """What a winner is valid for. Every field is a plain string; see make_key."""
    region_sig: str      # sha256 of the region's IR text
    dtypes: str          # "f32" or "f16,f32,..." (the region's input/output dtypes)
    shape_class: str     # pinned dims and their values + a bucket of the varying sizes
    gpu_name: str        # "NVIDIA H100 80GB HBM3"
    gpu_arch: str        # "sm_90"
    driver: str          # "12.4"
    nvrtc: str           # "12.4"
    torch_version: str
    kbench_version: str

    def __post_init__(self):
        for f in KEY_FIELDS:
            v = getattr(self, f)
            if not isinstance(v, str):
                raise TypeError(f"CacheKey.{f} must be a str, got {type(v).__name__}")
            if _ABS_PATH.search(v):
                raise ValueError(f"CacheKey.{f} contains an absolute path ({v!r}); pass a version, not a path")

    def as_dict(self) -> dict:
        return {f: getattr(self, f) for f in KEY_FIELDS}


def region_signature(region_text: str) -> str:
    """The hash of a region's IR text (line endings and trailing blanks do not matter)."""
    norm = "\n".join(line.rstrip() for line in region_text.strip().splitlines())
    return hashlib.sha256(norm.encode()).hexdigest()


def make_key(region_text: str, dtypes, shape_class: str, *, driver, nvrtc, gpu_name: str | None = None,
             gpu_arch: str | None = None, device=None, torch_version: str | None = None,
             kbench_version: str | None = None) -> CacheKey:
    """A CacheKey with the environment filled in: torch and kbench versions, and the GPU's name
    and arch from torch.cuda (device, default the current one) unless given. driver and nvrtc
    are the caller's (ints like 12040 or strings like "12.4"): kbench's own loader knows them."""
    import torch
    if (gpu_name is None or gpu_arch is None) and torch.cuda.is_available():
        dev = torch.cuda.current_device() if device is None else device
        gpu_name = gpu_name if gpu_name is not None else torch.cuda.get_device_name(dev)
        gpu_arch = gpu_arch if gpu_arch is not None else "sm_{}{}".format(*torch.cuda.get_device_capability(dev))
    if kbench_version is None:
        kbench_version = __version__
    if not isinstance(dtypes, str):
        dtypes = ",".join(str(d) for d in dtypes)
    # CUDA-style integers (12040 = 12.4) become "12.4"; strings pass through
    driver, nvrtc = (f"{v // 1000}.{v % 1000 // 10}" if isinstance(v, int) else str(v) for v in (driver, nvrtc))
    return CacheKey(region_signature(region_text), dtypes, shape_class, gpu_name or "none", gpu_arch or "none",
                    driver, nvrtc, torch_version or torch.__version__, kbench_version)


def size_bucket(n: int) -> str:
    """Power-of-two bucket of a varying size: 300 -> "[256,512)". Kernels tuned for 300 rows are a
    fair start for 400 but not for 40000, and one entry per exact size would never hit."""
    if n <= 0:
        return str(n)
    lo = 1 << (n.bit_length() - 1)
    return f"[{lo},{lo * 2})"


def shape_class(pinned: dict, varying: dict) -> str:
    """A shape_class string: "pinned H=768 | varying B:[256,512)" (names sorted, stable)."""
    p = " ".join(f"{k}={v}" for k, v in sorted(pinned.items()))
    v = " ".join(f"{k}:{size_bucket(n)}" for k, n in sorted(varying.items()))
    return f"pinned {p or '-'} | varying {v or '-'}"


# ---------------------------------------------------------------------------------------- rows

@dataclass
class Winner:
    """The search's chosen kernel for a key, with everything a new process needs to launch it."""
    genome: str
    source_hash: str
    cubin: bytes | None
    entries: list                      # kernel entry names: ["k", "k_finish"]
    launch: dict                       # LAUNCH_FIELDS (block, smem, grid_units, ...)
    envelope: str = ""                 # what verification covered, as the runtime guard reads it
    best_ms: float | None = None
    search_s: float | None = None
    ncandidates: int = 0
    created: float = field(default_factory=time.time)
    eager_ms: float | None = None      # the region in eager torch and as this kernel, timed when it was
    kernel_ms: float | None = None     # tuned (the report's columns; a hit need not time them again)
    eager_sig: str | None = None       # what eager_ms timed (tuner.eager_signature; None: the IR op by op)


class Cache:
    """One open cache. Each call is its own short transaction; safe to share between threads.
    read_only: writes are skipped (strict: refused with CacheError). strict (the CLI's): a
    database error raises CacheError instead of moving on to an in-memory cache."""

    def __init__(self, conn: sqlite3.Connection, path: str | None, note: str = "", *, read_only: bool = False,
                 strict: bool = False, columns=None, tables=None):
        self._conn, self.path, self.note = conn, path, note
        self.read_only, self.strict = read_only, strict
        self._lock = threading.Lock()
        self._key: tuple | None = (os.urandom(keyfile.KEY_BYTES), "") if path is None else None
        # the winner columns the file has (a read-only file from an older kbench lacks the added ones)
        self._columns = None if columns is None else frozenset(columns)
        self._tables = None if tables is None else frozenset(tables)  # None: every table is there

    def _has(self, table: str) -> bool:
        """Whether the file has this table (a read-only file from an older kbench may lack one)."""
        return self._tables is None or table in self._tables

    @property
    def in_memory(self) -> bool:
        return self.path is None

    def key(self) -> bytes | None:
        """The key that signs this cache's entries (read, or made, at first use); None: nothing
        read from it is trusted and nothing is signed (warned once)."""
        if self._key is None:
            self._key = keyfile.load(os.path.dirname(self.path), create=not self.read_only)
            if self._key[0] is None:
                keyfile.warn_once(self._key[1])
        return self._key[0]

    def _col(self, name: str) -> str:
        return name if self._columns is None or name in self._columns else f"NULL AS {name}"

    def _writable(self, what: str) -> bool:
        """False for a read-only cache (strict: CacheError): its writes are skipped."""
        if not self.read_only:
            return True
        if self.strict:
            raise CacheError(f"cannot {what} {self.path}: {self.note}", CANNOT)
        return False

    def close(self):
        with self._lock:
            self._conn.close()

    def _run(self, fn, write: bool):
        """fn(conn) in one transaction. A database error mid-run (the file corrupted or locked
        for longer than BUSY_TIMEOUT_S) must not fail the user's optimize(): warn once, carry on
        in memory; the next open_cache() decides whether the file is to be set aside."""
        with self._lock:
            try:
                self._conn.execute("BEGIN IMMEDIATE" if write else "BEGIN")
                try:
                    out = fn(self._conn)
                    self._conn.execute("COMMIT")
                    return out
                except BaseException:
                    if self._conn.in_transaction:
                        self._conn.execute("ROLLBACK")
                    raise
            except sqlite3.ProgrammingError:  # used after close(), bad SQL: a bug, not the file's fault
                raise
            except sqlite3.Error as e:
                if self.path is None:
                    raise
                if self.strict:
                    raise CacheError(f"kbench cache {self.path}: {e}", CANNOT) from None
                warnings.warn(f"kbench cache {os.path.basename(self.path)}: {e}; continuing with an "
                              f"in-memory cache for this process", RuntimeWarning, stacklevel=3)
                self._conn.close()
                self._conn, self.path, self.note = _memory(), None, f"database error: {e}"
                self.read_only, self._columns, self._tables = False, None, None
                self._key = (os.urandom(keyfile.KEY_BYTES), "")
                return fn(self._conn)

    # ------------------------------------------------------------------ winners

    def lookup(self, key: CacheKey) -> Winner | None:
        """The stored winner for key, or None; a row not signed with this user's key (written by
        someone else, copied from elsewhere, or by a kbench before rows were signed) is a miss."""
        where = " AND ".join(f"{f} = ?" for f in KEY_FIELDS)
        cols = ", ".join(self._col(f) for f in WINNER_FIELDS + ("mac",))
        row = self._run(lambda c: c.execute(f"SELECT {cols} FROM winners WHERE {where}",
                                            tuple(key.as_dict().values())).fetchone(), write=False)
        if row is None:
            return None
        *row, mac = row
        w = Winner(*row)
        w.cubin = None if w.cubin is None else bytes(w.cubin)
        if not keyfile.verify(self.key(), mac, *self._signed(key, w)):
            if self.key() is not None:
                _warn_once(f"unsigned:{self.path}", f"kbench cache {self.path}: a stored kernel is not signed with "
                                                    f"this user's key (written elsewhere, or changed since); it is "
                                                    f"not loaded, the region is tuned again")
            return None
        w.entries, w.launch = json.loads(w.entries), json.loads(w.launch)
        return w

    @staticmethod
    def _signed(key: CacheKey, w: Winner) -> tuple:
        """What a winner's signature covers, as stored (entries and launch as their JSON text)."""
        return ("kbench-winner-1", *key.as_dict().values(), *(getattr(w, f) for f in SIGNED_FIELDS))

    def store(self, key: CacheKey, winner: Winner) -> None:
        """Insert, or replace the entry with the same key (the latest search wins)."""
        missing = [f for f in LAUNCH_FIELDS if f not in winner.launch]
        if missing:  # the launcher needs every one of them; fail at store, not in a later process
            raise ValueError(f"Winner.launch lacks {', '.join(missing)}")
        if isinstance(winner.entries, str) or not winner.entries:
            raise ValueError("Winner.entries must be a non-empty list of entry names")
        if not self._writable("store a winner in"):
            return
        cubin = None if winner.cubin is None else bytes(winner.cubin)
        stored = Winner(genome=_scrub(winner.genome), source_hash=winner.source_hash, cubin=cubin,
                        entries=json.dumps(list(winner.entries)),
                        launch=_scrub(json.dumps(winner.launch, sort_keys=True)), envelope=_scrub(winner.envelope))
        k = self.key()
        mac = None if k is None else keyfile.sign(k, *self._signed(key, stored))
        row = (*key.as_dict().values(), stored.genome, winner.source_hash,
               None if cubin is None else sqlite3.Binary(cubin), stored.entries, stored.launch, stored.envelope,
               winner.best_ms, winner.search_s, winner.ncandidates, winner.created, winner.eager_ms,
               winner.kernel_ms, winner.eager_sig, mac)
        cols = KEY_FIELDS + WINNER_FIELDS + ("mac",)
        sql = f"INSERT OR REPLACE INTO winners ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))})"
        self._run(lambda c: c.execute(sql, row), write=True)

    def set_times(self, key: CacheKey, eager_ms: float | None, kernel_ms: float | None,
                  eager_sig: str | None = None) -> bool:
        """Record the eager and kernel times of the winner stored under key (measured after it was
        stored) and what the eager time timed (eager_sig); False when there is no such winner."""
        if not self._writable("store times in"):
            return False
        where = " AND ".join(f"{f} = ?" for f in KEY_FIELDS)
        sql = f"UPDATE winners SET eager_ms = ?, kernel_ms = ?, eager_sig = ? WHERE {where}"
        cur = self._run(lambda c: c.execute(sql, (eager_ms, kernel_ms, eager_sig, *key.as_dict().values())),
                        write=True)
        return cur.rowcount > 0

    def explain_miss(self, key: CacheKey) -> str:
        """Why lookup(key) misses: the fields in which the nearest entry for the same region
        signature differs (fewest differences, then newest), or that there is none."""
        rows = self._run(lambda c: c.execute(
            f"SELECT {', '.join(KEY_FIELDS)}, created FROM winners WHERE region_sig = ?",
            (key.region_sig,)).fetchall(), write=False)
        if not rows:
            return f"no entry for this region signature ({key.region_sig[:12]})"
        want = key.as_dict()

        diffs = [([(f, v) for f, v in zip(KEY_FIELDS, r) if v != want[f]], -r[-1]) for r in rows]
        d = min(diffs, key=lambda x: (len(x[0]), x[1]))[0]
        if not d:
            return "hit: an entry with exactly this key is stored"
        parts = [f"{f} (stored {v!r}, wanted {want[f]!r})" for f, v in d]
        return (f"miss: nearest of {len(rows)} entr{'y' if len(rows) == 1 else 'ies'} for region "
                f"{key.region_sig[:12]} differs in " + ", ".join(parts))

    # ------------------------------------------------------------------ captures

    def load_capture(self, key: str) -> bytes | None:
        """A captured model stored by store_capture (kbench.capture.cache's bytes), or None; an
        entry not signed with this user's key (an older kbench's, or planted) is a miss."""
        if not self._has("captures"):
            return None
        row = self._run(lambda c: c.execute("SELECT blob FROM captures WHERE key = ?", (key,)).fetchone(),
                        write=False)
        if row is None:
            return None
        blob = bytes(row[0])
        n = len(SEAL) + 64
        if not blob.startswith(SEAL):
            return None
        mac, body = blob[len(SEAL):n].decode("ascii", "replace"), blob[n:]
        if not keyfile.verify(self.key(), mac, b"kbench-capture-1", body):
            if self.key() is not None:
                _warn_once(f"unsigned-capture:{self.path}", f"kbench cache {self.path}: a stored capture is not "
                                                            f"signed with this user's key; it is not loaded")
            return None
        return body

    def store_capture(self, key: str, blob: bytes) -> None:
        if not self._writable("store a capture in"):
            return
        k = self.key()
        if k is None:   # it could not be trusted later: not kept
            return
        sealed = SEAL + keyfile.sign(k, b"kbench-capture-1", blob).encode() + blob
        self._run(lambda c: c.execute("INSERT OR REPLACE INTO captures VALUES (?, ?, ?)",
                                      (key, sqlite3.Binary(sealed), time.time())), write=True)

    def drop_capture(self, key: str) -> None:
        if self._writable("drop a capture from"):
            self._run(lambda c: c.execute("DELETE FROM captures WHERE key = ?", (key,)), write=True)

    # ------------------------------------------------------------------ model gate verdicts

    def load_verdict(self, key: str) -> str | None:
        """The model gate's record stored under key (its JSON text), or None where there is none;
        ValueError for one not signed with this user's key (planted, or changed since)."""
        if not self._has("gate_verdicts"):
            return None
        row = self._run(lambda c: c.execute("SELECT body, mac FROM gate_verdicts WHERE key = ?", (key,)).fetchone(),
                        write=False)
        if row is None:
            return None
        body, mac = row
        if not isinstance(body, str) or not keyfile.verify(self.key(), mac, b"kbench-gate-1", key.encode(),
                                                           body.encode()):
            raise ValueError("not signed with this user's key")
        return body

    def store_verdict(self, key: str, body: str) -> None:
        """Keep (or replace) the model gate's record under key, signed; not kept where it could not
        be trusted later (no key) or the cache is read-only."""
        if not self._has("gate_verdicts") or not self._writable("store a gate verdict in"):
            return
        k = self.key()
        if k is None:
            return
        mac = keyfile.sign(k, b"kbench-gate-1", key.encode(), body.encode())
        self._run(lambda c: c.execute("INSERT OR REPLACE INTO gate_verdicts VALUES (?, ?, ?, ?)",
                                      (key, body, mac, time.time())), write=True)

    # ------------------------------------------------------------------ search record

    def record(self, key: CacheKey, candidates: list) -> None:
        """Append candidates (dicts with CANDIDATE_FIELDS; genome required, others may be absent;
        unknown keys are kept as JSON in `extra`) to the search record, in one transaction."""
        if not self._writable("record candidates in"):
            return
        now, rows = time.time(), []
        for cand in candidates:
            if "genome" not in cand:
                raise ValueError("a candidate needs at least its 'genome'")
            extra = {k: v for k, v in cand.items() if k not in CANDIDATE_FIELDS}
            vals = [_scrub(cand.get(f)) if f in _TEXT_FIELDS else cand.get(f) for f in CANDIDATE_FIELDS]
            rows.append((*key.as_dict().values(), *vals,
                         _scrub(json.dumps(extra, sort_keys=True, default=str)) if extra else None, now))
        cols = KEY_FIELDS + CANDIDATE_FIELDS + ("extra", "created")
        sql = f"INSERT INTO candidates ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))})"
        self._run(lambda c: c.executemany(sql, rows), write=True)

    def record_agent(self, task: str, entries: list) -> None:
        """Append the agentic loop's candidates for a task (JSON-able dicts with their 'key': the
        proposal, every verdict, time and piece of feedback) to the record, which `export` writes
        out with the search's: the record as a data set."""
        if not entries or not self._has("agent_record") or not self._writable("record agent candidates in"):
            return
        now = time.time()
        rows = [(str(task), str(e.get("key")), _scrub(json.dumps(e, sort_keys=True, default=str)), now)
                for e in entries]
        self._run(lambda c: c.executemany("INSERT INTO agent_record (task, key, body, created) VALUES (?, ?, ?, ?)",
                                          rows), write=True)

    # ------------------------------------------------------------------ inspection

    def ls(self) -> list[dict]:
        """The winners, newest first, without CUBIN bytes (cubin_bytes gives their size)."""
        cols = KEY_FIELDS + tuple(f for f in WINNER_FIELDS if f not in ("cubin", "launch"))
        rows = self._run(lambda c: c.execute(
            f"SELECT {', '.join(map(self._col, cols))}, length(cubin) FROM winners ORDER BY created DESC").fetchall(),
            write=False)
        return [dict(zip(cols + ("cubin_bytes",), r)) for r in rows]

    def clear(self) -> None:
        if not self._writable("clear"):
            return
        self._run(lambda c: (c.execute("DELETE FROM winners"), c.execute("DELETE FROM candidates"),
                             c.execute("DELETE FROM captures"),
                             self._has("agent_record") and c.execute("DELETE FROM agent_record"),
                             self._has("gate_verdicts") and c.execute("DELETE FROM gate_verdicts")), write=True)
        with self._lock, contextlib.suppress(sqlite3.Error):
            self._conn.execute("VACUUM")  # give the space back; harmless to skip if another process is busy

    def info(self) -> dict:
        def q(c):
            return (c.execute("SELECT value FROM meta WHERE name = 'schema_version'").fetchone()[0],
                    c.execute("SELECT count(*) FROM winners").fetchone()[0],
                    c.execute("SELECT count(*) FROM candidates").fetchone()[0],
                    c.execute("PRAGMA journal_mode").fetchone()[0],
                    c.execute("SELECT count(*) FROM captures").fetchone()[0] if self._has("captures") else 0,
                    c.execute("SELECT count(*) FROM agent_record").fetchone()[0] if self._has("agent_record") else 0,
                    c.execute("SELECT count(*) FROM gate_verdicts").fetchone()[0] if self._has("gate_verdicts") else 0)
        version, nw, nc, journal, ncap, nagent, ngate = self._run(q, write=False)
        size = sum(os.path.getsize(p) for p in (self.path, f"{self.path}-wal") if self.path and os.path.exists(p))
        return {"path": self.path or ":memory:", "size_bytes": size, "winners": nw, "candidates": nc,
                "captures": ncap, "agent_candidates": nagent, "gate_verdicts": ngate, "schema_version": int(version), "journal_mode": journal,
                "read_only": self.read_only, "note": self.note}

    def export(self, fp, *, cubins: bool = True) -> int:
        """Winners, the search's candidates, then the agentic loop's, as JSON lines (fp: a text file
        or a path); CUBINs base64, or left out (only their size) with cubins=False. Returns the
        number of lines written."""
        if isinstance(fp, (str, os.PathLike)):
            with open(fp, "w", encoding="utf-8") as f:
                return self.export(f, cubins=cubins)

        def q(c):
            tables = ("winners", "candidates") + (("agent_record",) if self._has("agent_record") else ())
            curs = [c.execute(f"SELECT * FROM {t} ORDER BY id") for t in tables]
            return [[dict(zip([d[0] for d in cur.description], r)) for r in cur] for cur in curs] + [[]]
        winners, cands, agent = self._run(q, write=False)[:3]
        lines = [{"kind": "meta", "magic": MAGIC, "schema_version": SCHEMA_VERSION}]
        for w in winners:
            del w["id"]
            cubin = w.pop("cubin")
            w["cubin_bytes"] = None if cubin is None else len(cubin)
            if cubins and cubin is not None:
                w["cubin_b64"] = base64.b64encode(bytes(cubin)).decode()
            w["entries"], w["launch"] = json.loads(w["entries"]), json.loads(w["launch"])
            lines.append({"kind": "winner", **w})
        for c in cands:
            del c["id"]
            c["extra"] = json.loads(c["extra"]) if c["extra"] else {}
            lines.append({"kind": "candidate", **c})
        for a in agent:
            # a candidate, or (kind agent_prompt) an LLM proposer's prompt and replies
            lines.append({"kind": "agent", **json.loads(a["body"]), "task": a["task"], "created": a["created"]})
        fp.writelines(json.dumps(line) + "\n" for line in lines)
        return len(lines)


# ---------------------------------------------------------------------------------------- opening

_warned: set = set()


def _warn_once(tag: str, message: str):
    # one warning per location and kind per process: optimize() may open the cache many times
    if tag not in _warned:
        _warned.add(tag)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def _memory() -> sqlite3.Connection:
    conn = sqlite3.connect(":memory:", isolation_level=None, check_same_thread=False)
    _check(conn)
    return conn


def _check(conn) -> str:
    """Under a write lock: create the schema in an empty database, or say why the file is not
    ours (""=fine). Holding BEGIN IMMEDIATE means a process that finds a half-created file waits
    for its creator instead of judging it foreign."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        tables = _tables(conn)
        if not tables:
            for stmt in filter(str.strip, _SCHEMA.split(";")):  # executescript would commit early
                conn.execute(stmt)
            conn.executemany("INSERT INTO meta VALUES (?, ?)", [("magic", MAGIC),
                                                               ("schema_version", str(SCHEMA_VERSION))])
            why = ""
        else:
            why = _not_ours(conn, tables)
            if not why:
                _add_columns(conn, tables)
        conn.execute("COMMIT")
        return why
    except BaseException:
        if conn.in_transaction:  # SQLite may already have rolled back (e.g. "not a database")
            conn.execute("ROLLBACK")
        raise


def _tables(conn) -> set:
    return {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}


def _not_ours(conn, tables) -> str:
    """Why a database with these tables is not a kbench cache this kbench reads ("": it is)."""
    if not tables:
        return "an empty database, without kbench's tables"
    if not _TABLES <= tables:
        return f"an SQLite file without kbench's tables (has {', '.join(sorted(tables)[:5])})"
    meta = dict(conn.execute("SELECT name, value FROM meta").fetchall())
    magic, version = meta.get("magic"), meta.get("schema_version")
    return (f"bad magic {magic!r}" if magic != MAGIC else "" if version == str(SCHEMA_VERSION)
            else f"schema version {version!r}, this kbench reads {SCHEMA_VERSION}")


def _add_columns(conn, tables) -> None:
    """Give a cache written by an earlier kbench the tables and winner columns added since (no
    data lost)."""
    for name, create in ADDED_TABLES.items():
        if name not in tables:
            conn.execute(create)
    have = {r[1] for r in conn.execute("PRAGMA table_info(winners)")}
    for name, decl in ADDED_WINNER_COLUMNS.items():
        if name not in have:
            conn.execute(f"ALTER TABLE winners ADD COLUMN {name} {decl}")


@contextlib.contextmanager
def _open_lock(path: str):
    """Serialize open_cache's check / set-aside / create among processes: else two that both find
    a corrupt file race to rename it and its -wal/-journal, and one may move the other's fresh
    file or journal. Held for milliseconds; past BUSY_TIMEOUT_S (stuck holder) or without fcntl, none."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    fd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + BUSY_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                time.sleep(0.01)
        yield
    finally:
        os.close(fd)  # releases the lock


def _set_aside(path: str, inode) -> None:
    """Rename a foreign/corrupt file (and its -wal/-shm) to <name>.corrupt-<timestamp>, unless
    another process already replaced it (different inode) — then the new file is not ours to move."""
    try:
        if inode is not None and os.stat(path).st_ino != inode:
            return
    except FileNotFoundError:
        return
    aside = base = f"{path}.corrupt-{time.strftime('%Y%m%dT%H%M%S')}"
    while os.path.exists(aside):  # a second bad file within the same second
        aside = f"{base}-{len(aside) - len(base)}"
    os.replace(path, aside)
    for side in ("-wal", "-shm", "-journal"):
        if os.path.exists(path + side):
            os.replace(path + side, aside + side)


def open_cache(path=None, *, strict: bool = False) -> Cache:
    """The cache at path (default $KBENCH_CACHE_DIR/kbench.sqlite or ~/.cache/kbench/kbench.sqlite;
    ":memory:" for a private one). Never raises for a bad file or location: see the module doc.
    A file or folder this process may not write is opened read-only: no lock file, no schema
    change, writes skipped. strict (the CLI): only an existing kbench cache is opened, anything
    else raises CacheError and is left exactly as it was; nothing falls back to memory."""
    if path is not None and str(path) == ":memory:":
        return Cache(_memory(), None, "in-memory by request", strict=strict)
    path = os.path.abspath(os.path.expanduser(str(path) if path is not None else default_path()))
    if strict:
        return _open_strict(path)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if not _may_write(path):
            if os.path.exists(path):
                return _open_read_only(path, strict=False)
            raise PermissionError(f"the folder {os.path.dirname(path)} is not writable")
        with _open_lock(path):
            return _open_locked(path)
    except (OSError, sqlite3.OperationalError, CacheError) as e:
        # unwritable, cannot open, locked longer than BUSY_TIMEOUT_S: not corruption, so the file stays
        _warn_once(f"unusable:{path}", f"kbench cache {path} is unusable ({e}); using an in-memory cache "
                                       f"for this process (nothing will persist)")
        return Cache(_memory(), None, f"unusable location: {e}")


def _may_write(path: str) -> bool:
    """Whether this process may change path and its folder (the lock file, -wal and -shm live
    beside it). os.access: what the kernel would allow this user, without trying."""
    folder = os.path.dirname(path)
    return os.access(folder, os.W_OK) and (not os.path.exists(path) or os.access(path, os.W_OK))


def _open_strict(path: str) -> Cache:
    if not os.path.exists(path):
        raise CacheError(f"no kbench cache at {path}", CANNOT)
    if not os.path.isfile(path):
        raise CacheError(f"{path} is not a kbench cache (not a regular file); left untouched", NOT_A_CACHE)
    # the schema is read before anything is written: another program's file is never changed
    _open_read_only(path, strict=True).close()
    if not _may_write(path):
        return _open_read_only(path, strict=True)
    with _open_lock(path):
        conn = sqlite3.connect(path, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False)
        try:
            why = _check(conn)
        except sqlite3.Error as e:
            conn.close()
            raise CacheError(f"kbench cache {path}: {e}", CANNOT) from None
        if why:   # replaced between the two looks
            conn.close()
            raise CacheError(f"{path} is not a kbench cache ({why}); left untouched", NOT_A_CACHE)
        return Cache(conn, path, strict=True)


def _open_read_only(path: str, *, strict: bool) -> Cache:
    """A kbench cache opened read-only (sqlite's mode=ro; in a folder this process may not write,
    immutable=1: SQLite then makes no -wal or -shm file beside it and takes no lock, and it could
    not make them anyway); CacheError when the file is not one."""
    uri = "file:" + urllib.parse.quote(path, safe="/")
    last = None
    tries = ("?mode=ro", "?mode=ro&immutable=1") if os.access(os.path.dirname(path), os.W_OK) else \
        ("?mode=ro&immutable=1",)
    for params in tries:
        conn = sqlite3.connect(uri + params, uri=True, timeout=BUSY_TIMEOUT_S, isolation_level=None,
                               check_same_thread=False)
        try:
            tables = _tables(conn)
            why = _not_ours(conn, tables)
            columns = {r[1] for r in conn.execute("PRAGMA table_info(winners)")} if not why else set()
        except sqlite3.OperationalError as e:   # e.g. "unable to open database file": try immutable
            conn.close()
            last = e
            continue
        except sqlite3.DatabaseError as e:
            conn.close()
            raise CacheError(f"{path} is not a kbench cache (not a usable SQLite database: {e}); left untouched",
                             NOT_A_CACHE) from None
        if why:
            conn.close()
            raise CacheError(f"{path} is not a kbench cache ({why}); left untouched", NOT_A_CACHE)
        note = "read-only (the file or its folder is not writable)"
        return Cache(conn, path, note, read_only=True, strict=strict, columns=columns, tables=tables)
    raise CacheError(f"kbench cache {path} cannot be read ({last})", CANNOT)


# File systems shared over a network: SQLite's WAL keeps its index in shared memory (the -shm
# file, mmapped), which processes on different hosts do not share, so a WAL cache there goes
# inconsistent; the rollback journal relies on POSIX locks alone, which NFS (v4, or v3 with lockd)
# honours across hosts.
NETWORK_FS = frozenset({"nfs", "nfs4", "cifs", "smb3", "smbfs", "9p", "afs", "ceph", "lustre", "gpfs",
                        "beegfs", "glusterfs", "fuse.glusterfs", "fuse.sshfs", "fuse.s3fs", "fuse.gcsfuse"})


def fs_type(path: str, mounts: str | None = None) -> str:
    """The type of the file system holding path, from /proc/mounts (the longest mount point that
    contains it); "" where it cannot be told."""
    if mounts is None:
        try:
            with open("/proc/mounts", encoding="utf-8", errors="replace") as f:
                mounts = f.read()
        except OSError:
            return ""
    where = os.path.realpath(path)
    best, kind = "", ""
    for line in mounts.splitlines():
        parts = line.split()
        if len(parts) < 3:
            continue
        point = parts[1].replace("\\040", " ")
        inside = where == point or where.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, parts[2]
    return kind


def _open_locked(path: str) -> Cache:
    for attempt in range(2):
        inode = os.stat(path).st_ino if os.path.exists(path) else None
        conn = sqlite3.connect(path, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False)
        try:
            why = _check(conn)
        except sqlite3.OperationalError:
            conn.close()
            raise
        except sqlite3.DatabaseError as e:  # not a database / malformed: never trusted
            why = f"not a usable SQLite database ({e})"
        if not why:
            kind = fs_type(os.path.dirname(path))
            try:  # WAL: readers never block the writer. Persistent once set; fine if refused
                if kind in NETWORK_FS:   # (above) every host's processes lock the one file instead
                    conn.execute("PRAGMA journal_mode=DELETE")
                    conn.execute("PRAGMA synchronous=FULL")
                else:
                    conn.execute("PRAGMA journal_mode=WAL")
                    conn.execute("PRAGMA synchronous=NORMAL")
            except sqlite3.OperationalError:
                pass
            return Cache(conn, path, f"on a network file system ({kind}): rollback journal, not WAL"
                         if kind in NETWORK_FS else "")
        conn.close()
        if attempt:
            break
        try:
            _set_aside(path, inode)
        except OSError as e:
            _warn_once(f"unusable:{path}", f"kbench cache {path} is {why} and cannot be moved aside ({e}); "
                                           f"using an in-memory cache for this process")
            return Cache(_memory(), None, f"foreign file kept in place: {why}")
        warnings.warn(f"kbench cache {path} is {why}; moved it aside to {os.path.basename(path)}.corrupt-* "
                      f"and started a fresh cache", RuntimeWarning, stacklevel=3)
    return Cache(_memory(), None, "could not create a fresh cache file")


def explain_miss(key: CacheKey, path=None) -> str:
    """Cache.explain_miss on the default (or given) cache."""
    with contextlib.closing(open_cache(path)) as c:
        return c.explain_miss(key)


def _table(rows: list[dict]) -> str:
    head = ("region", "dtypes", "shape class", "gpu", "genome", "best ms", "cands", "search s", "cubin", "created")
    body = []
    for r in rows:
        body.append((r["region_sig"][:12], r["dtypes"], r["shape_class"], f"{r['gpu_arch']} {r['gpu_name']}",
                     r["genome"] if len(r["genome"]) <= 48 else r["genome"][:45] + "...",
                     "-" if r["best_ms"] is None else f"{r['best_ms']:.4g}", str(r["ncandidates"]),
                     "-" if r["search_s"] is None else f"{r['search_s']:.1f}",
                     "-" if r["cubin_bytes"] is None else f"{r['cubin_bytes'] // 1024 or 1}K",
                     time.strftime("%Y-%m-%d %H:%M", time.localtime(r["created"]))))
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    return "\n".join("  ".join(x.ljust(w) for x, w in zip(line, widths)).rstrip() for line in (head, *body))


def cli_main(argv=None) -> int:
    """python -m kbench cache {ls,clear,export FILE,info} [--path P]. Touches only a kbench cache:
    a missing file is reported (exit 1), anything else is refused and left as it is (exit
    NOT_A_CACHE), and what cannot be done (clearing a read-only cache) says why (exit 1)."""
    p = argparse.ArgumentParser(prog="python -m kbench cache", description="the persistent kernel cache",
                                epilog=f"exit status: 0 done, {CANNOT} no cache or it cannot be done, 2 usage, "
                                       f"{NOT_A_CACHE} the file is not a kbench cache (left untouched)")
    p.add_argument("--path", default=None, help="cache file (default: $KBENCH_CACHE_DIR/kbench.sqlite "
                                                 "or ~/.cache/kbench/kbench.sqlite)")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("ls", help="the stored winners, newest first")
    sub.add_parser("clear", help="delete every winner, the search record, the agent's record, the stored "
                                 "captures and the model gate's verdicts")
    ex = sub.add_parser("export", help="winners, the search's candidates and the agent's as JSON lines")
    ex.add_argument("file")
    ex.add_argument("--no-cubins", action="store_true", help="leave the CUBIN bytes out")
    sub.add_parser("info", help="path, size, counts, schema version")
    try:
        args = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as e:  # argparse exits; a caller of cli_main wants the code
        return int(e.code or 0)
    try:
        with contextlib.closing(open_cache(args.path, strict=True)) as cache:
            return _command(cache, args)
    except CacheError as e:
        print(f"kbench cache: {e}", file=sys.stderr)
        return e.code


def _command(cache: Cache, args) -> int:
    if args.cmd == "ls":
        rows = cache.ls()
        print(_table(rows) if rows else f"no winners in {cache.path}")
    elif args.cmd == "clear":
        n = cache.info()
        cache.clear()   # CacheError where it cannot: never reported as done
        after = cache.info()
        if after["winners"] or after["candidates"] or after["captures"] or after["agent_candidates"] \
                or after["gate_verdicts"]:
            raise CacheError(f"{cache.path} still holds entries after clearing", CANNOT)
        print(f"cleared {n['winners']} winner(s), {n['candidates']} candidate(s), {n['agent_candidates']} "
              f"agent candidate(s), {n['gate_verdicts']} model gate verdict(s) and {n['captures']} captured "
              f"model(s) from {cache.path}")
    elif args.cmd == "export":
        n = cache.export(args.file, cubins=not args.no_cubins)
        print(f"wrote {n} line(s) to {args.file}")
    else:
        for k, v in cache.info().items():
            if k != "note" or v:
                print(f"{k}: {v}")
    return 0
