"""Transformer MLP: Linear(D, 4D) -> GELU (tanh) -> Linear(4D, D), with biases."""
import torch.nn as nn
import torch.nn.functional as F

from ._common import STANDARD_INITS, shape_inputs


class Model(nn.Module):
    def __init__(self, D: int):
        super().__init__()
        self.fc = nn.Linear(D, 4 * D)
        self.proj = nn.Linear(4 * D, D)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


def model_args(cfg):
    return {"D": cfg["shape"][-1]}


make_inputs = shape_inputs
init_configs = STANDARD_INITS
input_configs = [
    dict(name="n16_d32", shape=(16, 32), filter=True),
    dict(name="n1_d64", shape=(1, 64)),
    dict(name="b3_t7_d64", shape=(3, 7, 64)),
    dict(name="n33_d64_uniform", shape=(33, 64), dist="uniform"),
    dict(name="n5_d100", shape=(5, 100)),
    dict(name="n8192_d1024", shape=(8192, 1024), perf=True),
]


def flops(cfg, backward):
    """Two GEMMs of 2*N*D*4D each; the backward does twice the forward's GEMM work."""
    *lead, d = cfg["shape"]
    n = 1
    for x in lead:
        n *= x
    f = 2 * 2 * n * d * 4 * d
    return f * (3 if backward else 1)
