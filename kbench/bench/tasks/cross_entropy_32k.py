"""Cross-entropy over a 32k vocabulary, mean over tokens (a language-model loss); some configs
ignore targets (ignore_index=-100) or use a vocabulary that is not a multiple of 32."""
import torch
import torch.nn as nn
import torch.nn.functional as F

from ._common import NO_PARAMS, rand


class Model(nn.Module):
    def forward(self, logits, target):
        return F.cross_entropy(logits, target)


def make_inputs(cfg, dtype, device, gen):
    n, v = cfg["N"], cfg["V"]
    logits = rand((n, v), dtype, device, gen, cfg.get("dist", "normal"))
    target = torch.randint(0, v, (n,), generator=gen, device=device)
    if cfg.get("ignore"):
        drop = torch.rand((n,), generator=gen, device=device) < cfg["ignore"]
        drop[0] = False  # keep one target so the mean is defined
        target = torch.where(drop, torch.full_like(target, -100), target)
    return [logits, target]


init_configs = NO_PARAMS
input_configs = [
    dict(name="n4_v32000", N=4, V=32000, filter=True),
    dict(name="n1_v32000", N=1, V=32000),
    dict(name="n37_v32000_ignore", N=37, V=32000, ignore=0.25),
    dict(name="n16_v32001", N=16, V=32001),
    dict(name="n8_v32000_large", N=8, V=32000, dist="large"),
    dict(name="n8192_v32000", N=8192, V=32000, perf=True),
]


def bytes_moved(cfg, s, backward):
    """fwd: read logits and targets, write the scalar loss.  fwd+bwd: the logits read again and
    their gradient written (3 N V in all). The upstream gradient is unknown until the backward
    (the benchmark draws a random one), and every logit's gradient depends on it, so the
    backward must read N V values (the logits, or anything the forward kept of that size) and
    write N V; a gradient written in the forward (2 N V) is only the least for an upstream
    gradient of exactly 1, and costs 4 N V for any other (the scaling pass)."""
    n, v = cfg["N"], cfg["V"]
    return s * n * v + 8 * n + s + ((2 * s * n * v + 8 * n + s) if backward else 0)
