"""Train a small transformer for 100 steps twice from the same seed — once in eager PyTorch,
once with kbench's kernels (forward and backward) — and print the losses side by side.

    python examples/train_transformer.py            # cuda backend on a GPU, interp on the CPU
    python examples/train_transformer.py --steps 20 --check 1e-3

Exits non-zero if any step's loss differs by more than --check (relative)."""
import argparse
import copy
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import kbench


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc, self.out = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=-1)
        q, k, v = (z.reshape(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class TinyGPT(nn.Module):
    """Token + position embeddings, blocks, final LayerNorm, LM head; returns the mean cross-entropy."""

    def __init__(self, vocab=512, dim=128, heads=4, layers=2, ctx=64):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(ctx, dim)
        self.blocks = nn.Sequential(*[Block(dim, heads) for _ in range(layers)])
        self.ln, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, idx, targets):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos.weight[:t]
        logits = self.head(self.ln(self.blocks(x)))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def batches(steps, batch, ctx, vocab, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        data = torch.randint(0, vocab, (batch, ctx + 1), generator=g)
        yield data[:, :-1].to(device), data[:, 1:].to(device)


def train(model, steps, batch, ctx, vocab, device):
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for idx, tgt in batches(steps, batch, ctx, vocab, device):
        loss = model(idx, tgt)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--check", type=float, default=1e-3, help="max relative loss difference per step")
    p.add_argument("--budget", default="none", help="kbench schedule search budget (none, fast, ...)")
    a = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    vocab, ctx = 512, 64
    torch.manual_seed(0)
    eager = TinyGPT(vocab=vocab, ctx=ctx).to(device)
    ours_base = copy.deepcopy(eager)
    idx, tgt = next(batches(1, a.batch, ctx, vocab, device, seed=123))
    ours = kbench.optimize(ours_base, (idx, tgt), budget=a.budget, verbose=False)
    print(ours.kbench_report)

    l_eager = train(eager, a.steps, a.batch, ctx, vocab, device)
    l_ours = train(ours, a.steps, a.batch, ctx, vocab, device)
    worst = 0.0
    print(f"{'step':>4}  {'eager':>10}  {'kbench':>10}  {'rel diff':>9}")
    for i, (e, k) in enumerate(zip(l_eager, l_ours)):
        rel = abs(e - k) / max(abs(e), 1e-12)
        worst = max(worst, rel)
        print(f"{i:4d}  {e:10.6f}  {k:10.6f}  {rel:9.2e}")
    print(f"worst relative difference {worst:.2e} over {len(l_eager)} steps (limit {a.check:g})")
    if ours._kbench_reasons:
        print("eager fallbacks:", sorted(ours._kbench_reasons))
    return 0 if worst <= a.check and not ours._kbench_reasons else 1


if __name__ == "__main__":
    sys.exit(main())
