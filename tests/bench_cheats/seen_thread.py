"""Cheat: "seen this input object before -> return at once and compute on a thread". The call
returns an empty tensor that a thread (started once, fed through a queue, so a call costs
microseconds) fills in; a timer that stops at the return sees no work."""
import os
import queue
import threading
import weakref

import torch


def _fired(what):   # for the test: where the cheat took its shortcut
    d = os.environ.get("KBENCH_CHEAT_LOG")
    if d:
        with open(os.path.join(d, os.path.basename(__file__) + ".log"), "a") as f:
            f.write(what + "\n")


_seen = {}
_work = queue.SimpleQueue()


def _serve():
    while True:
        out, model, xs = _work.get()
        with torch.no_grad():
            out.copy_(model(*xs))


threading.Thread(target=_serve, daemon=True).start()


def make(model, example_inputs):
    shapes = {}

    def run(*xs):
        x = xs[0]
        r = _seen.get(id(x))
        if r is not None and r() is x and tuple(x.shape) in shapes:
            _fired("seen before")
            shape, dtype = shapes[tuple(x.shape)]
            out = torch.empty(shape, dtype=dtype, device=x.device)
            _work.put((out, model, xs))
            return out
        out = model(*xs)
        _seen[id(x)] = weakref.ref(x)
        shapes[tuple(x.shape)] = (out.shape, out.dtype)
        return out
    return run
