"""Two rewrites of GPT-2-style models on a GPU: a causal mask built from aranges runs as SDPA's
is_causal (capture/masks.py), and a bf16 LM head with an unaligned vocabulary runs on padded
weights, its logits sliced back and read by the loss kernel (capture/ops_matmul.py).
Each trains a step with CUDA graphs and matches eager's loss, output and gradients. On the CPU:
tests/test_masks.py and tests/test_optimize_interp.py."""
import copy

import pytest
import torch
import torch.nn.functional as F

import kbench

pytestmark = pytest.mark.gpu


def rel(got, want):
    got, want = got.detach().double(), want.detach().double()
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-6))


class Head(torch.nn.Module):
    """A causal attention layer and an LM head of 8191 classes (not a multiple of 8), the loss
    read by kbench's kernels and the logits returned too, as Hugging Face's LM heads do."""

    def __init__(self, dim=256, heads=4, vocab=8191):
        super().__init__()
        self.qkv, self.heads = torch.nn.Linear(dim, 3 * dim), heads
        self.norm = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, x, targets):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        i = torch.arange(t, device=x.device)
        mask = (i[None, :] <= i[:, None]).view(1, 1, t, t).expand(b, 1, t, t)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(b, t, d)
        logits = self.head(self.norm(x + a))
        loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))
        return loss, logits


def test_causal_attention_and_padded_head_train_like_eager():
    torch.manual_seed(0)
    model = Head().cuda()
    twin = copy.deepcopy(model)
    x = torch.randn(8, 512, 256, device="cuda")
    targets = torch.randint(0, 8191, (8, 512), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        fast = kbench.optimize(model, (x, targets), budget="none", verbose=False, strict=True, gate=False)
    notes = fast._kbench_captured.notes
    assert any("is_causal=True" in n for n in notes), notes
    assert any("padded from 8191 to 8192" in n for n in notes), notes
    for _ in range(4):   # past the CUDA graphs' capture
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss, logits = fast(x, targets)
        loss.backward()
    twin.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        want_loss, want_logits = twin(x, targets)
    want_loss.backward()
    assert logits.shape == want_logits.shape and logits.dtype == want_logits.dtype
    assert rel(loss, want_loss) <= 2e-2
    assert rel(logits, want_logits) <= 2e-2
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert rel(p.grad, q.grad) <= 2e-2, name
    # flash attention's output is laid out (B, T, H, D) and handed over as (B, H, T, D): the region
    # that reads it back through the heads' transpose runs in torch, where that read is a view
    assert all("is not contiguous" in why for why in fast._kbench_reasons), fast._kbench_reasons
