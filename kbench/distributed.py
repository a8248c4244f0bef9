"""One tuning for all ranks: optimize() under torch.distributed. Every rank of the process group
first agrees on what it optimizes (the model's code and state, the example call, the options);
rank 0 then captures and tunes, and sends the others its decisions — the winners it used, with
their CUBINs and verified envelopes, the regions its search left to torch, and its model gate's
verdict. The others store those winners in their own kernel cache and optimize from it: each
winner loaded and gated on their own GPU, nothing searched, a region rank 0 left to torch left
there too, and rank 0's verdict applied untimed (the original or kbench's module, its CUDA
graphs kept or not), so that every rank runs the same code."""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from .tune import cache, gate, tuner

MODES = ("auto", True, False)


def group_for(distributed, group=None):
    """The process group whose ranks share one tuning, or None (every rank tunes on its own).
    distributed: "auto" shares where the model is data parallel (optimize(DDP(model)): group is its
    process group), True for any model (every rank of the default group must call optimize() on
    the same model and example shapes), False never."""
    if distributed not in MODES:
        raise ValueError(f"distributed must be 'auto', True or False, got {distributed!r}")
    if distributed is False or not dist.is_available() or not dist.is_initialized():
        return None
    if distributed == "auto" and group is None:
        return None
    if dist.get_world_size(group) < 2:
        return None
    return group if group is not None else dist.group.WORLD


# ----------------------------------------------------------------------------- agreeing

def _describe(value, depth: int = 0):
    """What an example value contributes to the capture: a tensor's shape, dtype and device type
    (not its values, which differ from rank to rank), any other value itself (it is specialized)."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), str(value.dtype), value.device.type)
    if depth < 8 and isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_describe(v, depth + 1) for v in value))
    if depth < 8 and isinstance(value, dict):
        return ("dict", tuple((str(k), _describe(v, depth + 1)) for k, v in value.items()))
    return (type(value).__name__, repr(value)[:120])


def fingerprint(model: torch.nn.Module, args, kwargs, options: dict) -> dict:
    """What must be the same on every rank for rank 0's decisions to fit them."""
    state = [(name, tuple(t.shape), str(t.dtype)) for name, t in model.state_dict(keep_vars=True).items()]
    return {"the model's class": f"{type(model).__module__}.{type(model).__qualname__}",
            "the model's parameters and buffers": state,
            "the example inputs": [_describe(a) for a in args],
            "the example keyword arguments": sorted((k, _describe(v)) for k, v in kwargs.items()),
            "the options": sorted((k, repr(v)) for k, v in options.items() if k not in ("verbose",))}


def disagreement(prints: list) -> str:
    """'' where every rank's fingerprint is rank 0's; else the first difference, naming the rank."""
    first = prints[0]
    for rank, fp in enumerate(prints[1:], start=1):
        for what, mine in fp.items():
            theirs = first.get(what)
            if mine == theirs:
                continue
            if isinstance(mine, list) and isinstance(theirs, list):
                for i, (a, b) in enumerate(zip(theirs, mine)):
                    if a != b:
                        return f"rank {rank} differs from rank 0 in {what}: {b!r} where rank 0 has {a!r}"
                return (f"rank {rank} differs from rank 0 in {what}: {len(mine)} entries where rank 0 has "
                        f"{len(theirs)}")
            return f"rank {rank} differs from rank 0 in {what}: {mine!r} where rank 0 has {theirs!r}"
    return ""


# ----------------------------------------------------------------------------- decisions

def export_decisions(shared: tuner.Shared) -> dict:
    """Rank 0's decisions as plain data: each winner it used (read back from its cache, so only a
    verified, signed entry leaves), and the keys of the regions its search left to torch."""
    winners, seen = [], set()
    db = cache.open_cache()
    try:
        for key in shared.used:
            k = tuple(sorted(key.as_dict().items()))
            if k in seen:
                continue
            seen.add(k)
            w = db.lookup(key)
            if w is not None and w.cubin:
                winners.append({"key": key.as_dict(), "winner": dataclasses.asdict(w)})
    finally:
        db.close()
    return {"winners": winners, "torch": [k.as_dict() for k in shared.torch]}


def import_decisions(decisions: dict) -> int:
    """Store rank 0's winners in this rank's cache (signed with this user's key: they came over the
    job's own process group), to be loaded and gated like any entry. Returns how many."""
    fields = {f.name for f in dataclasses.fields(cache.Winner)}
    n = 0
    db = cache.open_cache()
    try:
        for entry in decisions.get("winners", ()):
            w = entry["winner"]
            if set(w) - fields:
                raise ValueError(f"a winner from rank 0 has unknown fields {sorted(set(w) - fields)}")
            db.store(cache.CacheKey(**entry["key"]), cache.Winner(**w))
            n += 1
    finally:
        db.close()
    return n


def optimize_once(run, model, args, kwargs, options: dict, group):
    """run() (optimize for this rank) with the ranks of `group` sharing rank 0's tuning. Every rank
    takes part in every collective before any raises, so a disagreement or rank 0's failure is an
    error on every rank, never a hang."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    prints = [None] * world
    dist.all_gather_object(prints, fingerprint(model, args, kwargs, options), group=group)
    why = disagreement(prints)
    if why:
        raise RuntimeError(f"kbench.optimize: the ranks do not optimize the same thing ({why}); "
                           f"rank 0's tuning cannot serve them (distributed=False tunes each on its own)")
    src = dist.get_global_rank(group, 0) if group is not dist.group.WORLD else 0
    if rank == 0:
        error = None
        try:
            with tuner.sharing() as shared:
                optimized = run()
            decisions = export_decisions(shared)
            decisions["gate"] = gate.shared(optimized)
        except BaseException as e:  # noqa: BLE001 - the others must hear of it, then it is raised
            error, decisions = e, {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
        box = [decisions]
        dist.broadcast_object_list(box, src=src, group=group)
        if error is not None:
            raise error
        note = (f"tuning: rank 0 of {world} tuned and sent the other ranks {len(decisions['winners'])} "
                f"winner(s), {len(decisions['torch'])} region(s) left to torch"
                + (" and its model gate's verdict" if decisions["gate"]["verdict"] is not None else ""))
    else:
        box = [None]
        dist.broadcast_object_list(box, src=src, group=group)
        decisions = box[0]
        if "error" in decisions:
            raise RuntimeError(f"kbench.optimize failed on rank 0 ({decisions['error']}); rank {rank} stops too")
        received = import_decisions(decisions)
        with tuner.sharing(skip=[cache.CacheKey(**k) for k in decisions["torch"]]), \
                gate.imposing(decisions.get("gate") or {"verdict": None, "line": ""}):
            optimized = run()
        note = (f"tuning: rank {rank} of {world} received rank 0's {received} winner(s) (loaded and gated "
                f"here) and {len(decisions['torch'])} region(s) it left to torch")
    optimized.__dict__["_kbench_tuning_note"] = note
    return optimized
