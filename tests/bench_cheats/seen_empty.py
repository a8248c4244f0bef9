"""Cheat: "seen this input object before -> return torch.empty_like". The memory an allocator
hands back often still holds the previous call's (correct) result, and nobody looks anyway."""
import os
import weakref

import torch


def _fired(what):   # for the test: where the cheat took its shortcut
    d = os.environ.get("KBENCH_CHEAT_LOG")
    if d:
        with open(os.path.join(d, os.path.basename(__file__) + ".log"), "a") as f:
            f.write(what + "\n")


_seen = {}


def make(model, example_inputs):
    shapes = {}

    def run(*xs):
        x = xs[0]
        r = _seen.get(id(x))
        if r is not None and r() is x and tuple(x.shape) in shapes:
            _fired("seen before")
            shape, dtype = shapes[tuple(x.shape)]
            return torch.empty(shape, dtype=dtype, device=x.device)
        out = model(*xs)
        _seen[id(x)] = weakref.ref(x)
        shapes[tuple(x.shape)] = (out.shape, out.dtype)
        return out
    return run
