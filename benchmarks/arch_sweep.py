#!/usr/bin/env python
"""Many Hugging Face architectures, each at a tiny random config, through kbench.optimize and one
training step against eager (the same weights, dropout off): does it capture (OptimizedModule or
eager with the reason), how many kernels, the loss's and the gradients' largest relative error,
and the time optimize took. On the CPU the regions run on the interpreter; with --device cuda on
kbench's kernels. A correctness sweep over model code nobody here wrote, not a timing benchmark.

    python benchmarks/arch_sweep.py [--models llama,phi3,swin] [--device cpu|cuda] [--bf16] [--out DIR]
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
import traceback
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

VOCAB, SEQ, IMAGE = 128, 16, 32


def configs():
    """name -> (factory of the model, "text" | "text-cls" | "seq2seq" | "image")."""
    import transformers as T
    small = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                 vocab_size=VOCAB, max_position_embeddings=64)

    def lm(model, config, **kw):
        return lambda: model(config(**{**small, **kw}))

    vision = dict(num_labels=10)
    return {
        "llama": (lm(T.LlamaForCausalLM, T.LlamaConfig, num_key_value_heads=2), "text"),
        "qwen2": (lm(T.Qwen2ForCausalLM, T.Qwen2Config, num_key_value_heads=2), "text"),
        "qwen3": (lm(T.Qwen3ForCausalLM, T.Qwen3Config, head_dim=16, num_key_value_heads=2), "text"),
        "gemma": (lm(T.GemmaForCausalLM, T.GemmaConfig, head_dim=16, num_key_value_heads=2), "text"),
        "gemma2": (lm(T.Gemma2ForCausalLM, T.Gemma2Config, head_dim=16, num_key_value_heads=2), "text"),
        "phi": (lm(T.PhiForCausalLM, T.PhiConfig), "text"),
        "phi3": (lm(T.Phi3ForCausalLM, T.Phi3Config, pad_token_id=0), "text"),
        "gpt_neox": (lm(T.GPTNeoXForCausalLM, T.GPTNeoXConfig), "text"),
        "falcon": (lm(T.FalconForCausalLM, T.FalconConfig), "text"),
        "mixtral": (lm(T.MixtralForCausalLM, T.MixtralConfig, num_key_value_heads=2, num_local_experts=4,
                       num_experts_per_tok=2), "text"),
        "opt": (lambda: T.OPTForCausalLM(T.OPTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                                     ffn_dim=128, vocab_size=VOCAB, max_position_embeddings=64,
                                                     word_embed_proj_dim=64, dropout=0.0, attention_dropout=0.0)),
                "text"),
        "bloom": (lambda: T.BloomForCausalLM(T.BloomConfig(hidden_size=64, n_layer=2, n_head=4, vocab_size=VOCAB)),
                  "text"),
        "gptj": (lambda: T.GPTJForCausalLM(T.GPTJConfig(n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB,
                                                        n_positions=64, rotary_dim=8)), "text"),
        "mamba": (lambda: T.MambaForCausalLM(T.MambaConfig(hidden_size=64, num_hidden_layers=2, vocab_size=VOCAB,
                                                           state_size=8)), "text"),
        "roberta": (lm(T.RobertaForSequenceClassification, T.RobertaConfig, max_position_embeddings=80),
                    "text-cls"),
        "distilbert": (lambda: T.DistilBertForSequenceClassification(T.DistilBertConfig(
            dim=64, n_layers=2, n_heads=4, hidden_dim=128, vocab_size=VOCAB, max_position_embeddings=64)), "text-cls"),
        "albert": (lm(T.AlbertForSequenceClassification, T.AlbertConfig, embedding_size=32), "text-cls"),
        "electra": (lm(T.ElectraForSequenceClassification, T.ElectraConfig, embedding_size=32), "text-cls"),
        "deberta_v2": (lm(T.DebertaV2ForSequenceClassification, T.DebertaV2Config), "text-cls"),
        "t5": (lambda: T.T5ForConditionalGeneration(T.T5Config(
            d_model=64, d_ff=128, num_layers=2, num_heads=4, d_kv=16, vocab_size=VOCAB, dropout_rate=0.0,
            decoder_start_token_id=0, pad_token_id=0)), "seq2seq"),
        "bart": (lambda: T.BartForConditionalGeneration(T.BartConfig(
            d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
            encoder_ffn_dim=128, decoder_ffn_dim=128, vocab_size=VOCAB, max_position_embeddings=64, dropout=0.0,
            attention_dropout=0.0, activation_dropout=0.0)), "seq2seq"),
        "vit": (lambda: T.ViTForImageClassification(T.ViTConfig(
            hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, image_size=IMAGE,
            patch_size=8, **vision)), "image"),
        "convnext": (lambda: T.ConvNextForImageClassification(T.ConvNextConfig(
            hidden_sizes=[16, 32], depths=[1, 1], num_stages=2, **vision)), "image"),
        "resnet": (lambda: T.ResNetForImageClassification(T.ResNetConfig(
            hidden_sizes=[16, 32], depths=[1, 1], embedding_size=16, **vision)), "image"),
        "swin": (lambda: T.SwinForImageClassification(T.SwinConfig(
            image_size=IMAGE, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=4,
            **vision)), "image"),
    }


def call_for(kind, device):
    import torch
    g = torch.Generator().manual_seed(1)
    if kind == "image":
        return (torch.randn(2, 3, IMAGE, IMAGE, generator=g).to(device),), {"labels": torch.tensor([1, 3]).to(device)}
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=g).to(device)
    if kind == "seq2seq":
        return (ids,), {"labels": torch.randint(0, VOCAB, (2, 8), generator=g).to(device)}
    if kind == "text-cls":
        return (ids,), {"attention_mask": torch.ones(2, SEQ, dtype=torch.long, device=device),
                        "labels": torch.tensor([0, 1]).to(device)}
    return (ids,), {"labels": ids}


def dropout_off(model):
    """Every dropout of model off, as the comparison with eager needs (kbench's dropout draws its
    own random numbers): nn.Dropout modules, and the probabilities attention modules keep as
    float attributes for SDPA's dropout_p (a config's own names vary from model to model)."""
    import torch
    for m in model.modules():
        if isinstance(m, torch.nn.modules.dropout._DropoutNd):
            m.p = 0.0
        for name, value in vars(m).items():
            if "drop" in name and isinstance(value, float):
                setattr(m, name, 0.0)
    return model


def rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-6))


def one(name, factory, kind, device, bf16) -> dict:
    import torch

    import kbench
    torch.manual_seed(0)
    model = dropout_off(factory()).to(device).train()
    twin = copy.deepcopy(model)
    args, kwargs = call_for(kind, device)
    backend = "interp" if device == "cpu" else "cuda"
    t0 = time.perf_counter()
    with warnings.catch_warnings(), torch.autocast(device, dtype=torch.bfloat16, enabled=bf16):
        warnings.simplefilter("ignore")
        opt = kbench.optimize(model, args, kwargs, backend=backend, verbose=False)
        optimize_s = time.perf_counter() - t0
        got, want = opt(*args, **kwargs).loss, twin(*args, **kwargs).loss
    got.backward()
    want.backward()
    pairs = [(p.grad, q.grad) for p, q in zip(model.parameters(), twin.parameters())]
    grad_err = max((rel(a, b) for a, b in pairs if a is not None and b is not None and b.abs().max() > 1e-6),
                   default=0.0)
    report = opt.kbench_report
    return {"model": name, "module": type(opt).__name__, "kernels": getattr(report, "kernels", 0),
            "loss_err": rel(got, want), "grad_err": grad_err,
            "grads_missing": sum((a is None) != (b is None) for a, b in pairs), "optimize_s": optimize_s,
            "why_eager": "" if type(opt).__name__ == "OptimizedModule" else str(report).splitlines()[-1][:200]}


def table(rows) -> str:
    lines = ["| model | module | kernels | loss err | grad err | missing grads | optimize s | note |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | ERROR | | | | | | {r['error']} |")
        else:
            lines.append(f"| {r['model']} | {r['module']} | {r['kernels']} | {r['loss_err']:.2e} | {r['grad_err']:.2e} "
                         f"| {r['grads_missing']} | {r['optimize_s']:.1f} | {r['why_eager']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="", help="comma-separated names (default: all)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--bf16", action="store_true", help="under torch.autocast(bfloat16)")
    ap.add_argument("--out", default="", help="a folder for arch-sweep.{json,md}")
    args = ap.parse_args(argv)
    cases = configs()
    names = [n for n in args.models.split(",") if n] or list(cases)
    unknown = [n for n in names if n not in cases]
    if unknown:
        print(f"arch_sweep: unknown model(s) {', '.join(unknown)}; known: {', '.join(cases)}", file=sys.stderr)
        return 2
    rows = []
    for name in names:
        factory, kind = cases[name]
        try:
            row = one(name, factory, kind, args.device, args.bf16)
        except Exception as e:  # noqa: BLE001 - a model that breaks is this sweep's finding, the next runs
            row = {"model": name, "error": f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}",
                   "where": traceback.format_exc(limit=-3)}
        rows.append(row)
        print(table([row]).splitlines()[-1], flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "arch-sweep.json"), "w") as f:
            json.dump(rows, f, indent=1)
        with open(os.path.join(args.out, "arch-sweep.md"), "w") as f:
            f.write(table(rows) + "\n")
    return 1 if any("error" in r or r["grads_missing"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
