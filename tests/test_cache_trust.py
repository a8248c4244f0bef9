"""What kbench reads back from its caches is data it checks, never code it runs: a pickle planted
in the database does not run, a stored capture is JSON that names no code, a tampered or foreign
winner is not loaded, and the per-user key that signs them is private. The cache CLI touches only
kbench caches, and a read-only cache is read without a lock file and never "cleared" in memory.
(NVRTC's CUBIN files: tests/test_nvrtc.py.)"""
import contextlib
import dataclasses
import json
import os
import pickle
import sqlite3
import stat
import warnings

import pytest
import torch
import torch.nn as nn

import kbench
from kbench import keyfile
from kbench.capture import cache as capture_cache
from kbench.capture import capture, stored
from kbench.tune import cache as kc

LAUNCH = {"block": 256, "smem": 0, "grid_units": [1, [0]], "units_per_block": 1, "max_blocks": 0, "nkernels": 1,
          "workspace": 0, "workspace_per_block": 0}


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return torch.softmax(self.lin(x), -1) * 2.0


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KBENCH_CACHE_DIR", str(tmp_path))
    return tmp_path


def _key():
    return kc.make_key("region 0 ROW\n  %3 = sum %1 axes=1 : f32[B, 1]\n", "-", kc.shape_class({}, {"s0": 300}),
                       driver=12040, nvrtc=12040, gpu_name="NVIDIA H100 80GB HBM3", gpu_arch="sm_90",
                       torch_version="2.11.0", kbench_version="0.1.0")


def _winner():
    return kc.Winner(genome="threads=256 vec=4", source_hash="ab" * 32, cubin=b"\x7fELF" + bytes(60),
                     entries=["kb_region0"], launch=dict(LAUNCH), envelope="24 checks", created=1000.0)


class _Payload:
    """What an attacker writes into a shared cache: unpickling it creates the marker file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


# ------------------------------------------------------------------------------ item 1: data only

def test_pickle_payload_planted_in_the_database_does_not_run(cache_dir, caplog):
    model, x = Small(), torch.randn(4, 8)
    key = capture_cache.fingerprint(model, (x,), "interp")
    marker = cache_dir / "pwned"
    payload = pickle.dumps(_Payload(marker))
    with contextlib.closing(kc.open_cache()) as db:
        db.store_capture(key, b"")                                  # the table and the key exist
    # an old-format (pickled) row, and one dressed as signed without the key: written behind
    # kbench's back, both are misses
    for blob, warns in ((payload, False), (kc.SEAL + b"0" * 64 + payload, True)):
        with sqlite3.connect(cache_dir / "kbench.sqlite") as con:
            con.execute("UPDATE captures SET blob = ? WHERE key = ?", (blob, key))
        con.close()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert capture_cache.lookup(model, (x,), "interp") == (key, None)
        assert any("not signed" in str(w.message) for w in caught) == warns
        assert not marker.exists()
    # signed with the user's key (a kbench bug, a stolen key), a pickle is still never unpickled:
    # the next optimize() refuses it, captures again and replaces it
    with contextlib.closing(kc.open_cache()) as db:
        db.store_capture(key, payload)
    with pytest.raises(stored.NotData, match="not a stored capture"):
        capture_cache.loads(payload)
    optimized = kbench.optimize(model, x, verbose=False)
    assert not marker.exists()
    assert "stored capture is unusable" in caplog.text
    assert "capture: torch.export, kept in the cache" in optimized.kbench_report.notes
    torch.testing.assert_close(optimized(x), model(x))


def test_stored_capture_is_json_that_names_no_code():
    captured = capture(Small(), (torch.randn(4, 8),))
    blob = capture_cache.dumps(captured)
    assert blob.startswith(stored.MAGIC)
    state = json.loads(blob[len(stored.MAGIC):])
    again = capture_cache.loads(blob)
    assert str(again.graph) == str(captured.graph)
    text = blob.decode()
    assert '"$":"op","v":["aten","linear","default"]' in text
    # the decoder resolves names only through its allow-lists: anything else is refused
    evil = [{"$": "fn", "v": "os.system"}, {"$": "fn", "v": "operator.attrgetter"},
            {"$": "op", "v": ["aten", "from_file", "default"]}, {"$": "op", "v": ["aten", "save", "default"]},
            {"$": "op", "v": ["aten", "linear"]}, {"$": "hop", "v": "nope"}, {"$": "global", "v": "os:system"},
            {"__enum__": True, "fqn": "os:system", "name": "x"}]
    for thing in evil:
        with pytest.raises(stored.NotData):
            stored._dec_callable(thing) if thing.get("$") in ("fn", "op", "hop") else stored._dec(thing)
    fields = state["fields"]
    ext = fields["externs"][0]
    ext["steps"][0][0] = {"$": "fn", "v": "builtins.eval"}
    with pytest.raises(stored.NotData, match="function"):
        capture_cache.loads(stored.MAGIC + json.dumps(state).encode())
    # a capture holding a callable outside the data format is not kept at all
    bad = dataclasses.replace(captured, externs=[type(captured.externs[0])([(os.system, ("true",), {})], "x", 0)])
    with pytest.raises(capture_cache.Uncacheable, match="callable"):
        capture_cache.dumps(bad)


def test_damaged_capture_fails_to_load_with_a_reason():
    captured = capture(Small(), (torch.randn(4, 8),))
    state = json.loads(capture_cache.dumps(captured)[len(stored.MAGIC):])
    state["fields"]["constants"]["$"] = "pickle"                           # an unknown tag
    with pytest.raises(stored.NotData, match="unknown tag"):
        capture_cache.loads(stored.MAGIC + json.dumps(state).encode())
    state = json.loads(capture_cache.dumps(captured)[len(stored.MAGIC):])
    node = next(n for n in state["nodes"] if dict(n["v"])["op"] == "extern")
    next(p for p in node["v"] if p[0] == "index")[1] = 7                   # an extern that is not there
    with pytest.raises(stored.NotData, match="runs extern 7"):
        capture_cache.loads(stored.MAGIC + json.dumps(state).encode())


def test_tampered_or_foreign_winner_is_not_loaded(tmp_path):
    path = tmp_path / "kbench.sqlite"
    c = kc.open_cache(path)
    c.store(_key(), _winner())
    assert c.lookup(_key()) == _winner()
    c.close()
    for column, value in (("cubin", b"\x7fELF" + b"\xcc" * 60), ("launch", json.dumps({**LAUNCH, "block": 1024})),
                          ("entries", '["other"]')):
        with sqlite3.connect(path) as con:
            con.execute(f"UPDATE winners SET {column} = ?", (value,))
        c = kc.open_cache(path)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert c.lookup(_key()) is None, column
        assert column != "cubin" or "not signed with this user's key" in str(caught[0].message)
        c.store(_key(), _winner())                              # tuned again: stored signed
        assert c.lookup(_key()) == _winner()
        c.close()
    # the same file under another user's key (a cache copied from elsewhere): nothing is loaded
    other = tmp_path / "copy"
    other.mkdir()
    (other / "kbench.sqlite").write_bytes(path.read_bytes())
    with contextlib.closing(kc.open_cache(other / "kbench.sqlite")) as c, pytest.warns(RuntimeWarning):
        assert c.lookup(_key()) is None


def test_key_file_is_private_and_an_untrusted_one_is_not_used(tmp_path):
    key, why = keyfile.load(str(tmp_path))
    assert why == "" and len(key) == keyfile.KEY_BYTES
    f = tmp_path / keyfile.KEY_NAME
    assert stat.S_IMODE(f.stat().st_mode) == 0o600
    assert keyfile.load(str(tmp_path)) == (key, "")                     # made once, then read
    c = kc.open_cache(tmp_path / "kbench.sqlite")
    c.store(_key(), _winner())
    c.close()
    f.chmod(0o640)
    c = kc.open_cache(tmp_path / "kbench.sqlite")
    with pytest.warns(RuntimeWarning, match="readable or writable by others"):
        assert c.lookup(_key()) is None
    c.close()
    f.unlink()
    os.symlink(tmp_path / "elsewhere", f)                                # a link is never followed
    assert keyfile.load(str(tmp_path))[0] is None
    f.unlink()
    f.mkdir()
    assert "not a regular file" in keyfile.load(str(tmp_path))[1]


# ------------------------------------------------------------------------------ item 9: the CLI

def _foreign(path, kind):
    if kind == "text":
        path.write_text("my notes\n")
    elif kind == "empty":
        path.write_bytes(b"")
    else:
        with sqlite3.connect(path) as con:
            con.execute("CREATE TABLE users (name TEXT)" if kind == "other_app" else "CREATE TABLE winners (x TEXT)")
            con.execute("INSERT INTO " + ("users" if kind == "other_app" else "winners") + " VALUES ('mine')")
        con.close()


@pytest.mark.parametrize("kind", ["other_app", "lookalike", "text", "empty"])
def test_cli_refuses_a_file_that_is_not_a_kbench_cache(tmp_path, capsys, kind):
    path = tmp_path / "other.db"
    _foreign(path, kind)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    for cmd in (["ls"], ["info"], ["clear"], ["export", str(tmp_path / "out.jsonl")]):
        assert kc.cli_main(["--path", str(path), *cmd]) == kc.NOT_A_CACHE, cmd
        err = capsys.readouterr().err
        assert "is not a kbench cache" in err and "left untouched" in err
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before    # nothing renamed, made or changed


def test_cli_on_a_missing_file_makes_nothing(tmp_path, capsys):
    assert kc.cli_main(["--path", str(tmp_path / "nope.db"), "ls"]) == kc.CANNOT
    assert "no kbench cache at" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def _read_only(monkeypatch, folder):
    """What os.access says for a folder (and its files) this user cannot write: the check the
    cache makes before it would make a lock file (root's chmod is not enforced)."""
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if mode & os.W_OK and
                        os.path.abspath(p).startswith(str(folder)) else real(p, mode, **kw))


def test_read_only_cache_is_read_without_a_lock_file_and_never_cleared_in_memory(cache_dir, monkeypatch, capsys):
    model, x = Small(), torch.randn(4, 8)
    kbench.optimize(model, x, verbose=False)                           # keeps the capture (and makes the key)
    with contextlib.closing(kc.open_cache()) as db:
        db.store(_key(), _winner())
    (cache_dir / "kbench.sqlite.lock").unlink()
    files = sorted(p.name for p in cache_dir.iterdir())
    _read_only(monkeypatch, cache_dir)

    assert kc.cli_main(["ls"]) == 0
    assert "threads=256 vec=4" in capsys.readouterr().out
    assert kc.cli_main(["info"]) == 0 and "read_only: True" in capsys.readouterr().out
    hit = kbench.optimize(model, x, verbose=False)
    assert any(n.startswith("capture: from the cache") for n in hit.kbench_report.notes)
    with contextlib.closing(kc.open_cache()) as db:
        assert db.read_only and db.lookup(_key()) == _winner()
        db.store(_key(), dataclasses.replace(_winner(), genome="other"))   # skipped, not an error
    assert kc.cli_main(["clear"]) == kc.CANNOT
    out = capsys.readouterr()
    assert "cannot clear" in out.err and "cleared" not in out.out
    assert sorted(p.name for p in cache_dir.iterdir()) == files       # no lock, no -wal/-shm, nothing set aside
    monkeypatch.undo()
    with contextlib.closing(kc.open_cache(cache_dir / "kbench.sqlite")) as db:
        info = db.info()
        assert (info["winners"], info["captures"]) == (1, 1) and db.lookup(_key()).genome == _winner().genome


def test_optimize_leaves_a_foreign_file_in_a_read_only_folder_alone(tmp_path, monkeypatch):
    path = tmp_path / "kbench.sqlite"
    _foreign(path, "other_app")
    before = path.read_bytes()
    _read_only(monkeypatch, tmp_path)
    with pytest.warns(RuntimeWarning, match="in-memory"):
        c = kc.open_cache(path)
    assert c.in_memory
    c.close()
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["kbench.sqlite"]


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root writes through chmod")
def test_read_only_by_chmod(tmp_path, capsys):
    path = tmp_path / "kbench.sqlite"
    with contextlib.closing(kc.open_cache(path)) as c:
        c.store(_key(), _winner())
    (tmp_path / "kbench.sqlite.lock").unlink()
    path.chmod(0o444)
    tmp_path.chmod(0o555)
    try:
        assert kc.cli_main(["--path", str(path), "ls"]) == 0
        with contextlib.closing(kc.open_cache(path)) as c:
            assert c.read_only and c.lookup(_key()) == _winner()
        assert kc.cli_main(["--path", str(path), "clear"]) == kc.CANNOT
        assert not (tmp_path / "kbench.sqlite.lock").exists()
    finally:
        tmp_path.chmod(0o755)


def test_a_cache_on_a_network_file_system_uses_the_rollback_journal(tmp_path, monkeypatch):
    """WAL's index lives in shared memory that processes on other hosts do not see: on NFS (and
    the like) the cache takes SQLite's rollback journal, which POSIX locks protect across hosts."""
    from kbench.tune import cache as kc
    mounts = ("proc /proc proc rw 0 0\n/dev/sda1 / ext4 rw 0 0\n"
              "server:/export /mnt/shared\\040dir nfs4 rw 0 0\n/dev/sdb /mnt/shared\\040dir/local xfs rw 0 0\n")
    assert kc.fs_type("/mnt/shared dir/kbench", mounts) == "nfs4"
    assert kc.fs_type("/mnt/shared dir/local/x", mounts) == "xfs"      # the longest mount point
    assert kc.fs_type("/mnt/shared dirt", mounts) == "ext4" and kc.fs_type("/x", "") == ""
    monkeypatch.setattr(kc, "fs_type", lambda path, mounts=None: "nfs4")
    c = kc.open_cache(tmp_path / "kbench.sqlite")
    info = c.info()
    c.close()
    assert info["journal_mode"] == "delete" and "network file system (nfs4)" in info["note"], info
    monkeypatch.setattr(kc, "fs_type", lambda path, mounts=None: "ext4")
    c = kc.open_cache(tmp_path / "kbench.sqlite")
    assert c.info()["journal_mode"] == "wal"
    c.close()
