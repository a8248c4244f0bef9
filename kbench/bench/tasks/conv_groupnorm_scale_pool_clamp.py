"""KernelBench level-2 style chain: Conv2d 3x3 -> GroupNorm -> per-channel scale -> MaxPool 2x2
-> clamp(0, 1). float32 only: bfloat16 values tie inside pooling windows (see maxpool_backward)."""
import torch
import torch.nn as nn
import torch.nn.functional as F

from ._common import STANDARD_INITS, shape_inputs


class Model(nn.Module):
    def __init__(self, Cin: int, Cout: int, G: int):
        super().__init__()
        self.G = G
        self.conv = nn.Conv2d(Cin, Cout, 3)
        self.gn = nn.GroupNorm(G, Cout)
        self.scale = nn.Parameter(torch.ones(Cout, 1, 1))

    def forward(self, x):
        x = F.conv2d(x, self.conv.weight, self.conv.bias)
        x = F.group_norm(x, self.G, self.gn.weight, self.gn.bias, self.gn.eps)
        x = F.max_pool2d(x * self.scale, 2)
        return torch.clamp(x, 0.0, 1.0)


def model_args(cfg):
    return {"Cin": cfg["shape"][1], "Cout": cfg["Cout"], "G": cfg["G"]}


make_inputs = shape_inputs
init_configs = STANDARD_INITS
dtypes = ("float32",)
input_configs = [
    dict(name="n2_c3_10x10", shape=(2, 3, 10, 10), Cout=8, G=4, filter=True),
    dict(name="n1_c3_9x12", shape=(1, 3, 9, 12), Cout=16, G=8),
    dict(name="n4_c3_17x17", shape=(4, 3, 17, 17), Cout=16, G=8),
    dict(name="n2_c3_8x8_uniform", shape=(2, 3, 8, 8), Cout=16, G=8, dist="uniform"),
    dict(name="n128_c3_128x128", shape=(128, 3, 128, 128), Cout=16, G=8, perf=True),
]


def flops(cfg, backward):
    n, cin, h, w = cfg["shape"]
    f = 2 * n * cfg["Cout"] * (h - 2) * (w - 2) * cin * 9
    return f * (3 if backward else 1)
