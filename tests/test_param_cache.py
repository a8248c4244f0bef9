"""Values computed from parameters alone, once per parameter version (kbench/runtime/param_cache.py),
on the CPU (interp backend): autocast's weight casts made explicit at capture, a tiny GPT-2 whose
second call casts no parameter, and every change of a parameter that must compute them again (an
update in place, load_state_dict, a replaced Parameter, a .data swap, a call that records
history), the memory bound, the keys themselves. The CUDA-graph runner's part: test_cuda_graphs.py;
the C++ Program's: test_fast_program.py; on a GPU: tests/gpu/test_param_cache_gpu.py."""
import copy
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import kbench
from kbench.runtime import fast, param_cache

sys.path.insert(0, str(Path(__file__).parent))
from models.zoo import BY_NAME  # noqa: E402

BF16 = dict(device_type="cpu", dtype=torch.bfloat16)


class Casts(TorchDispatchMode):
    """Counts the casts torch runs whose input is one of `params` (their storage)."""

    def __init__(self, params):
        super().__init__()
        self.ptrs = {p.untyped_storage().data_ptr() for p in params}
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten._to_copy.default, torch.ops.aten.to.dtype) and isinstance(args[0], torch.Tensor) \
                and args[0].untyped_storage().data_ptr() in self.ptrs:
            self.count += 1
        return func(*args, **(kwargs or {}))


def casts_in(module, call):
    with Casts(list(module.parameters())) as c:
        out = call()
    return out, c.count


class Net(torch.nn.Module):
    """Two Linears: the first a torch.linear call and an IR bias add, the second one extern call
    (its bias stays in the GEMM): autocast casts three weights and a bias."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(16, 32)
        self.b = torch.nn.Linear(32, 8)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def optimized(model, *inputs):
    with torch.autocast(**BF16), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return kbench.optimize(model, inputs, backend="interp", budget="none", verbose=False)


def eager(model, *inputs):
    """Eager under an autocast of its own (autocast's own cache lives as long as its region)."""
    with torch.autocast(**BF16), torch.no_grad():
        return model(*inputs)


def run(opt, *inputs, grad=False):
    with torch.autocast(**BF16), torch.set_grad_enabled(grad):
        return opt(*inputs)


def uncached(opt, *inputs):
    """kbench's path computing everything from the parameters as they are (the cache's reference,
    bit for bit; eager differs in bf16 rounding: a bias added after the product)."""
    bound = next(iter(opt._kbench_sigs.values()))
    with torch.autocast(**BF16), torch.no_grad():
        return opt._run(bound, inputs, cached=False)


def close(got, want):
    return (got.float() - want.float()).abs().max() <= 2e-2 * want.float().abs().max()


@pytest.fixture
def net():
    torch.manual_seed(0)
    model = Net().eval()
    x = torch.randn(4, 16)
    return model, optimized(model, x), x


def test_the_capture_casts_operands_where_autocast_would():
    """Under autocast, a Linear's weight, bias and input are cast in the IR (the parameters' casts
    a value of their own, read by the torch call; the activation's joins the kernel that makes
    it); without autocast nothing is cast."""
    torch.manual_seed(0)
    model, x = Net().eval(), torch.randn(4, 16)
    graph = optimized(model, x)._kbench_captured.graph
    inputs = {graph.node(v)["name"]: v for v in graph.inputs}
    cast_of = {graph.node(i)["inputs"][0] for i in range(graph.num_nodes) if graph.node(i)["op"] == "cast"
               and graph.node(i)["dtype"] == "bf16"}
    assert {inputs[n] for n in ("a.weight", "b.weight", "b.bias", "x")} <= cast_of
    plain = kbench.optimize(Net().eval(), (x,), backend="interp", budget="none", verbose=False)
    g = plain._kbench_captured.graph
    assert not [i for i in range(g.num_nodes) if g.node(i)["op"] == "cast"]


def test_gpt2_second_call_casts_no_parameter():
    """HF GPT-2 (the zoo's tiny config) under bf16 autocast and no_grad: the first call casts
    every weight, the second none (only activations, which autocast casts inside the calls), with
    eager's output and the uncached path's bits; after an update in place, the updated weight
    alone is cast again, and the output is eager's again."""
    entry = BY_NAME["gpt2"]
    torch.manual_seed(0)
    model = entry.make("tiny").eval()
    twin = copy.deepcopy(model)
    (ids,), _ = entry.call("tiny", torch.Generator().manual_seed(1), "cpu")
    opt = optimized(model, ids)
    out, first = casts_in(model, lambda: run(opt, ids))
    assert first >= 17      # 4 Linears a block (weight and bias), 2 blocks, the tied LM head
    out, second = casts_in(model, lambda: run(opt, ids))
    assert second == 0
    want = eager(twin, ids).logits
    assert (out.logits.float() - want.float()).abs().max() <= 1e-2 * want.float().abs().max()
    bound = next(iter(opt._kbench_sigs.values()))
    with torch.autocast(**BF16), torch.no_grad():
        assert torch.equal(opt._run(bound, (ids,), cached=False).logits, out.logits)
    with torch.no_grad():
        for m in (model, twin):
            m.transformer.h[1].mlp.c_fc.weight.mul_(1.5)
    out, again = casts_in(model, lambda: run(opt, ids))
    assert again == 2       # the weight's step casts its bias with it
    want = eager(twin, ids).logits
    assert (out.logits.float() - want.float()).abs().max() <= 1e-2 * want.float().abs().max()
    with torch.autocast(**BF16), torch.no_grad():
        assert torch.equal(opt._run(bound, (ids,), cached=False).logits, out.logits)
    line = [n for n in opt.kbench_report.notes if n.startswith("parameter cache:")]
    assert line and "recomputed after a change" in line[0] and "pinned" in line[0]


def test_an_update_in_place_load_state_dict_and_a_replaced_parameter(net):
    model, opt, x = net
    assert close(run(opt, x), eager(model, x))
    _, n = casts_in(model, lambda: run(opt, x))
    assert n == 0
    with torch.no_grad():
        model.a.weight.add_(0.5)                                   # an optimizer's step, in place
    got, n = casts_in(model, lambda: run(opt, x))
    assert n == 1 and torch.equal(got, uncached(opt, x)) and close(got, eager(model, x))
    state = {k: v + 1 for k, v in model.state_dict().items()}
    model.load_state_dict(state)                                   # copy_ into each tensor
    got = run(opt, x)
    assert torch.equal(got, uncached(opt, x)) and close(got, eager(model, x))
    model.b.weight = torch.nn.Parameter(torch.randn(8, 32))        # a Parameter replaced
    got, n = casts_in(model, lambda: run(opt, x))
    assert n == 2 and torch.equal(got, uncached(opt, x))           # its step: weight and bias
    assert close(got, eager(model, x))
    _, n = casts_in(model, lambda: run(opt, x))
    assert n == 0


def test_a_data_swap_and_a_round_trip_through_half(net):
    """.to() and .half() swap each parameter's storage under the same object, with the same version
    counter: the key holds the storage too, so even a new storage at the old address is seen."""
    model, opt, x = net
    run(opt, x)
    model.a.weight.data = model.a.weight.data * 2
    assert torch.equal(run(opt, x), uncached(opt, x))
    model.half()
    model.float()
    assert torch.equal(run(opt, x), uncached(opt, x))


def test_a_call_that_records_history_computes_them_itself(net):
    """A call in grad mode with parameters that require grad computes the casts (autograd sees them
    and the gradients are eager's); the next call without history reads the cache again, and an
    optimizer's step in between is seen."""
    model, opt, x = net
    twin = copy.deepcopy(model)
    run(opt, x)
    with Casts(list(model.parameters())) as c:
        y = run(opt, x, grad=True)
    assert c.count == 3 and y.grad_fn is not None
    with torch.autocast(**BF16):
        want = twin(x)
    y.float().sum().backward()
    want.float().sum().backward()
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-2, atol=1e-2)
    for m in (model, twin):
        torch.optim.SGD(m.parameters(), lr=0.1).step()
    got, n = casts_in(model, lambda: run(opt, x))
    assert n == 3 and torch.equal(got, uncached(opt, x)) and close(got, eager(twin, x))
    _, n = casts_in(model, lambda: run(opt, x))
    assert n == 0


def test_inference_mode_then_no_grad(net):
    """Values made in a call under inference mode are normal tensors: a later call outside it
    recomputes them in place."""
    model, opt, x = net
    with torch.inference_mode(), torch.autocast(**BF16):
        opt(x)
    with torch.no_grad():
        model.a.weight.mul_(2)
    assert torch.equal(run(opt, x), uncached(opt, x))


def test_writes_the_version_counter_misses_need_kbench_refresh(net):
    """p.data.copy_() writes through a tensor with a version counter of its own: not seen until
    kbench_refresh() says so."""
    model, opt, x = net
    run(opt, x)
    model.a.weight.data.copy_(torch.randn(32, 16))
    opt.kbench_refresh()
    assert torch.equal(run(opt, x), uncached(opt, x))


def test_past_the_memory_bound_values_are_computed_per_call(monkeypatch):
    monkeypatch.setattr(param_cache, "memory_bound", lambda param_bytes: param_bytes // 4)
    torch.manual_seed(0)
    model, x = Net().eval(), torch.randn(4, 16)
    opt = optimized(model, x)       # a quarter of the parameters' bytes: b's casts fit, a.weight's not
    run(opt, x)
    got, n = casts_in(model, lambda: run(opt, x))
    assert n == 1 and torch.equal(got, uncached(opt, x))
    cache = opt._kbench_pcache
    assert cache.over == 1 and 0 < cache.reserved <= cache.limit
    assert any("not cached (past the bound" in n for n in opt.kbench_report.notes)


@pytest.mark.parametrize("native", [True, False])
def test_keys(native):
    """What moves a key: an update in place, a .data swap, another layout of the same storage, a
    replaced tensor, forget(); not a write through .data. An inference tensor always moves."""
    if native and getattr(fast.module(), "TensorKeys", None) is None:
        pytest.skip("kbench._fast is not built")
    keys = fast.module().TensorKeys(3) if native else param_cache.ParamKeys(3)
    a, b, c = torch.nn.Parameter(torch.ones(3)), torch.zeros(2, 2), torch.ones(4)
    assert keys.observe([a, b, c]) and keys.epoch == 1 and tuple(keys.changed_at) == (1, 1, 1)
    assert not keys.observe([a, b, c])
    with torch.no_grad():
        a.add_(1)
    assert keys.observe([a, b, c]) and tuple(keys.changed_at) == (2, 1, 1)
    a.data.copy_(torch.zeros(3))
    assert not keys.observe([a, b, c])
    a.data = torch.zeros(3)
    assert keys.observe([a, b, c]) and tuple(keys.changed_at) == (3, 1, 1)
    b.data = b.data.t()
    assert keys.observe([a, b, c]) and tuple(keys.changed_at) == (3, 4, 1)
    assert keys.observe([a, b, torch.ones(4)]) and tuple(keys.changed_at) == (3, 4, 5)
    keys.forget()
    assert keys.observe([a, b, c]) and tuple(keys.changed_at) == (6, 6, 6)
    with torch.inference_mode():
        d = torch.ones(4)
    assert keys.observe([a, b, d]) and keys.observe([a, b, d])


class Diagonal(torch.nn.Module):
    """w * 2 read by a product and by torch's diagonal (a view): the product's operand is cached, and
    the output that is a view of it is returned as a copy of its own."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 6))

    def forward(self, x):
        w2 = self.w * 2
        return torch.mm(x, w2), w2.diagonal()


def test_an_output_that_is_a_view_of_a_cached_value_is_a_copy():
    torch.manual_seed(0)
    model, x = Diagonal(), torch.randn(4, 8)
    opt = kbench.optimize(model, (x,), backend="interp", budget="none", verbose=False)
    with torch.no_grad():
        _, first = opt(x)
        first.fill_(7.0)                    # the caller's tensor: the cache's value stays
        got, again = opt(x)
    bound = next(iter(opt._kbench_sigs.values()))
    assert bound.cache.clone and again._base is None
    assert torch.equal(again, (model.w * 2).diagonal()) and torch.equal(got, x @ (model.w * 2))


def test_a_padded_lm_head_casts_its_weight_once_and_returns_its_logits_uncopied(monkeypatch):
    """A 16-bit Linear with unaligned rows runs on its weight padded with zero rows (capture's
    gemm_row_padding): the weight's cast is cached (before the padding), and the logits, a slice
    of the padded call's own result, are returned as they are (no copy for the cache's sake)."""
    from kbench.capture import ops_matmul
    monkeypatch.setattr(ops_matmul, "PAD_GEMM_MIN_MACS", 1)
    torch.manual_seed(0)
    model, x = torch.nn.Linear(16, 1001, bias=False), torch.randn(6, 16)
    opt = optimized(model, x)
    assert any(fn is torch.ops.aten.constant_pad_nd.default
               for e in opt._kbench_captured.externs for fn, _, _ in e.steps)
    run(opt, x)
    got, n = casts_in(model, lambda: run(opt, x))
    bound = next(iter(opt._kbench_sigs.values()))
    assert n == 0 and bound.cache.clone == [] and torch.equal(got, uncached(opt, x))
    assert close(got, eager(model, x))
