"""MaxPool2d 3x3, stride 2, padding 1, scored forward and backward (the gradient is routed to
each window's maximum). float32 only: bfloat16 inputs tie within windows, and which of tied
elements receives the gradient is an implementation choice, not an error."""
import torch.nn as nn
import torch.nn.functional as F

from ._common import NO_PARAMS, shape_inputs


class Model(nn.Module):
    def forward(self, x):
        return F.max_pool2d(x, 3, stride=2, padding=1)


make_inputs = shape_inputs
init_configs = NO_PARAMS
dtypes = ("float32",)
input_configs = [
    dict(name="n2_c4_9x9", shape=(2, 4, 9, 9), filter=True),
    dict(name="n1_c3_7x8", shape=(1, 3, 7, 8)),
    dict(name="n2_c8_32x32", shape=(2, 8, 32, 32)),
    dict(name="n1_c5_17x13_large", shape=(1, 5, 17, 13), dist="large"),
    dict(name="n64_c64_112x112", shape=(64, 64, 112, 112), perf=True),
]


def bytes_moved(cfg, s, backward):
    """fwd: read x, write y (a quarter of x).  bwd: read dy, write dx."""
    n, c, h, w = cfg["shape"]
    x = n * c * h * w
    y = n * c * ((h + 1) // 2) * ((w + 1) // 2)
    return s * (x + y) + (s * (y + x) if backward else 0)
