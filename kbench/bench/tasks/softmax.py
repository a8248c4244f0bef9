"""Softmax over the last dim."""
import torch.nn as nn
import torch.nn.functional as F

from ._common import NO_PARAMS, shape_inputs


class Model(nn.Module):
    def forward(self, x):
        return F.softmax(x, dim=-1)


make_inputs = shape_inputs
init_configs = NO_PARAMS
input_configs = [
    dict(name="n16_h64", shape=(16, 64), filter=True),
    dict(name="n1_h1000", shape=(1, 1000)),
    dict(name="n37_h1000", shape=(37, 1000)),
    dict(name="b2_t3_h50257", shape=(2, 3, 50257)),
    dict(name="n64_h1024_large", shape=(64, 1024), dist="large"),
    dict(name="n31_h1031_uniform", shape=(31, 1031), dist="uniform"),
    dict(name="n8192_h4096", shape=(8192, 4096), perf=True),
]


def bytes_moved(cfg, s, backward):
    """fwd: read x, write y.  bwd: read y, dy; write dx."""
    n = 1
    for d in cfg["shape"]:
        n *= d
    return s * n * (5 if backward else 2)
