"""ROW and COL kernels with 16-byte vectors over a last dim the capture left varying (KernelBench's
tasks without parameters have every dim varying): the default schedule takes vec > 1 where the
example's last dim is a multiple of it, the kernel records that it requires so
(KernelInfo.last_multiple, last_dim) and its source compiles; every launcher declines a size that
breaks it (RegionFallback: the region runs in eager for that call), verification and the sandbox
never launch it there, and sweep points that keep it check it at sizes it runs at. Pinned shapes
keep their kernels (tests/test_codegen.py's golden sources). On a GPU: tests/gpu/test_symvec.py."""
import json
import types

import pytest
import torch
import torch.nn.functional as F

import kbench
from kbench import _C, verify
from kbench.runtime import cuda as cuda_rt
from kbench.runtime import fast as fastmod
from kbench.runtime.plan import Plan, Program, RegionFallback
from kbench.tune import sandbox, tuner as tuner_mod


class Softmax(torch.nn.Module):
    def forward(self, x):
        return torch.softmax(x, dim=-1)


class LayerNorm(torch.nn.Module):
    def forward(self, x):
        return F.layer_norm(x, x.shape[-1:])


class FrobeniusNorm(torch.nn.Module):   # KernelBench's 37_FrobeniusNorm_: one row, split over blocks
    def forward(self, x):
        return x / torch.norm(x, p="fro")


class SumDim1(torch.nn.Module):         # a COL region: the last dim is the columns
    def forward(self, x):
        return x.sum(dim=1)


class SoftmaxFlat(torch.nn.Module):     # the row is a product of two varying dims
    def forward(self, x):
        return torch.softmax(x.flatten(1), dim=-1)


# (model, a divisible example, the same with the last dim (each factor of it) odd, region kind)
CASES = [(Softmax, (8, 256), (8, 255), "ROW"), (LayerNorm, (8, 256), (8, 255), "ROW"),
         (FrobeniusNorm, (4, 8, 16, 64), (4, 8, 16, 63), "ROW"), (SumDim1, (16, 64, 32), (16, 64, 31), "COL"),
         (SoftmaxFlat, (8, 16, 64), (8, 15, 63), "ROW")]
IDS = [c[0].__name__ for c in CASES]


def compute_region(model, shape, dtype=torch.float32):
    """(graph, partition, r) of the model's one compute region, captured with every dim varying."""
    graph = kbench.capture(model(), (torch.randn(*shape, dtype=dtype),)).ir
    part = graph.partition()
    (r,) = [r for r in range(len(part)) if part.region(r)["kind"] != "EXTERN"]
    return graph, part, r


@pytest.mark.parametrize("model,shape,odd,kind", CASES, ids=IDS)
def test_default_takes_vectors_over_a_varying_last_dim(model, shape, odd, kind):
    graph, part, r = compute_region(model, shape)
    assert part.region(r)["kind"] == kind
    last = graph.node(part.region(r)["anchor"])["dims"][-1]
    assert not isinstance(last, int)             # varying: no pin made it a constant
    k = _C.generate(part, r, 90, None)
    assert k.genome.vec == 4 and k.last_multiple == 4 and k.last_dim == last
    assert "% 4 == 0: the launch checks it" in k.source   # the kernel says what it requires
    assert verify.dim_value(k.last_dim, [s[1] for s in graph.symbols]) % 4 == 0
    # an example whose last dim no vector divides: 4-byte loads, no requirement
    _, part_odd, r_odd = compute_region(model, odd)
    k_odd = _C.generate(part_odd, r_odd, 90, None)
    assert k_odd.genome.vec == 1 and k_odd.last_multiple == 1 and k_odd.last_dim == 1


def test_sixteen_bit_rows_take_eight_and_the_search_offers_only_what_the_example_admits():
    _, part, r = compute_region(Softmax, (8, 256), torch.bfloat16)
    assert _C.generate(part, r, 90, None).last_multiple == 8
    v4 = _C.Genome.parse("threads=256 vec=4 rows=8 items=4 cache=reread")
    assert _C.genome_legal(part, r, [8, 256], None, v4) and not _C.genome_legal(part, r, [8, 254], None, v4)
    # codegen takes it at any example: the kernel carries the requirement, the launchers check it
    assert _C.generate(part, r, 90, v4).last_multiple == 4


def test_guarded_kernels_compile(compile_once):
    items = []
    for model, shape, _, _ in CASES:
        _, part, r = compute_region(model, shape)
        for arch in (90, 80):
            k = _C.generate(part, r, arch, None)
            assert k.last_multiple > 1
            items.append((k.source, f"sm_{arch}", (model.__name__, arch)))
    for (_, arch, what), cubin in zip(items, compile_once(items, together=True)):
        assert cubin[:4] == b"\x7fELF", what


# ------------------------------------------------------------------ the launchers' guard (no GPU)

def executor(model, shape):
    """A CudaExecutor (not prepared: no GPU) over the model's plan, its region's default kernel as
    a Kernel (nothing loaded), and r."""
    graph, _, _ = compute_region(model, shape)
    plan = Plan(graph, example_symvals=[s[1] for s in graph.symbols])
    (r,) = [i.index for i in plan.regions if i.kind != "EXTERN"]
    ex = cuda_rt.CudaExecutor(types.SimpleNamespace(seed=0))
    ex.plan, ex.device, ex.cuda = plan, torch.device("cpu"), None
    info = _C.generate(plan.partition, r, 90, None)
    kernel = ex.kernels[r] = cuda_rt.Kernel.of(info)
    return ex, plan, r, kernel, info


def test_python_launcher_declines_an_indivisible_last_dim(monkeypatch):
    ex, plan, r, kernel, _ = executor(Softmax, (8, 256))
    launched = []
    monkeypatch.setattr(fastmod, "module", lambda: None)   # the Python closure (the C++ one: tests/gpu)
    monkeypatch.setattr(cuda_rt, "stream_getter", lambda device: None)   # no CUDA here
    monkeypatch.setattr(_C, "launch", lambda *a: launched.append(a))
    odd, even = [8, 255], [8, 260]
    why = "region 0: last dim 255 is not a multiple of 4 (kernel uses vec=4)"
    assert verify.refused(kernel, r, odd) == why and verify.refused(kernel, r, even) == ""
    with pytest.raises(RegionFallback) as e:
        ex.launcher(r, odd)([torch.randn(8, 255)])
    assert str(e.value) == why and not launched
    with pytest.raises(RegionFallback, match="not a multiple of 4"):   # checks and searches: never launched
        ex.launch(kernel, r, odd, [torch.randn(8, 255)])
    assert verify.gate(ex, r, kernel, odd) == why and not launched
    ex.launcher(r, even)([torch.randn(8, 260)])               # past the guard: the launch
    assert len(launched) == 1 and launched[0][-1][-2:] == [8, 260]
    # off the hot path (a gradient check at sizes no call used): eager, and nothing noted
    notes = []
    x = torch.randn(8, 255)
    (y,) = Program(plan, ex, notes.append).run_region(r, odd, [x])
    assert torch.allclose(y, torch.softmax(x, -1)) and not notes and len(launched) == 1


def test_sweep_checks_the_kernel_where_it_runs_and_nowhere_else(monkeypatch):
    _, flat, _, _, _ = executor(SoftmaxFlat, (2, 4, 8))   # a row of s1 * s2: both move to multiples
    assert verify.vec_symbols(flat, 0, flat.example_symvals) == {1, 2}
    ex, plan, r, kernel, info = executor(Softmax, (4, 64))
    points, _ = verify.plan_points(ex, r, plan.example_symvals, free=None)
    assert verify.vec_symbols(plan, r, plan.example_symvals) == {1}
    for alt in (1, 7, 67, 129, verify.VEC_SWEEP, 64 + verify.VEC_SWEEP):   # the odd ones stay: eager there
        assert [4, alt] in points
    admitted = [p for p in points if not verify.refused(kernel, r, p)]
    assert [p[1] for p in admitted] == [64] * (len(admitted) - 2) + [8, 72]
    launched = []

    def perfect(kernel, r, symvals, inputs, poison=False, **kw):   # the reference, as a kernel would
        assert not verify.refused(kernel, r, symvals)
        launched.append(list(symvals))
        return [o.to(torch.float32) for o in ex.reference(r, symvals, inputs)]
    monkeypatch.setattr(ex, "launch", perfect)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    verdict = verify.verify_region(ex, r, kernel, points[0], points=points)
    assert verdict.ok, verdict.reason
    assert {tuple(p) for p in verdict.sizes} == {tuple(p) for p in admitted}
    assert {tuple(p) for p in launched} == {tuple(p) for p in admitted}
    assert f"{len(points) - len(admitted)} sizes whose last dim is no multiple of 4 run in eager" in verdict.note
    # the sandbox's request holds a group per size the kernel runs at (one entry point here)
    header, _ = sandbox.describe(ex, r, info, kernel, points)
    assert len(header["groups"]) == len(admitted)
    # an example the kernel cannot run at is no verification at all
    odd = [4, 63]
    assert not verify.verify_region(ex, r, kernel, odd, points=[odd]).ok


def test_stored_winner_keeps_its_requirement():
    _, _, r, _, info = executor(LayerNorm, (8, 256))
    launch = json.loads(json.dumps(tuner_mod.stored_launch(info)))   # as the cache stores it
    w = types.SimpleNamespace(launch=launch, entries=list(info.entries), genome=str(info.genome))
    k = tuner_mod.stored_kernel(w)
    assert (k.last_multiple, k.last_dim) == (4, info.last_dim)
    for f in ("last_multiple", "last_dim"):   # an entry from before: runs at every size
        launch.pop(f)
    assert tuner_mod.stored_kernel(w).last_multiple == 1
