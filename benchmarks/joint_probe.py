#!/usr/bin/env python
"""A loss's gradient in its forward (kbench/joint.py) against the forward plus each region's own
backward, on a 8192 x 32000 cross-entropy (f32 and bf16): per call and device time (CUDA graph),
peak memory, with upstream gradients 1 (loss.backward()) and 0.37 (a loss scale, 1/accumulation
steps: the joint path then scales the gradient in one more pass). The joint program is forced
here; optimize() takes it only where it is no slower in the worst case (the report says why).

    python benchmarks/joint_probe.py
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kbench  # noqa: E402
from kbench import joint  # noqa: E402
from kbench.bench import timing  # noqa: E402


def main():
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        model = torch.nn.CrossEntropyLoss().cuda()
        x = torch.randn(8192, 32000, device="cuda", dtype=dtype)
        t = torch.randint(0, 32000, (8192,), device="cuda")
        decided = kbench.optimize(model, (x, t), budget="none", verbose=False)
        slack, joint.JOINT_SLACK = joint.JOINT_SLACK, float("inf")
        forced = kbench.optimize(model, (x, t), budget="none", verbose=False)
        xs = x.clone().requires_grad_()
        forced(xs, t)                     # builds the joint program while the slack is lifted
        joint.JOINT_SLACK = slack
        separate = kbench.optimize(model, (x, t), budget="none", verbose=False, grad_in_forward=False)
        for name, f in (("eager", model), ("kbench joint", forced), ("kbench per-region", separate)):
            for g in (1.0, 0.37):
                go = torch.tensor(g, device="cuda", dtype=dtype)

                def call(f=f, go=go):
                    return torch.autograd.grad(f(xs, t), [xs], go)
                per_call = timing.time_fn(call, [()], device="cuda", reps=30)
                graph = timing.time_graph(call, [()], device="cuda", reps=10)
                torch.cuda.reset_peak_memory_stats()
                call()
                torch.cuda.synchronize()
                print(f"{str(dtype):15s} {name:18s} g={g:<5} per call {per_call.median_ms:.4f} ms  "
                      f"graph {graph.median_ms if graph else float('nan'):.4f} ms  "
                      f"peak {torch.cuda.max_memory_allocated() / 1e6:.0f} MB", flush=True)
        decided(xs, t)
        print("optimize()'s own choice:", decided._kbench_loss)


if __name__ == "__main__":
    main()
