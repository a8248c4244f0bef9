"""BatchNorm2d in eval mode: normalise with the running statistics, then the channel affine."""
import torch
import torch.nn as nn
import torch.nn.functional as F

from ._common import init_random, shape_inputs


class Model(nn.Module):
    def __init__(self, C: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(C))
        self.bias = nn.Parameter(torch.zeros(C))
        self.register_buffer("running_mean", torch.zeros(C))
        self.register_buffer("running_var", torch.ones(C))

    def forward(self, x):
        return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias,
                            training=False, eps=self.eps)


def model_args(cfg):
    return {"C": cfg["shape"][1]}


make_inputs = shape_inputs


def init_unit_affine(model, gen):
    """weight 1, bias 0, running statistics still random: (0, 1) statistics as well would
    make the module the identity, which an implementation returning its input would pass."""
    init_random(model, gen)
    with torch.no_grad():
        model.weight.fill_(1.0)
        model.bias.zero_()


init_configs = {"random": init_random, "unit_affine": init_unit_affine}
input_configs = [
    dict(name="n4_c8_6x6", shape=(4, 8, 6, 6), filter=True),
    dict(name="n1_c32_7x7", shape=(1, 32, 7, 7)),
    dict(name="n5_c32_15x13_large", shape=(5, 32, 15, 13), dist="large"),
    dict(name="n3_c32_1x1", shape=(3, 32, 1, 1)),
    dict(name="n2_c19_9x9", shape=(2, 19, 9, 9)),
    dict(name="n64_c256_32x32", shape=(64, 256, 32, 32), perf=True),
]
