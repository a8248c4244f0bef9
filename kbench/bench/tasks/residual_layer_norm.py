"""Residual add + LayerNorm, the pre-norm transformer pattern: returns (norm(x + r), x + r)."""
import torch
import torch.nn as nn
import torch.nn.functional as F

from ._common import STANDARD_INITS, last_dim, rand


class Model(nn.Module):
    def __init__(self, H: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(H))
        self.bias = nn.Parameter(torch.zeros(H))

    def forward(self, x, residual):
        h = x + residual
        return F.layer_norm(h, (h.shape[-1],), self.weight, self.bias, self.eps), h


def make_inputs(cfg, dtype, device, gen):
    dist = cfg.get("dist", "scaled")
    return [rand(cfg["shape"], dtype, device, gen, dist),
            rand(cfg["shape"], dtype, device, gen, dist)]


model_args = last_dim
init_configs = STANDARD_INITS
input_configs = [
    dict(name="n16_h64", shape=(16, 64), filter=True),
    dict(name="n1_h1024", shape=(1, 1024)),
    dict(name="b2_t19_h1024", shape=(2, 19, 1024)),
    dict(name="n33_h1024_large", shape=(33, 1024), dist="large"),
    dict(name="n12_h2050", shape=(12, 2050)),
    dict(name="n8192_h4096", shape=(8192, 4096), perf=True),
]


def bytes_moved(cfg, s, backward):
    """fwd: read x, r, params; write y, h.  bwd: read dy, dh, h, params; write dx (dr is the
    same tensor: an add hands one gradient to both operands, in eager too) and the parameter
    gradients."""
    *lead, H = cfg["shape"]
    NH = H
    for d in lead:
        NH *= d
    return s * (4 * NH + 2 * H) + (s * (4 * NH + 2 * 2 * H) if backward else 0)
