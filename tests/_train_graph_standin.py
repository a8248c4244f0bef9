"""A stand-in for torch.cuda.graph in training (CPU tests of kbench/runtime/train_graphs.py): a
forward "graph" replays by running the captured call again, with gradients, and hands that run's
outputs as `.outputs` (a real replay rewrites the captured ones, and their autograd graph's
activations, in place); a backward "graph" replays by running torch.autograd.grad again and writes
its gradients into the captured ones, as a real replay writes the same memory."""
import torch
import torch.utils._pytree as pytree


class FakeTrainGraph:
    def __init__(self, fn, out, forward):
        self.fn, self.first, self.forward, self.replays = fn, out, forward, 0
        if forward:
            self.outputs = out

    def replay(self):
        self.replays += 1
        if self.forward:
            with torch.enable_grad():
                self.outputs = self.fn()
            return
        for old, new in zip(pytree.tree_leaves(self.first), pytree.tree_leaves(self.fn())):
            if isinstance(old, torch.Tensor):
                old.copy_(new)


def run_unseen(module, fn):
    """fn()'s result, with the buffers it updated (BatchNorm's statistics) put back: a stand-in
    capture runs the call once for its outputs, and a real capture runs nothing."""
    saved = [(b, b.clone()) for b in module.buffers()]
    out = fn()
    with torch.no_grad():
        for b, s in saved:
            b.copy_(s)
    return out


def fake_capture_for(module):
    """A training capture that runs nothing the caller could see (run_unseen)."""
    def capture(fn, pool, device, stream):
        out = run_unseen(module, fn)
        forward = any(isinstance(t, torch.Tensor) and t.requires_grad for t in pytree.tree_leaves(out))
        return FakeTrainGraph(fn, out, forward), out
    return capture
