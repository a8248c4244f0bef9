"""Cross-entropy over 10 classes with per-sample losses (reduction='none'), as in a small
classifier; some configs mark targets ignored (ignore_index=-100, loss 0 there)."""
import torch
import torch.nn as nn
import torch.nn.functional as F

from ._common import NO_PARAMS, rand


class Model(nn.Module):
    def forward(self, logits, target):
        return F.cross_entropy(logits, target, reduction="none")


def make_inputs(cfg, dtype, device, gen):
    n, c = cfg["N"], cfg["C"]
    logits = rand((n, c), dtype, device, gen, cfg.get("dist", "normal"))
    target = torch.randint(0, c, (n,), generator=gen, device=device)
    if cfg.get("ignore"):
        drop = torch.rand((n,), generator=gen, device=device) < cfg["ignore"]
        target = torch.where(drop, torch.full_like(target, -100), target)
    return [logits, target]


init_configs = NO_PARAMS
input_configs = [
    dict(name="n64", N=64, C=10, filter=True),
    dict(name="n1", N=1, C=10),
    dict(name="n999_ignore", N=999, C=10, ignore=0.1),
    dict(name="n128_large", N=128, C=10, dist="large"),
    dict(name="n4194304", N=4194304, C=10, perf=True),
]


def bytes_moved(cfg, s, backward):
    """fwd: read logits and targets (int64), write losses.  bwd: read dloss (and targets),
    write dlogits; logits re-reads are not counted (a fused forward can keep the softmax)."""
    n, c = cfg["N"], cfg["C"]
    fwd = s * n * c + 8 * n + s * n
    return fwd + ((s * n + 8 * n + s * n * c) if backward else 0)
