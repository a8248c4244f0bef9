"""A region whose kernel does not beat what eager runs for its ops goes back to torch as eager's own
ATen calls: every IR value knows the FX node it came from (Captured.origin), a capture can keep
named nodes as torch calls (lower's keep), optimize() lowers the same export again with the ops of
the regions that lost kept (api._demote), and the report's eager column times those ATen calls.
On the CPU: the interp backend, with its prepare (standing in for the tuner) saying a region lost."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import kbench
from kbench import api
from kbench.capture import capture, capture_exported, relower
from kbench.runtime import torch_eval
from kbench.runtime.interp import InterpExecutor
from kbench.runtime.eager import RegionEager
from kbench.runtime.plan import RegionInfo, Status
from kbench.tune import cache as kc
from kbench.tune import tuner as tuner_mod
from kbench.tune.tuner import Tuner
from models import MODELS


class Attention(nn.Module):
    """LayerNorm, a Linear and GELU, then attention written with matmuls and a softmax."""

    def __init__(self, dim=16):
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, dim)
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)

    def forward(self, x):
        y = F.gelu(self.fc(self.ln(x)))
        a = torch.softmax(self.q(y) @ self.k(y).transpose(-1, -2) / 4.0, dim=-1)
        return a @ y


class TwoNorms(nn.Module):
    """Two LayerNorm blocks alike but for their weights: their regions are the same IR."""

    def __init__(self, dim=32):
        super().__init__()
        self.a, self.b = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, dim)

    def forward(self, x):
        return self.b(self.fc(self.a(x)))


def example(dim=16):
    torch.manual_seed(0)
    return torch.randn(3, 8, dim)


def lose(monkeypatch, which, why="its kernel did not beat eager's ops (forced)"):
    """The interp backend's prepare, then the compute regions `which(info, plan)` picks marked as
    a tuner marks a region whose kernel lost (status eager, with the reason)."""
    real = InterpExecutor.prepare
    lost = []

    def prepare(self, plan, device):
        real(self, plan, device)
        for info in plan.regions:
            if info.kind != "EXTERN" and which(info, plan):
                info.set_status(Status.EAGER, why(info) if callable(why) else why)
                lost.append(info.fx_nodes)
    monkeypatch.setattr(InterpExecutor, "prepare", prepare)
    return lost


def grads_match(model, opt, x, tol=1e-10):
    """Outputs and gradients (input and every parameter) of opt equal eager's (float64)."""
    xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    want, got = model(xa), opt(xb)
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    g = torch.randn_like(want)
    params = list(model.parameters())
    gw = torch.autograd.grad(want, [xa, *params], g)
    gg = torch.autograd.grad(got, [xb, *params], g)
    for w, h in zip(gw, gg):
        torch.testing.assert_close(h, w, rtol=tol, atol=tol)


# ------------------------------------------------------------------------------------ provenance


def test_every_value_maps_to_the_aten_node_it_came_from():
    model = Attention()
    captured, exported = capture_exported(model, (example(),))
    fx = {n.name: n for n in exported.ep.graph.nodes}
    g = captured.graph
    assert sorted(captured.origin) == list(range(g.num_nodes))       # every value, no other id
    from_op = {"mean": "layer_norm", "rsqrt": "layer_norm", "gelu": "gelu", "exp": "softmax",
               "recip": "softmax", "extern": ("linear", "matmul"), "div": "div", "permute": "transpose"}
    seen = set()
    for v in range(g.num_nodes):
        op, node = g.node(v)["op"], fx[captured.origin[v]]
        if op == "input":
            assert node.op == "placeholder", (v, node)
            continue
        assert node.op == "call_function", (v, node)
        aten_name = node.target._schema.name.split("::")[1]
        if op in from_op:
            want = from_op[op]
            assert aten_name in (want if isinstance(want, tuple) else (want,)), (v, op, node.name)
            seen.add(op)
    assert seen == set(from_op)
    # the LayerNorm's whole decomposition is the one aten.layer_norm node's
    ln = [v for v, name in captured.origin.items() if name == "layer_norm"]
    assert len(ln) >= 8 and {g.node(v)["op"] for v in ln} >= {"mean", "sub", "mul", "rsqrt", "add"}
    # and that node's call is eager's: aten.layer_norm on the input and the parameters, its result
    # the value the next op reads
    call = captured.calls["layer_norm"]
    assert call.op == "aten.layer_norm.default" and call.call.fn is torch.ops.aten.layer_norm.default
    assert [v for v, _, _ in call.operands] == [0, *[g.inputs[i] for i in range(1, 3)]]
    (axis, out), = call.results
    assert axis is None and captured.value_names[out] == "layer_norm" and max(ln) == out
    assert captured.calls["gelu"].operands[0][0] != out     # the Linear's bias add is between them


def test_extern_values_and_multi_output_values_name_their_node():
    class VarMean(nn.Module):
        def forward(self, x):
            var, mean = torch.var_mean(x, dim=-1, keepdim=True)
            return (x - mean) / (var + 1).sqrt() + torch.cumsum(x, -1)   # cumsum: no lowering
    captured, exported = capture_exported(VarMean(), (example(),))
    names = {n.name: n for n in exported.ep.graph.nodes}
    g = captured.graph
    ext = [v for v in range(g.num_nodes) if g.node(v)["op"] == "extern"]
    assert [captured.origin[v] for v in ext] == ["cumsum"]
    # var_mean's outputs are made when its getitems ask for them, but they are var_mean's
    vm = [v for v, name in captured.origin.items() if name == "var_mean"]
    assert names["var_mean"].target._schema.name == "aten::var_mean"
    assert {g.node(v)["op"] for v in vm} >= {"mean", "sub", "div"}
    # x - mean is var_mean's own x - mean (one IR value): it keeps its first maker as origin
    assert "sub" not in captured.origin.values()
    (_, sub), = captured.calls["sub"].results
    assert captured.origin[sub] == "var_mean"
    assert not any(names[name].target.__name__ == "getitem" for name in captured.origin.values()
                   if names[name].op == "call_function")
    assert sorted(i for i, _ in captured.calls[captured.origin[vm[0]]].results) == [0, 1]


# ------------------------------------------------------------------------------------ keep


def test_keep_makes_the_node_one_extern_call_that_matches_eager(exports):
    model, x = Attention(), example()
    captured, exported = capture_exported(model, (x,))
    kept = relower(exported, {"layer_norm": "a test keeps it"})
    assert len(exports) == 1                                  # the same export, lowered again
    g = kept.graph
    ops = [g.node(v)["op"] for v in range(g.num_nodes)]
    assert "rsqrt" not in ops and "mean" not in ops           # no decomposition left
    ext = [v for v in range(g.num_nodes) if g.node(v)["op"] == "extern" and kept.origin[v] == "layer_norm"]
    assert len(ext) == 1
    assert kept.externs[g.node(ext[0])["index"]].fn is torch.ops.aten.layer_norm.default
    assert kept.kept == {"layer_norm": "a test keeps it"}
    assert "layer_norm" not in kept.calls                      # not lowered: no eager call of its own to record
    assert any(n.startswith("layer_norm: extern") and "kept in torch: a test keeps it" in n for n in kept.notes)
    part = g.partition()
    region = next(part.region(r) for r in range(len(part)) if ext[0] in part.region(r)["nodes"])
    assert region["kind"] == "EXTERN" and region["nodes"] == [ext[0]]
    with torch.no_grad():
        torch.testing.assert_close(torch_eval.run_graph(kept, model, (x,)), model(x))
    # capture(keep=) gives the same graph (a fresh export)
    assert str(capture(model, (x,), keep={"layer_norm"}).graph) == str(g)


def test_keeping_what_a_linear_feeds_keeps_its_bias_in_the_gemm():
    """A Linear whose only consumer is kept in torch is one aten.linear (bias in the GEMM), not a
    product and a bias add of its own: kept ops merge with the torch work next to them."""
    model = nn.Sequential(nn.Linear(16, 16), nn.GELU())
    x = example()
    plain, exported = capture_exported(model, (x,))
    assert any(plain.graph.node(v)["op"] == "add" for v in range(plain.graph.num_nodes))   # the bias add: IR
    kept = relower(exported, {"gelu": ""})
    g = kept.graph
    assert [g.node(v)["op"] for v in range(g.num_nodes) if g.node(v)["op"] != "input"] == ["extern", "extern"]
    assert [kept.externs[g.node(v)["index"]].fn for v in range(g.num_nodes) if g.node(v)["op"] == "extern"] == \
        [torch.ops.aten.linear.default, torch.ops.aten.gelu.default]


# ------------------------------------------------------------------------------------ demotion


def test_a_region_that_lost_is_kept_as_single_torch_calls(monkeypatch, exports):
    model = Attention().double()
    x = example().double()
    lost = lose(monkeypatch, lambda info, plan: "rsqrt" in info.ops.split())
    opt = kbench.optimize(model, (x,), backend="interp", budget="none", verbose=False)
    assert len(exports) == 1                                  # demotion lowers the same export again
    assert lost == [("layer_norm",)]
    plan = opt._kbench_plan
    assert opt._kbench_captured.kept.keys() == {"layer_norm"}
    for name, target in (("layer_norm", "layer_norm"),):
        regions = [info for info in plan.regions if name in info.fx_nodes]
        assert len(regions) == 1 and regions[0].kind == "EXTERN", [(i.kind, i.ops) for i in regions]
        externs = [v for v in regions[0].nodes if plan.nodes[v]["op"] == "extern"]
        assert len(externs) == 1                              # one aten call for the op, nothing else
        assert plan.externs[plan.nodes[externs[0]]["index"]].fn is getattr(torch.ops.aten, target).default
        assert regions[0].status is Status.TORCH
        assert regions[0].status_text == "torch (kept: its kernel did not beat eager's ops (forced))"
    # the Linear's bias add with GELU, and the softmax, still run on the backend
    assert [info.fx_nodes for info in plan.regions if info.kind != "EXTERN"] == [("linear", "gelu"), ("div", "softmax")]
    grads_match(model, opt, x)
    grads_match(model, opt, torch.randn(2, 5, 16, dtype=torch.float64))   # another size


def test_a_model_whose_every_region_loses_generates_nothing(monkeypatch):
    model = Attention().double()
    x = example().double()
    lose(monkeypatch, lambda info, plan: True)
    opt = kbench.optimize(model, (x,), backend="interp", budget="none", verbose=False)
    plan = opt._kbench_plan
    assert all(info.kind == "EXTERN" for info in plan.regions), [(i.kind, i.ops) for i in plan.regions]
    assert opt.kbench_report.kernels == 0
    assert {n for info in plan.regions for n in info.fx_nodes} >= {"layer_norm", "gelu", "softmax"}
    grads_match(model, opt, x)


def test_demotion_stops_after_its_rounds(monkeypatch):
    """A backend that finds a region losing in every plan: DEMOTE_ROUNDS lowerings after the first,
    then the module as it is (still right)."""
    rounds = []
    real = api.Lowering.capture

    def counted(self, keep=None):
        rounds.append(sorted(keep or {}))
        return real(self, keep)
    monkeypatch.setattr(api.Lowering, "capture", counted)
    # each plan's first compute region loses: the next round has another one
    lose(monkeypatch, lambda info, plan: info is next(i for i in plan.regions if i.kind != "EXTERN"))
    model = nn.Sequential(*[m for _ in range(4) for m in (nn.LayerNorm(16), nn.Linear(16, 16, bias=False))])
    opt = kbench.optimize(model, (example(),), backend="interp", budget="none", verbose=False)
    assert len(rounds) == 1 + api.DEMOTE_ROUNDS, rounds
    assert rounds[1] == ["layer_norm"] and rounds[2] == ["layer_norm", "layer_norm_1"]
    assert sum(info.kind != "EXTERN" for info in opt._kbench_plan.regions) == 2
    with torch.no_grad():
        torch.testing.assert_close(opt(example()), model(example()))


def test_report_says_why_a_region_is_kept(monkeypatch):
    """The tuner's own verdict text, as the report prints it for the ops kept in torch."""
    judge = Tuner(budget="fast", verbose=False)

    def why(info):
        info.eager_ms, info.kernel_ms = 0.03, 0.05
        return judge.verdict(info)
    lose(monkeypatch, lambda info, plan: info.fx_nodes == ("layer_norm",), why)
    model = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 16))
    opt = kbench.optimize(model, (example(),), backend="interp", budget="none", verbose=False)
    text = str(opt.kbench_report)
    assert "torch (kept: its kernel did not beat eager's layer_norm (0.0500 ms against 0.0300 ms))" in text, text
    assert "layer_norm: extern aten.layer_norm.default (kept in torch: its kernel did not beat" in \
        " ".join(opt._kbench_captured.notes)


# ------------------------------------------------------------------------------------ the verdict


def region(ops="layer_norm", eager=0.03, kernel=0.05, program=True):
    info = RegionInfo(0, "ROW", [], [], [], "mean sub mul")
    info.eager = RegionEager(("layer_norm",), _Program(ops) if program else None, "" if program else "no eager time")
    info.eager_ms, info.kernel_ms = eager, kernel
    return info


class _Program:
    def __init__(self, ops):
        self.ops, self.signature = ops, f"aten.{ops}.default(in0:f32[16])"


def test_verdict():
    t = Tuner(budget="fast", verbose=False)
    assert t.verdict(region()) == "its kernel did not beat eager's layer_norm (0.0500 ms against 0.0300 ms)"
    assert t.verdict(region(eager=0.05, kernel=0.04)) == ""
    # within the tie band the times cannot tell them apart: the kernel keeps its region
    assert t.verdict(region(eager=0.05, kernel=0.05 * tuner_mod.TORCH_ABOVE)) == ""
    assert t.verdict(region(eager=0.05, kernel=0.0526)).startswith("its kernel did not beat")
    assert t.verdict(region(program=False, eager=None)) == ""      # part of an op: nothing to compare with
    assert Tuner(budget="none", verbose=False).verdict(region()) == ""   # default schedules as they come


class FakeKernel:
    genome, regs, spills, fn_nostats, source = "threads=256 vec=4", 20, 0, None, ""


def key():
    return kc.make_key("region 0 ROW\n  %3 = mean %1 axes=1 : f32[B, 1]\n", "-", kc.shape_class({}, {"s0": 300}),
                       driver=12040, nvrtc=12040, gpu_name="NVIDIA H100 80GB HBM3", gpu_arch="sm_90",
                       torch_version="2.11.0", kbench_version="0.1.0")


def fake_executor(db, timings, eager_ms=0.03, kernel_ms=0.05):
    """A cuda executor whose GPU parts are stubbed (as tests/test_cache_times.py does)."""
    from kbench.runtime.cuda import CudaExecutor
    tuner = Tuner(budget="fast", verbose=False)
    ex = CudaExecutor(tuner)
    tuner._db = db
    ex.device = torch.device("cpu")
    tuner.cache_key = lambda ex, r: key()
    tuner.points = lambda ex, r, symvals: ([list(symvals)], "")   # no plan: the sizes as given
    ex.load = lambda k, cubin=None: FakeKernel()
    tuner.gate = lambda ex, r, kernel, symvals: ""

    def time_region(ex, r, symvals, reps=20):
        timings.append(r)
        return eager_ms, kernel_ms
    tuner.time_region = time_region

    def tune(ex, r, key_, symvals, info, points=None):
        return FakeKernel(), (Status.KERNEL, ""), "24 checks", {"cache": "miss"}
    tuner.tune = tune
    return ex


def test_a_kernel_that_loses_leaves_its_region_to_torch(tmp_path):
    db = kc.open_cache(tmp_path / "kbench.sqlite")
    timings = []
    ex = fake_executor(db, timings)
    info = region(eager=None, kernel=None)
    ex.tuner.prepare_region(ex, info, [300])
    assert info.status is Status.EAGER and 0 not in ex.kernels
    assert info.reason == "its kernel did not beat eager's layer_norm (0.0500 ms against 0.0300 ms)"
    # where nothing would lower its ops again (optimize()'s last round), the kernel stays
    ex = fake_executor(db, timings)
    ex.tuner.demote = False
    info = region(eager=None, kernel=None)
    ex.tuner.prepare_region(ex, info, [300])
    assert info.status is Status.KERNEL and 0 in ex.kernels
    # a kernel that wins keeps its region
    ex = fake_executor(db, timings, eager_ms=0.05, kernel_ms=0.03)
    info = region(eager=None, kernel=None)
    ex.tuner.prepare_region(ex, info, [300])
    assert info.status is Status.KERNEL and (info.eager_ms, info.kernel_ms) == (0.05, 0.03)
    db.close()


def test_stored_eager_times_are_reused_only_for_the_same_aten_calls(tmp_path, monkeypatch):
    LAUNCH = {"block": 256, "smem": 0, "grid_units": [1, [0]], "units_per_block": 1, "max_blocks": 0,
              "nkernels": 1, "workspace": 0, "workspace_per_block": 0}
    db = kc.open_cache(tmp_path / "kbench.sqlite")
    db.store(key(), kc.Winner(genome="threads=256 vec=4", source_hash="ab" * 32, cubin=b"\x7fELF" * 4,
                              entries=["kb_region0"], launch=LAUNCH, envelope="24 checks"))
    monkeypatch.setattr(tuner_mod, "stored_kernel", lambda w: FakeKernel())
    timings = []
    ex = fake_executor(db, timings, eager_ms=0.05, kernel_ms=0.03)
    info = region(eager=None, kernel=None)
    ex.tuner.prepare_region(ex, info, [300])
    assert timings == [0] and info.status is Status.CACHED      # an entry without times: timed once
    stored = db.lookup(key())
    assert (stored.eager_ms, stored.kernel_ms, stored.eager_sig) == (0.05, 0.03, info.eager.program.signature)
    timings.clear()
    ex = fake_executor(db, timings, eager_ms=0.05, kernel_ms=0.03)
    ex.tuner.prepare_region(ex, region(eager=None, kernel=None), [300])
    assert timings == []                                      # the same ATen calls: times from the cache
    ex = fake_executor(db, timings, eager_ms=0.07, kernel_ms=0.03)
    other = region(ops="rms_norm", eager=None, kernel=None)     # the same IR from other ATen ops
    ex.tuner.prepare_region(ex, other, [300])
    assert timings == [0] and other.eager_ms == 0.07
    db.close()


# ------------------------------------------------------------------------------------ eager column


def test_eager_column_runs_the_aten_op_not_its_decomposition():
    model = nn.Sequential(nn.LayerNorm(64), nn.GELU())
    x = torch.randn(32, 64)
    opt = kbench.optimize(model, (x,), backend="interp", budget="none", verbose=False)
    (info,) = opt._kbench_plan.regions
    program = info.eager.program
    assert [c.op for c in program.calls] == ["aten.layer_norm.default", "aten.gelu.default"]
    assert info.eager.ops == "layer_norm, gelu" and info.eager_ms is not None and info.eager_ms > 0
    # the program computes the region's outputs, as eager does
    plan = opt._kbench_plan
    gen = torch.Generator().manual_seed(0)
    ins = opt._kbench_executor.region_inputs(0, plan.example_symvals, "normal", gen)
    env = program.run(program.draw(dict(zip(info.inputs, ins)), plan.example_symvals, None, gen), plan.example_symvals)
    real = len(info.outputs) - info.saved                  # the rest: row statistics kept for a backward
    for v, want in zip(info.outputs[:real], plan.eager_region(0, plan.example_symvals, ins)):
        torch.testing.assert_close(env[v], want)
    row = opt.kbench_report.rows[0]
    assert row.eager_ms == info.eager_ms and not row.eager_note
    assert "eager ms: what eager runs for the region's ops" in str(opt.kbench_report)


@pytest.mark.parametrize("case", MODELS, ids=[c.name for c in MODELS])
def test_every_regions_eager_program_computes_its_outputs(case):
    """Over every test model: each compute region has an eager program or says why not, and a
    program computes the region's outputs from the region's inputs as eager does (where no
    torch call runs before it: then its input is that call's result, drawn, not the region's)."""
    torch.manual_seed(0)
    model = case.make().double().eval()
    args = tuple(a.double() if a.is_floating_point() else a for a in case.inputs())
    opt = kbench.optimize(model, args, backend="interp", budget="none", verbose=False)
    plan, sv = opt._kbench_plan, opt._kbench_plan.example_symvals
    for info in plan.regions:
        if info.kind == "EXTERN":
            continue
        program = info.eager.program
        if program is None:
            assert info.eager.note.startswith("no eager time: "), info.eager
            continue
        assert all(c.op.startswith("aten.") for c in program.calls), program.ops
        if info.eager.torch_led:
            continue
        gen = torch.Generator().manual_seed(0)
        ins = opt._kbench_executor.region_inputs(info.index, sv, "normal", gen)
        env = program.run(program.draw(dict(zip(info.inputs, ins)), sv, None, gen), sv)
        got = [(env[v], w) for v, w in zip(info.outputs, plan.eager_region(info.index, sv, ins)) if v in env]
        assert got, (info.ops, program.ops)
        for g, w in got:
            torch.testing.assert_close(g.to(w.dtype), w, rtol=1e-9, atol=1e-12, equal_nan=True)


def test_eager_column_of_a_region_after_a_linear_leaves_the_product_to_torch():
    model = nn.Sequential(nn.Linear(16, 16), nn.GELU())
    opt = kbench.optimize(model, (example(),), backend="interp", budget="none", verbose=False)
    (info,) = [i for i in opt._kbench_plan.regions if i.kind != "EXTERN"]
    assert info.eager.torch_led == ("linear",) and info.eager.ops == "gelu"
    assert info.eager_ms is not None
    assert "linear: torch's call runs either way" in str(opt.kbench_report)


def test_a_region_holding_part_of_an_op_has_no_eager_time_and_says_why():
    model = nn.CrossEntropyLoss()
    x, t = torch.randn(16, 10), torch.randint(0, 10, (16,))
    opt = kbench.optimize(model, (x, t), backend="interp", budget="none", verbose=False)
    rows = opt.kbench_report.rows
    assert len(rows) > 1 and all(r.eager_ms is None for r in rows)
    text = str(opt.kbench_report)
    for r in rows:
        assert r.eager_note.startswith("no eager time: it holds part of cross_entropy_loss "
                                       "(aten.cross_entropy_loss.default), the rest is in region")
        assert f"* region {r.region}: {r.eager_note}" in text
    head, body = opt.kbench_report._cells()
    assert all(cells[head.index("eager ms")] == "*" for cells in body)   # the cell points at the footnote


def test_eager_signature_has_no_names_in_it():
    model = TwoNorms()
    opt = kbench.optimize(model, (torch.randn(4, 8, 32),), backend="interp", budget="none", verbose=False)
    ln = [i for i in opt._kbench_plan.regions if i.kind != "EXTERN"]
    assert [i.eager.ops for i in ln] == ["layer_norm", "layer_norm"], [i.eager for i in ln]
    assert ln[1].eager.torch_led == ("linear",)                 # its input is the Linear's, drawn as given
    sigs = {tuner_mod.eager_signature(i) for i in ln}
    assert len(sigs) == 1, sigs                                 # one eager time for both
    assert not any(name in s for s in sigs for name in ("layer_norm_1", "weight", "x"))


# ------------------------------------------------------------------------------------ the capture cache


def test_the_demoted_capture_is_what_the_cache_keeps(monkeypatch, tmp_path, exports):
    """The capture kept between processes is the final one: a second optimize() starts from the
    ops kept in torch (no export, nothing to demote); a stored capture whose regions lose in a
    later optimize() is lowered again from one export and stored so."""
    monkeypatch.setenv("KBENCH_CACHE_DIR", str(tmp_path))
    model = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 16), nn.GELU())
    x = example()
    first = kbench.optimize(model, (x,), backend="interp", verbose=False)       # nothing loses
    assert len(exports) == 1 and not first._kbench_captured.kept
    lose(monkeypatch, lambda info, plan: "layer_norm" in info.fx_nodes)
    second = kbench.optimize(model, (x,), backend="interp", verbose=False)      # the stored capture loses
    assert len(exports) == 2                                                   # one export, for the keep
    assert second._kbench_captured.kept.keys() == {"layer_norm"}
    assert "then torch.export to keep ops in torch" in " ".join(second.kbench_report.notes)
    third = kbench.optimize(model, (x,), backend="interp", verbose=False)
    assert len(exports) == 2                                                   # the kept ops from the cache
    assert third._kbench_captured.kept == second._kbench_captured.kept
    assert any(n.startswith("capture: from the cache (torch.export skipped") for n in third.kbench_report.notes)
    assert "torch (kept: its kernel did not beat eager's ops (forced))" in str(third.kbench_report)
    assert third._kbench_captured.calls.keys() == second._kbench_captured.calls.keys()
    with torch.no_grad():
        torch.testing.assert_close(third(x), model(x))


def test_the_cuda_lowering_keeps_its_row_pins_when_ops_are_kept(exports):
    """The cuda backend pins row lengths on the first export; a lowering with ops kept is the same
    export with the same pins (pure capture logic: runs on the CPU)."""
    model = nn.Sequential(nn.Softmax(dim=-1), nn.GELU())   # a row that is the input's last dim
    lowering = api.Lowering(model, (example(),), "cuda")
    first = lowering.capture()
    assert lowering.pin and "row lengths pinned" in first.static_reason
    kept = lowering.capture({"softmax": "test"})
    assert len(exports) == 1
    assert kept.static_reason == first.static_reason and kept.input_syms == first.input_syms
    assert kept.kept == {"softmax": "test"}
    g = kept.graph
    assert [kept.origin[v] for v in range(g.num_nodes) if g.node(v)["op"] == "extern"] == ["softmax"]


def test_the_last_round_leaves_losing_kernels_in_place(monkeypatch):
    """After DEMOTE_ROUNDS lowerings nothing would keep more ops in torch: the tuner is told not to
    send a working kernel's region back to torch in the last one."""
    tuner = Tuner(budget="fast", verbose=False)
    seen = []
    lose(monkeypatch, lambda info, plan: seen.append(tuner.demote) or info is next(
        i for i in plan.regions if i.kind != "EXTERN"))
    model = nn.Sequential(*[m for _ in range(4) for m in (nn.LayerNorm(16), nn.Linear(16, 16, bias=False))])
    lowering = api.Lowering(model, (example(),), "interp")

    def build(captured):
        from kbench.runtime.module import OptimizedModule
        return OptimizedModule(model, captured, InterpExecutor(), torch.device("cpu"))
    api._demote(build(lowering.capture()), lowering, build, tuner)
    assert seen[0] is True and seen[-1] is False and tuner.demote is False


def test_a_lowering_that_fails_leaves_the_module_as_it_was(monkeypatch, caplog):
    real = api.Lowering.capture

    def failing(self, keep=None):
        if keep:
            raise RuntimeError("no second lowering today")
        return real(self, keep)
    monkeypatch.setattr(api.Lowering, "capture", failing)
    lose(monkeypatch, lambda info, plan: True)
    model, x = nn.Sequential(nn.LayerNorm(16), nn.GELU()), example()
    with caplog.at_level("WARNING", logger="kbench"):
        opt = kbench.optimize(model, (x,), backend="interp", budget="none", verbose=False)
    assert "could not keep gelu, layer_norm in torch (RuntimeError: no second lowering today)" in caplog.text
    assert not opt._kbench_captured.kept
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))
