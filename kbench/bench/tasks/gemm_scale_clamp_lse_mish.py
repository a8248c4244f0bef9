"""KernelBench level-2 style chain: Linear -> *scale -> +itself -> clamp(-10, 10) ->
logsumexp over features (keepdim) -> x * mish(x)."""
import torch
import torch.nn as nn
import torch.nn.functional as F

from ._common import STANDARD_INITS, shape_inputs


class Model(nn.Module):
    def __init__(self, D: int, F_out: int, scale: float = 2.0):
        super().__init__()
        self.scale = scale
        self.fc = nn.Linear(D, F_out)

    def forward(self, x):
        x = self.fc(x) * self.scale
        x = x + x
        x = torch.clamp(x, -10.0, 10.0)
        x = torch.logsumexp(x, dim=1, keepdim=True)
        return x * F.mish(x)


def model_args(cfg):
    return {"D": cfg["shape"][1], "F_out": cfg["F"]}


make_inputs = shape_inputs
init_configs = STANDARD_INITS
input_configs = [
    dict(name="n16_d32_f16", shape=(16, 32), F=16, filter=True),
    dict(name="n1_d64_f48", shape=(1, 64), F=48),
    dict(name="n37_d64_f48", shape=(37, 64), F=48),
    dict(name="n8_d64_f48_uniform", shape=(8, 64), F=48, dist="uniform"),
    dict(name="n8192_d1024_f4096", shape=(8192, 1024), F=4096, perf=True),
]


def flops(cfg, backward):
    n, d = cfg["shape"]
    f = 2 * n * d * cfg["F"]
    return f * (3 if backward else 1)
