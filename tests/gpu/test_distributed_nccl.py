"""Optimized modules under torch.distributed on two GPUs (NCCL, one process per GPU), the GPU side
of tests/test_distributed.py: (a) DDP(optimize(model)) and optimize(DDP(model)) train the zoo's
tiny GPT-2 20 SGD steps in f32 as eager DDP does (losses within 1e-5, the all-reduced gradients
the same bits on both ranks and eager's within 1e-4 of the gradient scale); (b) the zoo's tiny ViT
with each block optimized, then sharded with FSDP2's fully_shard, trains 20 steps as the eager
one sharded the same way; (c) under DDP rank 0 tunes (budget "fast") and rank 1 searches nothing,
loading rank 0's winners; (d) ranks that optimize different shapes get an error naming rank 1, on
both ranks, not a hang (the whole run is bounded by TIMEOUT_S). One spawn for all four: a process's
start (torch, NCCL, the sandbox's worker) is most of the cost."""
import copy
import io
import math
import os
import queue
import socket
import sys
import time
import traceback
import warnings
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 20
LR = 0.05
TIMEOUT_S = 240      # the ranks' answers; a hang in a collective is a failure, not a stuck run


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _setup(rank, backend):
    """(device, kbench backend, DDP's device_ids) for this rank: NCCL on GPU `rank`, or gloo on the
    CPU with the interp backend (the same checks, for a run without GPUs)."""
    if backend == "nccl":
        torch.cuda.set_device(rank)
        return torch.device("cuda", rank), "cuda", [rank]
    return torch.device("cpu"), "interp", None


def _worker(rank, world, port, cache_root, out, backend, steps):
    sys.path.insert(0, TESTS)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      KBENCH_CACHE_DIR=os.path.join(cache_root, f"rank{rank}"))   # nothing shared on disk
    device, kb_backend, ids = _setup(rank, backend)
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=90))
    from kbench.tune import tuner
    tuner.TORCH_ABOVE = math.inf    # as tests/gpu/conftest.py: kbench's kernels kept, whatever their speed
    results = {}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for order in ("ddp_of_optimized", "optimized_ddp"):
                results[order] = _ddp(rank, order, device, kb_backend, ids, steps)
            results["fsdp"] = _fsdp(rank, world, device, kb_backend, steps)
            results["tuning"] = _tuning(rank, device, kb_backend, ids)
            results["differ"] = _differ(rank, device, kb_backend, ids)
    except BaseException:  # noqa: BLE001 - reported to the test, which fails with it
        results["error"] = traceback.format_exc()
    finally:
        dist.destroy_process_group()
    # as bytes: a tensor put on a torch.multiprocessing queue is shared memory the parent maps from
    # this process, which is gone by then
    buf = io.BytesIO()
    torch.save(results, buf)
    out.put((rank, buf.getvalue()))


def _options(kb_backend, budget="none"):
    return dict(backend=kb_backend, budget=budget, verbose=False, gate=False)


def _train(m, model, entry, calls):
    """An SGD step per call of m (which trains model's parameters); the losses, and the last step's
    gradients (all-reduced, before the optimizer's step) on the CPU."""
    opt = torch.optim.SGD(m.parameters(), lr=LR)
    losses, grads = [], None
    for args, kwargs in calls:
        opt.zero_grad(set_to_none=True)
        loss = entry.loss(m(*args, **kwargs), args, kwargs)
        loss.backward()
        grads = [p.grad.detach().cpu().clone() for p in model.parameters()]
        opt.step()
        losses.append(loss.item())
    return losses, grads


def _ddp(rank, order, device, kb_backend, ids, steps):
    from models.zoo import BY_NAME

    import kbench
    entry = BY_NAME["gpt2"]
    torch.manual_seed(0)
    model = entry.make("tiny").to(device)
    twin = copy.deepcopy(model)
    calls = [entry.call("tiny", torch.Generator().manual_seed(1000 * rank + s), device) for s in range(steps)]
    args, kwargs = calls[0]
    if order == "ddp_of_optimized":
        ours = DDP(kbench.optimize(model, args, kwargs, strict=True, **_options(kb_backend)), device_ids=ids)
    else:
        ours = kbench.optimize(DDP(model, device_ids=ids), args, kwargs, strict=True, **_options(kb_backend))
    ref = DDP(twin, device_ids=ids)
    got = _train(ours, model, entry, calls)
    want = _train(ref, twin, entry, calls)
    opt = ours.module
    return {"losses": (got[0], want[0]), "grads": (got[1], want[1]), "kind": type(opt).__name__,
            "kernels": opt.kbench_report.kernels, "reasons": sorted(opt._kbench_reasons),
            "same_params": all(p is q for p, q in zip(opt.parameters(), model.parameters()))}


def _fsdp(rank, world, device, kb_backend, steps):
    """The tiny ViT, each block optimized (its example: the block's input in the eager model), then
    every block and the root sharded with fully_shard, against the eager model sharded alike."""
    from models.zoo import BY_NAME
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import kbench
    entry = BY_NAME["vit"]
    mesh = init_device_mesh(device.type, (world,))
    torch.manual_seed(0)
    model = entry.make("tiny").to(device)
    twin = copy.deepcopy(model)
    calls = [entry.call("tiny", torch.Generator().manual_seed(1000 * rank + s), device) for s in range(steps)]
    seen = []
    hook = model.blocks[0].register_forward_pre_hook(lambda mod, a: seen.append(a[0].detach()))
    with torch.no_grad():
        model(*calls[0][0])
    hook.remove()
    x = seen[0].requires_grad_(True)    # in training, a block's input is an activation
    for i in range(len(model.blocks)):
        model.blocks[i] = kbench.optimize(model.blocks[i], (x,), strict=True, **_options(kb_backend))
    for m in (model, twin):
        for block in m.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(m, mesh=mesh)
    got = _train(model, model, entry, calls)[0]
    want = _train(twin, twin, entry, calls)[0]
    return {"losses": (got, want), "kinds": [type(b).__name__ for b in model.blocks],
            "kernels": [b.kbench_report.kernels for b in model.blocks],
            "reasons": sorted(r for b in model.blocks for r in b._kbench_reasons)}


def _tuning(rank, device, kb_backend, ids):
    """Under DDP, one tuning for both ranks (kbench/distributed.py): rank 0 searches (budget
    "fast", a cold cache of its own), rank 1 loads what it sent."""
    import kbench
    from kbench.runtime.plan import Status
    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(256), nn.GELU()).to(device)
    x = torch.randn(64, 256, device=device)
    opt = kbench.optimize(DDP(model, device_ids=ids), (x,), **_options(kb_backend, "fast")).module
    regions = [{"status": info.status.name, "cache": info.extra.get("cache"),
                "candidates": info.extra.get("candidates", 0)}
               for info in opt._kbench_plan.regions if info.kind != "EXTERN"]
    with torch.no_grad():
        err = float((opt(x) - model(x)).abs().max())
    return {"notes": [n for n in opt.kbench_report.notes if n.startswith("tuning:")], "regions": regions,
            "cached": Status.CACHED.name, "err": err}


def _differ(rank, device, kb_backend, ids):
    """Rank 1 optimizes another batch size: an error on both ranks, naming rank 1."""
    import kbench
    x = torch.randn(8 if rank == 0 else 4, 32, device=device)
    t0 = time.perf_counter()
    try:
        kbench.optimize(DDP(nn.Linear(32, 32).to(device), device_ids=ids), (x,), **_options(kb_backend))
        return {"error": "no error", "seconds": time.perf_counter() - t0}
    except RuntimeError as e:
        return {"error": str(e), "seconds": time.perf_counter() - t0}


def run_ranks(tmp_path, backend="nccl", steps=STEPS, timeout=TIMEOUT_S, world=2):
    """The two ranks' results, or a failure where they do not answer in TIMEOUT_S (a hang)."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = mp.start_processes(_worker, args=(world, _free_port(), str(tmp_path), out, backend, steps), nprocs=world,
                               join=False, start_method="spawn")
    got, deadline = {}, time.monotonic() + timeout
    try:
        while len(got) < world:
            try:
                rank, results = out.get(timeout=5)
                got[rank] = torch.load(io.BytesIO(results))
            except queue.Empty:
                procs.join(timeout=0)   # a rank that died before answering: its traceback, raised here
                if time.monotonic() > deadline:
                    pytest.fail(f"no answer from rank(s) {sorted(set(range(world)) - set(got))} in {timeout} s: "
                                f"a hang")
        procs.join(timeout=60)
    finally:
        for p in procs.processes:
            if p.is_alive():
                p.kill()
    return got


def _close(ours, ref, rel, steps):
    return all(abs(a - b) <= rel * abs(b) for a, b in zip(ours, ref)) and len(ours) == len(ref) == steps


def check(got, steps=STEPS):
    for rank, results in got.items():
        assert "error" not in results, f"rank {rank}:\n{results['error']}"
    for order in ("ddp_of_optimized", "optimized_ddp"):
        for rank, results in got.items():
            r = results[order]
            assert r["kind"] == "OptimizedModule" and r["kernels"] > 0 and r["same_params"], (order, r["kind"])
            assert r["reasons"] == [], (order, rank, r["reasons"])      # every call on kbench's regions
            ours, ref = r["losses"]
            assert _close(ours, ref, 1e-5, steps), (order, rank, ours, ref)
            mine, eager = r["grads"]
            scale = max(float(g.abs().max()) for g in eager)
            for a, b in zip(mine, eager):
                assert float((a - b).abs().max()) <= 1e-4 * scale, (order, rank)
        # all-reduced: the same gradients on both ranks, to the bit, though each saw its own data
        for a, b in zip(got[0][order]["grads"][0], got[1][order]["grads"][0]):
            assert torch.equal(a, b), order
        assert got[0][order]["losses"][0] != got[1][order]["losses"][0]
    for rank, results in got.items():
        f = results["fsdp"]
        assert all(k.endswith("OptimizedModule") for k in f["kinds"]), f    # FSDP makes FSDPOptimizedModule
        assert len(f["kinds"]) == 2 and min(f["kernels"]) > 0 and f["reasons"] == [], f
        assert _close(*f["losses"], 1e-5, steps), (rank, f["losses"])
    t0, t1 = got[0]["tuning"], got[1]["tuning"]
    assert len(t0["notes"]) == 1 and "rank 0 of 2 tuned and sent" in t0["notes"][0], t0["notes"]
    assert len(t1["notes"]) == 1 and "rank 1 of 2 received rank 0's" in t1["notes"][0], t1["notes"]
    sent = int(t0["notes"][0].split("sent the other ranks ")[1].split()[0])
    assert sent >= 1 and f"received rank 0's {sent} winner(s)" in t1["notes"][0], (t0["notes"], t1["notes"])
    assert any(r["candidates"] > 0 for r in t0["regions"]), t0["regions"]          # rank 0 searched
    for r in t1["regions"]:                                                          # rank 1 did not
        assert r["candidates"] == 0 and r["status"] == t1["cached"] and r["cache"] == "hit", t1["regions"]
    assert t0["err"] <= 1e-5 and t1["err"] <= 1e-5
    for rank, results in got.items():
        d = results["differ"]
        assert "rank 1 differs from rank 0 in the example inputs" in d["error"], (rank, d)
        assert d["seconds"] < 60, d    # an error at once, not a collective's timeout


def test_ddp_fsdp_and_one_tuning_on_two_gpus_with_nccl(tmp_path):
    check(run_ranks(tmp_path))
