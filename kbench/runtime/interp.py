"""The interp backend: every compute region through the C interpreter on the CPU (float64
accumulation) — the reference path CI runs end to end."""
from __future__ import annotations

import torch

from .. import _C
from ..dtypes import torch_dtype
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
        plan = self.plan
        info = plan.regions[r]
        ins = []
        for x in inputs:
            if x.device.type != "cpu":
                raise Fallback(f"the interp backend runs on the CPU; got a tensor on {x.device}")
            ins.append(x.contiguous())
        outs = [torch.empty(plan.graph.sizes(v, symvals), dtype=torch_dtype(plan.nodes[v]["dtype"]))
                for v in info.outputs]
        _C.interp_region(plan.partition, r, symvals, [x.data_ptr() for x in ins], [o.data_ptr() for o in outs])
        return outs
