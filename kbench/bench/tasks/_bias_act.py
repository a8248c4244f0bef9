"""Shared by the bias+activation tasks: a bias add then one activation, over [..., H]."""
import torch
import torch.nn as nn

from ._common import STANDARD_INITS, last_dim, shape_inputs


class BiasAct(nn.Module):
    """y = act(x + bias); a task subclasses it with its activation as `act`."""

    act = None

    def __init__(self, H: int):
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(H))

    def forward(self, x):
        return type(self).act(x + self.bias)


model_args = last_dim
make_inputs = shape_inputs
init_configs = STANDARD_INITS
input_configs = [
    dict(name="n16_h64", shape=(16, 64), filter=True),
    dict(name="n1_h3072", shape=(1, 3072)),
    dict(name="n7_h3072", shape=(7, 3072)),
    dict(name="b2_t9_h3072_large", shape=(2, 9, 3072), dist="large"),
    dict(name="n17_h3072_tiny", shape=(17, 3072), dist="tiny"),
    dict(name="n5_h1001", shape=(5, 1001)),
    dict(name="n8192_h4096", shape=(8192, 4096), perf=True),
]


def bytes_moved(cfg, s, backward):
    """fwd: read x, b; write y.  bwd: read dy, x, b; write dx, db."""
    *lead, H = cfg["shape"]
    NH = H
    for d in lead:
        NH *= d
    return s * (2 * NH + H) + (s * (3 * NH + 2 * H) if backward else 0)
