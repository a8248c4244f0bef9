"""Small nn.Modules that exercise capture, the interpreter and the runtime.
MODELS is a list of Case(name, make, inputs, other_inputs): make() builds the module (in eval
mode), inputs() the example inputs, other_inputs() inputs of another batch size (and, where a
dim is free to vary, another length) for the dynamic-shape checks. Sizes are chosen distinct so
size symbols are never ambiguous, and every varying size is at least 2."""
from __future__ import annotations

import collections

import torch
import torch.nn as nn
import torch.nn.functional as F

Case = collections.namedtuple("Case", "name make inputs other_inputs")


def _randn(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype)


class Lambda(nn.Module):
    """A parameter-free module around a function (its name shows in reprs)."""

    def __init__(self, fn, name):
        super().__init__()
        self.fn, self.name = fn, name

    def forward(self, *xs):
        return self.fn(*xs)

    def extra_repr(self):
        return self.name


def _fn(name, fn):
    return lambda: Lambda(fn, name).eval()


class LinearBias(nn.Module):
    def __init__(self, bias=True):
        super().__init__()
        self.fc = nn.Linear(24, 40, bias=bias)

    def forward(self, x):
        return self.fc(x)


class LayerNormM(nn.Module):
    def __init__(self, affine=True):
        super().__init__()
        self.ln = nn.LayerNorm(48, elementwise_affine=affine)
        if affine:
            with torch.no_grad():
                self.ln.weight.normal_(1.0, 0.2)
                self.ln.bias.normal_(0.0, 0.2)

    def forward(self, x):
        return self.ln(x)


class RMSNormM(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.RMSNorm(48, eps=1e-6)
        with torch.no_grad():
            self.norm.weight.normal_(1.0, 0.2)

    def forward(self, x):
        return self.norm(x)


class HandRMSNorm(nn.Module):
    def __init__(self, dim=48, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.randn(dim) * 0.2 + 1.0)

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class CrossEntropy(nn.Module):
    def __init__(self, reduction="mean", ignore_index=-100, weight=False):
        super().__init__()
        self.reduction, self.ignore_index = reduction, ignore_index
        self.register_buffer("w", torch.rand(20) + 0.5 if weight else None)

    def forward(self, logits, target):
        return F.cross_entropy(logits, target, weight=self.w, reduction=self.reduction,
                               ignore_index=self.ignore_index)


class LMLoss(nn.Module):
    """Language-model loss: logits [B, T, V] flattened against targets [B, T]."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(16, 20)

    def forward(self, h, target):
        logits = self.head(h)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), target.view(-1), ignore_index=0)


class ChannelBias(nn.Module):
    def __init__(self):
        super().__init__()
        self.b = nn.Parameter(torch.randn(6))

    def forward(self, x):
        return x + self.b.view(1, 6, 1, 1)


class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(32))

    def forward(self, x, y):
        return x + y * self.scale + 0.5


class BatchNormM(nn.Module):
    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm2d(6)
        with torch.no_grad():
            self.bn.running_mean.normal_()
            self.bn.running_var.uniform_(0.5, 2.0)
            self.bn.weight.normal_(1.0, 0.2)
            self.bn.bias.normal_()

    def forward(self, x):
        return F.relu(self.bn(x))


class GroupNormM(nn.Module):
    def __init__(self):
        super().__init__()
        self.gn = nn.GroupNorm(3, 6)
        with torch.no_grad():
            self.gn.weight.normal_(1.0, 0.2)
            self.gn.bias.normal_()

    def forward(self, x):
        return self.gn(x)


class DropoutEval(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(24, 24)
        self.drop = nn.Dropout(0.3)

    def forward(self, x):
        return self.drop(F.silu(self.fc(x)))


class Casts(nn.Module):
    def forward(self, x):
        y = x.to(torch.bfloat16) * 2
        return y.float() + x, (x > 0).float().sum(-1)


class Block(nn.Module):
    """A small pre-norm transformer block: LN → attention → residual → LN → MLP(GELU) → residual."""

    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=-1)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(B, T, C))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class MatmulAttention(nn.Module):
    """Attention written with matmuls and softmax (the softmax is IR, the matmuls extern)."""

    def __init__(self, dim=32):
        super().__init__()
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)

    def forward(self, x):
        att = self.q(x) @ self.k(x).transpose(-2, -1) * (x.size(-1) ** -0.5)
        return torch.softmax(att, dim=-1) @ self.v(x)


class Embed(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(30, 16)
        self.ln = nn.LayerNorm(16)

    def forward(self, idx):
        return self.ln(self.emb(idx))


def _ce_inputs(n):
    def make():
        logits = _randn(n, 20)
        target = torch.randint(0, 20, (n,))
        target[::4] = 3   # some ignored when ignore_index=3
        return logits, target
    return make


def _lm_inputs(b, t):
    def make():
        target = torch.randint(0, 20, (b, t))
        target[:, -1] = 0
        return _randn(b, t, 16), target
    return make


def _x(*shape):
    return lambda: (_randn(*shape),)


MODELS = [
    Case("linear_bias", lambda: LinearBias().eval(), _x(4, 24), _x(7, 24)),
    Case("linear_bias_3d", lambda: LinearBias().eval(), _x(3, 5, 24), _x(2, 9, 24)),
    Case("linear_nobias", lambda: LinearBias(bias=False).eval(), _x(4, 24), _x(6, 24)),
    Case("layernorm", lambda: LayerNormM().eval(), _x(3, 5, 48), _x(4, 7, 48)),
    Case("layernorm_noaffine", lambda: LayerNormM(affine=False).eval(), _x(6, 48), _x(9, 48)),
    Case("rmsnorm", lambda: RMSNormM().eval(), _x(3, 5, 48), _x(2, 11, 48)),
    Case("rmsnorm_hand", lambda: HandRMSNorm().eval(), _x(3, 5, 48), _x(5, 2, 48)),
    Case("softmax_last", _fn("softmax(-1)", lambda x: torch.softmax(x, -1)), _x(3, 5, 7), _x(4, 6, 9)),
    Case("softmax_dim0", _fn("softmax(0)", lambda x: torch.softmax(x, 0)), _x(3, 5, 7), _x(4, 6, 9)),
    Case("softmax_dim1", _fn("softmax(1)", lambda x: torch.softmax(x, 1)), _x(3, 5, 7), _x(4, 6, 9)),
    Case("log_softmax_last", _fn("log_softmax(-1)", lambda x: F.log_softmax(x, -1)), _x(3, 5, 7), _x(4, 6, 9)),
    Case("log_softmax_dim0", _fn("log_softmax(0)", lambda x: F.log_softmax(x, 0)), _x(3, 5, 7), _x(4, 6, 9)),
    Case("log_softmax_dim1", _fn("log_softmax(1)", lambda x: F.log_softmax(x, 1)), _x(3, 5, 7), _x(4, 6, 9)),
    Case("cross_entropy_mean", lambda: CrossEntropy().eval(), _ce_inputs(12), _ce_inputs(17)),
    Case("cross_entropy_sum", lambda: CrossEntropy("sum").eval(), _ce_inputs(12), _ce_inputs(17)),
    Case("cross_entropy_none", lambda: CrossEntropy("none").eval(), _ce_inputs(12), _ce_inputs(17)),
    Case("cross_entropy_ignore", lambda: CrossEntropy(ignore_index=3).eval(), _ce_inputs(12), _ce_inputs(17)),
    Case("cross_entropy_weight", lambda: CrossEntropy(ignore_index=3, weight=True).eval(), _ce_inputs(12),
         _ce_inputs(17)),
    Case("lm_loss", lambda: LMLoss().eval(), _lm_inputs(3, 5), _lm_inputs(2, 7)),
    Case("gelu", _fn("gelu", F.gelu), _x(4, 33), _x(6, 33)),
    Case("gelu_tanh", _fn("gelu tanh", lambda x: F.gelu(x, approximate="tanh")), _x(4, 33), _x(6, 33)),
    Case("silu", _fn("silu", F.silu), _x(4, 33), _x(6, 33)),
    Case("mish", _fn("mish", F.mish), _x(4, 33), _x(6, 33)),
    Case("softplus", _fn("softplus", F.softplus), _x(4, 33), _x(6, 33)),
    Case("softplus_beta", _fn("softplus(2, 1.5)", lambda x: F.softplus(x * 3, beta=2.0, threshold=1.5)),
         _x(4, 33), _x(6, 33)),
    Case("hardswish", _fn("hardswish", lambda x: F.hardswish(x * 4)), _x(4, 33), _x(6, 33)),
    Case("leaky_relu", _fn("leaky_relu", lambda x: F.leaky_relu(x, 0.2)), _x(4, 33), _x(6, 33)),
    Case("relu_tanh_sigmoid", _fn("relu/tanh/sigmoid", lambda x: torch.relu(x) + torch.tanh(x) * torch.sigmoid(x)),
         _x(4, 33), _x(6, 33)),
    Case("clamp", _fn("clamp", lambda x: x.clamp(-0.5, 0.7) + x.clamp(min=0.1)), _x(4, 33), _x(6, 33)),
    Case("where_compare", _fn("where", lambda x, y: torch.where(x > y, x, y * 2.0) + (x <= 0.3).float()
                              - (x == y).to(x.dtype) + torch.where(x != 0, 1.0, x)),
         lambda: (_randn(5, 8), _randn(5, 8)), lambda: (_randn(3, 8), _randn(3, 8))),
    Case("residual_broadcast", lambda: Residual().eval(), lambda: (_randn(3, 4, 32), _randn(4, 32)),
         lambda: (_randn(2, 6, 32), _randn(6, 32))),
    Case("channel_bias", lambda: ChannelBias().eval(), _x(2, 6, 5, 3), _x(3, 6, 4, 7)),
    Case("logsumexp", _fn("logsumexp", lambda x: torch.logsumexp(x, -1) + torch.logsumexp(x, (0, 2), keepdim=True).sum()),
         _x(3, 5, 7), _x(4, 6, 9)),
    Case("reductions", _fn("mean/sum/amax/amin", lambda x: (x.mean((0, 2)), x.sum((1, 2), keepdim=True),
                                                             x.amax((0, 1)), x.amin(-1), x.sum())),
         _x(3, 5, 7), _x(4, 6, 9)),
    Case("views", _fn("permute/transpose/reshape/expand", lambda x: (
        x.permute(2, 0, 1).reshape(x.shape[2], -1).t() * 2,
        x.transpose(0, 1).unsqueeze(0).expand(2, -1, -1, -1) + 1,
        x[:, 1:3].flatten(1) - x.sum((1, 2)).unsqueeze(-1).expand(-1, 2 * x.shape[2]))),
         _x(3, 4, 5), _x(6, 4, 5)),
    Case("batchnorm_eval", lambda: BatchNormM().eval(), _x(2, 6, 5, 3), _x(3, 6, 4, 7)),
    Case("groupnorm", lambda: GroupNormM().eval(), _x(2, 6, 5, 3), _x(3, 6, 4, 7)),
    Case("dropout_eval", lambda: DropoutEval().eval(), _x(4, 24), _x(5, 24)),
    Case("casts", lambda: Casts().eval(), _x(4, 10), _x(3, 10)),
    Case("transformer_block", lambda: Block().eval(), _x(2, 5, 32), _x(3, 7, 32)),
    Case("matmul_attention", lambda: MatmulAttention().eval(), _x(2, 5, 32), _x(3, 4, 32)),
    Case("embedding", lambda: Embed().eval(), lambda: (torch.randint(0, 30, (3, 5)),),
         lambda: (torch.randint(0, 30, (2, 8)),)),
]

BY_NAME = {c.name: c for c in MODELS}
