"""LayerNorm over the trailing (C, H, W) of an image batch, with an affine weight and bias of that
shape (robust-kbench's LayerNorm task): few rows, each of C*H*W elements — the shape class a
block per row leaves most SMs idle on."""
import torch
import torch.nn as nn
import torch.nn.functional as F

from ._common import init_random, scaled_inputs


class Model(nn.Module):
    def __init__(self, C: int, H: int, W: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(C, H, W))
        self.bias = nn.Parameter(torch.zeros(C, H, W))

    def forward(self, x):
        return F.layer_norm(x, tuple(x.shape[-3:]), self.weight, self.bias, self.eps)


def model_args(cfg):
    return dict(zip("CHW", cfg["shape"][-3:]))


def init_ones_zeros(model, gen):
    """nn.LayerNorm's own init: weight 1, bias 0 (the shared one only fills 1-D parameters)."""
    with torch.no_grad():
        model.weight.fill_(1.0)
        model.bias.zero_()


make_inputs = scaled_inputs
init_configs = {"random": init_random, "ones_zeros": init_ones_zeros}
input_configs = [
    dict(name="b2_c4_h8_w16", shape=(2, 4, 8, 16), filter=True),
    dict(name="b3_c5_h7_w9_large", shape=(3, 5, 7, 9), dist="large"),
    dict(name="b16_c64_h256_w256", shape=(16, 64, 256, 256), perf=True),
]


def bytes_moved(cfg, s, backward):
    """fwd: read x, w, b; write y.  bwd: read dy, x, w; write dx, dw, db."""
    B, C, H, W = cfg["shape"]
    row = C * H * W
    return s * (2 * B * row + 2 * row) + (s * (3 * B * row + 4 * row) if backward else 0)
