"""Optimized modules under DistributedDataParallel and FSDP2 on the CPU: 2 processes, the gloo
backend, the interp backend. DDP(optimize(model)) and optimize(DDP(model)) train as eager DDP
does (the same losses and parameters after a few SGD steps, gradients all-reduced), with
find_unused_parameters and with no_sync() gradient accumulation; an optimized block inside a
model sharded with fully_shard trains as the eager one does, on kbench's regions at every step
(the parameters FSDP gathers are what they read: no fallback). In a shared tuning, every rank
applies rank 0's model gate verdict, its CUDA-graph decision included, where their own timings
would disagree."""
import copy
import os
import socket
import sys
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

TESTS = os.path.dirname(os.path.abspath(__file__))


class Block(nn.Module):
    """A transformer-style MLP block, with a layer the forward never uses where `unused`."""

    def __init__(self, d=32, unused=False):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        if unused:
            self.unused = nn.Linear(d, d)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, out):
    sys.path.insert(0, TESTS)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import kbench
    results = {}
    try:
        for order in ("ddp_of_optimized", "optimized_ddp"):
            for unused in (False, True):
                torch.manual_seed(0)
                model = Block(unused=unused)
                twin = copy.deepcopy(model)
                xs = [torch.randn(8, 16, 32, generator=torch.Generator().manual_seed(10 * rank + i)) for i in range(4)]
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    if order == "ddp_of_optimized":
                        ours = DDP(kbench.optimize(model, (xs[0],), backend="interp", verbose=False, strict=True),
                                   find_unused_parameters=unused)
                    else:
                        ours = kbench.optimize(DDP(model, find_unused_parameters=unused), (xs[0],), backend="interp",
                                               verbose=False, strict=True)
                ref = DDP(twin, find_unused_parameters=unused)
                losses = []
                for m in (ours, ref):
                    opt = torch.optim.SGD(m.parameters(), lr=0.1)
                    got = []
                    for step in range(2):
                        opt.zero_grad()
                        with m.no_sync():      # accumulate one micro-batch locally
                            m(xs[2 * step]).pow(2).mean().backward()
                        loss = m(xs[2 * step + 1]).pow(2).mean()
                        loss.backward()
                        opt.step()
                        got.append(loss.item())
                    losses.append(got)
                params = max(float((p - q).abs().max()) for p, q in zip(model.parameters(), twin.parameters()))
                same = all(torch.equal(p, q) for p, q in zip(ours.module.parameters(), model.parameters()))
                results[(order, unused)] = (losses, params, same, type(ours.module).__name__)
        results["tuning"] = _shared_tuning(rank, kbench)
        results["gate"] = _shared_gate(rank, kbench)
        results["fsdp"] = _fsdp(rank, world, kbench)
    finally:
        dist.destroy_process_group()
    out.put((rank, results))


def _shared_tuning(rank, kbench):
    """One tuning for all ranks (kbench/distributed.py): each rank's report says what it did;
    ranks that optimize different shapes, and a failure on rank 0, are errors on every rank."""
    from kbench import api
    got = {}
    x = torch.randn(8, 16, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = kbench.optimize(DDP(Block()), (x,), backend="interp", verbose=False)
        got["note"] = [n for n in m.module.kbench_report.notes if n.startswith("tuning:")]
        try:
            kbench.optimize(Block(), (torch.randn(8 if rank == 0 else 4, 16, 32),), backend="interp",
                            verbose=False, distributed=True)
            got["differ"] = "no error"
        except RuntimeError as e:
            got["differ"] = str(e)
        real = api._optimize
        if rank == 0:
            def planted(*a, **k):
                raise ValueError("planted on rank 0")
            api._optimize = planted
        try:
            kbench.optimize(Block(), (x,), backend="interp", verbose=False, distributed=True)
            got["failed"] = "no error"
        except (RuntimeError, ValueError) as e:
            got["failed"] = f"{type(e).__name__}: {e}"
        finally:
            api._optimize = real
        # and each on its own: no collective at all (rank 1 alone optimizes a model of its own)
        if rank == 1:
            alone = kbench.optimize(Block(d=16), (torch.randn(2, 16),), backend="interp", verbose=False,
                                    distributed=False)
            got["alone"] = [n for n in alone.kbench_report.notes if n.startswith("tuning:")]
    return got


def _shared_gate(rank, kbench):
    """One model gate verdict for all ranks: the gate of the interp module run as the cuda
    backend's (api._gated with the CUDA-graph runner's stand-in, tests/test_cuda_graphs.py), its
    timing replaced by a fake whose times make the ranks disagree: on rank 0 kbench's module is
    faster and its graphs are not; on rank 1 the original is faster and the graphs are."""
    from kbench import api
    from kbench.runtime import graphs
    from kbench.tune import gate
    from test_cuda_graphs import graphed
    timed, runners = [], []

    def compare(model, optimized, args, kwargs, device, ungraphed=None):
        timed.append(rank)
        with torch.no_grad():
            for _ in range(graphs.WARMUP + 2):
                optimized(*args)        # the timed calls replay its graphs
        return gate.decide(2.0, 1.2, False, 1.0, 5.0, 5.0) if rank == 0 else gate.decide(2.0, 2.5, False, 3.0, 5.0, 5.0)

    def gated(model, optimized, args, kwargs, backend, device, options, capture_key=None):
        runners.append(graphed(optimized, option="auto"))
        return real_gated(model, optimized, args, kwargs, "cuda", device, options, capture_key)
    real_gated, real_compare = api._gated, gate.compare
    api._gated, gate.compare = gated, compare
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            m = kbench.optimize(DDP(Block()), (torch.randn(8, 16, 32),), backend="interp", verbose=False,
                                gate="measure")
    finally:
        api._gated, gate.compare = real_gated, real_compare
    opt = m.module
    return {"timed": timed, "original": bool(opt._kbench_original), "graphs off": runners[0].off,
            "line": opt._kbench_gate, "tuning": opt.kbench_report.notes}


def _fsdp(rank, world, kbench):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from kbench.runtime import interp
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block())
    twin = copy.deepcopy(model)
    x = torch.randn(8, 16, 32, generator=torch.Generator().manual_seed(rank))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model[0] = kbench.optimize(model[0], (x,), backend="interp", verbose=False, strict=True)
    for m in (model, twin):
        for block in m:
            fully_shard(block, mesh=mesh)
        fully_shard(m, mesh=mesh)
    runs, real = [0], interp.InterpExecutor.run

    def counted(self, *a, **kw):
        runs[0] += 1
        return real(self, *a, **kw)
    interp.InterpExecutor.run = counted
    losses = []
    for m in (model, twin):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        got = []
        for _ in range(3):
            opt.zero_grad()
            loss = m(x).pow(2).mean()
            loss.backward()
            opt.step()
            got.append(loss.item())
        losses.append(got)
    interp.InterpExecutor.run = real
    return losses, runs[0], sorted(model[0]._kbench_reasons)


@pytest.fixture(scope="module")
def ranks():
    """Each rank's results (2 processes, gloo), run once for the tests below."""
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    mp.start_processes(_worker, args=(2, _free_port(), out), nprocs=2, start_method="spawn")
    return dict(out.get() for _ in range(2))


def test_ddp_trains_like_eager_ddp(ranks):
    got = {rank: dict(results) for rank, results in ranks.items()}
    for rank, results in got.items():
        results.pop("gate")
        (ours, ref), runs, reasons = results.pop("fsdp")
        tuning = results.pop("tuning")
        want = "rank 0 of 2 tuned" if rank == 0 else "rank 1 of 2 received rank 0's"
        assert len(tuning["note"]) == 1 and want in tuning["note"][0], tuning["note"]
        assert "rank 1 differs from rank 0 in the example inputs" in tuning["differ"], tuning["differ"]
        assert tuning["failed"] == ("ValueError: planted on rank 0" if rank == 0 else
                                    "RuntimeError: kbench.optimize failed on rank 0 (ValueError: planted on rank 0); "
                                    "rank 1 stops too"), tuning["failed"]
        assert tuning.get("alone", []) == []
        assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(ours, ref)), (rank, ours, ref)
        assert runs >= 3 and reasons == [], (runs, reasons)    # kbench's regions ran at each step
        assert len(results) == 4
        for (order, unused), (losses, params, same, kind) in results.items():
            ours, ref = losses
            assert kind == "OptimizedModule", (order, kind)
            assert same, order     # the optimized module trains the model's own parameters
            assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(ours, ref)), (rank, order, unused, losses)
            assert params <= 1e-5, (rank, order, unused, params)
    # the ranks' data differ, the all-reduced parameters do not: each rank's losses differ
    assert got[0][("ddp_of_optimized", False)][0] != got[1][("ddp_of_optimized", False)][0]


def test_every_rank_applies_rank_0s_gate_verdict(ranks):
    """Rank 0 times (its fake says: kbench's module, without its graphs); rank 1, whose own times
    would run the original with graphs, times nothing and applies rank 0's verdict, and says so."""
    zero, one = ranks[0]["gate"], ranks[1]["gate"]
    assert zero["timed"] == [0] and one["timed"] == [], (zero["timed"], one["timed"])
    for got in (zero, one):
        assert not got["original"], got["line"]
        assert got["graphs off"].startswith("the model gate timed the call at 1.2 ms with graphs, 1 ms without"), got
    assert "rank 0's verdict" not in zero["line"] and "eager 2 ms, kbench 1 ms" in zero["line"]
    assert "rank 0's verdict, applied on every rank, measured" in one["line"] and "eager 2 ms, kbench 1 ms" in one["line"]
    assert one["graphs off"].endswith("(rank 0's verdict, applied on every rank)")
    assert any("and its model gate's verdict" in n for n in zero["tuning"]), zero["tuning"]
