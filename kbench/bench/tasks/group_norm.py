"""GroupNorm on an NCHW activation with a per-channel affine weight and bias."""
import torch
import torch.nn as nn
import torch.nn.functional as F

from ._common import STANDARD_INITS, scaled_inputs


class Model(nn.Module):
    def __init__(self, C: int, G: int, eps: float = 1e-5):
        super().__init__()
        self.G, self.eps = G, eps
        self.weight = nn.Parameter(torch.ones(C))
        self.bias = nn.Parameter(torch.zeros(C))

    def forward(self, x):
        return F.group_norm(x, self.G, self.weight, self.bias, self.eps)


def model_args(cfg):
    return {"C": cfg["shape"][1], "G": cfg["G"]}


make_inputs = scaled_inputs
init_configs = STANDARD_INITS
input_configs = [
    dict(name="n2_c16_g4_7x9", shape=(2, 16, 7, 9), G=4, filter=True),
    dict(name="n1_c16_g4_5x5", shape=(1, 16, 5, 5), G=4),
    dict(name="n3_c16_g4_13x11_large", shape=(3, 16, 13, 11), G=4, dist="large"),
    dict(name="n2_c64_g32_16x16", shape=(2, 64, 16, 16), G=32),
    dict(name="n2_c30_g3_9x31", shape=(2, 30, 9, 31), G=3),
    dict(name="n32_c256_g32_64x64", shape=(32, 256, 64, 64), G=32, perf=True),
]
