"""The model zoo on the CPU (interp backend): every model's inference output and one training
step (forward, loss, backward, optimizer step) match eager PyTorch's, in float32 and under
torch.autocast(bfloat16) for a model of each family; the module switches between train and eval
and serves both."""
import copy
import warnings

import pytest
import torch

import kbench
from models.zoo import ZOO, BY_NAME

F32_TOL, BF16_TOL = 1e-4, 2e-2


def rel(got, want, floor=1e-6):
    """Max error relative to the reference's largest value; a reference at rounding level (a key
    bias's gradient, exactly zero in exact arithmetic) is compared against `floor`."""
    got, want = got.detach().double(), want.detach().double()
    return float((got - want).abs().max() / want.abs().max().clamp_min(floor))


def setup(entry, seed=0):
    torch.manual_seed(seed)
    model = entry.make("tiny")
    twin = copy.deepcopy(model)
    args, kwargs = entry.call("tiny", torch.Generator().manual_seed(seed + 1), "cpu")
    return model, twin, args, kwargs


def optimize(model, args, kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return kbench.optimize(model, args, kwargs, backend="interp", verbose=False, strict=True)


def train_step(module, entry, args, kwargs, autocast):
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = module(*args, **kwargs)
        loss = entry.loss(out, args, kwargs)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    opt.step()
    return out, loss, grads


@pytest.mark.parametrize("name", [m.name for m in ZOO])
def test_training_step_and_inference_match_eager(name):
    entry = BY_NAME[name]
    model, twin, args, kwargs = setup(entry)
    opt = optimize(model, args, kwargs)
    assert type(opt).__name__ == "OptimizedModule", opt.kbench_report
    assert opt.kbench_report.kernels > 0, opt.kbench_report
    out, loss, grads = train_step(opt, entry, args, kwargs, autocast=False)
    want_out, want_loss, want_grads = train_step(twin, entry, args, kwargs, autocast=False)
    assert rel(entry.output(out), entry.output(want_out)) <= F32_TOL
    assert rel(loss, want_loss) <= F32_TOL
    assert grads.keys() == want_grads.keys()
    scale = max(float(g.abs().max()) for g in want_grads.values())
    for n in grads:   # a gradient that is zero in exact arithmetic is rounding noise: judged on the model's scale
        assert rel(grads[n], want_grads[n], floor=1e-3 * scale) <= F32_TOL, n
    pscale = max(float(q.detach().abs().max()) for q in twin.parameters())
    for (n, p), q in zip(model.named_parameters(), twin.parameters()):   # the optimizer's step, through
        assert rel(p, q, floor=1e-3 * pscale) <= F32_TOL, n                # the shared parameters
    for (n, b), c in zip(model.named_buffers(), twin.buffers()):
        if b.is_floating_point():
            assert rel(b, c) <= F32_TOL, n      # BatchNorm's running statistics updated as eager's
    # evaluation: the module switches mode and serves it from a capture of its own
    opt.eval()
    twin.eval()
    with torch.no_grad():
        got, want = opt(*args, **kwargs), twin(*args, **kwargs)
    assert rel(entry.output(got), entry.output(want)) <= F32_TOL
    assert (False, ()) in opt._kbench_modes and not isinstance(opt._kbench_modes[(False, ())], str), opt.kbench_report


@pytest.mark.parametrize("name", ["gpt2", "resnet50", "vit"])
def test_autocast_bf16_training_step_matches_eager(name):
    entry = BY_NAME[name]
    model, twin, args, kwargs = setup(entry)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        opt = optimize(model, args, kwargs)
    out, loss, grads = train_step(opt, entry, args, kwargs, autocast=True)
    want_out, want_loss, want_grads = train_step(twin, entry, args, kwargs, autocast=True)
    assert entry.output(out).dtype == entry.output(want_out).dtype
    assert rel(entry.output(out), entry.output(want_out)) <= BF16_TOL
    scale = max(float(g.abs().max()) for g in want_grads.values())
    for n in grads:
        assert rel(grads[n], want_grads[n], floor=1e-3 * scale) <= BF16_TOL, n


def test_an_encoder_decoder_returning_its_cache_is_captured():
    """Hugging Face BART in evaluation with use_cache=True returns an EncoderDecoderCache, which
    torch.export cannot flatten until it is registered: kbench registers it, and the call returns
    the same logits and a cache holding the same keys as eager's."""
    import transformers
    torch.manual_seed(0)
    cfg = transformers.BartConfig(d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                                  decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
                                  vocab_size=64, max_position_embeddings=32)
    model = transformers.BartForConditionalGeneration(cfg).eval()
    ids, kwargs = torch.randint(0, 64, (2, 8)), {"decoder_input_ids": torch.randint(0, 64, (2, 4)), "use_cache": True}
    opt = optimize(model, (ids,), kwargs)
    assert type(opt).__name__ == "OptimizedModule" and opt.kbench_report.kernels > 0, opt.kbench_report
    with torch.no_grad():
        got, want = opt(ids, **kwargs), model(ids, **kwargs)
    assert rel(got.logits, want.logits) <= F32_TOL
    assert type(got.past_key_values) is type(want.past_key_values)
    for part in ("self_attention_cache", "cross_attention_cache"):
        k_got = getattr(got.past_key_values, part).layers[0].keys
        k_want = getattr(want.past_key_values, part).layers[0].keys
        assert rel(k_got, k_want) <= F32_TOL, part
