"""Capture (torch.export → IR) checked end to end on the CPU: every model of tests/models.py is
captured and run through the IR with torch ops (kbench.runtime.torch_eval), against eager, at the example
sizes and at another batch size; golden IR dumps; bad inputs; models left untouched."""
import copy
import os
import pathlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils._pytree as pytree

import kbench
from kbench.capture import Captured, capture
from kbench.errors import CaptureError
from kbench.runtime.torch_eval import evaluate, run_graph

from models import BY_NAME, MODELS

GOLDEN = pathlib.Path(__file__).parent / "golden"
_CACHE = {}


def _captured(name, dtype=torch.float32):
    key = (name, dtype)
    if key not in _CACHE:
        case = BY_NAME[name]
        torch.manual_seed(0)
        model = case.make().to(dtype)
        _CACHE[key] = model, capture(model, _cast(case.inputs(), dtype))
    return _CACHE[key]


def _cast(xs, dtype):
    return tuple(x.to(dtype) if x.is_floating_point() else x for x in xs)


def assert_close(got, want, rtol):
    g, w = pytree.tree_leaves(got), pytree.tree_leaves(want)
    assert pytree.tree_structure(got) == pytree.tree_structure(want)
    assert len(g) == len(w) and len(g) > 0
    for a, b in zip(g, w):
        if not isinstance(b, torch.Tensor):
            assert a == b
            continue
        assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
        if not b.is_floating_point():
            assert torch.equal(a, b)
            continue
        assert torch.equal(torch.isnan(a), torch.isnan(b))
        a, b = a.double().nan_to_num(), b.double().nan_to_num()
        err = (a - b).norm().item()
        assert err <= rtol * max(b.norm().item(), 1e-30), f"relative error {err / max(b.norm().item(), 1e-30):.2e}"


# ---------------------------------------------------------------------------- every model

@pytest.mark.parametrize("name", [c.name for c in MODELS])
def test_model_matches_eager_f32(name):
    model, cap = _captured(name)
    assert isinstance(cap, Captured)
    assert cap.graph.num_outputs >= 1
    case = BY_NAME[name]
    torch.manual_seed(1)
    for xs in (case.inputs(), case.other_inputs()):
        with torch.no_grad():
            assert_close(run_graph(cap, model, xs), model(*xs), 2e-5)


@pytest.mark.parametrize("name", [c.name for c in MODELS])
def test_model_matches_eager_f64(name):
    model, cap = _captured(name, torch.float64)
    case = BY_NAME[name]
    torch.manual_seed(2)
    for xs in (case.inputs(), case.other_inputs()):
        xs = _cast(xs, torch.float64)
        with torch.no_grad():
            assert_close(run_graph(cap, model, xs), model(*xs), 1e-9)


@pytest.mark.parametrize("name", [c.name for c in MODELS])
def test_sizes_vary(name):
    """Every model's batch dim is a symbol (nothing here needs a static capture), and the
    binding checks shapes."""
    _, cap = _captured(name)
    assert cap.static_reason is None
    assert cap.input_syms[0][0] is not None, cap.input_syms
    xs = BY_NAME[name].other_inputs()
    symvals = cap.bind(xs)
    for i, x in enumerate(xs):
        assert tuple(cap.graph.sizes(cap.graph.inputs[i], symvals)) == tuple(x.shape)
    with pytest.raises(ValueError):
        cap.bind(tuple(x.unsqueeze(0) for x in xs))


def test_float64_reference_mode():
    """torch_eval's float64 mode on an f32 capture agrees with eager f64 to f64 precision."""
    model, cap = _captured("transformer_block")
    x = BY_NAME["transformer_block"].other_inputs()[0]
    got = run_graph(cap, model, (x,), dtype=torch.float64)
    want = copy.deepcopy(model).double()(x.double())
    assert got.dtype == torch.float64
    assert_close(got, want, 1e-9)


@pytest.mark.parametrize("name", ["layernorm", "rmsnorm", "softmax_dim1", "log_softmax_last",
                                  "cross_entropy_weight", "groupnorm", "batchnorm_eval", "gelu_tanh"])
def test_bf16_models(name):
    """Half-precision composites compute in f32 inside and round once, as torch's kernels do."""
    model, cap = _captured(name, torch.bfloat16)
    xs = _cast(BY_NAME[name].other_inputs(), torch.bfloat16)
    with torch.no_grad():
        assert_close(run_graph(cap, model, xs), model(*xs), 2e-2)


def test_graph_is_decomposed():
    """Composites become primitives; only matmul-like work is EXTERN."""
    for name in ("layernorm", "rmsnorm", "softmax_dim1", "cross_entropy_ignore", "groupnorm",
                 "batchnorm_eval", "logsumexp", "embedding", "lm_loss"):
        _, cap = _captured(name)
        ops = {cap.graph.node(i)["op"] for i in range(cap.graph.num_nodes)}
        externs = [cap.externs[cap.graph.node(i)["index"]].name
                   for i in range(cap.graph.num_nodes) if cap.graph.node(i)["op"] == "extern"]
        assert all("linear" in e for e in externs), (name, externs)
        assert "input" in ops and ops - {"input", "extern"}, name
    _, cap = _captured("cross_entropy_weight")
    ops = [cap.graph.node(i)["op"] for i in range(cap.graph.num_nodes)]
    assert ops.count("gather") == 2 and "log" in ops and "where" in ops


def test_the_op_table_holds_every_family():
    """ops.py imports every op family module (kbench/capture/ops_*.py), which registers its
    lowerings into the one table: a family left out of ops.py's imports would leave its ops to torch."""
    from kbench.capture import ops
    families = {p.stem for p in pathlib.Path(ops.__file__).parent.glob("ops_*.py")} - {"ops_base"}
    assert len(families) >= 4
    registered = {fn.__module__.rsplit(".", 1)[-1] for fn in ops.LOWER.values()}
    assert registered == families
    aten = torch.ops.aten
    for op in (aten.relu.default, aten.permute.default, aten.cat.default, aten.sum.dim_IntList,
               aten.layer_norm.default, aten.mm.default):
        assert op in ops.LOWER, op


def test_linear_bias_stays_in_the_gemm_unless_kbench_computes_what_follows():
    """A Linear whose output only torch reads (or returns) is one call, bias inside cuBLAS's
    GEMM as in eager; one followed by work kbench computes (an activation) is the product plus
    a bias add, which fuses with that work."""
    _, cap = _captured("linear_bias")
    g = cap.graph
    ops = [g.node(i)["op"] for i in range(g.num_nodes)]
    assert ops.count("extern") == 1 and g.node(g.outputs[0])["op"] == "extern"
    assert cap.param_names == ["fc.weight", "fc.bias"]
    assert cap.input_kinds == ["user", "param", "param"]
    fn, args = cap.externs[0]
    assert fn is torch.ops.aten.linear.default and len(args) == 3

    class LinearGelu(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(24, 40)

        def forward(self, x):
            return torch.nn.functional.gelu(self.fc(x))
    cap = capture(LinearGelu(), (torch.randn(5, 24),))
    g = cap.graph
    ops = [g.node(i)["op"] for i in range(g.num_nodes)]
    assert ops.count("extern") == 1 and "add" in ops and g.node(g.outputs[0])["op"] == "gelu"
    fn, args = cap.externs[0]
    assert fn is torch.ops.aten.linear.default and len(args) == 2
    assert [r["kind"] for r in (g.partition().region(i) for i in range(len(g.partition())))] == ["EXTERN", "POINTWISE"]


def test_params_are_fetched_live():
    """The graph reads parameters from the live module at run time, not copies."""
    model, cap = _captured("layernorm")
    x = BY_NAME["layernorm"].inputs()[0]
    m2 = copy.deepcopy(model)
    with torch.no_grad():
        m2.ln.weight.mul_(3.0)
        m2.ln.bias.add_(1.0)
        assert_close(run_graph(cap, m2, (x,)), m2(x), 2e-5)


# ---------------------------------------------------------------------------- golden dumps

@pytest.mark.parametrize("name", ["layernorm", "cross_entropy_weight", "groupnorm", "matmul_attention"])
def test_golden_dump(name):
    _, cap = _captured(name)
    text = str(cap.graph)
    path = GOLDEN / f"capture_{name}.txt"
    if os.environ.get("KBENCH_UPDATE_GOLDEN"):
        GOLDEN.mkdir(exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"run with KBENCH_UPDATE_GOLDEN=1 to write {path}"
    assert text == path.read_text()


# ---------------------------------------------------------------------------- bad inputs

def test_rejects_non_module():
    with pytest.raises(TypeError, match="model"):
        capture(lambda x: x, (torch.randn(2),))


def test_rejects_bad_example_inputs():
    m = BY_NAME["gelu"].make()
    with pytest.raises(TypeError, match="example_inputs"):
        capture(m, 3.0)
    with pytest.raises(TypeError, match=r"example_inputs\[1\]"):
        capture(m, (torch.randn(2), "x"))
    with pytest.raises(TypeError, match="example_inputs"):
        capture(BY_NAME["layernorm"].make(), (torch.randn(2, 48), torch.randn(2, 48)))


def test_rejects_complex_input():
    with pytest.raises(TypeError, match=r"example_inputs\[0\].*complex"):
        capture(BY_NAME["gelu"].make(), (torch.randn(2, 3, dtype=torch.complex64),))


def test_rejects_mixed_devices():
    m = BY_NAME["where_compare"].make()
    with pytest.raises(ValueError, match="example_inputs"):
        capture(m, (torch.randn(2, 8), torch.randn(2, 8, device="meta")))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a second device kind")
def test_rejects_inputs_and_model_on_different_devices():
    with pytest.raises(ValueError):
        capture(BY_NAME["layernorm"].make().cuda(), (torch.randn(2, 48),))


def test_integer_input_to_float_op_follows_eager():
    """An integer input promoted into a float op computes what eager computes; one into an op
    eager rejects for its dtype raises eager's exception type (tests/test_eager_rules.py has
    every op)."""
    class Scale(nn.Module):
        def forward(self, x, t):
            return x * t

    xs = (torch.randn(3, 4), torch.randint(0, 5, (3, 4)))
    cap = capture(Scale(), xs)
    assert_close(run_graph(cap, Scale(), xs), Scale()(*xs), 1e-6)

    lin = nn.Linear(4, 4)
    x = torch.randint(0, 5, (3, 4))
    with pytest.raises(RuntimeError) as eager:
        lin(x)
    with pytest.raises(RuntimeError, match=r"aten.linear.default .*int64\[3, 4\]") as got:
        capture(lin, (x,))
    assert str(eager.value).splitlines()[0] in str(got.value)
    assert not isinstance(got.value, CaptureError)


def test_integer_inputs_as_indices_casts_and_masks_are_fine():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 6)

        def forward(self, idx, pos):
            mask = (idx != 0).unsqueeze(-1)
            return torch.where(mask, self.emb(idx), 0.0) + pos.float().unsqueeze(-1)

    m = M().eval()
    xs = (torch.randint(0, 10, (3, 5)), torch.arange(5).expand(3, 5).contiguous())
    cap = capture(m, xs)
    assert_close(run_graph(cap, m, xs), m(*xs), 2e-5)


def test_uncapturable_model_raises_capture_error():
    class DataDependent(nn.Module):
        def forward(self, x):
            if x.sum() > 0:
                return x * 2
            return -x

    with pytest.raises(CaptureError, match="DataDependent"):
        capture(DataDependent(), (torch.randn(3, 4),))


# ---------------------------------------------------------------------------- the model is left alone

@pytest.mark.parametrize("train", [False, True])
def test_model_unchanged(train):
    torch.manual_seed(0)
    model = BY_NAME["transformer_block"].make()
    bn = BY_NAME["batchnorm_eval"].make()
    for m in (model, bn):
        m.train(train)
    if train:
        model.ln1.eval()   # a mixed-mode submodule must stay as it was
    before = {n: (t, t.detach().clone()) for m in (model, bn) for n, t in m.state_dict(keep_vars=True).items()}
    modes = [(m, m.training) for mm in (model, bn) for m in mm.modules()]
    grads = [(p, p.requires_grad) for p in model.parameters()]
    capture(model, BY_NAME["transformer_block"].inputs())
    capture(bn, BY_NAME["batchnorm_eval"].inputs())
    after = {n: t for m in (model, bn) for n, t in m.state_dict(keep_vars=True).items()}
    for n, (t, val) in before.items():
        assert after[n] is t and torch.equal(t, val), n
    assert all(m.training == was for m, was in modes)
    assert all(p.requires_grad == rg for p, rg in grads)


# ---------------------------------------------------------------------------- the harder cases

def test_training_batchnorm_updates_running_stats_like_eager():
    """BatchNorm in training mode: an extern call (batch statistics) whose running-stat updates
    are graph outputs the runtime copies back into the live buffers."""
    torch.manual_seed(0)
    m1 = BY_NAME["batchnorm_eval"].make().train()
    m2 = copy.deepcopy(m1)
    x = BY_NAME["batchnorm_eval"].inputs()[0]
    cap = capture(m1, (x,))
    assert {k for _, k, _ in cap.mutations} == {"buffer"}
    assert {n for _, _, n in cap.mutations} >= {"bn.running_mean", "bn.running_var"}
    assert_close(run_graph(cap, m1, (x,)), m2(x), 2e-5)
    for name in ("bn.running_mean", "bn.running_var", "bn.num_batches_tracked"):
        assert_close(m1.get_buffer(name), m2.get_buffer(name), 1e-6)


def test_unsupported_ops_become_externs():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(6))    # pins dim 1 to 6

        def forward(self, x):
            x = x * self.w
            y = torch.cumsum(x, 1) + torch.cat([x, x * 2], 1)[:, : x.shape[1]]
            v, i = torch.sort(y, dim=-1)
            z = torch.view_as_complex(x.reshape(x.shape[0], 3, 2))     # complex in the middle:
            return F.relu(v), i, torch.view_as_real(z * z).flatten(1) + 1   # computed by torch

    m = M()
    xs = (torch.randn(3, 6),)
    cap = capture(m, xs)
    ops = [cap.graph.node(i)["op"] for i in range(cap.graph.num_nodes)]
    assert "extern" in ops and "relu" in ops and cap.static_reason is None
    assert_close(run_graph(cap, m, xs), m(*xs), 2e-5)
    xs = (torch.randn(5, 6),)
    assert_close(run_graph(cap, m, xs), m(*xs), 2e-5)


def test_symbolic_scalars_go_through_externs():
    class M(nn.Module):
        def forward(self, x):
            return torch.softmax(x / x.shape[-1], -1) + torch.arange(x.shape[-1])

    m = M()
    cap = capture(m, (torch.randn(3, 5),))
    assert cap.static_reason is None
    for shape in ((3, 5), (4, 9)):
        x = torch.randn(*shape)
        assert_close(run_graph(cap, m, (x,)), m(x), 2e-5)


def test_dims_fixed_when_a_size_is_not_a_product():
    """x[:, 1:] has size s1 - 1, which the IR cannot write: that input dim is fixed at its
    example size and the batch dim still varies."""
    class Shift(nn.Module):
        def forward(self, x):
            return x[:, 1:] - x[:, :-1]

    m = Shift()
    cap = capture(m, (torch.randn(3, 7),))
    assert cap.static_reason and "fixed" in cap.static_reason
    assert cap.input_syms == [[0, None]]
    for shape in ((3, 7), (5, 7)):
        x = torch.randn(*shape)
        assert_close(run_graph(cap, m, (x,)), m(x), 0)
    with pytest.raises(ValueError):
        cap.bind((torch.randn(3, 8),))


def test_cnn_keeps_a_varying_batch():
    class CNN(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 8, 3, padding=1)
            self.bn = nn.BatchNorm2d(8)
            self.fc = nn.Linear(8, 5)

        def forward(self, x):
            x = F.max_pool2d(F.relu(self.bn(self.conv(x))), 2)
            return F.log_softmax(self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1)), -1)

    torch.manual_seed(0)
    m = CNN().eval()
    cap = capture(m, (torch.randn(2, 3, 12, 10),))
    assert cap.input_syms == [[0, None, None, None]]
    for n in (2, 5):
        x = torch.randn(n, 3, 12, 10)
        with torch.no_grad():
            assert_close(run_graph(cap, m, (x,)), m(x), 2e-5)


def test_dynamic_false_is_static():
    m, _ = _captured("gelu")
    cap = capture(m, BY_NAME["gelu"].inputs(), dynamic=False)
    assert cap.static_reason == "dynamic=False" and cap.graph.num_symbols == 0


class _CeilPools(nn.Module):
    """SqueezeNet's stem: ceil-mode max pools one after another, whose sizes torch.export cannot
    solve for as symbols at 32x32 (a sympy inequality it gives up on)."""

    def __init__(self):
        super().__init__()
        self.f = nn.Sequential(nn.Conv2d(3, 4, 7, stride=2), nn.ReLU(), nn.MaxPool2d(3, 2, ceil_mode=True),
                               nn.MaxPool2d(3, 2, ceil_mode=True), nn.MaxPool2d(3, 2, ceil_mode=True),
                               nn.AdaptiveAvgPool2d(1))

    def forward(self, x):
        return torch.flatten(self.f(x), 1) * 2


def test_a_failed_dynamic_export_leaves_the_inputs_as_they_were():
    """The dynamic export fails and leaves torch.export's dynamic marks on the example tensor;
    the static export tried next would read them and fail too. Capture takes the static export,
    and the user's tensor carries no mark afterwards."""
    torch.manual_seed(0)
    m, x = _CeilPools().eval(), torch.randn(4, 3, 32, 32)
    cap = capture(m, (x,))
    assert cap.static_reason.startswith("dynamic export failed") and cap.graph.num_symbols == 0
    assert not [a for a in dir(x) if a.startswith("_dynamo")], [a for a in dir(x) if a.startswith("_dynamo")]
    fast = kbench.optimize(m, (x,), backend="interp")
    with torch.no_grad():
        assert_close(fast(x), m(x), 2e-5)
    assert not fast._kbench_reasons, fast._kbench_reasons


class _HiddenState(nn.Module):
    """KernelBench's vanilla RNN: the hidden state a plain tensor attribute that forward rebinds."""

    def __init__(self):
        super().__init__()
        self.hidden = torch.randn(4, 8)
        self.i2h, self.h2o = nn.Linear(16, 8), nn.Linear(8, 3)

    def forward(self, x):
        self.hidden = torch.tanh(self.i2h(torch.cat((x, self.hidden), 1)))
        if not hasattr(self, "calls"):
            self.calls = 0   # made on the first call
        return self.h2o(self.hidden)


def test_export_leaves_no_attribute_the_forward_binds():
    """torch.export runs forward on fake tensors: the attributes it binds there (the new hidden
    state, one made on the first call) are put back, or the model would carry fake tensors into
    the eager call that follows a failed capture (KernelBench's VanillaRNN crashed there)."""
    torch.manual_seed(0)
    m, x = _HiddenState(), torch.randn(4, 8)
    twin = copy.deepcopy(m)
    hidden = m.hidden
    fast = kbench.optimize(m, (x,), backend="interp", verbose=False)
    assert m.hidden is hidden and "calls" not in vars(m)
    with torch.no_grad():
        assert_close(fast(x), twin(x), 1e-6)
        assert_close(fast(x), twin(x), 1e-6)   # the state moves on as eager's does
    assert type(m.hidden) is torch.Tensor


def test_output_structure_is_rebuilt():
    class M(nn.Module):
        def forward(self, x, y):
            return {"sum": x + y, "pair": (x * 2, None), "n": 3}

    m = M()
    xs = (torch.randn(2, 3), torch.randn(2, 3))
    got = run_graph(capture(m, xs), m, xs)
    assert set(got) == {"sum", "pair", "n"} and got["pair"][1] is None and got["n"] == 3
    assert_close(got["pair"][0], xs[0] * 2, 0)


def test_lm_loss_unifies_flattened_sizes():
    """logits.view(-1, V) against targets.view(-1): both inputs bind the same symbols, so the
    gather needs no cast between unrelated sizes."""
    _, cap = _captured("lm_loss")
    assert cap.input_syms[0][:2] == cap.input_syms[1]


def test_evaluate_subset_of_nodes():
    """evaluate() runs a chosen node list given its inputs (how regions fall back to eager)."""
    model, cap = _captured("softmax_last")
    g = cap.graph
    x = BY_NAME["softmax_last"].inputs()[0]
    symvals = cap.bind((x,))
    full = evaluate(g, cap, {g.inputs[0]: x}, symvals)
    mid = g.num_nodes // 2
    part = evaluate(g, cap, {i: full[i] for i in range(mid)}, symvals, nodes=list(range(mid, g.num_nodes)))
    assert torch.equal(part[g.outputs[0]], full[g.outputs[0]])


@pytest.mark.parametrize("name", ["layernorm", "transformer_block", "cross_entropy_weight"])
def test_evaluate_is_differentiable(name):
    """Gradients through the IR (torch ops, externs included) match eager's, for the input and
    every parameter."""
    model, cap = _captured(name)
    xs = [x.requires_grad_(True) if x.is_floating_point() else x for x in BY_NAME[name].inputs()]
    params = list(model.parameters())
    wrt = [x for x in xs if x.requires_grad] + params
    got = torch.autograd.grad(pytree.tree_leaves(run_graph(cap, model, xs))[0].square().sum(), wrt)
    want = torch.autograd.grad(pytree.tree_leaves(model(*xs))[0].square().sum(), wrt)
    for a, b in zip(got, want):
        assert_close(a, b, 1e-5)


def test_in_place_ops():
    """In-place ops on intermediates (ReLU(inplace=True), out += identity) become functional
    ops; a write into a view whose aliasing capture does not follow (a view read after the write)
    and writes into inputs go through torch's functionalization."""
    class Res(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)
            self.act = nn.ReLU(inplace=True)

        def forward(self, x):
            out = self.act(self.fc(x))
            out += x
            out.mul_(0.5)
            return torch.sigmoid_(out)

    class ViewWrite(nn.Module):
        def forward(self, x):
            y = x * 2
            v = y[:, 0]
            y[:, 1] = 0.0          # a write through a view of y
            return y + 1, v        # v sees the write only if it aliases column 1: it does not

    class InputWrite(nn.Module):
        def forward(self, x):
            x.add_(1.0)
            return x * 2

    for m in (Res().eval(), ViewWrite(), InputWrite()):
        xs = (torch.randn(3, 8),)
        cap = capture(m, xs)
        for x in (xs[0], torch.randn(5, 8)):
            a, b = x.clone(), x.clone()
            with torch.no_grad():
                assert_close(run_graph(cap, m, (a,)), m(b), 2e-5)
            assert torch.equal(a, b)      # the input written in place, like eager
    assert [k for _, k, _ in cap.mutations] == ["user"]


def test_evaluate_places_input_free_values_on_the_given_device():
    """A node with no tensor input (a constant region of a loss's joint graph) is made on the
    device evaluate() is given, so a reference computed for a GPU kernel sits on that GPU; values
    with inputs follow the inputs."""
    from kbench import _C
    g = _C.Graph()
    x = g.add_input("x", "user", "f32", [4, 8])
    c = g.add_node("const", [], "f32", [4, 8], scalars=(0.25, 0.0))
    y = g.add_node("add", [x, c], "f32", [4, 8])
    g.add_output(y)
    alone = evaluate(g, None, {}, [], nodes=[c], device=torch.device("meta"))
    assert alone[c].device.type == "meta"
    assert evaluate(g, None, {}, [], nodes=[c])[c].device.type == "cpu"
    xs = torch.ones(4, 8)
    both = evaluate(g, None, {x: xs}, [], nodes=[c, y], device=torch.device("meta"))
    assert both[y].device.type == "cpu" and torch.equal(both[y], xs + 0.25)
