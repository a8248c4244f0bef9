"""x / ||x||_F (KernelBench level 1's Frobenius-norm normalization): one reduction over every
element, then a pass that scales each — one row as long as the tensor."""
import torch
import torch.nn as nn

from ._common import NO_PARAMS, scaled_inputs


class Model(nn.Module):
    def forward(self, x):
        return x / torch.norm(x, p="fro")


make_inputs = scaled_inputs
init_configs = NO_PARAMS
input_configs = [
    dict(name="n4_c3_h5_w7", shape=(4, 3, 5, 7), filter=True),
    dict(name="n2_c8_h33_w31_large", shape=(2, 8, 33, 31), dist="large"),
    dict(name="n28_c64_h512_w512", shape=(28, 64, 512, 512), perf=True),
]


def bytes_moved(cfg, s, backward):
    """fwd: read x twice (the norm, then the scale: the tensor is far past L2), write y. bwd:
    read dy and x (twice: the dot product, then the gradient), write dx."""
    n = 1
    for d in cfg["shape"]:
        n *= d
    return s * 3 * n + (s * 4 * n if backward else 0)
