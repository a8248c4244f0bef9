"""The sandbox (kbench/tune/sandbox.py, sandbox_worker.py) on the CPU: its wire format and the request
a candidate makes, the watchdog against a stand-in worker (tests/_sandbox_standin.py: no torch, no
CUDA), and what the tuner makes of a search that ends without a verified kernel (a fake bench): the
region runs in torch with the reason, nothing is built after it; the memory the checks may use.
tests/gpu/test_sandbox.py plants real kernels that hang, trap and write out of bounds."""
import io
import json
import os
import time

import pytest
import torch

from kbench import _C, verify
from kbench.runtime import cuda as cuda_runtime
from kbench.runtime.cuda import CudaExecutor
from kbench.runtime.plan import Plan, Status
from kbench.tune import cache, sandbox, sandbox_worker, search
from kbench.tune.sandbox_worker import ProtocolError, decode, encode, parse_check, parse_item
from kbench.tune.tuner import Tuner
from test_evolve import FakeBench, layernorm_graph, ln_cost, region_of_kind, texts

# ------------------------------------------------------------------------------------ the wire format


def test_frames_round_trip_and_junk_is_refused():
    header = {"op": "check", "x": [1, 2.5, "é", None], "nested": {"a": [[]]}}
    blobs = [b"\x7fELF" + bytes(range(256)), b""]
    data = encode(header, blobs)
    assert decode(data) == (header, blobs)
    assert decode(encode({})) == ({}, [])
    bad = {
        "short": data[:5],
        "magic": b"XXXX" + data[4:],
        "trailing bytes": data + b"\0",
        "truncated blob": data[:-1],
        "header past the end": data[:14],
        "not an object": b"KBS1" + (2).to_bytes(4, "little") + (0).to_bytes(4, "little") + b"[]",
        "not JSON": b"KBS1" + (2).to_bytes(4, "little") + (0).to_bytes(4, "little") + b"{x",
        "too many blobs": b"KBS1" + (2).to_bytes(4, "little") + (99).to_bytes(4, "little") + b"{}",
    }
    for why, junk in bad.items():
        with pytest.raises(ProtocolError):
            decode(junk)
    with pytest.raises(ProtocolError):
        encode({}, [b""] * (sandbox_worker.MAX_BLOBS + 1))
    with pytest.raises(ValueError):
        encode({"x": float("nan")})          # JSON has no NaN: never sent
    # frames over a pipe: a length, then the payload; the reader bounds both size and time
    r, w = os.pipe()
    try:
        sandbox_worker.write_frame(w, data)
        assert decode(sandbox_worker.read_frame(r, 1 << 20)) == (header, blobs)
        with pytest.raises(TimeoutError):
            sandbox_worker.read_frame(r, 1 << 20, deadline=time.monotonic() + 0.05)
        sandbox_worker.write_frame(w, data)
        with pytest.raises(ProtocolError, match="at most 16"):   # (the stream is lost: the worker is killed)
            sandbox_worker.read_frame(r, 16)
    finally:
        os.close(w)
    os.read(r, len(data))
    with pytest.raises(EOFError):
        sandbox_worker.read_frame(r, 1 << 20)
    os.close(r)


def test_launch_items_are_checked():
    assert parse_item(["tensor", [2, 3], "float32", "input"]) == ("tensor", (2, 3), "float32", "input", None)
    assert parse_item(["tensor", [4], "int64", "index:7"]) == ("tensor", (4,), "int64", "index", 7)
    assert parse_item(["tensor", [], "bfloat16", "output"])[1] == ()
    assert parse_item(["tensor", [8], "float32", "stat"])[3] == "stat"
    assert parse_item(["int", -5]) == ("int", -5) and parse_item(["float", 1]) == ("float", 1.0)
    assert parse_item(["null"]) == ("null",) and parse_item(["workspace", 64]) == ("workspace", 64)
    for junk in (["tensor", [2], "torch.float32", "input"], ["tensor", [2], "__class__", "input"],
                 ["tensor", [-1], "float32", "input"], ["tensor", [1] * 9, "float32", "input"],
                 ["tensor", [2], "float32", "index:x"], ["tensor", [2], "float32", "weights"],
                 ["tensor", [2.0], "float32", "input"], ["int", 1.5], ["int", True], ["int", 1 << 63],
                 ["workspace", -1], ["null", 0], ["call", "os.system"], "tensor", [], [3]):
        with pytest.raises(ProtocolError):
            parse_item(junk)
    good = {"entries": [["k", 0], ["k_finish", 0]],
            "groups": [{"args": [["null"]], "calls": [[0, [4, 1, 1], 256, 0], [1, 4, 256, 0]]}]}
    cubin, entries, groups = parse_check(good, [b"cubin"])
    assert cubin == b"cubin" and entries == [("k", 0), ("k_finish", 0)]
    assert groups == [([("null",)], [(0, (4, 1, 1), 256, 0), (1, (4, 1, 1), 256, 0)])]
    for change in ({"entries": [["k; rm -rf /", 0]]}, {"entries": []},
                   {"groups": [{"args": [], "calls": [[2, 4, 256, 0]]}]},     # no such entry
                   {"groups": [{"args": [], "calls": [[0, 0, 256, 0]]}]},     # an empty grid
                   {"groups": [{"args": [], "calls": [[0, [1, 1], 256, 0]]}]},
                   {"groups": [{"args": [], "calls": [[0, 1, [256, 1, 1], 0]]}]},    # threads: one int
                   {"groups": [{"args": [], "calls": [[0, 1, 2048, 0]]}]}):
        with pytest.raises(ProtocolError):
            parse_check({**good, **change}, [b"cubin"])
    with pytest.raises(ProtocolError):
        parse_check(good, [])


def test_the_worker_sees_writes_outside_a_buffer(monkeypatch):
    """The worker's check on the CPU with the launches played by Python: inputs drawn by role,
    outputs NaN-poisoned, and a byte written just before or just past any buffer (an output, a
    workspace) refuses the candidate with where it was; a launch error that leaves the context
    working is the candidate's "launch failed"."""
    import kbench
    seen = {}

    def raw(t):
        return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())

    class FakeC:
        CudaError = _C.CudaError

        def module_load(self, cuda, cubin):
            return cubin

        def get_function(self, cuda, module, name, smem):
            return name, 0, 0

        def launch(self, cuda, fn, grid, block, smem, stream, args):
            y, x, idx, stat, n, ws, none = args
            seen.update(y=y.clone(), idx=idx.clone(), stat=stat.clone(), n=n, none=none, launch=(grid, block, smem))
            y.copy_(x * 2)
            end = y.storage_offset() * 4 + y.numel() * 4
            if fn == "past_the_end":
                raw(y)[end + 3] = 0
            elif fn == "before":
                raw(y)[y.storage_offset() * 4 - 1] = 0
            elif fn == "workspace":
                raw(ws)[ws.storage_offset() + ws.numel()] = 7
            elif fn == "refused":
                raise _C.CudaError("cuLaunchKernel: CUDA_ERROR_INVALID_VALUE: too many resources requested")
    monkeypatch.setattr(kbench, "_C", FakeC())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    args = [["tensor", [5, 3], "float32", "output"], ["tensor", [5, 3], "float32", "input"],
            ["tensor", [4], "int64", "index:3"], ["tensor", [2], "float32", "stat"], ["int", 5], ["workspace", 100],
            ["null"]]
    fates = {}
    for fn in ("good", "past_the_end", "before", "workspace", "refused"):
        request = {"op": "check", "entries": [[fn, 0]], "groups": [{"args": args, "calls": [[0, 2, 64, 0]]}]}
        fates[fn] = sandbox_worker.check(None, torch.device("cpu"), *parse_check(request, [b"cubin"]))["fate"]
    assert fates == {"good": "ok",
                     "past_the_end": "out-of-bounds write: past the end of argument 0 (output) (sizes 1 of 1)",
                     "before": "out-of-bounds write: before the start of argument 0 (output) (sizes 1 of 1)",
                     "workspace": "out-of-bounds write: past the end of argument 5 (workspace) (sizes 1 of 1)",
                     "refused": "launch failed: cuLaunchKernel: CUDA_ERROR_INVALID_VALUE: too many resources requested"}
    assert torch.isnan(seen["y"]).all() and seen["y"].shape == (5, 3)       # poisoned before the launch
    assert ((seen["idx"] >= 0) & (seen["idx"] < 3)).all() and (seen["stat"] >= 8).all()
    assert seen["n"] == 5 and seen["none"] is None and seen["launch"] == ((2, 1, 1), 64, 0)


def _executor(graph, monkeypatch, save_stats=False):
    """A cuda executor with no GPU: a plan, and kernels 'loaded' from no CUBIN."""
    monkeypatch.setattr(cuda_runtime._C, "module_load", lambda cuda, cubin: object())
    monkeypatch.setattr(cuda_runtime._C, "get_function", lambda cuda, module, name, smem: (name, 32, 0))
    ex = CudaExecutor(Tuner(budget="none", verbose=False))
    ex.plan, ex.cuda, ex.dev, ex.device = Plan(graph, save_stats=save_stats), None, {"num_sms": 132, "regs_per_sm": 65536}, \
        torch.device("cpu")
    return ex


def _column_sum(rows=4096):
    g = _C.Graph()
    s = g.add_symbol("s0", rows)
    x = g.add_input("x", "user", "f32", [(1, (s,)), 512])
    g.add_output(g.add_node("sum", [x], "f32", [1, 512], axes=1))
    return g


def test_a_candidates_request_round_trips(monkeypatch):
    """What the sandbox is sent for a candidate: per size, its inputs (made there), its outputs
    (poisoned there), its sizes and workspace in CudaExecutor.launch's order, the kernel and then
    its finishing kernel; and the entry point without saved statistics with null pointers for them."""
    ex = _executor(_column_sum(), monkeypatch)
    k = _C.generate(ex.plan.partition, 0, 90, None, None)
    assert k.finish_name and k.workspace_bytes_per_block     # a kernel and its finishing kernel
    kernel = ex.load(k, cubin=b"x")
    header, moved = sandbox.describe(ex, 0, k, kernel, [[4096], [7]])
    cubin, entries, groups = parse_check(*decode(encode(header, [b"\x7fELF"])))
    assert cubin == b"\x7fELF" and entries == [(k.name, k.smem), (k.finish_name, 0)]
    assert len(groups) == 2
    for (items, calls), n in zip(groups, (4096, 7)):
        grid = kernel.grid([n])
        ws = kernel.workspace_per_block * grid
        assert items == [("tensor", (n, 512), "float32", "input", None), ("tensor", (1, 512), "float32", "output", None),
                         ("int", n), ("workspace", ws)]
        assert calls == [(0, (grid, 1, 1), k.block, k.smem), (1, (grid, 1, 1), k.block, 0)]
    assert moved == sum(2 * (n * 512 * 4 + 512 * 4 + kernel.workspace_per_block * kernel.grid([n])) for n in (4096, 7))
    assert sandbox.watchdog_s(moved) == pytest.approx(sandbox.WATCHDOG_FLOOR_S + sandbox.WATCHDOG_MARGIN * moved / 500e9)
    # a forward that saves row statistics: a second group runs the entry without them
    ex = _executor(layernorm_graph(rows=300), monkeypatch, save_stats=True)
    r = region_of_kind(ex.plan.partition, "ROW")
    k = _C.generate(ex.plan.partition, r, 90, None, None)
    saved = ex.plan.regions[r].saved
    assert k.nostats_name and saved == 2
    _, entries, groups = parse_check(*decode(encode(sandbox.describe(ex, r, k, ex.load(k, cubin=b"x"), [[300]])[0], [b"x"])))
    assert entries == [(k.name, k.smem), (k.nostats_name, k.smem)]
    (full, calls), (lean, lean_calls) = groups
    assert [i[3] for i in full[:6]] == ["input"] * 3 + ["output"] * 3 and full[6] == ("int", 300)
    assert lean[:4] == full[:4] and lean[4:6] == [("null",), ("null",)] and lean[6:] == full[6:]
    assert calls[0][0] == 0 and lean_calls[0][0] == 1


def test_input_roles_tell_the_worker_how_to_fill_them():
    """A gather's indices are drawn below the gathered axis's size (random integers would read out
    of bounds in a correct kernel); row statistics are drawn positive, as region_inputs draws them."""
    g = _C.Graph()
    x = g.add_input("x", "user", "f32", [4, 10])
    i = g.add_input("i", "user", "i64", [4, 3])
    g.add_output(g.add_node("gather", [x, i], "f32", [4, 3], axis=1))
    ex = CudaExecutor(Tuner(budget="none", verbose=False))
    ex.plan = Plan(g)
    r = next(info.index for info in ex.plan.regions if info.kind != "EXTERN")
    assert ex.input_roles(r, []) == [([4, 10], torch.float32, "input"), ([4, 3], torch.int64, "index:10")]
    ex.plan.stat_inputs = {ex.plan.regions[r].inputs[0]}
    assert ex.input_roles(r, [])[0][2] == "stat"


# ------------------------------------------------------------------------------------ the watchdog


def _gone(pid, within=5.0) -> bool:
    """The process has exited (gone, or a zombie nobody has reaped yet)."""
    end = time.monotonic() + within
    while time.monotonic() < end:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.02)
    return False


def test_a_worker_past_the_watchdog_is_killed_with_its_children_and_replaced():
    box = sandbox.Sandbox(target="_sandbox_standin:serve", kwargs={})
    try:
        first = box.request({"op": "echo", "x": 1}, [b"abc"], timeout=10)
        assert first == {"fate": "ok", "header": {"op": "echo", "x": 1}, "blobs": [3], "pid": box.pid}
        child = box.request({"op": "spawn"}, timeout=10)["child"]
        pid = box.pid
        t = time.monotonic()
        reply = box.request({"op": "sleep", "seconds": 60}, timeout=0.3)
        assert time.monotonic() - t < 5
        assert reply == {"fate": "hang: no answer within 0.3 s (worker killed)"}
        assert box.proc is None and _gone(pid) and _gone(child)       # its process group went with it
        again = box.request({"op": "echo"}, timeout=10)               # a fresh worker for the next
        assert again["fate"] == "ok" and again["pid"] != pid and box.starts == 2
        died = box.request({"op": "die"}, timeout=10)                 # one that dies mid-request
        assert died == {"fate": "crash: the worker died (exit code 3)"} and box.proc is None
        assert box.request({"op": "echo"}, timeout=10)["fate"] == "ok" and box.starts == 3
    finally:
        box.close()
    assert box.proc is None
    # an idle worker is stopped (its CUDA context holds device memory); the next request starts one
    box = sandbox.Sandbox(target="_sandbox_standin:serve", kwargs={}, idle_stop=0.2)
    try:
        pid = box.request({"op": "echo"}, timeout=10)["pid"]
        end = time.monotonic() + 5
        while box.proc is not None and time.monotonic() < end:
            time.sleep(0.02)
        assert box.proc is None and _gone(pid)
        assert box.request({"op": "echo"}, timeout=10)["pid"] != pid and box.starts == 2
    finally:
        box.close()
    # a worker that never says it is ready: no sandbox, and every request after is refused at once
    box = sandbox.Sandbox(target="_sandbox_standin:never_ready", kwargs={}, startup_timeout=0.3)
    for _ in range(2):
        with pytest.raises(sandbox.SandboxUnavailable, match="did not start"):
            box.request({"op": "echo"})
    assert box.starts == 1 and box.proc is None


# ------------------------------------------------------------------------------------ the tuner


@pytest.fixture
def layernorm_ex(tmp_path, monkeypatch):
    """A cuda executor on the CPU whose search runs on a fake bench (set bench_box[0])."""
    bench_box = []
    monkeypatch.setattr(search, "CudaRegionBench", lambda *a, **kw: bench_box[0])
    tuner = Tuner(budget="fast", verbose=False)
    tuner._db = cache.open_cache(tmp_path / "kbench.sqlite")
    ex = CudaExecutor(tuner)
    ex.plan = Plan(layernorm_graph(rows=4096))
    ex.device, ex.dev, ex.sm, ex.arch = torch.device("cpu"), None, 90, "sm_90"
    tuner.cache_key = lambda ex, r: cache.make_key(ex.plan.region_text(r), "-", cache.shape_class({}, {"s0": 4096}),
                                                   driver=1, nvrtc=1, gpu_name="test", gpu_arch="sm_90")
    built = []
    tuner.build = lambda *a, **kw: built.append(a) or pytest.fail("a kernel was built after the search")
    yield ex, bench_box, built
    tuner._db.close()


def candidates(db) -> list:
    """The search records in the cache, as `kbench cache export` writes them."""
    out = io.StringIO()
    db.export(out, cubins=False)
    return [row for row in map(json.loads, out.getvalue().splitlines()) if row["kind"] == "candidate"]


def _first(ex, r, n=12):
    return texts(_C.evolve_ask(_C.evolve_new(ex.plan.partition, r, [4096], None, 0, n), n))


def test_a_fatal_search_leaves_the_region_to_torch(layernorm_ex):
    ex, bench_box, built = layernorm_ex
    r = region_of_kind(ex.plan.partition, "ROW")
    first = _first(ex, r)
    bench_box.append(FakeBench(ln_cost, trap={first[2]}))
    info = ex.plan.regions[r]
    ex.tuner.prepare_region(ex, info, [4096])
    assert info.status is Status.EAGER and r not in ex.kernels and not built
    assert info.reason.startswith("search stopped: cuStreamSynchronize: CUDA_ERROR_ILLEGAL_ADDRESS") and \
        "the CUDA context may be unusable" in info.reason and "\n" not in info.reason
    assert ex.tuner.poisoned
    rows = candidates(ex.tuner.store())
    assert [row["genome"] for row in rows] == first          # the record of what became of each candidate
    assert rows[2]["verify"].startswith("trap: ") and all(row["extra"]["sandbox"] == "ok" for row in rows[:3])
    # nothing is launched in a context that may be dead: the next region is not tried
    other = type(info)(99, "ROW", [], [], [], "sum")
    ex.tuner.prepare_region(ex, other, [4096])
    assert other.status is Status.EAGER and other.reason.startswith(f"not tried: region {r}'s search: search stopped")


def test_a_search_the_sandbox_refuses_leaves_the_region_to_torch(layernorm_ex):
    ex, bench_box, built = layernorm_ex
    r = region_of_kind(ex.plan.partition, "ROW")
    bench_box.append(FakeBench(ln_cost, sandbox={g: "trap: CUDA error: an illegal instruction was encountered"
                                                 for g in _first(ex, r)}))
    info = ex.plan.regions[r]
    ex.tuner.prepare_region(ex, info, [4096])
    assert info.status is Status.EAGER and r not in ex.kernels and not built and not ex.tuner.poisoned
    assert info.reason.startswith("no candidate compiled and passed the sandbox and the gate: 12 of 12 compiled, "
                                  "12 refused by the sandbox (first: trap: CUDA error: an illegal instruction")


def test_out_of_memory_in_a_search_leaves_the_region_to_torch(layernorm_ex):
    ex, bench_box, built = layernorm_ex
    r = region_of_kind(ex.plan.partition, "ROW")

    class Oom(FakeBench):
        def time(self, kernel, reps, warmup=2):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
    bench_box.append(Oom(ln_cost))
    info = ex.plan.regions[r]
    ex.tuner.prepare_region(ex, info, [4096])
    assert info.status is Status.EAGER and r not in ex.kernels and not built and not ex.tuner.poisoned
    assert info.reason == "out of GPU memory: CUDA out of memory. Tried to allocate 20.00 GiB"
    # out of memory anywhere else on the way (a stored winner's gate, the timing): the same
    ex.tuner.by_source.clear()
    ex.tuner.cached = lambda *a: (_ for _ in ()).throw(torch.cuda.OutOfMemoryError("CUDA out of memory (gate)"))
    ex.tuner.prepare_region(ex, info, [4096])
    assert info.status is Status.EAGER and info.reason.startswith("out of GPU memory while it was searched")
    # a trap or hang here on the way (a kernel the sandbox passed): the region in torch, nothing tried after
    ex.tuner.by_source.clear()
    ex.tuner.cached = lambda *a: (_ for _ in ()).throw(search.KernelHang("kernel hang: still running after 10 s"))
    ex.tuner.prepare_region(ex, info, [4096])
    assert info.status is Status.EAGER and info.reason == \
        "trap: kernel hang: still running after 10 s; the CUDA context may be unusable"
    assert ex.tuner.poisoned == f"region {r}: kernel hang: still running after 10 s"
    ex.tuner.cached = lambda *a: (_ for _ in ()).throw(ValueError("a bug, not the device's"))
    ex.tuner.poisoned = ""
    ex.tuner.by_source.clear()
    with pytest.raises(ValueError):
        ex.tuner.prepare_region(ex, info, [4096])


def test_checks_fit_the_free_memory():
    """The sweep points are those that fit MEMORY_SHARE of the free memory: with room for all, the
    usual sweep; with less, the points larger than fits are left out; with less than the example
    needs, the example halved until it fits, and the envelope says so; with too little for even one
    row, none (the region is not verified, so it runs in torch)."""
    ex = CudaExecutor(Tuner(budget="none", verbose=False))
    ex.plan = Plan(layernorm_graph(rows=4096))
    r = region_of_kind(ex.plan.partition, "ROW")
    need = verify.point_bytes(ex.plan, r, [4096])
    # at least x, its clone and its float64 copy, and the float64 output, twice (the dependence check)
    assert need >= 2 * 4096 * 768 * (4 + 4 + 8 + 8) and verify.point_bytes(ex.plan, r, [8193]) > 1.9 * need
    everything = verify.sweep_symvals([4096])
    assert verify.plan_points(ex, r, [4096], free=None) == (everything, "")
    assert verify.plan_points(ex, r, [4096], free=int(1.01 * need / verify.MEMORY_SHARE)) == \
        ([[4096], [1], [7], [4099]], "")       # 8193 does not fit
    points, note = verify.plan_points(ex, r, [4096], free=int(need / 3 / verify.MEMORY_SHARE))
    assert points[0] == [1024] and [1] in points and [1027] in points and [2049] not in points
    assert all(verify.point_bytes(ex.plan, r, p) <= need / 3 for p in points)
    assert note.startswith("the example [4096] does not fit the free GPU memory") and \
        note.endswith("checked at [1024] in its stead")
    assert verify.plan_points(ex, r, [4096], free=1000) == \
        ([], f"too large to verify in the free GPU memory (~{need / 2 ** 30:.3g} GiB at the example sizes, "
             f"{1000 / 2 ** 30:.3g} GiB free)")
    v = verify.Verdict(True, checked=9, sizes=[[1024], [1], [7], [1027]], note=note)
    assert verify.envelope(v, ["s0"]).endswith(f"s0∈[1,1027], max err 0 ({note})")
