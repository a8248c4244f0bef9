"""LayerNorm over the last dim with an affine weight and bias (as nn.LayerNorm)."""
import torch
import torch.nn as nn
import torch.nn.functional as F

from ._common import STANDARD_INITS, last_dim, scaled_inputs


class Model(nn.Module):
    def __init__(self, H: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(H))
        self.bias = nn.Parameter(torch.zeros(H))

    def forward(self, x):
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


model_args = last_dim
make_inputs = scaled_inputs
init_configs = STANDARD_INITS
input_configs = [
    dict(name="n16_h64", shape=(16, 64), filter=True),
    dict(name="n1_h1024", shape=(1, 1024)),
    dict(name="n37_h1024", shape=(37, 1024)),
    dict(name="b3_t33_h1024_large", shape=(3, 33, 1024), dist="large"),
    dict(name="n64_h1024_uniform", shape=(64, 1024), dist="uniform"),
    dict(name="n29_h4099", shape=(29, 4099)),
    dict(name="n8_h771_tiny", shape=(8, 771), dist="tiny"),
    dict(name="n8192_h4096", shape=(8192, 4096), perf=True),
]


def bytes_moved(cfg, s, backward):
    """fwd: read x, w, b; write y.  bwd: read dy, x, w; write dx, dw, db."""
    *lead, H = cfg["shape"]
    NH = H
    for d in lead:
        NH *= d
    return s * (2 * NH + 2 * H) + (s * (3 * NH + 4 * H) if backward else 0)
