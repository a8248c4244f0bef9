"""The cuda backend's capture runs torch.export once: the row lengths it pins are pinned
on the first capture's export (capture.repin), not by exporting the model again, and the result is
the capture that a second export with those dims static gives. Pure capture logic: runs on the CPU."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from kbench import api
from kbench.capture import capture, capture_exported, repin
from kbench.runtime.interp import InterpExecutor
from kbench.runtime.module import OptimizedModule

from models import BY_NAME


class Fn(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *xs):
        return self.fn(*xs)


CASES = {
    "softmax_last": lambda: (BY_NAME["softmax_last"].make(), BY_NAME["softmax_last"].inputs()),
    "cross_entropy_mean": lambda: (BY_NAME["cross_entropy_mean"].make(), BY_NAME["cross_entropy_mean"].inputs()),
    # guards that pinning makes trivially true (Min(5, 5*s) == 5) are dropped, as a static export drops them
    "views": lambda: (BY_NAME["views"].make(), BY_NAME["views"].inputs()),
    # the pinned symbol is shared by two inputs (broadcasting unifies them)
    "bcast_softmax": lambda: (Fn(lambda x, y: torch.softmax(x + y, -1)), (torch.randn(3, 7), torch.randn(7))),
    # a pinned row length inside a product of symbols (logits.view(-1, V) against targets.view(-1))
    "ce_flat": lambda: (Fn(lambda lg, t: F.cross_entropy(lg.reshape(-1, lg.shape[-1]), t.reshape(-1))),
                        (torch.randn(2, 3, 11), torch.randint(0, 11, (2, 3)))),
    # a size the IR cannot write (s0 - 1) fixes dims: lowered again with them pinned, not re-exported
    "slice_softmax": lambda: (Fn(lambda x: torch.softmax(x[:, 1:], -1) * 2), (torch.randn(4, 5, 7),)),
}
EXPORTS = {}   # every case: one export


def describe(c):
    return dict(graph=str(c.graph), input_syms=c.input_syms, static_reason=c.static_reason,
                guards=sorted(str(g.expr) for g in c.guards), notes=c.notes, param_names=c.param_names,
                externs=[repr(e) for e in c.externs], example_symvals=c.example_symvals,
                symbol_sources=c.symbol_sources, value_names=c.value_names, input_kinds=c.input_kinds,
                mutations=c.mutations, leaves=repr(c.output_tree.leaves))


@pytest.mark.parametrize("name", sorted(CASES))
def test_pinned_capture_exports_once_and_matches_a_second_export(name, exports):
    torch.manual_seed(0)
    model, args = CASES[name]()
    captured, exported = capture_exported(model, args)
    pin = api.row_length_dims(captured)
    assert pin, "the case must pin a row length"
    pinned = api._pin_row_lengths(model, args, captured, exported)
    assert len(exports) == EXPORTS.get(name, 1)
    for i, d in pin:
        assert pinned.input_syms[i][d] is None
    assert "row lengths pinned" in pinned.static_reason or "not expressible" in pinned.static_reason
    exports.clear()
    again = api._pin_row_lengths(model, args, capture(model, args))   # the old way: export again
    assert len(exports) >= 2
    assert describe(pinned) == describe(again)


def test_unpinned_capture_is_the_plain_capture(exports):
    model, args = BY_NAME["layernorm"].make(), BY_NAME["layernorm"].inputs()
    captured, exported = capture_exported(model, args)
    assert not api.row_length_dims(captured)
    assert api._pin_row_lengths(model, args, captured, exported) is captured
    assert len(exports) == 1
    assert describe(captured) == describe(capture(model, args))
    with pytest.raises(ValueError):
        repin(exported, ())


def test_pinned_capture_runs_and_guards_the_row_length(exports):
    torch.manual_seed(0)
    model, args = CASES["softmax_last"]()
    captured, exported = capture_exported(model, args)
    pinned = api._pin_row_lengths(model, args, captured, exported)
    del exported
    assert len(exports) == 1
    om = OptimizedModule(model, pinned, InterpExecutor(), torch.device("cpu"))
    with torch.no_grad():
        for x in (args[0], torch.randn(4, 6, args[0].shape[-1])):       # batch sizes still vary
            torch.testing.assert_close(om(x), model(x))
        assert not om._kbench_reasons
        other = torch.randn(3, 5, args[0].shape[-1] + 2)                 # another row length: eager
        torch.testing.assert_close(om(other), model(other))
    assert om._kbench_reasons


def test_optimize_interp_exports_once(exports, monkeypatch, tmp_path):
    monkeypatch.setenv("KBENCH_CACHE_DIR", str(tmp_path))   # a cold cache: no stored capture to reuse
    model, args = CASES["softmax_last"]()
    import kbench
    kbench.optimize(model, args, backend="interp", verbose=False)
    assert len(exports) == 1


class Chunk3(torch.nn.Module):
    def forward(self, x):
        a, b, c = x.chunk(3, dim=-1)
        return F.silu(a) * b + torch.tanh(c)


class ShiftedLoss(torch.nn.Module):
    """A causal LM's loss: logits[:, :-1] against labels[:, 1:] (sizes s - 1)."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 11)

    def forward(self, h, labels):
        logits = self.proj(h)[:, :-1]
        return F.cross_entropy(logits.reshape(-1, 11), labels[:, 1:].reshape(-1))


NEED_STATIC = {
    "chunk3": lambda: (Chunk3(), (torch.randn(3, 12),)),
    "shifted_loss": lambda: (ShiftedLoss(), (torch.randn(2, 9, 8), torch.randint(0, 11, (2, 9)))),
    "slice_softmax": CASES["slice_softmax"],
}


@pytest.mark.parametrize("name", sorted(NEED_STATIC))
def test_a_size_the_ir_cannot_write_is_pinned_without_a_second_export(name, exports):
    """A size like s - 1 or s // 3 fixes the input dims it comes from: the same export is lowered
    again with them pinned, which must give what an export with them static gives."""
    torch.manual_seed(0)
    model, args = NEED_STATIC[name]()
    captured, exported = capture_exported(model, args)
    assert len(exports) == 1 and exported.fixed and exported.pinned == exported.fixed
    static = capture(model, args, pin=sorted(exported.fixed))
    want, got = describe(static), describe(captured)
    for key in ("static_reason", "value_names"):   # FX's node names differ between two exports
        want.pop(key), got.pop(key)
    assert got == want
