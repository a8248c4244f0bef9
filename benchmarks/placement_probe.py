#!/usr/bin/env python
"""Does where a region's buffers fall move two kernels' time ratio? The search's bench times two
genomes of one region interleaved (as the finalists' rounds are), with the inputs, the outputs or
the L2 flush buffer moved to new addresses between trials (a spacer tensor held before the new
allocation), and prints each trial's median ratio and its interval. (Since the bench touches the
buffers after each flush, the flush buffer's address no longer shows; before, it alternated the
softmax pair between 0.933 and 0.940.)

    python benchmarks/placement_probe.py
    python benchmarks/placement_probe.py --flush-sizes 2,3,4,6   # the flush buffer only, at sizes x L2
    python benchmarks/placement_probe.py --gaps     # inputs and outputs in one allocation, gaps apart
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kbench import search  # noqa: E402
from search_repeat_probe import Softmax, row_region  # noqa: E402


CASES = [   # two genomes the same-seed searches of the GPU tests chose between
    ("softmax f32", Softmax, (8192, 1000), torch.float32,
     "threads=256 vec=4 rows=8 items=1 cache=regs two_pass=1 fast_math=0 persistent=0 col_split=1",
     "threads=128 vec=2 rows=8 items=1 cache=regs two_pass=0 fast_math=1 persistent=1 col_split=1"),
    ("layernorm bf16", lambda: nn.LayerNorm(768), (16384, 768), torch.bfloat16,
     "threads=256 vec=8 rows=8 items=1 cache=regs two_pass=1 fast_math=0 persistent=0 col_split=1",
     "threads=512 vec=4 rows=16 items=1 cache=smem two_pass=1 fast_math=0 persistent=0 col_split=1"),
]
ROUNDS = 200


def ratio(bench, ka, kb, rounds=ROUNDS):
    a, b = {}, {}
    for i in range(rounds):
        ta, tb = bench.time_each([ka, kb])
        a[i], b[i] = ta, tb
    lo, hi = search._ratio_interval(b, a)
    return statistics.median(b[i] / a[i] for i in a), lo, hi, statistics.median(a.values()) * 1e3


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--flush-sizes", default="", help="multiples of the L2 to read as the flush, each at 4 "
                    "addresses (instead of the inputs/outputs/flush moves)")
    ap.add_argument("--gaps", action="store_true", help="the inputs and outputs in one allocation, at gaps of "
                    "several sizes apart (with the touch)")
    a = ap.parse_args(argv)
    for name, factory, shape, dtype, ga, gb in CASES:
        ex, symvals, r = row_region(factory, shape, dtype)
        bench = search.CudaRegionBench(ex, r, symvals)
        kernels = []
        for g in (ga, gb):
            k = bench.generate(g)
            bench.compile(k)
            kernels.append(bench.load(k))
        ka, kb = kernels
        bench.time(ka, 0), bench.time(kb, 0)
        print(f"{name} {shape}: B/A median ratio [interval] (A's median us), {ROUNDS} rounds each", flush=True)
        print(f"  as built          {'%.4f [%.4f, %.4f] %.2f' % ratio(bench, ka, kb)}", flush=True)
        if a.gaps:
            shapes = ex._launch_params(ka, r, symvals)[0]
            for gap in (0, 256, 4096 + 256, 65536 + 768, (1 << 20) + 1280, (2 << 20) + 2304, (8 << 20) + 4352):
                big = [x for x in bench.inputs if x.numel() >= (1 << 20)]
                sizes = [x.numel() * x.element_size() for x in big] + [math.prod(sh) * d.itemsize for sh, d in shapes]
                arena = torch.empty(sum(sizes) + gap * len(sizes) + 256, dtype=torch.uint8, device="cuda")
                views, at = [], 0
                for n in sizes:
                    views.append(arena[at:at + n])
                    at += n + gap
                ins, k = [], 0
                for x in bench.inputs:
                    if x.numel() >= (1 << 20):
                        v = views[k].view(x.dtype).view(x.shape)
                        v.copy_(x)
                        ins.append(v)
                        k += 1
                    else:
                        ins.append(x)
                outs = [views[k + j].view(d).view(sh) for j, (sh, d) in enumerate(shapes)]
                spans = [v for t in ins + outs for v in (t.data_ptr(), t.numel() * t.element_size())]
                bench.layout = (None, (ins, outs, torch.tensor(spans, dtype=torch.int64, device="cuda")))   # every round
                print(f"  gap {gap:>8}        {'%.4f [%.4f, %.4f] %.2f' % ratio(bench, ka, kb, 300)}", flush=True)
            continue
        if a.flush_sizes:
            l2 = int(ex.dev["l2_bytes"])
            for f in (float(x) for x in a.flush_sizes.split(",")):
                keep = []
                for trial in range(4):
                    keep.append(torch.empty((trial + 1) * 3 * (1 << 20) + 65536 * 5, dtype=torch.uint8, device="cuda"))
                    bench.flush = torch.zeros(int(f * l2) // 4, dtype=torch.int32, device="cuda")
                    print(f"  flush {f:g}x L2 at {trial}  {'%.4f [%.4f, %.4f] %.2f' % ratio(bench, ka, kb, 300)}",
                          flush=True)
            continue
        spacers = []
        for trial in range(6):
            spacers.append(torch.empty((trial + 1) * (1 << 20) + 65536 * 3, dtype=torch.uint8, device="cuda"))
            held = torch.empty(((trial + 1) * 1536 + 4096) * 1024, dtype=torch.uint8, device="cuda")
            bench.arena = bench.layout = None   # the arena is made again: its outputs land past `held`
            print(f"  outputs moved {trial}   {'%.4f [%.4f, %.4f] %.2f' % ratio(bench, ka, kb)}", flush=True)
            del held
            bench.inputs = [t.clone() for t in bench.inputs]
            bench.arena = bench.layout = None
            print(f"  inputs moved {trial}    {'%.4f [%.4f, %.4f] %.2f' % ratio(bench, ka, kb)}", flush=True)
            bench.flush = bench.flush.clone()
            print(f"  flush moved {trial}     {'%.4f [%.4f, %.4f] %.2f' % ratio(bench, ka, kb)}", flush=True)
        for _ in range(3):
            print(f"  same again        {'%.4f [%.4f, %.4f] %.2f' % ratio(bench, ka, kb)}", flush=True)


if __name__ == "__main__":
    main()
