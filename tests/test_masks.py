"""capture/masks.py: a boolean attention mask built from aranges that is exactly causal becomes
SDPA's is_causal=True, as does an additive float mask that is 0 there and far below 0 elsewhere.
Masks that are not (one key past the diagonal, the other triangle, shifted by a cache, differing
across the batch, a window shorter than the sequence, f16's -65504) stay as they are; a window the
sequence may outgrow keeps its mask unless the export's guards already keep the sequence within it."""
import pytest
import torch
import torch.nn.functional as F

import kbench
from kbench.capture import capture


class Attention(torch.nn.Module):
    """q, k, v from one projection; `mask(i, j, x)` builds the boolean mask from position aranges."""

    def __init__(self, mask, dim=16, heads=2):
        super().__init__()
        self.qkv, self.heads, self.mask = torch.nn.Linear(dim, 3 * dim), heads, mask

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        i = torch.arange(t, device=x.device)
        mask = self.mask(i[:, None], i[None, :], x).view(-1, 1, t, t).expand(b, 1, t, t)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def causal(i, j, x):
    return (j <= i)[None]


def causal_offset(i, j, x):            # positions that start at 3 on both sides: still j <= i
    return ((j + 3) <= (i + 3))[None]


def causal_and_window(i, j, x):        # a sliding window of 64 over a causal mask: causal up to 64 long
    return ((j <= i) & (j > i - 64))[None]


def causal_strict(i, j, x):           # j < i + 1 is j <= i
    return (j < i + 1)[None]


def additive_filled(i, j, x):          # older Hugging Face: finfo.min, 0 filled in where j < i + 1
    t = i.shape[0]
    return torch.full((t, t), torch.finfo(x.dtype).min).masked_fill(j < i + 1, 0)[None]


def additive_where(i, j, x):
    return torch.where(j <= i, 0.0, float("-inf"))[None]


def additive_filled_where_not(i, j, x):
    t = i.shape[0]
    return torch.zeros(t, t).masked_fill(~(j <= i), float("-inf"))[None]


def additive_f16_min(i, j, x):         # -65504 is not provably far enough below a score
    return torch.where(j <= i, 0.0, -65504.0)[None]


def additive_upper(i, j, x):           # the other triangle
    return torch.where(j >= i, 0.0, float("-inf"))[None]


def one_past_the_diagonal(i, j, x):    # j <= i + 1 sees one key ahead
    return (j <= i + 1)[None]


def window_too_short(i, j, x):         # a window of 4: shorter than the example's 8 positions
    return ((j <= i) & (j > i - 4))[None]


def per_batch(i, j, x):                # causal and a padding mask that differs per sequence
    keep = torch.ones(x.shape[0], x.shape[1], dtype=torch.bool, device=x.device)
    keep[:, -2:] = False
    return (j <= i)[None] & keep[:, None, :]


def sdpa_calls(graph_text):
    return [line for line in graph_text.splitlines() if "scaled_dot_product_attention" in line]


def causal_notes(captured):
    return [n for n in captured.notes if "is_causal=True" in n]


@pytest.mark.parametrize("mask", [causal, causal_offset, causal_strict, additive_filled, additive_where,
                                  additive_filled_where_not])
def test_a_causal_mask_becomes_is_causal(mask):
    torch.manual_seed(0)
    model = Attention(mask).eval()
    x = torch.randn(2, 8, 16)
    captured = capture(model, (x,))
    assert causal_notes(captured), captured.notes
    (call,) = sdpa_calls(str(captured.graph))
    assert call.count("%") == 4, call          # q, k, v and the result: no mask operand
    fast = kbench.optimize(model, (x,), backend="interp")
    for t in (8, 5, 13):
        y = torch.randn(3, t, 16)
        with torch.no_grad():
            torch.testing.assert_close(fast(y), model(y), rtol=1e-5, atol=1e-6)
    assert not fast._kbench_reasons, fast._kbench_reasons


@pytest.mark.parametrize("mask", [one_past_the_diagonal, window_too_short, per_batch, additive_f16_min,
                                  additive_upper])
def test_other_masks_stay(mask):
    check_mask_stays(mask)


def check_mask_stays(mask):
    """mask's SDPA call keeps its mask, and the optimized model matches eager: (model, optimized)."""
    torch.manual_seed(0)
    model = Attention(mask).eval()
    x = torch.randn(2, 8, 16)
    captured = capture(model, (x,))
    assert not causal_notes(captured), captured.notes
    fast = kbench.optimize(model, (x,), backend="interp")
    with torch.no_grad():
        torch.testing.assert_close(fast(x), model(x), rtol=1e-5, atol=1e-6)
    return model, fast


def test_a_window_the_sequence_may_outgrow_keeps_its_mask():
    """Causal and a window of 64 is causal only while the sequence is at most 64 long, which
    nothing in this export guarantees: the mask stays (no guard narrows what the capture serves),
    and a call of 80 positions runs on the captured program, correct."""
    model, fast = check_mask_stays(causal_and_window)
    y = torch.randn(1, 80, 16)
    with torch.no_grad():
        torch.testing.assert_close(fast(y), model(y), rtol=1e-5, atol=1e-6)
    assert not fast._kbench_reasons, fast._kbench_reasons


def test_a_bound_the_export_guards_already_is_implied():
    """The same window where the export itself bounds the sequence (torch._check(t <= 60) narrows
    its range, as Mistral's Python branch on its window does): every size served is within the
    window, so the mask is is_causal."""

    class Guarded(Attention):
        def forward(self, x):
            torch._check(x.shape[1] <= 60)
            return super().forward(x)

    torch.manual_seed(0)
    model = Guarded(causal_and_window).eval()
    x = torch.randn(2, 8, 16)
    captured = capture(model, (x,))
    assert causal_notes(captured), captured.notes
    fast = kbench.optimize(model, (x,), backend="interp")
    with torch.no_grad():
        torch.testing.assert_close(fast(x), model(x), rtol=1e-5, atol=1e-6)


def test_cache_mask_with_fewer_queries_stays():
    """Queries at the end of a longer key sequence (a cache): the mask's triangle is aligned
    bottom-right, which is_causal (top-left) is not."""

    class Cached(torch.nn.Module):
        def forward(self, q, k, v):
            t, s = q.shape[-2], k.shape[-2]
            i = torch.arange(t) + (s - t)
            j = torch.arange(s)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=(j[None, :] <= i[:, None]))

    q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 12, 8), torch.randn(1, 2, 12, 8)
    captured = capture(Cached(), (q, k, v))
    assert not causal_notes(captured), captured.notes


def test_training_gradients_match():
    torch.manual_seed(0)
    model = Attention(causal)
    x = torch.randn(2, 8, 16, requires_grad=True)
    fast = kbench.optimize(model, (x,), backend="interp")
    fast(x).square().sum().backward()
    got = [x.grad.clone()] + [p.grad.clone() for p in model.parameters()]
    x.grad = None
    model.zero_grad()
    model(x).square().sum().backward()
    want = [x.grad] + [p.grad for p in model.parameters()]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_a_mask_the_reading_cannot_follow_stays(monkeypatch):
    """An error inside the proof is a mask left as it is, never a failed capture."""
    from kbench.capture import masks

    def broken(self, n):
        raise ZeroDivisionError("a reading that fails")
    monkeypatch.setattr(masks._Reader, "_read", broken)
    check_mask_stays(causal)


@pytest.mark.parametrize("arch", ["llama", "mistral", "opt", "bart"])
def test_hugging_face_decoders_attend_causally(arch):
    """Hugging Face's own masks, as torch.export traces them: every decoder self-attention is
    is_causal (Llama's arange comparisons; Mistral's sliding window, which its export already
    guards the sequence under; OPT's; BART's decoder beside its encoder and its cross-attention,
    which keep theirs), and the optimized model matches eager."""
    transformers = pytest.importorskip("transformers")
    small = dict(vocab_size=128, max_position_embeddings=64)
    config, cls, selfs = {
        "llama": (transformers.LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                           intermediate_size=64, **small), transformers.LlamaForCausalLM, 2),
        "mistral": (transformers.MistralConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                               num_key_value_heads=1, intermediate_size=64, sliding_window=4096,
                                               **small), transformers.MistralForCausalLM, 2),
        "opt": (transformers.OPTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, ffn_dim=64,
                                       word_embed_proj_dim=32, **small), transformers.OPTForCausalLM, 2),
        "bart": (transformers.BartConfig(d_model=32, encoder_layers=1, decoder_layers=2, encoder_attention_heads=2,
                                         decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, **small),
                 transformers.BartForConditionalGeneration, 2),
    }[arch]
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = cls(config).eval()
    ids = torch.randint(0, 128, (2, 12))
    captured = capture(model, (ids,))
    assert len(causal_notes(captured)) == selfs, captured.notes
    fast = kbench.optimize(model, (ids,), backend="interp")
    with torch.no_grad():
        torch.testing.assert_close(fast(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)
