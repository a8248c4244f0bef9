"""Guards on the Python state a forward reads (kbench/capture/guards.py): an attribute, a config
value, a class constant or a global changed after optimize() is seen at the next call, which a
capture for the new state serves (matching eager), in process and through the capture cache; what
the forward did not read is not guarded; the checks in Python and in C++ (kbench._fast.Guards,
and Program declining on them) agree."""
import logging
import sys

import pytest
import torch
import torch.nn as nn

import kbench
from kbench.capture import guards
from kbench.runtime import fast as fastmod
from kbench.runtime import module as runtime_module

SHIFT = 1.0          # read by Shifted's forward through a helper
LIMIT = 100.0        # read by Clamped's forward: invisible on the example inputs below 50
FACTOR = 3.0         # read by Flags' forward as a module's attribute (_this.FACTOR)
_this = sys.modules[__name__]


def _add_shift(x):
    return x + SHIFT


class Cfg:
    def __init__(self):
        self.mult = 2.0


class Scaled(nn.Module):
    """Reads an attribute, a config's value and a global (through a helper); never reads .unused."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.scale = 2.0
        self.cfg = Cfg()
        self.unused = 1

    def forward(self, x):
        return _add_shift(torch.relu(self.lin(x)) * self.scale * self.cfg.mult)


class Clamped(nn.Module):
    FLOOR = -100.0   # a class constant, read as self.FLOOR

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x).clamp(min=self.FLOOR, max=LIMIT)


class Counting(nn.Module):
    """Changes the state it reads at every call: no capture of it would hold at the next one."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return x * self.calls


class Filling(nn.Module):
    """Fills in a config value at its first call (as a Hugging Face classifier sets problem_type)."""

    def __init__(self):
        super().__init__()
        self.cfg = Cfg()
        self.cfg.kind = None

    def forward(self, x):
        if self.cfg.kind is None:
            self.cfg.kind = "double"
        return x * 2 if self.cfg.kind == "double" else x


class Flags(nn.Module):
    """Branches on an attribute it may lack, and reads a value of a module it names."""

    def forward(self, x):
        extra = getattr(self, "extra", None)
        y = x * _this.FACTOR
        return y if extra is None else y + extra


class Branchy(nn.Module):
    """Under a flag, a branch on the values: torch.export cannot capture that state."""

    def __init__(self):
        super().__init__()
        self.by_value = False

    def forward(self, x):
        if self.by_value and x.sum() > 0:
            return x * 2
        return x + 1


def _close(a, b):
    return torch.allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KBENCH_CACHE_DIR", str(tmp_path))
    return tmp_path


def test_attribute_config_and_global_changes_are_seen(cache_dir, monkeypatch, caplog, exports):
    torch.manual_seed(0)
    model = Scaled().eval()
    x = torch.randn(4, 8)
    opt = kbench.optimize(model, (x,), backend="interp")
    assert _close(opt(x), model(x)) and len(exports) == 1
    native = fastmod.guards_type()
    assert native is None or isinstance(opt._kbench_state.native, native)
    with caplog.at_level(logging.WARNING, logger="kbench"):
        model.unused = 5                      # not read by the forward: no new capture
        assert _close(opt(x), model(x)) and len(exports) == 1
        model.scale = 5.0                     # on the original
        assert _close(opt(x), model(x))
        opt.scale = 3.0                       # through the wrapper: it is the original's attribute
        assert model.scale == 3.0 and _close(opt(x), model(x))
        model.cfg.mult = -1.0                 # a value of a plain object the module holds
        assert _close(opt(x), model(x))
        monkeypatch.setattr(_this, "SHIFT", 7.0)   # a global read by a helper the forward calls
        assert _close(opt(x), model(x))
    lines = [r.getMessage() for r in caplog.records if "capturing again" in r.getMessage()]
    assert len(lines) == 4 and "attribute scale changed (2.0 -> 5.0)" in lines[0], lines
    assert "cfg.mult" in lines[2] and "global SHIFT" in lines[3], lines
    # the state captured first is served by its own capture again, with no new one
    n = len(exports)
    model.scale, model.cfg.mult = 2.0, 2.0
    monkeypatch.setattr(_this, "SHIFT", 1.0)
    assert _close(opt(x), model(x)) and len(exports) == n
    assert "unused" not in {name for _, _, name, _ in opt._kbench_captured.python_state}
    notes = opt.kbench_report.notes
    assert any(n.startswith("python state: 6 values the forward read") for n in notes), notes
    assert sum(n.endswith("served by a capture of its own") and n.startswith("python state") for n in notes) == 4


def test_an_attribute_the_forward_lacked_and_a_modules_value(monkeypatch):
    model = Flags()
    x = torch.randn(3)
    opt = kbench.optimize(model, (x,), backend="interp", budget="none")
    assert torch.equal(opt(x), model(x))
    model.extra = 1.5                           # absent when captured: the branch taken changes
    assert torch.equal(opt(x), model(x))
    monkeypatch.setattr(_this, "FACTOR", -2.0)  # _this.FACTOR: a value of a module of the user's
    assert torch.equal(opt(x), model(x))
    assert len(opt._kbench_variants) == 2


def test_a_state_that_cannot_be_captured_runs_in_eager_and_is_not_tried_again(exports):
    model = Branchy()
    x = torch.ones(3)
    opt = kbench.optimize(model, (x,), backend="interp", budget="none")
    model.by_value = True
    assert torch.equal(opt(x), x * 2) and torch.equal(opt(-x), -x + 1)
    assert len(exports) >= 2 and len(opt._kbench_uncaptured) == 1
    n = len(exports)
    assert torch.equal(opt(x), x * 2) and len(exports) == n     # known: eager at once
    model.by_value = False
    assert torch.equal(opt(x), x + 1) and len(exports) == n     # the captured state again
    assert any("by_value changed since the capture, and the state as it is could not be captured" in r
               for r in opt._kbench_reasons)


def test_the_python_loop_checks_where_cpp_does_not(monkeypatch):
    monkeypatch.setattr(fastmod, "guards_type", lambda: None)   # KBENCH_FAST=0, or a build without it
    torch.manual_seed(0)
    model = Scaled().eval()
    x = torch.randn(4, 8)
    opt = kbench.optimize(model, (x,), backend="interp", budget="none")
    assert opt._kbench_state.native is None
    model.scale = -3.0
    assert _close(opt(x), model(x)) and len(opt._kbench_variants) == 1


def test_an_attribute_set_on_any_wrapper_is_the_originals():
    """optimize()'s wrappers (a module captured at its first call, one left in eager) set a plain
    attribute on the model, where its forward reads it."""
    model, x = Scaled().eval(), torch.randn(4, 8)
    eager = kbench.api.EagerModule(model, "a reason")
    eager.scale = 4.0
    assert model.scale == 4.0 and eager.scale == 4.0 and _close(eager(x), model(x))
    lazy = kbench.optimize(model, backend="interp")
    lazy.scale = 6.0
    assert model.scale == 6.0 and lazy.cfg is model.cfg
    model.train()
    lazy.training = False          # the wrapper's own state stays its own
    assert model.training and not lazy.training


def test_through_the_capture_cache(cache_dir, monkeypatch, exports):
    """A fresh optimize() after a global or a class constant changed does not reuse the stored capture
    of the old state, even where the example inputs cannot tell them apart (|x| < 50)."""
    torch.manual_seed(0)
    model = Clamped().eval()
    x = torch.randn(4, 8)
    big = torch.randn(4, 8) * 1000
    kbench.optimize(model, (x,), backend="interp")
    again = kbench.optimize(model, (x,), backend="interp")
    assert len(exports) == 1 and _close(again(big), model(big))        # the stored capture, used
    monkeypatch.setattr(_this, "LIMIT", 50.0)
    fresh = kbench.optimize(model, (x,), backend="interp")
    assert _close(fresh(big), model(big)) and fresh(big).max() == 50.0
    monkeypatch.setattr(Clamped, "FLOOR", -20.0)
    fresh = kbench.optimize(model, (x,), backend="interp")
    assert _close(fresh(big), model(big)) and fresh(big).min() == -20.0
    assert len(exports) == 3


def test_a_stored_capture_of_other_state_is_not_used(cache_dir, monkeypatch, exports):
    """The key misses on a changed global; where a key could not tell (a stored entry of another state
    under the same key), the capture's recorded state is checked before use."""
    torch.manual_seed(0)
    model = Clamped().eval()
    x = torch.randn(4, 8)
    kbench.optimize(model, (x,), backend="interp")
    monkeypatch.setattr(guards, "global_reads", lambda classes: {})   # a key blind to globals
    monkeypatch.setattr(_this, "LIMIT", 50.0)
    fresh = kbench.optimize(model, (x,), backend="interp")
    big = torch.randn(4, 8) * 1000
    assert _close(fresh(big), model(big))


def test_a_forward_that_changes_what_it_reads_runs_in_eager(exports):
    model = Counting()
    x = torch.randn(3)
    opt = kbench.optimize(model, (x,), backend="interp", budget="none")
    assert opt._kbench_original and "calls" in opt._kbench_original
    assert any("the model itself runs" in n and "calls" in n for n in opt.kbench_report.notes)
    before = model.calls
    assert torch.equal(opt(x), x * (before + 1)) and model.calls == before + 1
    assert len(exports) == 2     # captured once more, from the state the first run left: still changing


def test_state_filled_in_at_the_first_call_is_captured_as_it_is_left(exports):
    model = Filling()
    x = torch.randn(3)
    opt = kbench.optimize(model, (x,), backend="interp", budget="none")
    assert not opt._kbench_original and model.cfg.kind == "double" and len(exports) == 2
    assert torch.equal(opt(x), model(x))
    model.cfg.kind = "same"
    assert torch.equal(opt(x), x)


def test_captures_for_other_state_are_bounded(monkeypatch, caplog):
    monkeypatch.setattr(runtime_module, "MAX_VARIANTS", 1)
    torch.manual_seed(0)
    model = Scaled().eval()
    x = torch.randn(4, 8)
    opt = kbench.optimize(model, (x,), backend="interp", budget="none")
    model.scale = 3.0
    assert _close(opt(x), model(x)) and len(opt._kbench_variants) == 1
    with caplog.at_level(logging.WARNING, logger="kbench"):
        model.scale = 4.0
        assert _close(opt(x), model(x)) and len(opt._kbench_variants) == 1
    assert any("running in eager" in r.getMessage() and "attribute scale changed" in r.getMessage()
               for r in caplog.records)
    assert any("attribute scale" in n for n in opt.kbench_report.notes)


def _entries():
    class Obj:
        pass
    obj = Obj()
    obj.n, obj.xs = 3, [1, 2]
    table = {"flag": True, "mod": obj}
    entries = [(vars(obj), "n", 3, 0), (obj, "xs", [1, 2], guards.GETATTR), (table, "flag", True, 0),
               (table, "mod", obj, guards.IDENTITY), (vars(obj), "later", None, guards.ABSENT)]
    return obj, table, entries


@pytest.mark.parametrize("impl", ["native", "python"])
def test_the_checks_in_python_and_cpp_agree(impl):
    native = fastmod.guards_type()
    if impl == "native" and native is None:
        pytest.skip("kbench._fast.Guards is not built")
    obj, table, entries = _entries()
    check = native(tuple(entries)).check if impl == "native" else (lambda: guards.check(entries))
    assert check() == -1
    obj.xs.append(3)                    # a list changed in place: compared with the value read
    assert check() == 1
    obj.xs = [1, 2]                     # another list, equal: holds
    assert check() == -1
    obj.n = 3.0                         # equal but another type (it may trace otherwise)
    assert check() == 0
    obj.n = 3
    table["mod"] = Cfg()                # identity
    assert check() == 3
    table["mod"] = obj
    del table["flag"]                   # gone
    assert check() == 2
    table["flag"] = True
    obj.later = 0                       # absent when bound: set now
    assert check() == 4
    if impl == "native":
        with pytest.raises(TypeError):
            native(((table, 1, 1, 0),))         # a key must be a str
        with pytest.raises(TypeError):
            native(((table, "a", 1, 8),))       # how in 0..7


def test_the_cpp_program_declines_when_the_state_changed():
    ext = fastmod.module()
    if ext is None or not hasattr(ext, "Guards"):
        pytest.skip("kbench._fast.Guards is not built")
    import types
    net = nn.Linear(2, 2)
    net.scale = 2.0
    check = ext.Guards(((vars(net), "scale", 2.0, 0),))
    prog = ext.Program(orig=net, captured=types.SimpleNamespace(constants={}), ninputs=1, chains=[], meta=[],
                       training=net.training, grad_ok=True, apply_region=lambda *a: None, guards=check)
    x = torch.randn(2)
    assert prog.add((x,), [], [0], "one")
    assert prog.call(net, (x,)) is x
    net.scale = 3.0
    assert prog.call(net, (x,)) is NotImplemented and "Python state" in prog.why
    with pytest.raises(TypeError):
        ext.Program(orig=net, captured=None, ninputs=1, chains=[], meta=[], training=False, grad_ok=True,
                    apply_region=lambda *a: None, guards=[(vars(net), "scale", 2.0, 0)])
