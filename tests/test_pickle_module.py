"""An optimized module pickles, deep-copies and goes through torch.save / torch.load: it carries the
original module, the example call and the options, and is optimized again when loaded (from the
capture cache: no export). A copy has parameters of its own, gives the same outputs and trains on
its own."""
import copy
import io
import pickle

import pytest
import torch
import torch.nn as nn

import kbench
from kbench.runtime.interp import InterpExecutor
from kbench.runtime.module import OptimizedModule


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.ln = nn.LayerNorm(8)
        self.scale = 0.5

    def forward(self, x):
        return torch.relu(self.ln(self.lin(x))) * self.scale


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KBENCH_CACHE_DIR", str(tmp_path))
    return tmp_path


def _made():
    torch.manual_seed(0)
    model = Net()
    x = torch.randn(4, 8)
    return model, kbench.optimize(model, (x,), backend="interp"), x


def _own_copy(a, b):
    """b is a kbench module like a, over a model of its own: equal parameters, none shared."""
    assert isinstance(b, OptimizedModule) and b._kbench_orig is not a._kbench_orig
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for k in pa:
        assert torch.equal(pa[k], pb[k]) and pa[k].data_ptr() != pb[k].data_ptr()
    assert b._kbench_orig.scale == a._kbench_orig.scale


@pytest.mark.parametrize("how", ["pickle", "deepcopy", "torch.save"])
def test_round_trip(how, cache_dir, exports):
    model, opt, x = _made()
    assert len(exports) == 1
    if how == "pickle":
        again = pickle.loads(pickle.dumps(opt))
    elif how == "deepcopy":
        again = copy.deepcopy(opt)
    else:
        buf = io.BytesIO()
        torch.save(opt, buf)
        buf.seek(0)
        again = torch.load(buf, weights_only=False)
    _own_copy(opt, again)
    assert len(exports) == 1     # optimized again from the capture cache
    y = torch.randn(6, 8)
    assert torch.allclose(again(y), opt(y), atol=1e-6) and torch.allclose(again(y), model(y), atol=1e-6)
    assert again.kbench_report.kernels == opt.kbench_report.kernels


def test_a_copy_trains_on_its_own(cache_dir):
    model, opt, x = _made()
    twin = copy.deepcopy(opt)
    before = {k: p.detach().clone() for k, p in opt.named_parameters()}
    step = torch.optim.SGD(twin.parameters(), lr=0.1)
    twin(torch.randn(4, 8)).pow(2).sum().backward()
    step.step()
    for k, p in opt.named_parameters():           # the original did not move
        assert torch.equal(p, before[k]) and p.grad is None
    assert any(not torch.equal(p, before[k]) for k, p in twin.named_parameters())
    y = torch.randn(4, 8)
    assert torch.allclose(twin(y), twin._kbench_orig(y), atol=1e-6)   # the copy runs its own parameters
    assert torch.allclose(opt(y), model(y), atol=1e-6) and not torch.allclose(twin(y), opt(y))


def test_a_lazy_module_and_an_eager_one_pickle(cache_dir):
    torch.manual_seed(0)
    lazy = kbench.optimize(Net(), backend="interp")
    x = torch.randn(4, 8)
    want = lazy(x)
    again = pickle.loads(pickle.dumps(lazy))
    assert torch.allclose(again(x), want, atol=1e-6)
    assert again._kbench_impl._kbench_orig is again._kbench_orig      # still one model, shared


def test_a_module_not_made_by_optimize_says_why():
    from kbench.capture import capture
    model, x = Net(), torch.randn(4, 8)
    bare = OptimizedModule(model, capture(model, (x,)), InterpExecutor(), torch.device("cpu"))
    with pytest.raises(TypeError, match="not made by kbench.optimize"):
        pickle.dumps(bare)
