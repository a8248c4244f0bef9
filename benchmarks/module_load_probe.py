#!/usr/bin/env python
"""Does a kernel's speed depend on its loaded instance? Loads the same two genomes of one region
several times each (a module per load, as every search does), then times all the instances
interleaved on the search's own bench (the same layouts round by round) and prints each
instance's median and its paired ratio to the first instance of the first genome. Instances of
one genome that differ by more than their noise mean a search's level moves with its loads.

    python benchmarks/module_load_probe.py --model softmax --dtype float32 --loads 4
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kbench import search  # noqa: E402
from search_repeat_probe import MODELS, row_region  # noqa: E402

GENOMES = {   # the pair whose ratio sat at the keep threshold (NOTES, sessions 15-18)
    "softmax": ("threads=256 vec=4 rows=8 items=1 cache=regs two_pass=1 fast_math=0 persistent=0 col_split=1",
                "threads=128 vec=2 rows=8 items=1 cache=regs two_pass=0 fast_math=1 persistent=1 col_split=1"),
}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(GENOMES), default="softmax")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--loads", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=400)
    a = ap.parse_args(argv)
    factory, shape = MODELS[a.model]
    ex, symvals, r = row_region(factory, shape, getattr(torch, a.dtype))
    bench = search.CudaRegionBench(ex, r, symvals)
    kernels, labels = [], []
    for gi, genome in enumerate(GENOMES[a.model]):
        k = bench.generate(genome)
        bench.compile(k)
        for li in range(a.loads):
            kernels.append(bench.load(k))
            labels.append(f"genome {gi} load {li}")
    for kern in kernels:
        bench.time(kern, 0)   # warm-up
    print(f"{a.model} {shape} {a.dtype}: {a.loads} loads of each genome, {a.rounds} interleaved rounds")
    report(labels, interleaved(bench, kernels, a.rounds))
    # the same loads again, in reverse order within each round: an order effect would move with it
    print("  reversed order:")
    report(labels, interleaved(bench, kernels, a.rounds, reverse=True))


def interleaved(bench, kernels, rounds, reverse=False):
    """Each kernel's times over `rounds` rounds of one repetition each (round n on layout n),
    in the order given or its reverse within each round."""
    order = list(range(len(kernels)))[::-1] if reverse else list(range(len(kernels)))
    samples = [[] for _ in kernels]
    for n in range(rounds):
        for i, ms in zip(order, bench.time_each([kernels[i] for i in order], n)):
            samples[i].append(ms)
    return samples


def report(labels, samples):
    """Each instance's median and paired ratio (with its interval) to the first instance's."""
    first = dict(enumerate(samples[0]))
    for label, s in zip(labels, samples):
        lo, hi = search._ratio_interval(dict(enumerate(s)), first)
        ratio = statistics.median(x / y for x, y in zip(s, samples[0]))
        print(f"  {label}: {statistics.median(s) * 1e3:7.2f} us  /first {ratio:.4f} [{lo:.4f}, {hi:.4f}]")

if __name__ == "__main__":
    main()
