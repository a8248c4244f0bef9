#!/usr/bin/env python
"""The per-call cost of the Python-state guards (kbench/capture/guards.py) on GPT-2 module trees
built from transformers' GPT2Config (tiny widths, 2 and 12 blocks): how many values the forward
read, and one check of all of them in C++ (kbench._fast.Guards, what the fast call path and the
CUDA-graph runner run) and in Python (the interp backend's path), in microseconds. CPU only.

    python benchmarks/bench_guards.py [--layers 2 12]
"""
from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from kbench.capture import capture, guards  # noqa: E402
from kbench.runtime import fast  # noqa: E402


def per_call_us(fn, n=20000) -> float:
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t) / n)
    return best * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 12])
    opts = ap.parse_args(argv)
    from transformers import GPT2Config, GPT2Model
    for n in opts.layers:
        cfg = GPT2Config(n_layer=n, n_embd=32, n_head=2, vocab_size=128, n_positions=64,
                         bos_token_id=0, eos_token_id=0)
        model = GPT2Model(cfg).eval()
        t = time.perf_counter()
        captured = capture(model, (torch.randint(0, 128, (2, 16)),))
        took = time.perf_counter() - t
        kinds = collections.Counter(d[0] for d in captured.python_state)
        native = guards.bind(model, captured.python_state, native=fast.guards_type())
        python = guards.bind(model, captured.python_state)
        assert native.failing() == python.failing() == -1
        row = (f"GPT-2 {n:2d} blocks: {len(captured.python_state)} reads recorded ({dict(kinds)}), {len(native)} "
               f"checks; capture {took:.1f} s; one check of all: ")
        if native.native is not None:
            row += f"C++ {per_call_us(native.failing):.2f} us, "
        print(row + f"Python {per_call_us(python.failing, 2000):.2f} us", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
