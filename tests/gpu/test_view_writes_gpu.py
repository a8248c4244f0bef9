"""Writes into views of a fresh value on CUDA: capture rewrites them to slice_scatter /
select_scatter, which lower to selects on the coordinate (iota, compare, where, gather); those
regions run as generated, verified kernels, and a training step's outputs and gradients are
eager's."""
import copy

import pytest
import torch
import torch.nn as nn

import kbench

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


class ShiftRight(nn.Module):
    """T5's _shift_right, then an embedding; a column of a float clone overwritten (select)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(32, 64)

    def forward(self, ids, x):
        shifted = ids.new_zeros(ids.shape)
        shifted[..., 1:] = ids[..., :-1].clone()
        shifted[..., 0] = 3
        shifted.masked_fill_(shifted == -100, 0)
        y = (self.emb(shifted) * x).clone()
        y[:, :, 5] = x[:, :, 0] * 2
        return y.relu()


def test_view_writes_run_as_kernels_and_train_as_eager():
    torch.manual_seed(0)
    model = ShiftRight().cuda()
    twin = copy.deepcopy(model)
    ids = torch.randint(0, 32, (4, 96), device="cuda")
    ids[0, 3] = -100
    x = torch.randn(4, 96, 64, device="cuda")
    fast = kbench.optimize(model, (ids, x), budget="none", verbose=False)
    report = fast.kbench_report
    assert type(fast).__name__ == "OptimizedModule", report
    scatter_rows = [r for r in report.rows if "iota" in r.ops]
    assert scatter_rows and all(r.status.startswith("kernel") for r in scatter_rows), report
    xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
    got, want = fast(ids, xs[0]), twin(ids, xs[1])
    g = torch.randn_like(want)
    got.backward(g)
    want.backward(g)
    assert not fast._kbench_reasons, fast._kbench_reasons
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(xs[0].grad, xs[1].grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model.emb.weight.grad, twin.emb.weight.grad, rtol=1e-4, atol=1e-5)
