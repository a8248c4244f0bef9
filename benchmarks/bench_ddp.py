#!/usr/bin/env python
"""One DistributedDataParallel training step on two GPUs (NCCL, a process per GPU, spawned here:
no torchrun): eager DDP, torch.compile of DDP and kbench's DDP (optimize(DDP(model)): rank 0
tunes, the other rank loads its winners) for the zoo's GPT-2 (Hugging Face's configuration, random
weights) at a small real size, all three over the same process group on the same GPUs. A step is
zero_grad, forward with the loss, backward (the gradients all-reduced) and an SGD step; each is
timed by CUDA events on every rank, in interleaved rounds (every implementation in turn, so a
drift hits all alike), and a step costs what the slower rank took. Also: kbench's optimize time,
and each implementation's first loss against eager's. Writes <out>/ddp-<gpu>-<date>-<commit>.{json,md}.

    python benchmarks/bench_ddp.py [--layers 12] [--batch 4] [--ctx 256] [--budget fast]
                                   [--reps 10] [--rounds 5] [--impls eager,compile,kbench] [--out DIR]
"""
from __future__ import annotations

import argparse
import copy
import os
import queue
import socket
import statistics
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
IMPLS = ("eager", "compile", "kbench")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model(args):
    import transformers
    cfg = transformers.GPT2Config(n_layer=args.layers, attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg).train(), cfg.vocab_size


def _build(impl, model, args, ids, ddp_kwargs):
    """The implementation's DDP module (over the default group) and what building it took."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP
    t0 = time.perf_counter()
    if impl == "eager":
        m = DDP(model, **ddp_kwargs)
    elif impl == "compile":
        m = torch.compile(DDP(model, **ddp_kwargs))
    else:
        import kbench
        m = kbench.optimize(DDP(model, **ddp_kwargs), (ids,), {"labels": ids}, budget=args.budget, verbose=False)
    return m, time.perf_counter() - t0


def _step(m, opt, ids):
    opt.zero_grad(set_to_none=True)
    loss = m(ids, labels=ids).loss
    loss.backward()
    opt.step()
    return loss


def _rank(rank, world, port, args, out):
    import torch
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, timeout=timedelta(seconds=600))
    device = torch.device("cuda", rank)
    report = {"rank": rank, "impls": {}}
    try:
        torch.manual_seed(0)
        base, vocab = _model(args)
        gen = torch.Generator().manual_seed(1 + rank)     # each rank its own batch
        ids = torch.randint(0, vocab, (args.batch, args.ctx), generator=gen).to(device)
        impls = {}
        for impl in args.impls:
            model = copy.deepcopy(base).to(device)
            cell = report["impls"][impl] = {}
            try:
                m, built = _build(impl, model, args, ids, {"device_ids": [rank]})
                opt = torch.optim.SGD(model.parameters(), lr=1e-4)
                t0 = time.perf_counter()
                cell["first_loss"] = float(_step(m, opt, ids))   # builds the backward (and compiles)
                torch.cuda.synchronize()
                cell.update(build_s=built, first_step_s=time.perf_counter() - t0)
                if impl == "kbench":
                    rep = m.module.kbench_report
                    wanted = ("tuning:", "fallback", "capture", "model gate")
                    cell["notes"] = [n for n in rep.notes if n.startswith(wanted)]
                    cell["kernels"], cell["regions"] = rep.kernels, len(rep.rows)
                impls[impl] = (m, opt)
            except Exception as e:  # noqa: BLE001 - recorded; the other ranks must fail alike (a collective)
                cell["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
                cell["trace"] = traceback.format_exc()[-2000:]
            # every rank goes on only with the implementations that built everywhere
            ok = [None] * world
            dist.all_gather_object(ok, "error" not in cell)
            if not all(ok):
                impls.pop(impl, None)
                cell.setdefault("error", "failed on another rank")
        times = {impl: [] for impl in impls}
        for _ in range(args.rounds):
            for impl, (m, opt) in impls.items():
                for _ in range(2):   # warm-up: the previous implementation's allocations, caches
                    _step(m, opt, ids)
                dist.barrier()
                pairs = []
                for _ in range(args.reps):
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                    _step(m, opt, ids)
                    b.record()
                    pairs.append((a, b))
                torch.cuda.synchronize()
                times[impl].append(statistics.median(a.elapsed_time(b) for a, b in pairs))
        for impl, ms in times.items():
            report["impls"][impl].update(ms=statistics.median(ms), ms_rounds=ms)
        report["peak_mb"] = torch.cuda.max_memory_allocated() / 2**20
    except Exception as e:  # noqa: BLE001
        report["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"
    finally:
        everyone = [None] * world
        try:
            dist.all_gather_object(everyone, report)
        except Exception:  # noqa: BLE001 - a rank that died: its own report still goes out
            everyone = [report]
        dist.destroy_process_group()
    if rank == 0:
        out.put(everyone)


def table(doc) -> str:
    ranks = doc["ranks"]
    head = ["impl", "step ms (slower rank)", "per rank", "vs eager", "first loss", "rel to eager", "build s",
            "first step s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    eager_ms = doc["summary"].get("eager", {}).get("ms")
    eager_loss = [r["impls"].get("eager", {}).get("first_loss") for r in ranks]
    for impl, s in doc["summary"].items():
        cells = [r["impls"].get(impl, {}) for r in ranks]
        err = next((c["error"] for c in cells if "error" in c), "")
        ms = s.get("ms")
        rel = [abs(c["first_loss"] - e) / abs(e) for c, e in zip(cells, eager_loss) if c.get("first_loss") and e]
        lines.append("| " + " | ".join([
            impl, f"{ms:.3f}" if ms else err[:60] or "-",
            " / ".join(f"{c['ms']:.3f}" if c.get("ms") else "-" for c in cells),
            f"{eager_ms / ms:.2f}×" if ms and eager_ms else "-",
            f"{cells[0].get('first_loss', float('nan')):.5f}", f"{max(rel):.1e}" if rel else "-",
            " / ".join(f"{c.get('build_s', 0):.1f}" for c in cells),
            " / ".join(f"{c.get('first_step_s', 0):.1f}" for c in cells)]) + " |")
    notes = ranks[0]["impls"].get("kbench", {}).get("notes", []) + ranks[-1]["impls"].get("kbench", {}).get("notes", [])
    return "\n".join(lines + [""] + [f"- {n}" for n in notes])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=12, help="GPT-2 blocks (768 wide, 12 heads)")
    p.add_argument("--batch", type=int, default=4, help="sequences per rank")
    p.add_argument("--ctx", type=int, default=256)
    p.add_argument("--budget", default="fast", help="kbench's search budget")
    p.add_argument("--reps", type=int, default=10, help="timed steps per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--impls", default=",".join(IMPLS))
    p.add_argument("--world", type=int, default=2, help="processes, one GPU each")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = p.parse_args(argv)
    args.impls = [i for i in args.impls.split(",") if i]
    if set(args.impls) - set(IMPLS):
        print(f"bench_ddp.py: unknown implementation(s) {sorted(set(args.impls) - set(IMPLS))}", file=sys.stderr)
        return 2
    import torch
    import torch.multiprocessing as mp
    if not torch.cuda.is_available():
        print("bench_ddp.py: no CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 1
    if torch.cuda.device_count() < args.world:
        print(f"bench_ddp.py: needs {args.world} CUDA GPUs, {torch.cuda.device_count()} visible", file=sys.stderr)
        return 1
    from kbench.bench import results
    # a cold kernel cache of its own (the ranks' processes inherit it): what a first run costs
    os.environ.setdefault("KBENCH_CACHE_DIR", tempfile.mkdtemp(prefix="kbench-ddp-"))
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    t0 = time.perf_counter()
    procs = mp.start_processes(_rank, args=(args.world, _free_port(), args, out), nprocs=args.world, join=False,
                               start_method="spawn")
    while True:
        try:
            ranks = out.get(timeout=5)
            break
        except queue.Empty:
            procs.join(timeout=0)   # a rank that died: its traceback, raised here
    procs.join(timeout=120)
    summary = {}
    for impl in args.impls:
        per = [r["impls"].get(impl, {}).get("ms") for r in ranks]
        summary[impl] = {"ms": max(per) if per and all(per) else None}
    meta = results.metadata(torch.device("cuda"))
    doc = {"schema": "kbench-ddp/1", "meta": meta, "options": vars(args), "seconds": time.perf_counter() - t0,
           "summary": summary, "ranks": ranks}
    path = Path(results.results_path(args.out, meta, prefix="ddp-"))
    results.write_json(str(path), doc)
    md = table(doc)
    path.with_suffix(".md").write_text(f"# DDP training step, {args.world} × {meta.get('gpu', '?')}\n\n"
                                       f"GPT-2 {args.layers} blocks, batch {args.batch} × {args.ctx} per rank, "
                                       f"budget {args.budget}\n\n{md}\n")
    print(md)
    for r in ranks:
        if "error" in r:
            print(f"rank {r['rank']}: {r['error']}", file=sys.stderr)
    print(f"wrote {path} and {path.with_suffix('.md')}")
    return 0 if all("error" not in r for r in ranks) else 1


if __name__ == "__main__":
    sys.exit(main())
