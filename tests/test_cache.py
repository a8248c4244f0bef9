"""The persistent kernel cache (kbench/tune/cache.py): round trips, misses and their explanation, the
search record, robustness against foreign files, unusable locations and concurrent writers, the CLI."""
import dataclasses
import io
import json
import multiprocessing as mp
import os
import sqlite3
import subprocess
import sys
import warnings

import pytest

from kbench.tune import cache as kc

REGION = "region 0 ROW\n  %3 = sub %1 %2 : f32[B, 768]\n  %4 = sum %3 axes=1 : f32[B, 1]\n"
LAUNCH = {"block": 256, "smem": 3072, "grid_units": [1, [0]], "units_per_block": 1, "max_blocks": 0,
          "nkernels": 1, "workspace": 0, "workspace_per_block": 0}


def key(**over) -> kc.CacheKey:
    k = kc.make_key(REGION, ("f32", "f32"), kc.shape_class({"H": 768}, {"B": 300}), driver=12040, nvrtc=12040,
                    gpu_name="NVIDIA H100 80GB HBM3", gpu_arch="sm_90", torch_version="2.11.0",
                    kbench_version="0.1.0")
    return dataclasses.replace(k, **over)


def winner(genome="threads=256 vec=4 rows=1 cache=regs", cubin=b"\x7fELF\x00\x01\xff" * 100) -> kc.Winner:
    return kc.Winner(genome=genome, source_hash="ab" * 32, cubin=cubin, entries=["kb_region0"], launch=dict(LAUNCH),
                     envelope="24 checks, sizes B∈[1,1024], max err 3e-07", best_ms=0.0123, search_s=4.5,
                     ncandidates=37)


@pytest.fixture
def cache(tmp_path):
    c = kc.open_cache(tmp_path / "kbench.sqlite")
    yield c
    c.close()


def test_make_key_fills_environment_and_hashes_region():
    import torch

    k = kc.make_key(REGION, ["f16", "f32"], "pinned H=768 | varying B:[256,512)", driver=12040, nvrtc="12.4",
                    gpu_arch="sm_90", gpu_name="test")
    assert k.torch_version == torch.__version__
    assert k.kbench_version == __import__("kbench").__version__
    assert k.driver == "12.4" and k.nvrtc == "12.4" and k.dtypes == "f16,f32"
    assert k.region_sig == kc.region_signature(REGION) and len(k.region_sig) == 64
    assert kc.region_signature(REGION + "  \n") == k.region_sig      # trailing blanks do not matter
    assert kc.region_signature(REGION.replace("768", "769")) != k.region_sig
    assert kc.size_bucket(300) == "[256,512)" and kc.size_bucket(256) == "[256,512)"
    with pytest.raises(ValueError, match="absolute path"):
        key(nvrtc="/usr/local/cuda/lib64/libnvrtc.so (12.4)")
    with pytest.raises(dataclasses.FrozenInstanceError):
        k.driver = "1"


def test_store_lookup_round_trip(cache):
    assert cache.lookup(key()) is None
    w = winner()
    cache.store(key(), w)
    got = cache.lookup(key())
    assert got == w                                   # every field, CUBIN bytes included
    assert isinstance(got.cubin, bytes) and got.cubin == w.cubin
    # a fresh connection (a new process, in effect) sees the same winner
    again = kc.open_cache(cache.path)
    assert again.lookup(key()) == w
    again.close()
    # same key again: replaced, not duplicated
    cache.store(key(), winner(genome="threads=128 vec=2 rows=1 cache=smem", cubin=None))
    got = cache.lookup(key())
    assert got.genome.startswith("threads=128") and got.cubin is None
    assert len(cache.ls()) == 1


def test_store_rejects_incomplete_launch_facts(cache):
    w = winner()
    del w.launch["smem"]
    with pytest.raises(ValueError, match="smem"):
        cache.store(key(), w)


@pytest.mark.parametrize("field", kc.KEY_FIELDS)
def test_miss_on_any_key_field_and_explain_names_it(cache, field):
    cache.store(key(), winner())
    other = key(**{field: getattr(key(), field) + "x"})
    assert cache.lookup(other) is None
    why = cache.explain_miss(other)
    if field == "region_sig":
        assert why.startswith("no entry for this region signature")
    else:
        assert why.startswith("miss:") and field in why
        assert [f for f in kc.KEY_FIELDS if f + " (" in why] == [field]   # only the differing field
    assert cache.explain_miss(key()).startswith("hit")


def test_explain_miss_picks_nearest_entry(cache):
    cache.store(key(gpu_arch="sm_80", driver="11.8", nvrtc="11.8"), winner())
    cache.store(key(driver="12.2"), winner())
    why = cache.explain_miss(key())
    assert "of 2 entries" in why and "driver" in why and "gpu_arch" not in why


def test_record_and_export_jsonl(cache, tmp_path):
    cache.store(key(), winner())
    cands = [{"genome": f"threads={32 << i} vec=1", "compile_status": "ok", "compile_log": "", "regs": 20 + i,
              "spills": 0, "time_ms": 0.01 * (i + 1), "verify": "pass", "generation": i // 2, "seed": 7}
             for i in range(5)]
    cands.append({"genome": "threads=2048 vec=8", "compile_status": "error",
                  "compile_log": "/home/someone/tmp/kb_0.cu(3): error: too many threads", "time_ms": None,
                  "generation": 0, "seed": 7, "wall_ms": 1.5})
    cache.record(key(), cands)
    with pytest.raises(ValueError, match="genome"):
        cache.record(key(), [{"time_ms": 1.0}])
    buf = io.StringIO()
    n = cache.export(buf)
    lines = [json.loads(line) for line in buf.getvalue().splitlines()]
    assert n == len(lines) == 1 + 1 + 6
    assert lines[0]["kind"] == "meta" and lines[0]["schema_version"] == kc.SCHEMA_VERSION
    (w,) = [x for x in lines if x["kind"] == "winner"]
    import base64
    assert base64.b64decode(w["cubin_b64"]) == winner().cubin and w["launch"] == LAUNCH
    assert w["region_sig"] == key().region_sig and w["entries"] == ["kb_region0"]
    cs = [x for x in lines if x["kind"] == "candidate"]
    assert [c["genome"] for c in cs] == [c["genome"] for c in cands]
    assert cs[2]["regs"] == 22 and cs[5]["time_ms"] is None and cs[5]["extra"] == {"wall_ms": 1.5}
    # no absolute paths in rows: the log keeps the file name only
    assert cs[5]["compile_log"] == "kb_0.cu(3): error: too many threads"
    assert "/home/" not in buf.getvalue()
    with sqlite3.connect(cache.path) as con:
        assert "/home/" not in "\n".join(con.iterdump()) and str(cache.path) not in "\n".join(con.iterdump())
    # without CUBINs, to a path
    out = tmp_path / "out.jsonl"
    cache.export(str(out), cubins=False)
    w2 = [json.loads(x) for x in out.read_text().splitlines()][1]
    assert "cubin_b64" not in w2 and w2["cubin_bytes"] == len(winner().cubin)


def test_info_and_clear(cache):
    info = cache.info()
    assert info["winners"] == 0 and info["schema_version"] == kc.SCHEMA_VERSION
    assert info["path"] == cache.path and info["journal_mode"] == "wal"
    cache.store(key(), winner())
    cache.store(key(dtypes="f16"), winner())
    cache.record(key(), [{"genome": "a"}, {"genome": "b"}])
    info = cache.info()
    assert (info["winners"], info["candidates"]) == (2, 2) and info["size_bytes"] > 0
    cache.clear()
    info = cache.info()
    assert (info["winners"], info["candidates"]) == (0, 0)
    assert cache.lookup(key()) is None


def _aside_files(tmp_path):
    return sorted(p.name for p in tmp_path.iterdir() if ".corrupt-" in p.name)


def _assert_fresh_and_working(path):
    c = kc.open_cache(path)
    assert not c.in_memory and c.info()["winners"] == 0
    w = winner()
    c.store(key(), w)
    assert c.lookup(key()) == w
    c.close()


def test_random_bytes_file_is_set_aside(tmp_path):
    path = tmp_path / "kbench.sqlite"
    junk = os.urandom(8192)
    path.write_bytes(junk)
    with pytest.warns(RuntimeWarning, match="moved it aside"):
        c = kc.open_cache(path)
    assert not c.in_memory
    c.close()
    (aside,) = _aside_files(tmp_path)
    assert (tmp_path / aside).read_bytes() == junk           # kept for inspection, never trusted
    _assert_fresh_and_working(path)


@pytest.mark.parametrize("kind", ["foreign", "version", "magic"])
def test_sqlite_with_another_schema_is_set_aside(tmp_path, kind):
    path = tmp_path / "kbench.sqlite"
    if kind == "foreign":
        con = sqlite3.connect(path)
        con.execute("CREATE TABLE winners (x TEXT)")
        con.execute("INSERT INTO winners VALUES ('not ours')")
    else:
        kc.open_cache(path).close()
        con = sqlite3.connect(path)
        row = ("schema_version", "99") if kind == "version" else ("magic", "something else")
        con.execute("UPDATE meta SET value = ? WHERE name = ?", row[::-1])
    con.commit()
    con.close()
    with pytest.warns(RuntimeWarning, match="moved it aside"):
        c = kc.open_cache(path)
    assert c.info()["winners"] == 0 and not c.in_memory
    c.close()
    assert len(_aside_files(tmp_path)) >= 1
    _assert_fresh_and_working(path)


def test_unwritable_location_degrades_to_memory(tmp_path):
    # a regular file where the directory should be: unwritable even for root
    (tmp_path / "blocker").write_text("x")
    path = tmp_path / "blocker" / "kbench.sqlite"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        c = kc.open_cache(path)
        c2 = kc.open_cache(path)                                  # warned once, not twice
    assert len([w for w in caught if "in-memory" in str(w.message)]) == 1
    assert c.in_memory and c2.in_memory and c.info()["path"] == ":memory:"
    w = winner()
    c.store(key(), w)
    assert c.lookup(key()) == w
    assert (tmp_path / "blocker").read_text() == "x"


def _writer(path, tag, n, barrier):
    from kbench.tune import cache as kc2
    c = kc2.open_cache(path)
    barrier.wait()
    for i in range(n):
        k = key(region_sig=f"{tag}-{i:04d}")
        c.store(k, winner(cubin=os.urandom(2048)))
        c.record(k, [{"genome": f"g{i}", "time_ms": 0.1, "generation": 0, "seed": i}])
    c.close()


def test_two_processes_write_concurrently(tmp_path):
    path = str(tmp_path / "kbench.sqlite")
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(2)
    procs = [ctx.Process(target=_writer, args=(path, tag, 200, barrier)) for tag in ("a", "b")]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    assert [p.exitcode for p in procs] == [0, 0]
    c = kc.open_cache(path)
    info = c.info()
    assert (info["winners"], info["candidates"]) == (400, 400)
    assert {r["region_sig"] for r in c.ls()} == {f"{t}-{i:04d}" for t in "ab" for i in range(200)}
    with sqlite3.connect(path) as con:
        assert con.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    c.close()


def _open_and_store(path, tag, barrier, results):
    from kbench.tune import cache as kc2
    barrier.wait()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        c = kc2.open_cache(path)
        c.store(key(region_sig=tag), winner())
    results.put((tag, c.in_memory, len(caught)))
    c.close()


def test_processes_opening_a_corrupt_file_at_once(tmp_path):
    # each finds the file corrupt; exactly one sets it aside, none moves another's fresh file
    path = tmp_path / "kbench.sqlite"
    path.write_bytes(os.urandom(5000))
    ctx = mp.get_context("spawn")
    n = 4
    barrier, results = ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=_open_and_store, args=(str(path), f"p{i}", barrier, results)) for i in range(n)]
    for p in procs:
        p.start()
    got = [results.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    assert [p.exitcode for p in procs] == [0] * n
    assert not any(mem for _, mem, _ in got) and sum(w for _, _, w in got) == 1
    assert len(_aside_files(tmp_path)) == 1
    c = kc.open_cache(path)
    assert {r["region_sig"] for r in c.ls()} == {f"p{i}" for i in range(n)}
    c.close()


def test_cli(tmp_path, capsys):
    path = str(tmp_path / "kbench.sqlite")
    c = kc.open_cache(path)
    c.store(key(), winner())
    c.record(key(), [{"genome": "g"}])
    c.close()
    assert kc.cli_main(["--path", path, "ls"]) == 0
    out = capsys.readouterr().out
    assert "genome" in out and key().region_sig[:12] in out and "threads=256" in out
    assert kc.cli_main(["--path", path, "info"]) == 0
    assert "winners: 1" in capsys.readouterr().out
    out_file = tmp_path / "x.jsonl"
    assert kc.cli_main(["--path", path, "export", str(out_file)]) == 0
    assert len(out_file.read_text().splitlines()) == 3
    assert kc.cli_main(["--path", path, "clear"]) == 0
    assert "cleared 1 winner" in capsys.readouterr().out
    assert kc.cli_main(["--path", path, "ls"]) == 0
    assert "no winners" in capsys.readouterr().out
    assert kc.cli_main(["--path", path, "bogus"]) == 2


def test_python_m_kbench_cache(tmp_path):
    c = kc.open_cache(tmp_path / "kbench.sqlite")
    c.store(key(), winner())
    c.close()
    env = dict(os.environ, KBENCH_CACHE_DIR=str(tmp_path))
    r = subprocess.run([sys.executable, "-m", "kbench", "cache", "ls"], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert key().region_sig[:12] in r.stdout and "threads=256" in r.stdout
