"""RMSNorm over the last dim, Llama style: statistics in float32, the weight applied after
casting back."""
import torch
import torch.nn as nn

from ._common import STANDARD_INITS, last_dim, scaled_inputs


class Model(nn.Module):
    def __init__(self, H: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(H))

    def forward(self, x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


model_args = last_dim
make_inputs = scaled_inputs
init_configs = STANDARD_INITS
input_configs = [
    dict(name="n16_h64", shape=(16, 64), filter=True),
    dict(name="n1_h2048", shape=(1, 2048)),
    dict(name="n45_h2048", shape=(45, 2048)),
    dict(name="b2_t17_h2048_large", shape=(2, 17, 2048), dist="large"),
    dict(name="n33_h2048_uniform", shape=(33, 2048), dist="uniform"),
    dict(name="n20_h1001", shape=(20, 1001)),
    dict(name="n8192_h4096", shape=(8192, 4096), perf=True),
]


def bytes_moved(cfg, s, backward):
    """fwd: read x, w; write y.  bwd: read dy, x, w; write dx, dw."""
    *lead, H = cfg["shape"]
    NH = H
    for d in lead:
        NH *= d
    return s * (2 * NH + H) + (s * (3 * NH + 2 * H) if backward else 0)
