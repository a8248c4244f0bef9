"""The interp backend: every compute region through the C interpreter on the CPU (float64
accumulation) — the reference path CI runs end to end — and run_graph/run_region, the one way
tensors reach the interpreter: kbench._C takes buffers, never addresses (bytes checked there)."""
from __future__ import annotations

import math

import torch

from .. import _C
from ..dtypes import ir_dtype, torch_dtype
from .plan import Executor, Fallback, Status


class InterpExecutor(Executor):
    """Every region through the C interpreter on the CPU (double accumulation)."""

    name = "interp"

    def prepare(self, plan, device):
        super().prepare(plan, device)
        for info in plan.regions:
            if info.kind != "EXTERN":
                info.set_status(Status.INTERP)

    def run(self, r, symvals, inputs):
        for x in inputs:
            if x.device.type != "cpu":
                raise Fallback(f"the interp backend runs on the CPU; got a tensor on {x.device}")
        return run_region(self.plan.partition, r, symvals, inputs)


def run_graph(graph, symvals, inputs, outputs=None) -> list:
    """graph (a _C.Graph without EXTERN nodes) on CPU tensors, one per graph input, each of its
    value's shape and dtype. Returns new tensors, or writes `outputs` (tensors of the outputs'
    shapes, any dtype: copied into) and returns them."""
    return _run(graph, graph.inputs, graph.outputs, symvals, inputs, outputs,
                lambda ins, outs: _C.interp_graph(graph, symvals, ins, outs))


def run_region(partition, r, symvals, inputs, outputs=None) -> list:
    """Region r of a _C.Partition, as run_graph, on its inputs."""
    region = partition.region(r)
    return _run(partition.graph, region["inputs"], region["outputs"], symvals, inputs, outputs,
                lambda ins, outs: _C.interp_region(partition, r, symvals, ins, outs))


def _run(graph, in_ids, out_ids, symvals, inputs, outputs, call):
    symvals = list(symvals)
    if len(inputs) != len(in_ids):
        raise ValueError(f"the interpreter takes {len(in_ids)} inputs here, got {len(inputs)}")
    ins = [_input_buffer(graph, v, symvals, x, j) for j, (v, x) in enumerate(zip(in_ids, inputs))]
    # each output in a bytearray of its own, seen as a tensor; the interpreter writes the bytes
    bufs, views = [], []
    for v in out_ids:
        shape, dtype = graph.sizes(v, symvals), torch_dtype(graph.node(v)["dtype"])
        numel = math.prod(shape)
        buf = bytearray(numel * dtype.itemsize)
        bufs.append(buf)
        views.append(torch.frombuffer(buf, dtype=dtype).view(shape) if numel else torch.empty(shape, dtype=dtype))
    call(ins, bufs)
    if outputs is None:   # tensors of torch's own memory: a bytearray's cannot be resized
        return [t.clone() for t in views]
    if len(outputs) != len(views):
        raise ValueError(f"the interpreter writes {len(views)} outputs here, got {len(outputs)}")
    for j, (o, t) in enumerate(zip(outputs, views)):
        if o.shape != t.shape:
            raise ValueError(f"output {j}: shape {tuple(o.shape)}, the graph has {tuple(t.shape)} at these sizes")
        o.copy_(t)
    return list(outputs)


def _input_buffer(graph, v, symvals, x, j) -> bytearray:
    """Input j (value v) as a copy of its elements in row-major order, after checking what the
    bytes cannot show: the dtype and the shape."""
    if not isinstance(x, torch.Tensor) or x.device.type != "cpu":
        raise TypeError(f"input {j}: expected a CPU tensor, got {type(x).__name__}"
                        + (f" on {x.device}" if isinstance(x, torch.Tensor) else ""))
    want = graph.node(v)["dtype"]
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
                       torch.bool) or ir_dtype(x.dtype) != want:
        raise TypeError(f"input {j} (value %{v}): dtype {x.dtype}, the graph has {want}")
    shape = tuple(graph.sizes(v, symvals))
    if tuple(x.shape) != shape:
        raise ValueError(f"input {j} (value %{v}): shape {tuple(x.shape)}, the graph has {shape} at these sizes")
    buf = bytearray(x.numel() * x.element_size())
    if buf:
        torch.frombuffer(buf, dtype=x.dtype).copy_(x.reshape(-1))
    return buf
