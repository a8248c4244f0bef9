"""kbench._fast.Program without a GPU: the guards of an OptimizedModule's C++ forward (the
signature, the train/eval mode, every parameter read live through the module dicts, gradients),
exercised through entries with no steps (their outputs are inputs or parameters), its refusal of
malformed descriptions, and the Python glue in kbench/runtime/module.py: which bound calls it takes and that
forward() takes the Python path whenever it declines (what it does on a GPU:
tests/gpu/test_fast_path.py)."""
import gc
import os
import types
import weakref

import pytest
import torch

import kbench
from kbench.runtime import fast as fastmod
from kbench.runtime import plan as runtime
from kbench.runtime.module import OptimizedModule

fast = fastmod.module()


@pytest.fixture(autouse=True)
def _fast_is_built():
    """kbench._fast is built with kbench (setup.py, against the torch at hand): without it these
    tests fail, unless KBENCH_FAST=0 asks for the Python path."""
    if fast is None or not hasattr(fast, "Program"):
        if os.environ.get("KBENCH_FAST", "1") == "0":
            pytest.skip("KBENCH_FAST=0: the Python path was asked for")
        pytest.fail("kbench._fast (with Program) is not there: it was not built, or does not load "
                    "(see the warning above; rebuild with pip install --no-build-isolation -e .)", pytrace=False)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = torch.nn.LayerNorm(4)
        self.register_buffer("scale", torch.ones(3))


# slots: 0 the input, 1 ln.weight, 2 ln.bias, 3 scale, 4 the constant
CHAINS = [(("ln",), "_parameters", "weight"), (("ln",), "_parameters", "bias"), ((), "_buffers", "scale"),
          (None, None, "c0")]
META = [("ln.weight", torch.float32, (4,)), ("ln.bias", torch.float32, (4,)), ("scale", torch.float32, (3,)),
        ("c0", torch.int64, (2,))]


def program(net, grad_ok=True, **kw):
    captured = types.SimpleNamespace(constants={"c0": torch.arange(2)})
    args = dict(orig=net, captured=captured, ninputs=1, chains=CHAINS, meta=META, training=net.training,
                grad_ok=grad_ok, apply_region=lambda *a: None)
    args.update(kw)
    return fast.Program(**args), captured


def declined(prog, *call):
    before = prog.declined
    got = prog.call(*call)
    assert got is NotImplemented and prog.declined == before + 1
    return prog.why


def test_serves_the_live_parameters():
    net = Net()
    prog, captured = program(net)
    x = torch.randn(2, 4)
    assert prog.add((x,), [], [1], "one") and prog.entries == 1
    assert prog.call(net, (x,)) is net.ln.weight
    assert prog.call(net, (torch.randn(2, 4),)) is net.ln.weight   # same signature, other values
    assert prog.served == 2 and prog.declined == 0
    # replaced: a Parameter, then the submodule, then a constant: the next call reads the new one
    net.ln.weight = torch.nn.Parameter(torch.zeros(4))
    assert prog.call(net, (x,)) is net.ln.weight
    net.ln = torch.nn.LayerNorm(4)
    assert prog.call(net, (x,)) is net.ln.weight
    prog.add((x,), [], [4], "one")   # the same signature again: replaces the entry
    assert prog.entries == 1
    captured.constants["c0"] = torch.arange(2) + 5
    assert prog.call(net, (x,)) is captured.constants["c0"]
    captured.constants = {"c0": torch.arange(2)}
    assert prog.call(net, (x,)) is captured.constants["c0"]


def test_outputs_as_a_tuple_or_built_by_python():
    net = Net()
    prog, _ = program(net)
    x = torch.randn(2, 4)
    prog.add((x,), [], [0, 2, 0], "tuple")
    got = prog.call(net, (x,))
    assert type(got) is tuple and got[0] is x and got[1] is net.ln.bias and got[2] is x
    seen = []
    prog.add((x,), [], [3, 1], lambda outs: seen.append(outs) or {"a": outs[0]})
    got = prog.call(net, (x,))
    assert got == {"a": net.scale} and type(seen[0]) is list and seen[0][1] is net.ln.weight


def test_declines_what_the_python_path_must_decide():
    net = Net()
    prog, captured = program(net)
    x = torch.randn(2, 4)
    prog.add((x,), [], [1], "one")
    # the inputs: count, type, a subclass, the signature (sizes, dtype)
    assert "inputs" in declined(prog, net, ())
    assert "inputs" in declined(prog, net, (x, x))
    assert "plain tensor" in declined(prog, net, ([1.0],))

    class Sub(torch.Tensor):
        pass
    assert "plain tensor" in declined(prog, net, (x.as_subclass(Sub),))
    assert "signature" in declined(prog, net, (torch.randn(3, 4),))
    assert "signature" in declined(prog, net, (torch.randn(2, 4, dtype=torch.float64),))
    assert "signature" in declined(prog, net, (torch.randn(2, 4, 1),))
    # the mode
    net.eval()
    assert "train/eval" in declined(prog, net, (x,))
    net.train()
    assert prog.call(net, (x,)) is net.ln.weight
    # parameters and buffers: resized, None, gone, a non-tensor, another dtype (double())
    good = net.ln.weight
    net.ln.weight = torch.nn.Parameter(torch.ones(5))
    assert "changed" in declined(prog, net, (x,))
    net.ln.weight = None
    assert "gone" in declined(prog, net, (x,))
    del net.ln.weight
    assert "gone" in declined(prog, net, (x,))
    net.ln._parameters["weight"] = [1.0]
    assert "gone" in declined(prog, net, (x,))
    net.ln.weight = good
    net.scale = torch.ones(3, dtype=torch.float64)
    assert "changed" in declined(prog, net, (x,))
    net.scale = torch.ones(3)
    ln = net.ln
    del net.ln
    assert "gone" in declined(prog, net, (x,))
    net.ln = ln
    assert prog.call(net, (x,)) is good
    net.double()
    assert "changed" in declined(prog, net, (x,))
    net.float()
    del captured.constants["c0"]
    assert "gone" in declined(prog, net, (x,))
    captured.constants["c0"] = torch.arange(2)
    assert prog.call(net, (x,)) is good
    prog.clear()
    assert prog.entries == 0 and "signature" in declined(prog, net, (x,))


def test_declines_gradients_where_a_joint_program_may_apply():
    net = Net()
    prog, _ = program(net, grad_ok=False)
    x = torch.randn(2, 4)
    prog.add((x,), [], [0], "one")
    assert "joint" in declined(prog, net, (x,))   # the parameters want gradients
    with torch.no_grad():
        assert prog.call(net, (x,)) is x
    net.requires_grad_(False)
    assert prog.call(net, (x,)) is x
    assert "joint" in declined(prog, net, (x.clone().requires_grad_(),))
    ok, _ = program(net, grad_ok=True)
    ok.add((x,), [], [0], "one")
    xg = x.clone().requires_grad_()
    assert ok.call(net, (xg,)) is xg


def test_refuses_malformed_descriptions():
    net = Net()
    prog, _ = program(net)
    x = torch.randn(2, 4)
    assert prog.add((x,), [], [5], "one") is False       # no such slot
    assert prog.add((x,), [], [], "tuple") is False      # no outputs
    assert prog.add((x, x), [], [0], "one") is False     # not as many inputs as captured
    assert prog.add(([1.0],), [], [0], "one") is False   # not a tensor
    assert prog.entries == 0
    with pytest.raises(TypeError, match="build"):
        prog.add((x,), [], [0], "many")
    with pytest.raises(TypeError):
        prog.add((x,), [(None, None, None, [0], 1)], [0], "one")   # not a Launch and a Region
    with pytest.raises(TypeError, match="tuple"):
        prog.call(net, [x])
    with pytest.raises(TypeError):
        program(net, chains=[(("ln",), None, "weight")] + CHAINS[1:])
    with pytest.raises(ValueError, match="one meta entry"):
        program(net, meta=META[:2])
    with pytest.raises(TypeError, match="dtype"):
        program(net, meta=[("w", "float32", (4,))] + META[1:])
    with pytest.raises(TypeError, match="callable"):
        program(net, apply_region=None)


class Cached:
    """Stands for a bound signature's parameter cache (runtime/param_cache.BoundCache): take() gets
    the call's parameters, buffers and constants and gives the values of each cached step."""

    def __init__(self, values):
        self.values, self.seen = values, []

    def take(self, params):
        self.seen.append(params)
        return self.values


def test_steps_the_parameter_cache_holds():
    """A step only the cache runs (values computed from parameters alone, runtime/param_cache.py) is
    served from cache.take(params) on a call that records no history; where take() gives None (a
    caller's CUDA-graph capture) or the call records history, the Python path runs it."""
    net = Net()
    prog, _ = program(net)
    x, value = torch.randn(2, 4), torch.randn(4)
    cache = Cached([[value]])
    assert prog.add((x,), [(None, None, None, [1], 1, 0)], [0, 5], "tuple", cache)
    with torch.no_grad():
        got = prog.call(net, (x,))
        assert got[0] is x and got[1] is value and prog.served == 1
        (params,) = cache.seen
        assert [p is q for p, q in zip(params, (net.ln.weight, net.ln.bias, net.scale))] == [True] * 3
        cache.values = None
        assert "Python path" in declined(prog, net, (x,))
    cache.values = [[value]]
    assert "Python path" in declined(prog, net, (x,))   # grad mode, parameters that require it
    assert len(cache.seen) == 2
    with pytest.raises(TypeError, match="with a cache"):
        prog.add((x,), [(None, None, None, [1], 1, 0)], [0], "one")   # cached, but no cache given
    with pytest.raises(TypeError, match="with a cache"):
        prog.add((x,), [(None, None, None, [1], 1)], [0], "one", cache)   # no index into it


def test_takes_any_number_of_inputs():
    """A module of 70 inputs (more than the 64 it keeps on the stack) is served, not declined to
    the Python path."""
    net = Net()
    prog, _ = program(net, ninputs=70)
    xs = tuple(torch.randn(2, 4) for _ in range(70))
    assert prog.add(xs, [], [69, 70], "tuple") and prog.entries == 1
    got = prog.call(net, xs)
    assert got[0] is xs[69] and got[1] is net.ln.weight and prog.served == 1
    assert declined(prog, net, xs[:69] + (torch.randn(3, 4),)) == "no bound signature matches"
    prog.add(xs, [], [0], "one")   # the same signature again: replaces the entry
    assert prog.entries == 1 and prog.call(net, xs) is xs[0]


def test_collected_with_its_module():
    net = Net()
    prog, _ = program(net)
    net.prog = prog   # a cycle through the C++ object
    prog.add((torch.randn(2, 4),), [], [1], "one")
    ref = weakref.ref(net)
    del net, prog
    gc.collect()
    assert ref() is None


# ------------------------------------------------------------------ the runtime's use of it


def interp_model(model, *example):
    return kbench.optimize(model, example, backend="interp", verbose=False)


def test_not_made_for_the_interp_backend_nor_under_kbench_fast_0(monkeypatch):
    opt = interp_model(torch.nn.LayerNorm(8), torch.randn(3, 8))
    assert opt._kbench_fast_program is None
    monkeypatch.setenv("KBENCH_FAST", "0")
    assert fastmod._load() is None


class Pair(torch.nn.Module):
    def __init__(self, out):
        super().__init__()
        self.ln = torch.nn.LayerNorm(8)
        self.out = out

    def forward(self, x, r):
        h = x + r
        y = self.ln(h)
        return {"one": y, "tuple": (y, h), "dict": {"y": y, "h": h}, "none": (y, None)}[self.out]


@pytest.mark.parametrize("out", ["one", "tuple", "dict", "none"])
def test_which_bound_calls_it_takes(monkeypatch, out):
    x, r = torch.randn(3, 8), torch.randn(3, 8)
    opt = interp_model(Pair(out), x, r)
    opt(x, r)
    (bound,) = opt._kbench_sigs.values()
    assert opt._fast_entry(bound) is None   # the interpreter's launches are Python closures
    # as if every kernel step's launch and node were kbench._fast's
    monkeypatch.setattr(fastmod, "launch_of", lambda launcher: "launch" if launcher is not None else None)
    for s in bound.steps:
        s.fast = "region"
    kernels = [s for s in bound.steps if s.kind == runtime.KERNEL]
    entry = opt._fast_entry(bound)
    if len(kernels) != len(bound.steps):   # a step torch runs: Python's
        assert entry is None
        return
    steps, outputs, build, cache = entry
    assert cache is bound.cache
    assert [s[0] for s in steps] == bound.steps and all(s[1:3] == ("launch", "region") for s in steps)
    assert [s[4] for s in steps] == [len(s.out_meta) for s in bound.steps]
    probe = [object() for _ in bound.outputs]
    want = opt._kbench_captured.build_outputs(probe, bound.symvals)
    if out == "one":
        assert build == "one" and outputs == [bound.outputs[probe.index(want)]]
    elif out == "tuple":
        assert build == "tuple" and outputs == [bound.outputs[probe.index(w)] for w in want]
    else:   # built by build_outputs, from the graph outputs in order
        assert callable(build) and outputs == list(bound.outputs)
        assert build(probe) == want
    opt._kbench_captured.mutations = [(0, "buffer", "x")]
    assert opt._fast_entry(bound) is None


class FakeProgram:
    def __init__(self, result):
        self.result, self.calls = result, 0

    def call(self, module, args):
        self.calls += 1
        if isinstance(self.result, Exception):
            raise self.result
        return self.result


@pytest.mark.parametrize("route", ["module call (C++)", "forward (Python)"])
def test_forward_takes_the_python_path_when_declined(route):
    ln = torch.nn.LayerNorm(8)
    x = torch.randn(3, 8)
    opt = interp_model(ln, x)
    call = opt if route.startswith("module") else opt.forward
    want = call(x)
    fake = opt.__dict__["_kbench_fast_program"] = FakeProgram(NotImplemented)
    assert torch.equal(call(x), want) and fake.calls == 1 and not opt._kbench_reasons
    fake = opt.__dict__["_kbench_fast_program"] = FakeProgram(runtime.Fallback("the program says no"))
    assert torch.equal(call(x), ln(x)) and fake.calls == 1   # eager, with the reason noted
    assert opt._kbench_reasons == {"the program says no"}
    marker = object()
    fake = opt.__dict__["_kbench_fast_program"] = FakeProgram(marker)
    assert call(x) is marker and fake.calls == 1
    assert torch.equal(call(input=x), ln(x)) and fake.calls == 1   # keyword arguments never reach it
    opt.__dict__["_kbench_fast_program"] = FakeProgram(ValueError("not a fallback"))
    with pytest.raises(ValueError, match="not a fallback"):
        call(x)


def test_module_call_is_torchs_wherever_a_hook_or_a_compiled_call_needs_it():
    ln = torch.nn.LayerNorm(8)
    x = torch.randn(3, 8)
    opt = interp_model(ln, x)
    assert isinstance(vars(type(opt))["__call__"], types.MethodDescriptorType)   # kbench._fast.module_call
    marker = object()
    fake = opt.__dict__["_kbench_fast_program"] = FakeProgram(marker)
    seen = []
    handle = opt.register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    assert opt(x) is marker and seen == [x] and fake.calls == 1
    handle.remove()
    handle = opt.register_forward_hook(lambda m, args, out: ("hooked", out))
    assert opt(x) == ("hooked", marker) and fake.calls == 2
    handle.remove()
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, args, out: ("global", out))
    try:
        assert opt(x) == ("global", marker)
    finally:
        handle.remove()
    opt._compiled_call_impl = lambda *args, **kwargs: ("compiled", args)   # what module.compile() sets
    assert opt(x) == ("compiled", (x,)) and fake.calls == 3
    opt._compiled_call_impl = None
    assert opt(x) is marker and fake.calls == 4
    with pytest.raises(TypeError):   # the descriptor binds to nn.Modules only
        vars(type(opt))["__call__"](object(), x)
    # a full backward hook: torch's __call__ wraps the inputs and outputs, and the hook runs
    opt = interp_model(ln, x)
    grads = []
    opt.register_full_backward_hook(lambda m, grad_in, grad_out: grads.append(grad_out[0]))
    xg = x.clone().requires_grad_()
    g = torch.randn_like(x)
    opt(xg).backward(g)
    assert len(grads) == 1 and torch.equal(grads[0], g)
    fastmod.install_module_call(OptimizedModule, enabled=False)   # torch's own __call__, from nn.Module (where FX patches it)
    try:
        assert "__call__" not in vars(type(opt)) and type(opt).__call__ is torch.nn.Module.__call__
        assert torch.allclose(opt(x), ln(x), atol=1e-5)
    finally:
        fastmod.install_module_call(OptimizedModule)
    assert isinstance(vars(type(opt))["__call__"], types.MethodDescriptorType)
