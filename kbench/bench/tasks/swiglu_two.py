"""SwiGLU from two separate projections: silu(gate) * up."""
import torch.nn as nn
import torch.nn.functional as F

from ._common import NO_PARAMS, rand


class Model(nn.Module):
    def forward(self, gate, up):
        return F.silu(gate) * up


def make_inputs(cfg, dtype, device, gen):
    dist = cfg.get("dist", "normal")
    return [rand(cfg["shape"], dtype, device, gen, dist),
            rand(cfg["shape"], dtype, device, gen, dist)]


init_configs = NO_PARAMS
input_configs = [
    dict(name="n16_h64", shape=(16, 64), filter=True),
    dict(name="n1_h2048", shape=(1, 2048)),
    dict(name="n37_h2048", shape=(37, 2048)),
    dict(name="b2_t5_h1000_tiny", shape=(2, 5, 1000), dist="tiny"),
    dict(name="n9_h771", shape=(9, 771)),
    dict(name="n8192_h4096", shape=(8192, 4096), perf=True),
]


def bytes_moved(cfg, s, backward):
    """fwd: read gate, up; write y.  bwd: read dy, gate, up; write dgate, dup (the gradients
    need gate and up again, as every other task's backward re-reads its inputs)."""
    n = 1
    for d in cfg["shape"]:
        n *= d
    return s * 3 * n + (s * 5 * n if backward else 0)
