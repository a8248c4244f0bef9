"""kbench quickstart: capture a small transformer block, print its IR and its regions (kernels),
run it on the C interpreter and, on a GPU, on generated CUDA kernels — each checked against eager."""
import torch
import torch.nn as nn
import torch.nn.functional as F

import kbench


class Block(nn.Module):
    """Pre-norm transformer block: LN → attention → residual → LN → MLP(GELU) → residual."""

    def __init__(self, dim=64, heads=4):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc, self.out = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=-1)
        q, k, v = (z.reshape(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (c // self.heads) ** -0.5
        y = (att.softmax(dim=-1) @ v).transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


def main():
    torch.manual_seed(0)
    model = Block().eval()
    x = torch.randn(2, 16, 64)

    graph = kbench.capture(model, (x,))
    print(graph)
    print(graph.regions())

    fast = kbench.optimize(model, (x,), backend="interp")
    for shape in [(2, 16, 64), (3, 5, 64)]:      # the example shape and another one
        xi = torch.randn(*shape)
        err = (fast(xi) - model(xi)).abs().max().item()
        print(f"interp backend vs eager, input {shape}: max abs error {err:.2e}")
    print(fast.kbench_report)

    if torch.cuda.is_available():
        model, x = model.cuda(), x.cuda()
        fast = kbench.optimize(model, (x,))      # backend "cuda": generated, verified kernels
        xi = torch.randn(4, 32, 64, device="cuda")
        err = (fast(xi) - model(xi)).abs().max().item()
        print(f"cuda backend vs eager: max abs error {err:.2e}")
        print(fast.kbench_report)
    else:
        print("(no GPU here: the CUDA backend runs where torch.cuda.is_available())")


if __name__ == "__main__":
    main()
