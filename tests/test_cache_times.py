"""Issue 5: a cache hit reuses the eager and kernel times measured when the kernel was tuned (no
timing launches), while still gating the kernel; a cache file from before those columns existed
keeps its entries (listed, not loaded: they are not signed). The cuda backend's bookkeeping is
checked on the CPU with the GPU parts stubbed."""
import dataclasses
import os
import sqlite3

import pytest
import torch

from kbench.tune import cache as kc
from kbench.runtime import cuda as cuda_runtime
from kbench.runtime.cuda import CudaExecutor
from kbench.runtime.plan import RegionInfo, Status
from kbench.tune.tuner import Tuner, stored_kernel

LAUNCH = {"block": 256, "smem": 0, "grid_units": [1, [0]], "units_per_block": 1, "max_blocks": 0,
          "nkernels": 1, "workspace": 0, "workspace_per_block": 0}


def key(**over):
    k = kc.make_key("region 0 ROW\n  %3 = sum %1 axes=1 : f32[B, 1]\n", "-", kc.shape_class({}, {"s0": 300}),
                    driver=12040, nvrtc=12040, gpu_name="NVIDIA H100 80GB HBM3", gpu_arch="sm_90",
                    torch_version="2.11.0", kbench_version="0.1.0")
    return dataclasses.replace(k, **over)


def winner(**over):
    w = kc.Winner(genome="threads=256 vec=4", source_hash="ab" * 32, cubin=b"\x7fELF" * 10, entries=["kb_region0"],
                  launch=dict(LAUNCH), envelope="24 checks", best_ms=0.01, search_s=1.0, ncandidates=3)
    return dataclasses.replace(w, **over)


# ------------------------------------------------------------------------------------ the store


def test_times_round_trip_and_set_times(tmp_path):
    c = kc.open_cache(tmp_path / "kbench.sqlite")
    c.store(key(), winner(eager_ms=0.5, kernel_ms=0.1))
    got = c.lookup(key())
    assert (got.eager_ms, got.kernel_ms) == (0.5, 0.1)
    c.store(key(driver="12.2"), winner())
    assert c.lookup(key(driver="12.2")).eager_ms is None
    assert c.set_times(key(driver="12.2"), 0.25, 0.05)
    again = kc.open_cache(c.path)             # another process sees them
    assert (again.lookup(key(driver="12.2")).eager_ms, again.lookup(key(driver="12.2")).kernel_ms) == (0.25, 0.05)
    assert not again.set_times(key(driver="11.8"), 1.0, 1.0)     # no such winner: nothing written
    assert again.lookup(key(driver="11.8")) is None
    again.close()
    c.close()


OLD_SCHEMA = """
CREATE TABLE meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE winners (
    id INTEGER PRIMARY KEY, {keys},
    genome TEXT NOT NULL, source_hash TEXT NOT NULL, cubin BLOB, entries TEXT NOT NULL,
    launch TEXT NOT NULL, envelope TEXT NOT NULL, best_ms REAL, search_s REAL, ncandidates INTEGER,
    created REAL NOT NULL,
    UNIQUE ({unique}));
CREATE TABLE candidates (
    id INTEGER PRIMARY KEY, {keys},
    genome TEXT NOT NULL, compile_status TEXT, compile_log TEXT, regs INTEGER, spills INTEGER,
    time_ms REAL, verify TEXT, generation INTEGER, seed INTEGER, extra TEXT, created REAL NOT NULL);
"""


def test_cache_written_before_the_time_columns_keeps_its_entries(tmp_path):
    path = tmp_path / "kbench.sqlite"
    con = sqlite3.connect(path)
    con.executescript(OLD_SCHEMA.format(keys=", ".join(f"{f} TEXT NOT NULL" for f in kc.KEY_FIELDS),
                                        unique=", ".join(kc.KEY_FIELDS)))
    con.executemany("INSERT INTO meta VALUES (?, ?)", [("magic", kc.MAGIC), ("schema_version", "1")])
    old_fields = [f for f in kc.WINNER_FIELDS if f not in kc.ADDED_WINNER_COLUMNS]
    w = winner()
    row = (*key().as_dict().values(), w.genome, w.source_hash, w.cubin, '["kb_region0"]',
           __import__("json").dumps(LAUNCH), w.envelope, w.best_ms, w.search_s, w.ncandidates, w.created)
    con.execute(f"INSERT INTO winners ({', '.join(kc.KEY_FIELDS + tuple(old_fields))}) "
                f"VALUES ({', '.join('?' * len(row))})", row)
    con.commit()
    con.close()
    c = kc.open_cache(path)
    assert not c.in_memory and not [p for p in os.listdir(tmp_path) if ".corrupt-" in p]   # not set aside
    assert [r["genome"] for r in c.ls()] == [w.genome] and c.ls()[0]["eager_ms"] is None
    # the old row is not signed: kept and listed, never loaded (the region is tuned again and stored signed)
    with pytest.warns(RuntimeWarning, match="not signed"):
        assert c.lookup(key()) is None
    c.store(key(), w)
    got = c.lookup(key())
    assert got == w and got.eager_ms is None and got.kernel_ms is None
    assert c.set_times(key(), 0.3, 0.2)
    assert (c.lookup(key()).eager_ms, c.lookup(key()).kernel_ms) == (0.3, 0.2)
    c.close()
    # a reader that knows only the old columns (an older kbench) still reads the entry
    with sqlite3.connect(path) as con:
        assert con.execute(f"SELECT {', '.join(old_fields)} FROM winners").fetchone()[0] == w.genome
    # the tables added since (captures, the agent's record) are made on open, and work
    c = kc.open_cache(path)
    c.record_agent("softmax", [{"key": "k1", "status": "PASS", "source": "__global__ void f() {}"}])
    assert c.info()["agent_candidates"] == 1
    lines = [__import__("json").loads(x) for x in _export(c).splitlines()]
    assert [(x["kind"], x["task"], x["key"]) for x in lines if x["kind"] == "agent"] == [("agent", "softmax", "k1")]
    c.clear()
    assert c.info()["agent_candidates"] == 0
    c.close()
    # read only, without the table (a file an older kbench wrote, in a folder this user cannot write)
    with sqlite3.connect(path) as con:
        con.execute("DROP TABLE agent_record")
    ro = kc.Cache(sqlite3.connect(path), str(path), read_only=True, tables={"meta", "winners", "candidates"})
    ro.record_agent("softmax", [{"key": "k2"}])      # skipped, no error
    assert ro.info()["agent_candidates"] == 0 and "agent" not in _export(ro)
    ro.close()


def _export(cache) -> str:
    import io
    buf = io.StringIO()
    cache.export(buf, cubins=False)
    return buf.getvalue()


# ------------------------------------------------------------------------------------ the backend


class FakeKernel:
    genome, regs, spills, fn_nostats, source = "threads=256 vec=4", 20, 0, None, ""


def executor(db, timings, gates):
    tuner = Tuner(budget="fast", verbose=False)
    ex = CudaExecutor(tuner)
    tuner._db = db
    ex.device = torch.device("cpu")
    tuner.cache_key = lambda ex, r: key()
    tuner.points = lambda ex, r, symvals: ([list(symvals)], "")   # no plan: the sizes as given
    ex.load = lambda k, cubin=None: FakeKernel()
    tuner.gate = lambda ex, r, kernel, symvals: gates.append(r) or ""

    def time_region(ex, r, symvals, reps=20):
        timings.append(r)
        return 0.5, 0.125
    tuner.time_region = time_region

    def tune(ex, r, key_, symvals, info, points=None):   # what a search that finds a kernel leaves: a stored winner
        db.store(key_, winner())
        return FakeKernel(), (Status.KERNEL, ""), "24 checks", {"cache": "miss", "candidates": 3}
    tuner.tune = tune
    return ex


def prepare(ex, info, symvals):
    ex.tuner.prepare_region(ex, info, symvals)


def regions(n):
    return [RegionInfo(i, "ROW", [], [], [], "sum") for i in range(n)]


def test_a_hit_reuses_the_tuning_times_and_still_gates(tmp_path):
    db = kc.open_cache(tmp_path / "kbench.sqlite")
    timings, gates = [], []
    first = executor(db, timings, gates)
    for info in regions(3):                      # three identical regions: tuned and timed once
        prepare(first, info, [300])
    assert timings == [0] and gates == []
    stored = db.lookup(key())
    assert (stored.eager_ms, stored.kernel_ms) == (0.5, 0.125)

    timings.clear()
    second = executor(db, timings, gates)        # a new process, in effect
    infos = regions(3)
    for info in infos:
        prepare(second, info, [300])
    assert timings == []                         # nothing timed
    assert gates == [0]                          # the correctness gate still runs, once per distinct region
    assert all(i.status is Status.CACHED for i in infos)
    assert all((i.eager_ms, i.kernel_ms) == (0.5, 0.125) for i in infos)
    assert infos[0].extra["cache"] == "hit" and infos[0].extra["times"] == "from cache"
    db.close()


def test_a_hit_without_stored_times_times_once_and_stores_them(tmp_path):
    db = kc.open_cache(tmp_path / "kbench.sqlite")
    db.store(key(), winner())                    # an entry from before the times were stored
    timings, gates = [], []
    ex = executor(db, timings, gates)
    info = regions(1)[0]
    prepare(ex, info, [300])
    assert timings == [0] and gates == [0] and "times" not in info.extra
    assert (db.lookup(key()).eager_ms, db.lookup(key()).kernel_ms) == (0.5, 0.125)
    timings.clear()
    prepare(executor(db, timings, gates), regions(1)[0], [300])
    assert timings == []
    db.close()


def test_budget_none_touches_no_cache(tmp_path):
    db = kc.open_cache(tmp_path / "kbench.sqlite")
    timings, gates = [], []
    ex = executor(db, timings, gates)
    ex.tuner.budget = "none"                     # (the fake search stores a winner even so: its times stay unset)
    prepare(ex, regions(1)[0], [300])
    assert timings == [0] and db.lookup(key()) is not None and db.lookup(key()).eager_ms is None
    db.close()


def test_an_old_entries_grid_clamp_loads_as_no_cap(monkeypatch):
    """Entries stored before the generator kept max_blocks for real caps hold the int32 grid clamp
    (2^31 - 1) there; the loader reads it as no cap, while a real cap is cut to the blocks that fit
    on the GPU at once (a second, mostly idle wave otherwise)."""
    monkeypatch.setattr(cuda_runtime._C, "module_load", lambda cuda, cubin: object())
    monkeypatch.setattr(cuda_runtime._C, "get_function", lambda cuda, module, name, smem: (name, 64, 0))
    ex = CudaExecutor.__new__(CudaExecutor)    # no GPU: only what load() reads
    ex.cuda, ex.dev = None, {"num_sms": 132, "regs_per_sm": 65536}

    def k(max_blocks):   # a stored winner's kernel, as the tuner rebuilds it
        return stored_kernel(winner(launch=dict(LAUNCH, max_blocks=max_blocks)))
    assert ex.load(k(0x7FFFFFFF), cubin=b"x").max_blocks == 0
    fit = cuda_runtime.resident_blocks(64, 256, 65536) * 132
    assert fit == 4 * 132                       # 64 registers x 256 threads: four blocks an SM
    assert ex.load(k(10 * fit), cubin=b"x").max_blocks == fit
    assert ex.load(k(fit // 2), cubin=b"x").max_blocks == fit // 2
    assert ex.load(k(0), cubin=b"x").max_blocks == 0
