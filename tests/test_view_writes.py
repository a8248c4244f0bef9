"""Writes into views of a fresh value (y = x.new_zeros(...); y[..., 1:] = ...; y[..., 0] = c): capture
rewrites them to functional ops (slice_scatter / select_scatter, nested for a chain of views), which
lower to selects on the coordinate; the optimized module's outputs and gradients are eager's on
the interp backend, with no region left to eager. Writes whose aliasing capture cannot follow (a
view taken before a write and read after it, a view op it does not know) are refused and take
torch's functionalization, still giving eager's answer. And Hugging Face T5, whose _shift_right is
such a pattern, trains as eager."""
import copy
import warnings

import pytest
import torch
import torch.nn as nn

import kbench
from kbench.capture import export as capture_export

aten = torch.ops.aten


class SliceWrite(nn.Module):       # a float slice of a new_zeros base, then the base read
    def forward(self, x):
        y = x.new_zeros(x.shape)
        y[:, 1:] = x[:, :-1] * 2
        return y * x


class SelectWrite(nn.Module):      # a column of a clone overwritten by a value that needs grad
    def forward(self, x):
        y = x.clone()
        y[:, 2] = x[:, 0] * 3
        return y.exp()


class Chain(nn.Module):            # select -> slice -> select, and a write through a view()
    def forward(self, x):
        y = torch.zeros_like(x)
        y[0][2:][:, 1] = x[0, 2:, 0] + 1
        y.view(-1)[0] = 5.0
        return y + x


class ShiftRight(nn.Module):       # T5's _shift_right: integer ids shifted, the start set, then masked_fill_
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 4)

    def forward(self, ids, x):
        shifted = ids.new_zeros(ids.shape)
        shifted[..., 1:] = ids[..., :-1].clone()
        shifted[..., 0] = 3
        shifted.masked_fill_(shifted == -100, 0)
        return self.emb(shifted) * x


class EmptyBase(nn.Module):        # an empty base filled piecewise, written again after reading
    def forward(self, x):
        y = torch.empty_like(x)
        y[:, :1] = x[:, :1].sin()
        y[:, 1:] = x[:, 1:] * 2
        s = y.sum(1, keepdim=True)
        y.mul_(2)
        y[:, -1] = 0.0
        return y + s


def _ids():
    ids = torch.randint(0, 16, (2, 6), generator=torch.Generator().manual_seed(1))
    ids[0, 2] = -100
    return ids


CASES = {
    "slice": (SliceWrite, lambda: (torch.randn(3, 5, requires_grad=True),)),
    "select": (SelectWrite, lambda: (torch.randn(3, 5, requires_grad=True),)),
    "chain": (Chain, lambda: (torch.randn(3, 5, 4, requires_grad=True),)),
    "shift_right": (ShiftRight, lambda: (_ids(), torch.randn(2, 6, 4, requires_grad=True))),
    "empty_base": (EmptyBase, lambda: (torch.randn(3, 5, requires_grad=True),)),
}


def _optimize(model, args):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return kbench.optimize(model, args, backend="interp", verbose=False, strict=True)


def _run(module, args):
    args = [a.detach().clone().requires_grad_(a.requires_grad) for a in args]
    out = module(*args)
    out.backward(torch.linspace(-1, 1, out.numel()).reshape(out.shape))
    grads = [a.grad for a in args if a.requires_grad] + [p.grad for p in module.parameters()]
    return out, grads


def _mutations(ep):
    return [n for n in ep.graph.nodes if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
            and n.target._schema.is_mutable]


@pytest.mark.parametrize("name", list(CASES))
def test_view_writes_become_functional(name):
    """The export's in-place ops are all rewritten by capture itself (run_decompositions is not
    needed), into scatters of the written views."""
    cls, make = CASES[name]
    ep = torch.export.export(cls(), make(), strict=False)
    assert _mutations(ep)
    assert capture_export._make_functional(ep)
    ep.graph_module.recompile()
    assert not _mutations(ep)
    targets = {n.target for n in ep.graph.nodes}
    assert targets & {aten.slice_scatter.default, aten.select_scatter.default}


@pytest.mark.parametrize("name", list(CASES))
def test_view_writes_match_eager(name):
    """Outputs and gradients (inputs and parameters) equal eager's; every region runs on kbench
    (no eager fallback) and only the float slices longer than one element are torch calls."""
    cls, make = CASES[name]
    torch.manual_seed(0)
    model, args = cls(), make()
    twin = copy.deepcopy(model)
    opt = _optimize(model, args)
    assert type(opt).__name__ == "OptimizedModule", opt.kbench_report
    got, got_grads = _run(opt, args)
    want, want_grads = _run(twin, args)
    assert not opt._kbench_reasons, opt._kbench_reasons
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    externs = [note for note in opt._kbench_captured.notes if "scatter" in note]
    if name in ("select", "shift_right"):
        assert not externs, externs    # a select write and an integer slice write are selects


class ViewReadAfterWrite(nn.Module):   # v aliases y: after the write it must read the new column
    def forward(self, x):
        y = x * 1
        v = y[:, 0]
        y[:, 0] = 7.0
        return v + y.sum(1)


class DiagonalWrite(nn.Module):        # a view op capture does not follow
    def forward(self, x):
        y = x + 1
        y.diagonal().fill_(0.5)
        return y * x


@pytest.mark.parametrize("cls", [ViewReadAfterWrite, DiagonalWrite])
def test_refused_view_writes_still_match_eager(cls):
    """Aliasing capture cannot follow is refused (the graph left as it was, for torch's
    functionalization), and the optimized module still answers as eager."""
    x = torch.randn(4, 4, requires_grad=True)
    ep = torch.export.export(cls(), (x,), strict=False)
    text = str(ep.graph)
    assert not capture_export._make_functional(ep)
    assert str(ep.graph) == text
    opt = _optimize(cls(), (x,))
    got, (gx,) = _run(opt, (x,))
    want, (wx,) = _run(cls(), (x,))
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(gx, wx)


def test_t5_training_step_matches_eager():
    """Hugging Face T5 (as benchmarks/arch_sweep.py builds it, smaller) shifts its labels right by
    writing into views of new_zeros: it is captured and a training step's loss and gradients are
    eager's."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.T5Config(d_model=32, d_ff=64, num_layers=1, num_decoder_layers=1, num_heads=2, d_kv=16,
                                vocab_size=64, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)
    model = transformers.T5ForConditionalGeneration(cfg).train()
    twin = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    ids, labels = torch.randint(0, 64, (2, 8), generator=g), torch.randint(0, 64, (2, 4), generator=g)
    labels[0, -1] = -100
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = kbench.optimize(model, (ids,), {"labels": labels}, backend="interp", verbose=False, strict=True)
    assert type(opt).__name__ == "OptimizedModule" and opt.kbench_report.kernels > 0, opt.kbench_report
    got, want = opt(ids, labels=labels).loss, twin(ids, labels=labels).loss
    got.backward()
    want.backward()
    assert not opt._kbench_reasons, opt._kbench_reasons
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for (n, p), q in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=n)


def test_view_write_kernels_compile(compile_once):
    """The regions the scatters lower to (iota, compares, where, gather) generate CUDA that NVRTC
    compiles."""
    from kbench import _C
    items = []
    for name in ("shift_right", "chain"):
        cls, make = CASES[name]
        p = capture_export.capture(cls(), make()).graph.partition()
        for r in range(len(p)):
            try:
                src = _C.generate(p, r, 90, None).source
            except Exception as e:   # noqa: BLE001 - an EXTERN region has no kernel
                assert "extern" in str(e).lower(), e
                continue
            items.append((src, "sm_90", (name, r)))
    assert any("iota" in src for src, _, _ in items)
    for (_, arch, what), cubin in zip(items, compile_once(items, together=True)):
        assert cubin[:4] == b"\x7fELF", what
