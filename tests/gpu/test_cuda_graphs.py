"""The CUDA-graph mode on a GPU (kbench/runtime/graphs.py, real torch.cuda graphs): a replay gives
the un-graphed path's bits (an MLP and a transformer block, f32 and bf16), computes from each
call's own inputs, never changes a tensor an earlier caller holds, reads parameters an optimizer
updated in place, is dropped and captured again when a parameter is replaced, and stays out of
calls it must not take (gradients, another mode, the caller's own capture); BatchNorm's running
statistics and dropout's random numbers move on each replay; the report names the memory pinned.
The decisions alone, without a GPU: tests/test_cuda_graphs.py."""
import copy
import gc
import os
import re
import sys

import pytest
import torch
import torch.nn.functional as F

import kbench
from kbench.runtime import graphs

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
from models import Block  # noqa: E402

pytestmark = pytest.mark.gpu

TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def mlp(dtype=torch.float32):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256),
                                torch.nn.LayerNorm(256))
    return model.to(dtype).cuda().eval(), lambda batch=64: torch.randn(batch, 256, device="cuda", dtype=dtype)


def block(dtype=torch.float32):
    torch.manual_seed(0)
    model = Block(dim=64, heads=4).to(dtype).cuda().eval()
    return model, lambda batch=4: torch.randn(batch, 32, 64, device="cuda", dtype=dtype)


MODELS = {"mlp": mlp, "block": block}


def make(model, x, **kw):
    """The module under test: graphs on, no model gate (it could run the original on a small model)."""
    kw = {"budget": "none", "verbose": False, "gate": False, "cuda_graphs": True, **kw}
    return kbench.optimize(model, (x,), **kw)


def runner_of(opt):
    r = opt._kbench_graphs
    assert not isinstance(r, str), f"no graphs: {r}"
    return r


def ungraphed(opt, *args):
    """The same module's un-graphed path (the same kernels, launched one by one)."""
    return opt._forward_python(args, {})


def warm(opt, x):
    for _ in range(graphs.WARMUP):
        opt(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("kind", list(MODELS))
def test_replays_give_the_ungraphed_bits(kind, dtype):
    model, new_x = MODELS[kind](dtype)
    opt = make(model, new_x())
    r = runner_of(opt)
    with torch.no_grad():
        warm(opt, new_x())
        assert r.captures == 0
        for i in range(4):
            x = new_x()
            got = opt(x)
            assert r.captures == 1 and r.replays == i + 1, r.describe()
            assert torch.equal(got, ungraphed(opt, x))
            assert rel_err(got, model(x)) <= TOL[dtype]


def test_autocast_with_its_weight_cache_on_is_graphed_and_never_reads_a_stale_cast():
    """torch.autocast's default keeps a cache of casts for the region. A graph captured after an
    eager call in the same region must not read that call's cached cast (freed when the region
    exits): the capture recasts, and a replay after an in-place update reads the new weights."""
    model, new_x = mlp()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        opt = make(model, new_x())
    r = runner_of(opt)
    sgd = torch.optim.SGD(model.parameters(), lr=0.5)
    x = new_x()
    with torch.no_grad():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            assert torch.is_autocast_cache_enabled()
            model(x)                          # the region's cache now holds the weights' bf16 casts
            warm(opt, x)
            first = opt(x)                    # captured here, after the cache was filled
            assert r.captures == 1, r.describe()
        junk = [torch.full((512, 256), 7.0, device="cuda", dtype=torch.bfloat16) for _ in range(8)]
        with torch.autocast("cuda", dtype=torch.bfloat16):   # a new region: the old casts are freed
            again = opt(x)
            want = model(x)
        assert r.replays >= 1 and torch.equal(again, first)
        assert rel_err(again, want) <= TOL[torch.bfloat16]
    sgd.zero_grad()
    model(new_x()).square().mean().backward()
    sgd.step()                                # in place: the graph's casts must see the new values
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        after, want = opt(x), model(x)
    assert not torch.equal(after, first) and rel_err(after, want) <= TOL[torch.bfloat16]
    assert r.replays >= 2 and r.drops == 0, r.describe()
    del junk


def test_each_call_computes_from_its_own_inputs_and_keeps_its_outputs():
    model, new_x = mlp()
    opt = make(model, new_x())
    r = runner_of(opt)
    with torch.no_grad():
        warm(opt, new_x())
        x1, x2 = new_x(), new_x()
        y1 = opt(x1)                 # captured on x1's values, then replayed
        held = y1.clone()
        y2 = opt(x2)                 # replayed on x2's
        torch.cuda.synchronize()
        assert r.replays == 2
        assert torch.equal(y2, ungraphed(opt, x2)) and not torch.equal(y2, held)
        assert torch.equal(y1, held)  # the graph wrote its own output again, not the caller's
        assert y1.data_ptr() != y2.data_ptr()
        x1.copy_(x2)                 # the caller's input changed after the call: nothing read it since
        assert torch.equal(opt(x1), y2)


def test_parameters_an_optimizer_updates_in_place_are_read_by_the_next_replay():
    model, new_x = mlp()
    opt = make(model, new_x())
    r = runner_of(opt)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    x = new_x()
    with torch.no_grad():
        warm(opt, x)
        before = opt(x)
    for _ in range(2):               # a training step (un-graphed: it wants gradients), then an eval call
        sgd.zero_grad()
        opt(new_x()).square().mean().backward()
        sgd.step()
        with torch.no_grad():
            after = opt(x)
        assert torch.equal(after, ungraphed(opt, x)) and not torch.equal(after, before)
        before = after
    assert r.captures == 1 and r.replays == 3 and r.drops == 0
    assert not r.train.graphed()     # two training calls: the training signature's warm-up


def test_a_replaced_parameter_is_never_read_stale():
    model, new_x = mlp()
    opt = make(model, new_x())
    r = runner_of(opt)
    x = new_x()
    with torch.no_grad():
        warm(opt, x)
        opt(x)
        old = model[0].weight
        model[0].weight = torch.nn.Parameter(old * 2.0)   # a new tensor: the graphs go
        got = opt(x)
        assert torch.equal(got, ungraphed(opt, x)) and rel_err(got, model(x)) <= 1e-4
        assert r.drops == 1
        del old
        gc.collect()
        warm(opt, x)
        assert torch.equal(opt(x), ungraphed(opt, x)) and r.captures == 2   # captured again
        model[2].weight.data = model[2].weight.data * 3.0  # a .data swap: a new address
        got = opt(x)
        assert torch.equal(got, ungraphed(opt, x)) and rel_err(got, model(x)) <= 1e-4
        assert r.drops == 2
        warm(opt, x)
        assert r.captures == 3
        replays = r.replays
        model.load_state_dict({k: v + 0.5 for k, v in model.state_dict().items()})   # in place: kept
        got = opt(x)
        assert r.captures == 3 and r.drops == 2 and r.replays == replays + 1
        assert torch.equal(got, ungraphed(opt, x)) and rel_err(got, model(x)) <= 1e-4


def test_a_new_shape_is_right_and_gets_its_own_graph():
    model, new_x = mlp()
    opt = make(model, new_x(64))
    r = runner_of(opt)
    with torch.no_grad():
        warm(opt, new_x(64))
        opt(new_x(64))
        for _ in range(graphs.WARMUP + 2):
            x = new_x(24)
            got = opt(x)
            assert rel_err(got, model(x)) <= 1e-4
        sig = ((x.shape, x.dtype, x.device),)
        if sig in opt._kbench_sigs:   # kbench runs that size: graphed as a signature of its own
            assert r.captures == 2 and torch.equal(got, ungraphed(opt, x))
        assert r.captures in (1, 2)
        x = new_x(64)
        assert torch.equal(opt(x), ungraphed(opt, x))


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(64, 128)
        self.bn = torch.nn.BatchNorm1d(128)
        self.fc2 = torch.nn.Linear(128, 64)

    def forward(self, x):
        return self.fc2(F.dropout(torch.relu(self.bn(self.fc1(x))), 0.25, self.training))


def test_train_and_eval_modes_running_statistics_and_random_numbers():
    torch.manual_seed(0)
    model = Net().cuda().train()
    twin = copy.deepcopy(model)
    x = torch.randn(32, 64, device="cuda")
    opt = make(model, x)
    ref = make(twin, x, cuda_graphs=False)
    r = runner_of(opt)
    outs = []
    with torch.no_grad():
        for _ in range(graphs.WARMUP + 3):     # training mode without gradients: graphed after the warm-up
            outs.append(opt(x))
            ref(x)
        assert r.captures == 1 and r.replays == 3, r.describe()
        # BatchNorm's statistics move on every replay as on every un-graphed call
        assert torch.allclose(model.bn.running_mean, twin.bn.running_mean, atol=1e-6)
        assert torch.allclose(model.bn.running_var, twin.bn.running_var, atol=1e-6)
        assert int(model.bn.num_batches_tracked) == int(twin.bn.num_batches_tracked) == graphs.WARMUP + 3
        # dropout draws new numbers on each replay (torch's generator, registered with the graph)
        assert not torch.equal(outs[-1], outs[-2])
        assert r.random

        opt.eval()
        model_eval = copy.deepcopy(model).eval()
        for _ in range(graphs.WARMUP + 2):
            got = opt(x)
        other = opt._kbench_modes[(False, ())]
        assert runner_of(other).captures == 1      # the eval module's own graphs
        assert torch.equal(got, ungraphed(other, x)) and rel_err(got, model_eval(x)) <= 1e-4
        assert r.replays == 3                      # the training graph did not serve eval calls

        opt.train()
        opt(x)
        assert r.replays == 4
    text = str(opt.kbench_report)
    assert "eval mode: CUDA graphs: on, 1 signature(s) graphed" in text


def test_inference_only_graphs_leave_gradients_un_graphed_and_match_eager():
    model, new_x = mlp()
    opt = make(model, new_x(), cuda_graphs="inference")
    r = runner_of(opt)
    for _ in range(graphs.WARMUP + 2):
        x = new_x().requires_grad_()
        y = opt(x)
        assert y.grad_fn is not None
    g = torch.randn_like(y)
    got = torch.autograd.grad(y, [x, *model.parameters()], g)
    want = torch.autograd.grad(model(x), [x, *model.parameters()], g)
    for a, b in zip(got, want):
        assert rel_err(a, b) <= 1e-4
    assert r.captures == 0 and r.skipped.get(graphs.WANTS_GRAD) == graphs.WARMUP + 2


class Split(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = torch.nn.LayerNorm(192)

    def forward(self, x):
        q, k, v = torch.nn.functional.gelu(self.ln(x)).chunk(3, dim=-1)
        return q, {"k": k, "v": v}


def test_outputs_that_share_a_buffer_still_do():
    model = Split().cuda().eval()
    x = torch.randn(16, 192, device="cuda")
    opt = make(model, x)
    r = runner_of(opt)
    with torch.no_grad():
        warm(opt, x)
        for _ in range(2):
            x = torch.randn(16, 192, device="cuda")
            q, kv = opt(x)
            q0, kv0 = ungraphed(opt, x)
            assert torch.equal(q, q0) and torch.equal(kv["k"], kv0["k"]) and torch.equal(kv["v"], kv0["v"])
            shared = q.untyped_storage().data_ptr() == kv["k"].untyped_storage().data_ptr()
            assert shared == (q0.untyped_storage().data_ptr() == kv0["k"].untyped_storage().data_ptr())
    assert r.replays == 2, r.describe()


def test_replays_on_several_streams_wait_for_each_other():
    model, new_x = mlp()
    opt = make(model, new_x())
    r = runner_of(opt)
    side = torch.cuda.Stream()
    with torch.no_grad():
        warm(opt, new_x())
        opt(new_x())
        results = []
        for i in range(20):
            x = new_x()
            stream = side if i % 2 else torch.cuda.current_stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                y = opt(x)
            torch.cuda.current_stream().wait_stream(stream)
            results.append((x, y))
        torch.cuda.synchronize()
        for x, y in results:
            assert torch.equal(y, ungraphed(opt, x))
    assert r.replays == 21


def test_inside_the_callers_own_capture_the_un_graphed_path_is_captured():
    model, new_x = mlp()
    opt = make(model, new_x())
    r = runner_of(opt)
    static = new_x()
    with torch.no_grad():
        warm(opt, static)
        opt(static)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = opt(static)
        static.copy_(new_x())
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, ungraphed(opt, static))
    assert any("capture of the caller's" in why for why in r.skipped)


def test_off_means_no_graph():
    model, new_x = mlp()
    opt = make(model, new_x(), cuda_graphs=False)
    assert opt._kbench_graphs == "cuda_graphs=False"
    program = opt._kbench_fast_program
    assert program is None or type(program).__name__ == "Program"
    with torch.no_grad():
        for _ in range(graphs.WARMUP + 3):
            x = new_x()
            assert torch.equal(opt(x), ungraphed(opt, x))
    assert "CUDA graphs: off (cuda_graphs=False)" in str(opt.kbench_report)


def test_the_model_gate_running_the_original_means_no_graph():
    model, new_x = mlp()
    opt = make(model, new_x())
    r = runner_of(opt)
    x = new_x()
    with torch.no_grad():
        warm(opt, x)
        opt(x)
        opt.run_original("test: as if kbench were slower")
        assert not r.entries and r.off
        assert torch.equal(opt(x), model(x))
    assert "CUDA graphs: off (the model gate runs the original module)" in str(opt.kbench_report)


def test_the_report_names_the_memory_pinned():
    model, new_x = block()
    opt = make(model, new_x())
    with torch.no_grad():
        warm(opt, new_x())
        opt(new_x())
    text = str(opt.kbench_report)
    line = next(ln for ln in text.splitlines() if ln.startswith("CUDA graphs: on"))
    assert "1 signature(s) graphed ([(4, 32, 64) float32] no grad)" in line, line
    m = re.search(r"pinned ([0-9.]+) MiB \(graph pools ([0-9.]+) MiB, static inputs and gradients ([0-9.]+) MiB\)", line)
    assert m, line
    pool, static = runner_of(opt).pinned()
    assert pool > 0 and static == 4 * 32 * 64 * 4
    assert float(m.group(2)) == pytest.approx(pool / 2**20, abs=0.01)


def test_a_graphed_model_collected_inside_the_callers_capture():
    """Python's collector may drop a graphed model while the caller captures a graph of their
    own: its graphs are destroyed after that capture, not in it."""
    model, new_x = mlp()
    opt = make(model, new_x())
    static = new_x()
    dropped_model = torch.nn.Sequential(torch.nn.LayerNorm(256), torch.nn.GELU()).cuda().eval()
    dropped = make(dropped_model, static)
    with torch.no_grad():
        warm(opt, static)
        opt(static)
        warm(dropped, static)
        dropped(static)
        assert runner_of(dropped).captures == 1
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = opt(static)
            del dropped
            gc.collect()
        assert graphs._deferred    # kept until no capture is under way
        static.copy_(new_x())
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, ungraphed(opt, static))
        x = new_x()
        assert torch.equal(opt(x), ungraphed(opt, x))
    assert not graphs._deferred


@pytest.mark.parametrize("kind", ["one_region", "deep"])
def test_the_model_gate_keeps_graphs_only_where_they_are_faster(kind):
    """With the gate on (the default), a forward without gradients is timed with the graphs and
    with them paused; whichever way it goes, the report and the module agree, and calls are right.
    (Which way is the GPU's business: a one-region module pays a replay's input and output copies,
    a deep one saves a host round trip per region.)"""
    torch.manual_seed(0)
    if kind == "one_region":
        model, x = torch.nn.LayerNorm(4096).cuda().eval(), torch.randn(4096, 4096, device="cuda")
    else:
        model, x = torch.nn.Sequential(*[Block(dim=64, heads=4) for _ in range(8)]).cuda().eval(), \
            torch.randn(2, 16, 64, device="cuda")
    opt = kbench.optimize(model, (x,), budget="none", verbose=False)
    text = str(opt.kbench_report)
    gate_line = next(ln for ln in text.splitlines() if ln.startswith("model gate"))
    if opt._kbench_original:
        return   # kbench's module as a whole was not faster: no graphs either way
    assert "with CUDA graphs" in gate_line, gate_line
    r = opt._kbench_graphs
    if "(graphs not faster: off)" in gate_line:
        assert r.off and "CUDA graphs: off (the model gate timed the call" in text
    else:
        assert not r.off and r.captures == 1, r.describe()
    with torch.no_grad():
        for _ in range(graphs.WARMUP + 1):
            y = opt(x)
        assert rel_err(y, model(x)) <= 1e-3
        assert torch.equal(y, ungraphed(opt, x))
