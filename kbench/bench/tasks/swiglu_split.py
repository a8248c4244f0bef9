"""SwiGLU on a fused projection: split [N, 2H] into gate and up halves, silu(gate) * up."""
import torch.nn as nn
import torch.nn.functional as F

from ._common import NO_PARAMS, shape_inputs


class Model(nn.Module):
    def forward(self, x):
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


make_inputs = shape_inputs
init_configs = NO_PARAMS
input_configs = [
    dict(name="n16_h64", shape=(16, 128), filter=True),
    dict(name="n1_h2048", shape=(1, 4096)),
    dict(name="n37_h2048", shape=(37, 4096)),
    dict(name="b2_t5_h1000_large", shape=(2, 5, 2000), dist="large"),
    dict(name="n9_h771", shape=(9, 1542)),
    dict(name="n8192_h4096", shape=(8192, 8192), perf=True),
]


def bytes_moved(cfg, s, backward):
    """fwd: read x (2 N H), write y (N H).  bwd: read dy and x again; write dx (2 N H)."""
    n = 1
    for d in cfg["shape"]:
        n *= d
    return s * (n + n // 2) + (s * (n // 2 + 2 * n) if backward else 0)
