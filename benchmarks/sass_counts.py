#!/usr/bin/env python
"""Registers and SASS instructions of a benchmark task's kernels, without a GPU: every forward and
backward region at the task's timed size is generated (default genome, or --genome over it),
compiled by nvcc for sm_90, disassembled by cuobjdump, and each loop's body is counted by opcode.
A row kernel's loop over its rows is where the time goes, so its count per row says what a code
generation change did before any GPU time is spent.

    python benchmarks/sass_counts.py layer_norm --dtype bfloat16
    python benchmarks/sass_counts.py softmax --dtype bfloat16 --genome two_pass=0 --no-backward

Needs nvcc and cuobjdump: on PATH, under $CUDA_HOME/bin, or from the nvidia-cuda-cuobjdump wheel
(`pip install nvidia-cuda-cuobjdump`); where one is missing it says so in one line and exits 1.
"""
from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

FLOAT_DTYPES = ("f32", "f16", "bf16", "f64")
_INSTR = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_FUNCTION = re.compile(r"Function : (\S+)")
_PREDICATE = re.compile(r"^@!?U?P\w+\s+")


def find_tool(name: str) -> str:
    """A CUDA tool by name: PATH, $CUDA_HOME/bin, then the nvidia-*-cu13/cu12 wheels' bin folders."""
    found = shutil.which(name)
    if found:
        return found
    for base in filter(None, (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda")):
        path = os.path.join(base, "bin", name)
        if os.access(path, os.X_OK):
            return path
    for path in sorted(glob.glob(os.path.join(sysconfig.get_paths()["purelib"], "nvidia", "*", "bin", name))):
        if os.access(path, os.X_OK):
            return path
    raise FileNotFoundError(f"{name} not found on PATH, under $CUDA_HOME/bin or in an nvidia wheel "
                            f"(pip install nvidia-cuda-{'cuobjdump' if name == 'cuobjdump' else 'nvcc'})")


def parse_sass(text: str) -> dict:
    """cuobjdump -sass output -> {function: {"instructions": n, "loops": [(start, end, Counter)]}}.
    A loop is a backward branch: its body is every instruction from the target to the branch;
    the Counter counts them by opcode (predicates and modifiers dropped: FADD.FTZ is FADD)."""
    funcs: dict = collections.OrderedDict()
    fn = None
    for line in text.splitlines():
        m = _FUNCTION.search(line)
        if m:
            fn = m.group(1)
            funcs[fn] = []
            continue
        m = _INSTR.match(line)
        if m and fn is not None:
            funcs[fn].append((int(m.group(1), 16), m.group(2)))
    out = collections.OrderedDict()
    for fn, ins in funcs.items():
        loops = []
        for addr, text_ in ins:
            op = _PREDICATE.sub("", text_)
            if not op.startswith("BRA"):
                continue
            target = re.search(r"0x([0-9a-f]+)", op)
            if target and int(target.group(1), 16) < addr:
                start = int(target.group(1), 16)
                body = [_PREDICATE.sub("", t).split()[0].split(".")[0] for a, t in ins if start <= a <= addr]
                loops.append((start, addr, collections.Counter(body)))
        out[fn] = {"instructions": len(ins), "loops": loops}
    return out


def registers(ptxas_log: str) -> dict:
    """ptxas -v output -> {function: registers}."""
    regs, fn = {}, None
    for line in ptxas_log.splitlines():
        m = re.search(r"Compiling entry function '(\S+)'", line)
        if m:
            fn = m.group(1)
        m = re.search(r"Used (\d+) registers", line)
        if m and fn:
            regs[fn] = int(m.group(1))
    return regs


def compile_and_count(source: str, nvcc: str, cuobjdump: str, arch: str = "sm_90") -> tuple[dict, dict]:
    with tempfile.TemporaryDirectory() as tmp:
        cu, cubin = os.path.join(tmp, "k.cu"), os.path.join(tmp, "k.cubin")
        Path(cu).write_text(source)
        done = subprocess.run([nvcc, "-cubin", f"-arch={arch}", "-Xptxas", "-v", "-o", cubin, cu],
                              capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"nvcc failed:\n{done.stderr[-2000:]}")
        sass = subprocess.run([cuobjdump, "-sass", cubin], capture_output=True, text=True, check=True).stdout
    return registers(done.stderr), parse_sass(sass)


def kernels(task: str, dtype, genome_over: str, backward: bool, forward: bool):
    """(label, source) of every kernel of the task at its timed size, captured on the CPU."""
    import torch
    from kbench import _C, api
    from kbench.runtime.plan import SAVE_STATS_MIN_ROW_BYTES
    from bench_ops import task_model

    model, inputs = task_model(task, dtype, device="cpu")
    with torch.no_grad():
        cap = api._fresh_capture(model, tuple(inputs), "cuda")   # the row lengths pinned, as optimize() does
    g, symvals = cap.graph, list(cap.example_symvals)
    part = g.partition()
    part.save_stats(SAVE_STATS_MIN_ROW_BYTES)

    def gen(p, r, label):
        genome = None
        if genome_over:   # 'key=value ...' over the default: a gene given twice takes the last value
            genome = _C.Genome.parse(f"{_C.genome_default(p, r, symvals)} {genome_over}")
        k = _C.generate(p, r, 90, genome)
        return f"{label} {p.region(r)['kind']} [{k.genome}]", k.source

    for r in range(len(part)):
        region = part.region(r)
        if region["kind"] == "EXTERN":
            continue
        if forward:
            yield gen(part, r, f"forward region {r}")
        if backward:
            rg = part.region_graph(r)
            need = [rg.node(v)["dtype"] in FLOAT_DTYPES for v in rg.inputs][:len(region["inputs"])]
            if not any(need):
                continue
            bp = rg.grad(need, saved=region["saved"]).partition()
            for b in range(len(bp)):
                if bp.region(b)["kind"] != "EXTERN":
                    yield gen(bp, b, f"backward of {r}: region {b}")


def main(argv=None):
    from kbench.bench.tasks import parse_dtype
    from bench_ops import OPS

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("task", choices=sorted(OPS))
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--genome", default="", help="'key=value ...' over each region's default genome")
    ap.add_argument("--no-backward", action="store_true")
    ap.add_argument("--no-forward", action="store_true")
    ap.add_argument("--source", metavar="DIR", help="also write each kernel's source here")
    a = ap.parse_args(argv)
    try:
        nvcc, cuobjdump = find_tool("nvcc"), find_tool("cuobjdump")
    except FileNotFoundError as e:   # one line: what is missing and where to get it
        print(f"sass_counts.py: {e}", file=sys.stderr)
        return 1
    for i, (label, source) in enumerate(kernels(a.task, parse_dtype(a.dtype), a.genome, not a.no_backward,
                                                not a.no_forward)):
        if a.source:
            os.makedirs(a.source, exist_ok=True)
            Path(a.source, f"{a.task}-{i}.cu").write_text(source)
        regs, funcs = compile_and_count(source, nvcc, cuobjdump)
        print(f"\n{label}")
        for fn, info in funcs.items():
            print(f"  {fn}: {regs.get(fn, '?')} registers, {info['instructions']} instructions")
            for start, end, ops in info["loops"]:
                print(f"    loop {start:#x}..{end:#x}: {sum(ops.values())}:",
                      " ".join(f"{k}:{v}" for k, v in ops.most_common()))


if __name__ == "__main__":
    sys.exit(main())
