"""Conv2d 3x3 (padding 1) -> BatchNorm2d in eval mode -> ReLU, the classic CNN stem."""
import torch.nn as nn
import torch.nn.functional as F

from ._common import STANDARD_INITS, shape_inputs


class Model(nn.Module):
    def __init__(self, Cin: int, Cout: int):
        super().__init__()
        self.conv = nn.Conv2d(Cin, Cout, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(Cout)

    def forward(self, x):
        y = F.conv2d(x, self.conv.weight, padding=1)
        y = F.batch_norm(y, self.bn.running_mean, self.bn.running_var, self.bn.weight,
                         self.bn.bias, training=False, eps=self.bn.eps)
        return F.relu(y)


def model_args(cfg):
    return {"Cin": cfg["shape"][1], "Cout": cfg["Cout"]}


make_inputs = shape_inputs
init_configs = STANDARD_INITS
input_configs = [
    dict(name="n2_c3_8x8", shape=(2, 3, 8, 8), Cout=8, filter=True),
    dict(name="n1_c16_5x7", shape=(1, 16, 5, 7), Cout=32),
    dict(name="n3_c16_15x15", shape=(3, 16, 15, 15), Cout=32),
    dict(name="n2_c16_9x9_large", shape=(2, 16, 9, 9), Cout=32, dist="large"),
    dict(name="n32_c64_56x56", shape=(32, 64, 56, 56), Cout=128, perf=True),
]


def flops(cfg, backward):
    """2 * N * Cout * H * W * Cin * 9 for the conv; backward (input and weight grads) twice."""
    n, cin, h, w = cfg["shape"]
    f = 2 * n * cfg["Cout"] * h * w * cin * 9
    return f * (3 if backward else 1)
