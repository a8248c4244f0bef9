"""A pre-LayerNorm GPT block: x + attn(LN(x)) (causal, multi-head, fused QKV projection), then
h + MLP(LN(h)) with a tanh-GELU MLP of width 4D."""
import torch.nn as nn
import torch.nn.functional as F

from ._common import STANDARD_INITS, shape_inputs


class Model(nn.Module):
    def __init__(self, D: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(D)
        self.qkv = nn.Linear(D, 3 * D)
        self.out = nn.Linear(D, D)
        self.ln2 = nn.LayerNorm(D)
        self.fc = nn.Linear(D, 4 * D)
        self.proj = nn.Linear(4 * D, D)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(F.layer_norm(x, (D,), self.ln1.weight, self.ln1.bias)).split(D, -1)
        q, k, v = (t.reshape(B, T, self.heads, D // self.heads).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = x + self.out(a.transpose(1, 2).reshape(B, T, D))
        m = F.gelu(self.fc(F.layer_norm(h, (D,), self.ln2.weight, self.ln2.bias)),
                   approximate="tanh")
        return h + self.proj(m)


def model_args(cfg):
    return {"D": cfg["shape"][-1], "heads": cfg["heads"]}


make_inputs = shape_inputs
init_configs = STANDARD_INITS
input_configs = [
    dict(name="b2_t8_d32", shape=(2, 8, 32), heads=4, filter=True),
    dict(name="b1_t1_d64", shape=(1, 1, 64), heads=4),
    dict(name="b2_t17_d64", shape=(2, 17, 64), heads=4),
    dict(name="b3_t5_d64_uniform", shape=(3, 5, 64), heads=4, dist="uniform"),
    dict(name="b8_t1024_d1024", shape=(8, 1024, 1024), heads=16, perf=True),
]


def flops(cfg, backward):
    """QKV, out, fc, proj GEMMs (2*N*D*12D) plus attention (2 * 2*B*T*T*D, halved by the
    causal mask); backward twice the forward."""
    b, t, d = cfg["shape"]
    f = 2 * b * t * d * 12 * d + 2 * b * t * t * d
    return f * (3 if backward else 1)
