"""What eager PyTorch runs for a region: the ATen calls of the FX nodes its values came from
(Captured.origin, Captured.calls), each run whole — one aten.layer_norm where the IR holds its
mean, sub, mul, rsqrt... The report's eager column and the tuner's kernel-or-torch decision time
this, not the region's decomposition run op by op (torch_eval), which launches several kernels
where eager launches one.

A node is the region's where the region holds all the values its lowering made (constants aside:
they are copied into every region that reads them). A node whose lowering is torch's call plus an
IR epilogue (a Linear's product with its bias add after it, the add in this region) counts as
torch's: eager's call does both, and runs either way, so its result is an input here. A region
holding part of any other node's values has no eager call of its own to time (`note` says why)."""
from __future__ import annotations

import dataclasses

import torch

from .. import verify
from ..dtypes import torch_dtype

# values no region owns alone: a constant is copied into every region that reads it
_SHARED_OPS = ("input", "const")


@dataclasses.dataclass
class RegionEager:
    """One region's side of eager: the FX nodes its values came from, in graph order, and what
    eager runs for them (program), or why there is nothing to time (note; program None)."""
    nodes: tuple
    program: "EagerProgram | None" = None
    note: str = ""
    torch_led: tuple = ()   # nodes whose torch call (run either way) the program takes as given

    @property
    def ops(self) -> str:
        """The program's ATen ops, short: "layer_norm, gelu"."""
        return self.program.ops if self.program is not None else ""


class EagerProgram:
    """NodeCalls run in graph order on graph values: inputs (keys: a graph value id, or
    (call, operand) for an operand the graph dropped) in, every call's results out."""

    def __init__(self, calls):
        self.calls = [_reshaping(c) for c in calls]
        made, self.inputs, self.keys = set(), [], []
        seen = set()
        for i, c in enumerate(self.calls):
            keys = []
            for k, (v, dtype, dims) in enumerate(c.operands):
                key = v if v is not None else (i, k)
                keys.append(key)
                if key not in made and key not in seen:
                    seen.add(key)
                    self.inputs.append((key, dtype, dims))
            self.keys.append(keys)
            made.update(v for _, v in c.results)
        self.signature = self._signature()

    @property
    def ops(self) -> str:
        return ", ".join(dict.fromkeys(c.op.split(".")[1] if c.op.startswith("aten.") else c.op
                                       for c in self.calls))

    def _signature(self) -> str:
        """The program as text with no FX or value names in it (repeated blocks give the same):
        which cached eager time is this program's."""
        local = {key: f"in{j}:{dtype}{list(dims)}" for j, (key, dtype, dims) in enumerate(self.inputs)}
        lines = []
        for i, (c, keys) in enumerate(zip(self.calls, self.keys)):
            lines.append(f"{c.op}({', '.join(local[k] for k in keys)}) {c.call.steps!r}")
            for axis, v in c.results:
                local[v] = f"c{i}.{axis}"
        return "\n".join(lines)

    def draw(self, given: dict, symvals, device, gen) -> list:
        """Tensors for the inputs: those in `given` (graph value id -> tensor, a region's inputs
        drawn with their index bounds), the others drawn here (integers 0 or 1: in range for any
        index)."""
        out = []
        for key, dtype, dims in self.inputs:
            t = given.get(key) if not isinstance(key, tuple) else None
            if t is None:
                shape = [verify.dim_value(d, symvals) for d in dims]
                t = verify.fill(torch.empty(shape, dtype=torch_dtype(dtype), device=device), "normal", gen)
            out.append(t)
        return out

    def run(self, tensors, symvals, device=None) -> dict:
        """Every call in order on the input tensors (draw's order): graph value id -> result."""
        env = {key: t for (key, _, _), t in zip(self.inputs, tensors)}
        for c, keys in zip(self.calls, self.keys):
            y = c.call.call([env[k] for k in keys], symvals, device)
            for axis, v in c.results:
                env[v] = y if axis is None else y[axis]
        return env


_VIEWS = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default)


def _reshaping(call):
    """call, with a view run as a reshape. A node lowered as an identity (clone, contiguous) made
    no value of its own, so no region's program holds its call: a view the model made after
    `.contiguous()` would meet the strided tensor before it (Swin's window merge). The reshape
    copies there, as the missing clone did."""
    steps = call.call.steps
    if not any(fn in _VIEWS for fn, _, _ in steps):
        return call
    new = type(call.call)([(torch.ops.aten.reshape.default if fn in _VIEWS else fn, a, k) for fn, a, k in steps],
                          call.call.name, call.call.noperands, call.call.autocast)
    return dataclasses.replace(call, call=new)


def analyze(nodes, regions, origin: dict, calls: dict) -> list:
    """A RegionEager per region (RegionInfo list of a plan whose graph has `nodes`), from the
    capture's provenance; None per region where there is none (a backward's graph)."""
    if not origin:
        return [None] * len(regions)
    where: dict = {}      # value id -> the regions holding it
    for info in regions:
        for v in info.nodes:
            where.setdefault(v, set()).add(info.index)
    made: dict = {}       # FX node name -> the values its lowering made that some region holds
    for v, name in origin.items():
        if v in where and nodes[v]["op"] not in _SHARED_OPS:
            made.setdefault(name, []).append(v)
    order = {name: i for i, name in enumerate(calls)}
    out = []
    for info in regions:
        names = tuple(dict.fromkeys(origin[v] for v in info.nodes
                                    if v in origin and nodes[v]["op"] not in _SHARED_OPS))
        if info.kind == "EXTERN":
            out.append(RegionEager(names))
            continue
        mine, led, why = set(info.nodes), [], []
        run = []
        for name in names:
            others = set().union(*(where[v] for v in made[name])) - {info.index}
            call = calls.get(name)
            if call is not None and not others:
                run.append(name)
            elif call is not None and all(regions[o].kind == "EXTERN" for o in others) \
                    and call.results and all(v in mine for _, v in call.results):
                led.append(name)   # torch's call runs either way; its result is given
            elif call is None:
                why.append(f"it holds values of {name}, which has no ATen call of its own here")
            else:
                rest = (f"region{'s' if len(others) > 1 else ''} {', '.join(map(str, sorted(others)))}"
                        if others else "torch")
                why.append(f"it holds part of {name} ({call.op}), the rest is in {rest}")
        if why:
            out.append(RegionEager(names, None, "no eager time: " + "; ".join(why), tuple(led)))
            continue
        program = EagerProgram([calls[n] for n in sorted(run, key=order.get)]) if run else None
        out.append(RegionEager(names, program, "" if program is not None else "no eager time: no ATen call of its own",
                               tuple(led)))
    return out
