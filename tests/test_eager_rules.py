"""Eager's dtype rules and empty tensors through optimize(backend="interp"): an integer input into
every float op of the lowering table gives eager's values or eager's exception type (at optimize
time, where the example triggers it, and at call time, through the input guard); mixed-dtype norms
raise as eager does; empty dims give eager's empty results, sums of 0, means of nan, max's error."""
import math
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import kbench
from kbench.api import EagerModule
from kbench.capture.ops import LOWER
from kbench.errors import CaptureError

aten = torch.ops.aten
ONES = torch.ones(4)
TARGET = torch.zeros(3, dtype=torch.long)

# An integer tensor into each op the lowering table (kbench/capture/ops.py) computes in floating
# point, or that promotes an integer operand to float: eager either computes it (kbench must give
# the same values and dtype) or raises (kbench must raise the same exception type).
FLOAT_OPS = {
    "softmax": lambda x: torch.softmax(x, -1),
    "log_softmax": lambda x: torch.log_softmax(x, -1),
    "_softmax": lambda x: aten._softmax(x, -1, False),
    "_log_softmax": lambda x: aten._log_softmax(x, -1, False),
    "_safe_softmax": lambda x: aten._safe_softmax(x, -1),
    "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "silu": F.silu, "mish": F.mish,
    "hardswish": F.hardswish, "hardsigmoid": F.hardsigmoid, "elu": F.elu, "softplus": F.softplus,
    "leaky_relu": F.leaky_relu, "relu": F.relu, "relu6": F.relu6, "hardtanh": F.hardtanh,
    "sigmoid": torch.sigmoid, "tanh": torch.tanh, "exp": torch.exp, "exp2": torch.exp2, "log": torch.log,
    "log2": torch.log2, "log10": torch.log10, "log1p": torch.log1p, "expm1": torch.expm1, "sqrt": torch.sqrt,
    "rsqrt": torch.rsqrt, "reciprocal": torch.reciprocal, "sin": torch.sin, "cos": torch.cos, "erf": torch.erf,
    "abs": torch.abs, "neg": torch.neg, "sign": torch.sign, "square": torch.square,
    "clamp": lambda x: torch.clamp(x, 1, 5), "clamp_float": lambda x: torch.clamp(x, 0.5, 5.5),
    "layer_norm": lambda x: F.layer_norm(x, (4,)), "layer_norm_affine": lambda x: F.layer_norm(x, (4,), ONES, ONES),
    "rms_norm": lambda x: F.rms_norm(x, (4,)), "group_norm": lambda x: F.group_norm(x, 2),
    "batch_norm": lambda x: F.batch_norm(x, ONES * 0, ONES, training=False),
    "sum": lambda x: x.sum(-1), "sum_all": torch.sum, "mean": lambda x: x.mean(-1), "mean_all": torch.mean,
    "amax": lambda x: x.amax(-1), "amin": lambda x: x.amin(-1), "max_dim": lambda x: x.max(-1)[0],
    "max_all": torch.max, "var": lambda x: x.var(-1), "std": lambda x: x.std(-1),
    "var_mean": lambda x: torch.var_mean(x, -1), "std_mean": lambda x: torch.std_mean(x, -1),
    "logsumexp": lambda x: torch.logsumexp(x, -1), "vector_norm": lambda x: torch.linalg.vector_norm(x, dim=-1),
    "vector_norm_1": lambda x: torch.linalg.vector_norm(x, 1, dim=-1),
    "div": lambda x: x / 3, "div_tensor": lambda x: x / (x + 1), "pow_half": lambda x: x ** 0.5,
    "pow_2": lambda x: x ** 2, "pow_3": lambda x: x ** 3, "pow_neg2": lambda x: x ** -2, "pow_scalar_base": lambda x: torch.pow(2.0, x), "mul_float": lambda x: x * 0.5,
    "add_float": lambda x: x + 0.5, "rsub": lambda x: 1 - x, "maximum_float": lambda x: torch.maximum(x, ONES * 2.5),
    "where_float": lambda x: torch.where(x > 2, x, 0.5), "masked_fill": lambda x: x.masked_fill(x > 2, 0.5),
    "cross_entropy": lambda x: F.cross_entropy(x, TARGET), "nll_loss": lambda x: F.nll_loss(x, TARGET),
    "linear": lambda x: F.linear(x, torch.ones(3, 4), torch.ones(3)),
    "sub_float": lambda x: x - 0.5, "minimum_float": lambda x: torch.minimum(x, ONES * 2.5),
    "clamp_min_float": lambda x: torch.clamp_min(x, 0.5), "clamp_max_float": lambda x: torch.clamp_max(x, 2.5),
    "min_dim": lambda x: x.min(-1)[0],
}

# The lowering table's ops (ATen names) and the case above that feeds each an integer; the others
# compute no floats of their own (views, copies, casts, constants, comparisons, logic, indexing,
# dropout, joins).
CASE_OF = {"native_layer_norm": "layer_norm", "native_group_norm": "group_norm",
           "_native_batch_norm_legit": "batch_norm", "_native_batch_norm_legit_no_training": "batch_norm",
           "cross_entropy_loss": "cross_entropy", "nll_loss_nd": "nll_loss", "nll_loss2d": "nll_loss",
           "nll_loss_forward": "nll_loss", "nll_loss2d_forward": "nll_loss", "linalg_vector_norm": "vector_norm",
           "mul": "mul_float", "add": "add_float", "sub": "sub_float", "maximum": "maximum_float",
           "minimum": "minimum_float", "where": "where_float", "pow": "pow_half", "clamp_min": "clamp_min_float",
           "clamp_max": "clamp_max_float", "max": "max_dim", "min": "min_dim"}
NOT_FLOAT = {"_unsafe_view", "alias", "alias_copy", "broadcast_to", "chunk", "expand", "expand_as", "expand_copy",
             "flatten", "narrow", "permute", "permute_copy", "reshape", "reshape_as", "select", "select_copy", "slice",
             "slice_copy", "split", "split_copy", "split_with_sizes", "split_with_sizes_copy", "squeeze", "swapaxes",
             "t", "transpose", "transpose_copy", "unbind", "unbind_copy", "unflatten", "unsqueeze", "view", "view_as",
             "view_copy", "clone", "contiguous", "copy", "detach", "detach_copy", "lift_fresh_copy", "_to_copy", "to",
             "type_as", "empty", "empty_like", "fill", "full", "full_like", "new_empty", "new_full", "new_ones",
             "new_zeros", "ones", "ones_like", "scalar_tensor", "zeros", "zeros_like", "eq", "ne", "lt", "le", "gt",
             "ge", "logical_and", "logical_or", "logical_not", "bitwise_and", "bitwise_or", "bitwise_not", "__and__",
             "__or__", "gather", "index_select", "embedding", "cat", "stack", "dropout", "alpha_dropout",
             "feature_dropout", "feature_alpha_dropout", "native_dropout",
             # data movement (T5 scatters into integer ids); products lower for float operands only
             # (optimize(gemm=True)): an integer product stays torch's own call
             "select_scatter", "slice_scatter", "mm", "bmm", "addmm", "baddbmm", "matmul"}


class Fn(nn.Module):
    def __init__(self, *fns):
        super().__init__()
        self.fns = fns

    def forward(self, x):
        outs = tuple(f(x) for f in self.fns)
        return outs[0] if len(outs) == 1 else outs


def optimize(model, x):
    return kbench.optimize(model, (x,), backend="interp", budget="none")


def same(got, want):
    if isinstance(want, torch.Tensor):
        return isinstance(got, torch.Tensor) and got.dtype == want.dtype and got.shape == want.shape \
            and torch.allclose(got.double(), want.double(), rtol=1e-5, atol=1e-6, equal_nan=True)
    return type(got) is type(want) and len(got) == len(want) and all(same(g, w) for g, w in zip(got, want))


def test_the_table_has_every_float_lowering():
    names = {op._schema.name.split("::")[-1] for op in LOWER}
    missing = sorted(n for n in names - NOT_FLOAT if CASE_OF.get(n, n) not in FLOAT_OPS)
    assert not missing, f"lowerings with no integer-input case in FLOAT_OPS: {missing}"


def test_integer_input_into_every_float_op_is_eager():
    x = torch.arange(-4, 8).reshape(3, 4)
    computes, raises = {}, {}
    for name, f in FLOAT_OPS.items():
        try:
            computes[name] = f(x.clone())
        except Exception as e:  # noqa: BLE001 - eager's answer, whatever it is
            raises[name] = type(e)
    # the table has both kinds, and the ops the attack named among those eager rejects
    assert {"softmax", "log_softmax", "gelu", "silu", "layer_norm", "mean"} <= raises.keys()
    assert {"exp", "log", "sigmoid", "div", "relu", "sum"} <= computes.keys()

    names = list(computes)   # the ops eager computes: one module, one capture
    got = optimize(Fn(*(FLOAT_OPS[n] for n in names)), x.clone())(x.clone())
    wrong = [n for n, g in zip(names, got) if not same(g, computes[n])]
    assert not wrong, f"kbench's values differ from eager's for {wrong}"

    for name, kind in raises.items():   # the ops eager rejects: at optimize time, eager's type
        with pytest.raises(Exception) as e:
            optimize(Fn(FLOAT_OPS[name]), x.clone())
        assert type(e.value) is kind, f"{name}: eager raises {kind.__name__}, kbench {e.value!r}"
        assert not isinstance(e.value, CaptureError)


def test_optimize_time_error_names_the_op():
    x = torch.arange(12).reshape(3, 4)
    with pytest.raises(NotImplementedError, match=r"aten.softmax.int \(softmax\) on int64\[3, 4\].*not implemented "
                                                  r"for 'Long'"):
        optimize(Fn(FLOAT_OPS["softmax"]), x)


def test_call_time_error_is_eager_s():
    """Captured with float inputs, called with integers: the guard sends the call to eager, and
    eager's exception reaches the caller."""
    x = torch.randn(3, 4)
    for name in ("softmax", "gelu", "layer_norm", "mean"):
        m = Fn(FLOAT_OPS[name])
        opt = optimize(m, x)
        assert same(opt(x), m(x))
        xi = torch.arange(12).reshape(3, 4)
        with pytest.raises(Exception) as want:
            m(xi)
        with pytest.raises(type(want.value), match=re.escape(str(want.value).splitlines()[0])):
            opt(xi)


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")   # eager's RMSNorm
def test_mixed_dtype_norms_are_eager_s():
    x = torch.randn(3, 4)
    ln = nn.LayerNorm(4).double()   # float64 weight, float32 input: eager raises
    with pytest.raises(RuntimeError, match="mixed dtype"):
        ln(x)
    with pytest.raises(RuntimeError, match="aten.layer_norm.default .*float64.*mixed dtype"):
        optimize(ln, x)
    for norm in (nn.GroupNorm(2, 4), nn.BatchNorm1d(4).eval(), nn.LayerNorm(4).half(), nn.RMSNorm(4)):
        norm = norm.double() if norm.weight.dtype == torch.float32 else norm
        try:
            want = norm(x)
        except RuntimeError:
            with pytest.raises(RuntimeError, match="mixed dtype"):
                optimize(norm, x)
        else:   # RMSNorm's float64 weight on float32 input: eager computes it
            assert same(optimize(norm, x)(x), want)

    ln = nn.LayerNorm(4)
    opt = optimize(ln, x)
    ln.double()   # the parameters become float64 after capture: the call runs in eager, which raises
    with pytest.raises(RuntimeError, match="mixed dtype"):
        opt(x)
    ln.float()
    assert same(opt(x), ln(x))

    bf = nn.LayerNorm(4)   # bfloat16 input with float32 parameters: eager's CPU kernel takes it
    xb = x.bfloat16()
    assert same(optimize(bf, xb)(xb), bf(xb))


EMPTY_OPS = {"softmax": lambda x: torch.softmax(x, -1), "sum": lambda x: x.sum(-1), "mean": lambda x: x.mean(-1),
             "amax": lambda x: x.amax(-1), "log_softmax_tanh": lambda x: torch.log_softmax(x.tanh(), -1) * 2}


def test_empty_dims_are_eager_s():
    """A size-0 batch or reduced dim, in the example or at a call: eager's results (empty, a sum of
    0, a mean of nan) or eager's exception (max over an empty dim)."""
    full = torch.randn(3, 4)
    for name, f in EMPTY_OPS.items():
        m = Fn(f)
        opt = optimize(m, full)
        for shape in ((3, 0), (0, 4)):
            x = torch.randn(shape)
            try:
                want = m(x)
            except IndexError:
                with pytest.raises(IndexError):          # called with an empty dim
                    opt(x)
                with pytest.raises(IndexError, match="amax"):   # or given one as the example
                    optimize(m, x)
                continue
            assert same(opt(x), want), (name, shape)
            empty = optimize(m, x)
            assert isinstance(empty, EagerModule) and "size-0" in empty.kbench_report.notes[0]
            assert same(empty(x), want) and same(empty(full), m(full)), (name, shape)
    assert torch.equal(optimize(Fn(EMPTY_OPS["sum"]), full)(torch.randn(3, 0)), torch.zeros(3))
    assert all(math.isnan(v) for v in optimize(Fn(EMPTY_OPS["mean"]), full)(torch.randn(3, 0)).tolist())


class EmptyConstantForTorch(torch.nn.Module):
    """An empty constant the forward makes and only torch reads (Hugging Face's attention passes
    one to its mask code): the rest of the model is still kbench's."""

    def forward(self, x):
        idx = torch.bucketize(x, torch.tensor([], dtype=x.dtype))
        return torch.relu(x) * 2 + idx


def test_an_empty_constant_only_torch_reads_keeps_the_capture():
    m, x = EmptyConstantForTorch(), torch.randn(4, 8)
    opt = optimize(m, x)
    assert not isinstance(opt, EagerModule), opt.kbench_report
    assert same(opt(x), m(x))
