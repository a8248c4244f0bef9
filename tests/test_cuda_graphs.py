"""The CUDA-graph mode's decisions without a GPU (kbench/runtime/graphs.py): the option's
validation, why a module or an extern step is unsafe to graph, the signature keys, and the
runner's whole life — warm-up, capture, guarded replays, recapture, release, report — on the
interp backend with a stand-in for torch.cuda.graph that replays by running the captured call
again into the first run's outputs (the memory a real graph writes). On a GPU, with real graphs:
tests/gpu/test_cuda_graphs.py."""
import types

import pytest
import torch
import torch.utils._pytree as pytree

import kbench
from kbench.capture.types import Extern, TensorSlot
from kbench.runtime import graphs
from tests._train_graph_standin import run_unseen

aten = torch.ops.aten


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32)).eval()


def optimized(model, *inputs, **kw):
    return kbench.optimize(model, inputs, backend="interp", budget="none", verbose=False, **kw)


class FakeGraph:
    """Stands for a captured torch.cuda.CUDAGraph: a replay runs the captured call again and
    writes its results into the capture's outputs, as a real replay writes the same memory."""

    def __init__(self, fn, out):
        self.fn, self.out, self.replays = fn, out, 0

    def replay(self):
        self.replays += 1
        for old, new in zip(pytree.tree_leaves(self.out), pytree.tree_leaves(self.fn())):
            if isinstance(old, torch.Tensor):
                old.copy_(new)


def fake_capture_for(module):
    """A capture that runs nothing the caller could see: the call runs once for its outputs, and
    the buffers it updated (BatchNorm's statistics) are put back, as a real capture leaves them."""
    def capture(fn, pool, device, stream):
        out = run_unseen(module, fn)
        return FakeGraph(fn, out), out
    return capture


def plain(model, *inputs):
    """The un-graphed kbench path on the same parameters: what a replay must give, bit for bit."""
    return optimized(model, *inputs, cuda_graphs=False)


def graphed(opt, option=True):
    """opt (an interp module, which never graphs on its own) with a runner on the stand-in."""
    slot = "_kbench_fast_program" if opt._kbench_spec.plain else "_kbench_fast_flat"
    runner = graphs.GraphRunner(opt, opt.__dict__[slot], option, capture=fake_capture_for(opt._kbench_orig))
    # this stand-in replays calls without gradients only; training graphs have their own
    # (tests/test_train_graphs.py)
    runner.train = None
    opt.__dict__.update({"_kbench_graphs": runner, slot: runner})
    return runner


# ---------------------------------------------------------------------------- the option

@pytest.mark.parametrize("value", ["auto", True, False, "inference"])
def test_option_values(value):
    assert graphs.check_option(value) is value


@pytest.mark.parametrize("value", ["yes", "Auto", 1, 0, None, "", "true"])
def test_bad_option_raises_before_anything_runs(value):
    with pytest.raises(ValueError, match=r"cuda_graphs must be 'auto', True, False or 'inference', got"):
        graphs.check_option(value)
    with pytest.raises(ValueError, match="cuda_graphs must be"):
        kbench.optimize(mlp(), (torch.randn(4, 16),), backend="interp", cuda_graphs=value)
    with pytest.raises(ValueError, match="cuda_graphs must be"):
        kbench.optimize(mlp(), cuda_graphs=value)   # lazy: still checked at once


def test_option_threaded_to_the_module_and_its_other_mode():
    model = mlp()
    x = torch.randn(4, 16)
    off = optimized(model, x, cuda_graphs=False)
    assert off._kbench_graphs == "cuda_graphs=False" and off._kbench_fast_program is None
    assert "CUDA graphs: off (cuda_graphs=False)" in str(off.kbench_report)
    off.train()
    off(x)                                        # the training mode: a capture of its own
    other = off._kbench_modes[(True, ())]
    assert other._kbench_graphs == "cuda_graphs=False"
    assert "training mode: CUDA graphs: off (cuda_graphs=False)" in str(off.kbench_report)
    lazy = kbench.optimize(mlp(), backend="interp", budget="none", verbose=False, cuda_graphs=False)
    lazy(x)
    assert lazy._kbench_impl._kbench_graphs == "cuda_graphs=False"


def test_interp_backend_is_never_graphed_and_says_why(caplog):
    x = torch.randn(4, 16)
    auto = optimized(mlp(), x)
    assert "interp" in auto._kbench_graphs and auto._kbench_fast_program is None
    assert "CUDA graphs: off (backend 'interp' runs its regions on the CPU" in str(auto.kbench_report)
    assert not [r for r in caplog.records if "CUDA graphs" in r.getMessage()]   # auto: no log line
    with caplog.at_level("WARNING", logger="kbench"):
        optimized(mlp(), x, cuda_graphs=True)
    assert any("CUDA graphs asked for" in r.getMessage() for r in caplog.records)


# ---------------------------------------------------------------------------- is it safe?

def as_cuda(module, **changes):
    """The module's plan as if it ran on the cuda backend: what module_blockers would say there."""
    view = types.SimpleNamespace(
        _kbench_executor=types.SimpleNamespace(name="cuda"), _kbench_device=torch.device("cuda", 0),
        _kbench_plan=module._kbench_plan, _kbench_captured=module._kbench_captured,
        _kbench_constants={})
    for info in module._kbench_plan.regions:   # as generated kernels, not the interpreter
        if info.kind != "EXTERN":
            info.set_status(graphs.Status.KERNEL)
    view.__dict__.update(changes)
    return view


def test_a_plain_model_would_be_safe_on_cuda():
    opt = optimized(mlp(), torch.randn(4, 16))
    assert graphs.module_blockers(opt)[0].startswith("backend 'interp'")
    assert graphs.module_blockers(as_cuda(opt)) == []


def test_what_makes_a_module_unsafe():
    opt = optimized(mlp(), torch.randn(4, 16))
    assert "on cpu, not a CUDA device" in graphs.module_blockers(as_cuda(opt, _kbench_device=torch.device("cpu")))[0]
    got = graphs.module_blockers(as_cuda(opt, _kbench_constants={"c": torch.ones(3)}))
    assert got == ["constant(s) c are held on the CPU"]
    opt._kbench_plan.regions[1].set_status(graphs.Status.INTERP)
    view = as_cuda(opt)
    opt._kbench_plan.regions[1].set_status(graphs.Status.INTERP)
    assert graphs.module_blockers(view) == ["region(s) [1] run on the C interpreter, on the CPU"]
    opt._kbench_plan.regions[1].set_status(graphs.Status.EAGER, "test")   # torch ops: no sync, fine
    assert graphs.module_blockers(view) == []


class Scales(torch.nn.Module):
    def forward(self, x):
        x.mul_(2.0)
        return x + 1.0


def test_an_input_updated_in_place_is_unsafe():
    x = torch.randn(4, 8)
    opt = optimized(Scales(), x.clone())
    assert [k for _, k, _ in opt._kbench_captured.mutations] == ["user"]
    (why,) = graphs.module_blockers(as_cuda(opt))
    assert "updates its input(s)" in why and "in place" in why


class Norm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.bn = torch.nn.BatchNorm1d(8)

    def forward(self, x):
        return self.bn(x)


def test_buffers_updated_in_place_are_safe():
    opt = optimized(Norm().train(), torch.randn(16, 8))
    assert {k for _, k, _ in opt._kbench_captured.mutations} == {"buffer"}
    assert graphs.module_blockers(as_cuda(opt)) == []


def test_extern_steps():
    i64 = ["f32", "i64"]
    assert graphs.step_blocker(aten.nonzero.default, (TensorSlot(0),), {}) == \
        "its output's shape depends on the values"
    assert "host" in graphs.step_blocker(aten._local_scalar_dense.default, (TensorSlot(0),), {})
    assert "host" in graphs.step_blocker(aten.item.default, (TensorSlot(0),), {})
    # integer indexing has the indices' shape; a mask's is counted on the host
    assert graphs.step_blocker(aten.index.Tensor, (TensorSlot(0), [TensorSlot(1)]), {}, i64) == ""
    assert graphs.step_blocker(aten.index.Tensor, (TensorSlot(0), [None, TensorSlot(1)]), {}, i64) == ""
    assert graphs.step_blocker(aten.index.Tensor, (TensorSlot(0), [TensorSlot(1)]), {}, ["f32", "bool"]) != ""
    assert graphs.step_blocker(aten.index.Tensor, (TensorSlot(0), [TensorSlot(1)]), {}) != ""   # dtypes unknown
    assert "generator" in graphs.step_blocker(aten.randn.default, ([3],), {"generator": torch.Generator()})
    assert "holds a tensor on cpu" == graphs.step_blocker(aten.add.Tensor, (TensorSlot(0), torch.ones(3)), {})
    assert graphs.step_blocker(aten.linear.default, (TensorSlot(0), TensorSlot(1)), {}) == ""
    dropout = Extern([(aten.native_dropout.default, (TensorSlot(0), 0.1, True), {})], "native_dropout", 1)
    assert graphs.step_blocker(*dropout.steps[0]) == ""   # torch's default generator: registered by the capture
    assert graphs.draws_random([dropout])
    assert not graphs.draws_random([Extern([(aten.linear.default, (TensorSlot(0), TensorSlot(1)), {})], "l", 2)])


def test_an_unsafe_extern_is_named():
    opt = optimized(mlp(), torch.randn(4, 16))
    captured = types.SimpleNamespace(**vars(opt._kbench_captured))
    captured.externs = list(captured.externs) + [Extern([(aten.nonzero.default, (TensorSlot(0),), {})], "aten.nonzero", 1)]
    (why,) = graphs.module_blockers(as_cuda(opt, _kbench_captured=captured))
    assert why == "extern aten.nonzero: its output's shape depends on the values"


# ---------------------------------------------------------------------------- the runner

def test_warm_up_capture_replay_and_fresh_outputs():
    model = mlp()
    x = torch.randn(4, 16)
    opt, ref = optimized(model, x), plain(model, x)
    runner = graphed(opt)
    with torch.no_grad():
        outs = [opt(torch.randn(4, 16)) for _ in range(graphs.WARMUP)]
        assert runner.captures == 0                      # the warm-up calls ran un-graphed
        x1, x2 = torch.randn(4, 16), torch.randn(4, 16)
        y1 = opt(x1)                                     # captured and replayed
        assert runner.captures == 1 and runner.replays == 1
        held = y1.clone()
        y2 = opt(x2)                                     # replayed on other values
        assert runner.replays == 2
        assert torch.equal(y1, held)                     # the first caller's tensor is its own
        assert torch.equal(y2, ref(x2)) and torch.equal(y1, ref(x1))
        (entry,) = [e for e in runner.entries.values() if e.graph is not None]
        assert y2.data_ptr() != entry.outputs.one.data_ptr()
    assert len(outs) == graphs.WARMUP
    text = str(opt.kbench_report)
    assert "CUDA graphs: on, 1 signature(s) graphed ([(4, 16) float32] no grad)" in text
    assert "pinned 0.00 MiB (graph pools 0.00 MiB, static inputs and gradients 0.00 MiB); 2 replay(s)" in text


def test_signature_keys():
    opt = optimized(mlp(), torch.randn(4, 16))
    runner = graphed(opt)

    def calls(x, n=graphs.WARMUP + 1):
        for _ in range(n):
            opt(x)

    with torch.no_grad():
        calls(torch.randn(4, 16))
        calls(torch.randn(6, 16))                 # another shape: another graph
    with torch.inference_mode():
        calls(torch.randn(4, 16))                 # inference mode: its own (inference tensors)
    calls(torch.randn(4, 16).requires_grad_(False).detach())   # grad mode, parameters want gradients
    assert runner.skipped == {graphs.WANTS_GRAD: graphs.WARMUP + 1}
    for p in opt.parameters():
        p.requires_grad_(False)
    calls(torch.randn(4, 16))                     # grad mode, nothing wants gradients
    labels = sorted(e.label for e in runner.entries.values() if e.graph is not None)
    assert labels == ["[(4, 16) float32] grad mode, nothing wants gradients", "[(4, 16) float32] inference mode",
                      "[(4, 16) float32] no grad", "[(6, 16) float32] no grad"]
    assert runner.captures == 4
    key = next(iter(runner.entries))
    sig, grad, inference, autocast = key
    assert sig == ((torch.Size([4, 16]), torch.float32, torch.device("cpu")),) and autocast is None


def test_calls_the_graph_does_not_take_run_un_graphed():
    model = mlp()
    opt, ref = optimized(model, torch.randn(4, 16)), plain(model, torch.randn(4, 16))
    runner = graphed(opt)
    with torch.no_grad():
        for _ in range(graphs.WARMUP + 1):
            opt(torch.randn(4, 16))
        assert runner.captures == 1
        xt = torch.randn(16, 4).t()                    # non-contiguous: the un-graphed path
        assert torch.equal(opt(xt), ref(xt))
        assert runner.replays == 1
        assert runner.skipped == {"an input is not contiguous or not 16-byte aligned": 1}
        x64 = torch.randn(4, 16, dtype=torch.float64)
        with pytest.raises(RuntimeError):
            model(x64)                                 # another dtype: eager's outcome, un-graphed
        with pytest.raises(RuntimeError):
            opt(x64)
        with pytest.raises(TypeError):
            opt(torch.randn(4, 16), torch.randn(4, 16))   # too many inputs: the Python path's error
        assert "the call passes 2 tensor(s), the capture reads 1" in runner.skipped
        # a tensor subclass: un-graphed, and the report says so (never silently)
        assert torch.equal(opt(torch.nn.Parameter(xt.contiguous())), ref(xt.contiguous()))
        assert runner.replays == 1 and "an input is a Parameter, not a plain tensor" in runner.skipped
    x = torch.randn(4, 16, requires_grad=True)
    y = opt(x)                                         # gradients wanted: un-graphed, differentiable
    assert y.requires_grad and runner.replays == 1
    assert any("gradients" in line for line in runner.describe())


def test_train_eval_switch():
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Dropout(0.5)).eval()
    x = torch.randn(4, 16)
    opt, ref = optimized(model, x), plain(model, x)
    runner = graphed(opt)
    with torch.no_grad():
        for _ in range(graphs.WARMUP + 1):
            opt(x)
        opt.train()
        got = opt(x)                                    # the training mode's own module serves it
        assert runner.replays == 1 and (got == 0).float().mean() > 0.2   # dropout: training mode's
        opt.eval()
        assert torch.equal(opt(x), ref(x)) and runner.replays == 2


def test_parameters_updated_in_place_or_replaced():
    model = mlp()
    x = torch.randn(4, 16)
    opt, ref = optimized(model, x), plain(model, x)
    runner = graphed(opt)
    with torch.no_grad():
        for _ in range(graphs.WARMUP + 1):
            opt(x)
        model[0].weight.add_(1.0)                       # an optimizer's step: in place, same address
        assert torch.equal(opt(x), ref(x)) and runner.captures == 1 and runner.replays == 2
        model[0].weight = torch.nn.Parameter(model[0].weight + 1.0)   # replaced: the graphs go
        assert torch.equal(opt(x), ref(x))
        assert runner.captures == 1 and runner.drops == 1 and runner.held is None
        for _ in range(graphs.WARMUP):
            assert torch.equal(opt(x), ref(x))
        assert runner.captures == 2                     # captured again, with the new one
        model[2].weight.data = model[2].weight.data.clone()   # a .data swap: another address
        assert torch.equal(opt(x), ref(x)) and runner.drops == 2
        for _ in range(graphs.WARMUP):
            assert torch.equal(opt(x), ref(x))
        assert runner.captures == 3
        model[2] = torch.nn.LayerNorm(32)               # a replaced submodule
        for _ in range(graphs.WARMUP + 1):
            assert torch.equal(opt(x), ref(x))
        assert runner.drops == 3 and runner.off         # parameters keep changing: graphs off
        assert runner.captures == 3 and not any(e.graph for e in runner.entries.values())
        assert any("graphs are off" in line for line in runner.describe())


class ParamCasts(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts casts whose input is one of `params` (their storage)."""

    def __init__(self, params):
        super().__init__()
        self.ptrs, self.count = {p.untyped_storage().data_ptr() for p in params}, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is aten._to_copy.default and args[0].untyped_storage().data_ptr() in self.ptrs:
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_values_from_parameters_alone_are_read_by_the_graph_not_computed_in_it():
    """Under autocast the weights' casts (runtime/param_cache.py) are not in the graph: a replay
    reads the cache's tensors, which the runner computes again, in place, before a replay where a
    parameter changed in place (the graph itself reads parameters at their addresses)."""
    model = mlp()
    x = torch.randn(4, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        opt, ref = optimized(model, x), plain(model, x)
    runner = graphed(opt)
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        for _ in range(graphs.WARMUP + 1):
            opt(x)
        assert runner.captures == 1 and runner.replays == 1
        (entry,) = [e for e in runner.entries.values() if e.graph is not None]
        held = [t.data_ptr() for values in entry.bound.cache.lists for t in values]
        with ParamCasts(model.parameters()) as casts:
            got = opt(x)                                 # a replay: nothing cast
        assert casts.count == 0 and runner.replays == 2 and torch.equal(got, ref(x))
        model[0].weight.mul_(2.0)                       # an optimizer's step: in place
        with ParamCasts(model.parameters()) as casts:
            got = opt(x)
        assert casts.count == 1 and runner.replays == 3 and runner.captures == 1
        assert torch.equal(got, ref(x))
        assert [t.data_ptr() for values in entry.bound.cache.lists for t in values] == held


def test_a_submodule_replaced_is_seen_by_the_guard():
    model = mlp()
    opt = optimized(model, torch.randn(4, 16))
    guard = graphs.ParamGuard(opt)
    live = guard.live()
    assert [t is p for t, p in zip(live, opt._params())] == [True] * len(live)
    assert graphs.same_tensors(live, live, [t.data_ptr() for t in live])
    model[0] = torch.nn.Linear(16, 32)
    assert guard.live() is None
    del model[2]._parameters["bias"]
    assert graphs.ParamGuard.__init__ and graphs.ParamGuard(opt).live() is None


class Eps(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)
        self.scale = 2.0

    def forward(self, x):
        return self.lin(x) * self.scale


def test_no_replay_once_the_python_state_it_read_changed():
    """A graph holds the capture's Python values (self.scale): once one changes, the call goes to the
    capture made for the new state, not to the replay."""
    torch.manual_seed(0)
    model = Eps().eval()
    opt = optimized(model, torch.randn(4, 16))
    runner = graphed(opt)
    with torch.no_grad():
        for _ in range(graphs.WARMUP + 2):
            opt(torch.randn(4, 16))
        assert runner.replays == 2
        model.scale = -1.0
        x = torch.randn(4, 16)
        assert torch.allclose(opt(x), model(x), atol=1e-6) and runner.replays == 2
        model.scale = 2.0                    # the state the graph was captured in: replayed again
        assert torch.allclose(opt(x), model(x), atol=1e-6) and runner.replays == 3


def test_buffers_the_forward_updates_are_updated_by_each_replay():
    model, twin = Norm().train(), Norm().train()
    twin.load_state_dict(model.state_dict())
    opt = optimized(model, torch.randn(16, 8))
    runner = graphed(opt)
    with torch.no_grad():
        for i in range(graphs.WARMUP + 3):
            x = torch.randn(16, 8)
            assert torch.allclose(opt(x), twin(x), atol=1e-5)
    assert runner.replays == 3
    assert torch.allclose(model.bn.running_mean, twin.bn.running_mean, atol=1e-6)
    assert torch.allclose(model.bn.running_var, twin.bn.running_var, atol=1e-6)
    assert model.bn.num_batches_tracked == twin.bn.num_batches_tracked == graphs.WARMUP + 3


def test_outputs_keep_their_sharing_and_never_alias_what_the_graph_writes():
    base = torch.arange(12.0)
    a, b = base[:6].view(2, 3), base[3:9].view(3, 2)   # overlapping views of one buffer
    solo = torch.ones(3)
    outs = graphs.Outputs({"a": a, "b": (b, solo, None, 7)}, forbidden=set())
    got = outs.fresh()
    assert torch.equal(got["a"], a) and torch.equal(got["b"][0], b) and got["b"][2:] == (None, 7)
    assert got["a"].untyped_storage().data_ptr() == got["b"][0].untyped_storage().data_ptr()
    assert got["a"].untyped_storage().data_ptr() != base.untyped_storage().data_ptr()
    assert got["b"][1].data_ptr() != solo.data_ptr()
    got["a"].add_(100)
    assert torch.equal(got["b"][0][0], b[0] + 100) and torch.equal(got["b"][0][2], b[2])
    assert torch.equal(base, torch.arange(12.0))
    with pytest.raises(graphs.Unsafe, match="shares memory with an input"):
        graphs.Outputs((a, solo), forbidden={base.untyped_storage().data_ptr()})


class WithScale(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.rand(4))

    def forward(self, x):
        return x * self.scale, self.scale


def test_an_output_that_is_a_parameter_is_not_graphed():
    model = WithScale()
    opt = optimized(model, torch.randn(4, 4))
    runner = graphed(opt)
    with torch.no_grad():
        for _ in range(graphs.WARMUP + 2):
            x = torch.randn(4, 4)
            y, scale = opt(x)
            assert scale is model.scale and torch.equal(y, x * model.scale)   # as un-graphed
    assert runner.captures == 0 and runner.replays == 0
    (line,) = [line for line in runner.describe() if "not graphed" in line]
    assert "an output shares memory with an input, a parameter or a buffer" in line


def test_release_by_the_gate():
    model = mlp()
    x = torch.randn(4, 16)
    opt = optimized(model, x)
    runner = graphed(opt)
    with torch.no_grad():
        for _ in range(graphs.WARMUP + 1):
            opt(x)
        assert runner.captures == 1
        opt.run_original("test: kbench is not faster")
        assert not runner.entries and runner.off
        assert torch.equal(opt(x), model(x)) and runner.replays == 1
    assert "CUDA graphs: off (the model gate runs the original module)" in str(opt.kbench_report)


def test_the_runner_stands_in_for_the_fast_program():
    opt = optimized(mlp(), torch.randn(4, 16))
    inner = types.SimpleNamespace(served=5, why="x", calls=[], cleared=[])
    inner.call = lambda module, args: inner.calls.append(args) or "inner's"
    inner.add = lambda *a: True
    inner.clear = lambda: inner.cleared.append(1)
    runner = graphs.GraphRunner(opt, inner, "auto", capture=fake_capture_for(opt._kbench_orig))
    assert runner.served == 5 and runner.why == "x" and runner.add(1, 2) is True
    runner.clear()
    assert inner.cleared == [1]
    x = torch.randn(4, 16)
    assert runner.call(opt, (x,)) == "inner's" and len(inner.calls) == 1   # grad mode: the Program's
    bare = graphs.GraphRunner(opt, None, "auto")
    with pytest.raises(AttributeError):
        bare.served
    assert bare.call(opt, (x,)) is NotImplemented and bare.add(1) is False


def test_a_failed_capture_is_remembered_with_its_reason():
    opt = optimized(mlp(), torch.randn(4, 16))

    def broken(fn, pool, device, stream):
        raise RuntimeError("operation not permitted when stream is capturing\nmore")
    runner = graphs.GraphRunner(opt, None, True, capture=broken)
    opt.__dict__.update(_kbench_graphs=runner, _kbench_fast_program=runner)
    x = torch.randn(4, 16)
    with torch.no_grad():
        for _ in range(graphs.WARMUP + 3):
            assert torch.allclose(opt(x), opt._kbench_orig(x), atol=1e-6)
    (entry,) = runner.entries.values()
    assert entry.reason == "capture failed (RuntimeError: operation not permitted when stream is capturing)"
    assert runner.captures == 0


class Recorder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("last", torch.zeros(4, 8))

    def forward(self, x):
        self.last.copy_(x * 2.0)
        return x + 1.0


def test_a_buffer_written_but_not_read_is_guarded_too():
    model = Recorder()
    opt = optimized(model, torch.randn(4, 8))
    assert opt._kbench_param_chains == [] and graphs.written_only(opt) == [((), "_buffers", "last")]
    runner = graphed(opt)
    with torch.no_grad():
        for _ in range(graphs.WARMUP + 2):
            x = torch.randn(4, 8)
            assert torch.equal(opt(x), x + 1.0) and torch.equal(model.last, x * 2.0)
        assert runner.captures == 1 and runner.replays == 2
        model.last = torch.zeros(4, 8)            # replaced: the graph would write the old one
        x = torch.randn(4, 8)
        assert torch.equal(opt(x), x + 1.0) and torch.equal(model.last, x * 2.0)
        assert runner.drops == 1


def test_the_model_gate_times_the_graphs_against_the_un_graphed_call(monkeypatch):
    """api._gated (the cuda backend's, here on the stand-in): with cuda_graphs="auto" the gate
    also times the module with its graphs paused, and where the graphs were not faster they go."""
    from kbench import api
    from kbench.tune import gate
    model = mlp()
    x = torch.randn(4, 16)
    seen = {}

    def compare(model_, optimized, args, kwargs, device, ungraphed=None):
        with torch.no_grad():
            for _ in range(graphs.WARMUP + 2):
                optimized(*args)                 # graphed after the warm-up
            replays = runner.replays
            plain = ungraphed(*args)
            seen["paused_replays"] = runner.replays - replays   # the paused call replayed nothing
            seen["ungraphed"] = torch.equal(plain, optimized(*args))
        return gate.Verdict(keep=True, eager_ms=2.0, kbench_ms=1.0, backward=False, graphed_ms=1.2,
                            ungraphed_ms=1.0, graphs=False)
    monkeypatch.setattr(gate, "compare", compare)
    options = dict(gate=True, cuda_graphs="auto")
    opt = optimized(model, x)
    runner = graphed(opt, option="auto")
    assert api._gated(model, opt, (x,), {}, "cuda", torch.device("cpu"), options) is opt
    assert seen == {"ungraphed": True, "paused_replays": 0} and runner.off and not runner.entries
    text = str(opt.kbench_report)
    assert "kbench with CUDA graphs 1.2 ms, without 1 ms (graphs not faster: off)" in text
    assert "CUDA graphs: off (the model gate timed the call at 1.2 ms with graphs, 1 ms without)" in text

    opt = optimized(model, x)                    # True: the graphs stay whatever the times
    runner = graphed(opt, option=True)
    monkeypatch.setattr(gate, "compare", lambda *a, ungraphed=None: (
        seen.__setitem__("asked", ungraphed) or gate.Verdict(True, 2.0, 1.0, False)))
    api._gated(model, opt, (x,), {}, "cuda", torch.device("cpu"), dict(gate=True, cuda_graphs=True))
    assert seen["asked"] is None and not runner.off


@pytest.mark.parametrize("queued, waited, stay", [
    ((1.0, 1.2), (5.0, 5.0), True),     # faster queued back to back
    ((1.0, 1.0), (3.0, 6.0), True),     # tied queued, the waited-for call is faster: host time gone
    ((1.0, 1.0), (5.9, 6.0), False),    # tied both ways: they pin memory for nothing
    ((1.1, 1.0), (3.0, 6.0), False),    # slower queued (the copies in and out): off, whatever the latency
])
def test_the_gate_keeps_graphs_where_they_take_away_time_queued_or_waited_for(queued, waited, stay):
    from kbench.tune import gate
    assert gate.graphs_stay(*queued, *waited) is stay
    v = gate.Verdict(keep=True, eager_ms=2.0, kbench_ms=1.0, backward=False, graphed_ms=queued[0],
                     ungraphed_ms=queued[1], graphs=stay, graphed_latency_ms=waited[0], ungraphed_latency_ms=waited[1])
    assert f"(one call waited for: {waited[0]:.4g} ms with, {waited[1]:.4g} ms without)" in v.describe()


class Pair:
    """A model output container whose unflatten runs code of its own (as Hugging Face's cache
    re-runs its update, which copies from the CPU): code a CUDA-graph capture must not hold."""
    capturing = False
    built = 0

    def __init__(self, a, b):
        if Pair.capturing:
            raise RuntimeError("the output's structure was built inside the capture")
        Pair.built += 1
        self.a, self.b = a, b


pytree.register_pytree_node(Pair, lambda p: ([p.a, p.b], None), lambda xs, _: Pair(*xs),
                            serialized_type_name="tests.test_cuda_graphs.Pair")


class Twice(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x)
        return Pair(y.relu(), y * 2)


def test_the_output_structure_is_built_after_each_replay_not_in_the_capture():
    model = Twice().eval()
    x = torch.randn(4, 8)
    opt, ref = optimized(model, x), plain(model, x)
    slot = "_kbench_fast_program" if opt._kbench_spec.plain else "_kbench_fast_flat"
    inner = fake_capture_for(model)

    def capture(fn, pool, device, stream):
        Pair.capturing = True
        try:
            return inner(fn, pool, device, stream)
        finally:
            Pair.capturing = False
    runner = graphs.GraphRunner(opt, opt.__dict__[slot], "auto", capture=capture)
    runner.train = None
    opt.__dict__.update({"_kbench_graphs": runner, slot: runner})
    with torch.no_grad():
        for _ in range(graphs.WARMUP + 2):
            x = torch.randn(4, 8)
            got, want = opt(x), ref(x)
            assert isinstance(got, Pair) and torch.equal(got.a, want.a) and torch.equal(got.b, want.b)
    assert runner.captures == 1 and runner.replays == 2, runner.describe()


class Cache:
    """A key-value cache rebuilt as Hugging Face's DynamicCache is: its unflatten joins each given
    tensor to an empty one (a copy, in eager)."""

    def __init__(self, keys):
        self.keys = [torch.cat([torch.tensor([], dtype=k.dtype), k], dim=-2) for k in keys]


pytree.register_pytree_node(Cache, lambda c: (list(c.keys), None), lambda xs, _: Cache(xs),
                            serialized_type_name="tests.test_cuda_graphs.Cache")


class Cached(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x)
        k = y.relu()
        return y, Cache([k, y * 2, k])


def test_a_replay_s_cache_keeps_its_fresh_tensors_without_copying_them():
    """After a replay the outputs are copies no one else holds: the cache's rebuild keeps them
    (no cat, no copy); a tensor two outputs share is still copied, as eager's cat copies it, and
    outside a replay the container is rebuilt as torch's pytree does."""
    from kbench.capture.types import OutputTree
    y, k, k2 = torch.randn(4, 8), torch.randn(4, 8), torch.randn(4, 8)
    spec = pytree.tree_flatten((y, Cache([k, k2, k])))[1]
    vals = [y, k, k2, k]
    tree = OutputTree(spec, [("out", i) for i in range(len(vals))])
    got = tree.build(vals, fresh=True)
    assert got[1].keys[1] is k2                      # taken
    assert got[1].keys[0] is not k and got[1].keys[2] is not k and torch.equal(got[1].keys[0], k)
    assert got[1].keys[0].data_ptr() != got[1].keys[2].data_ptr()
    again = tree.build(vals)
    assert all(c is not t for c, t in zip(again[1].keys, (k, k2, k)))

    model = Cached().eval()
    x = torch.randn(4, 8)
    opt, ref = optimized(model, x), plain(model, x)
    runner = graphed(opt, option="auto")
    with torch.no_grad():
        for _ in range(graphs.WARMUP + 2):
            x = torch.randn(4, 8)
            got, want = opt(x), ref(x)
            for a, b in zip(got[1].keys, want[1].keys):
                assert torch.equal(a, b)
            assert got[1].keys[0].data_ptr() != got[1].keys[2].data_ptr()
    assert runner.replays == 2, runner.describe()
