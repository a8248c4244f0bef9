"""Cheat: when called from a timing loop (found by walking the caller's frames), return an empty
output at once and let a thread (started once, fed through a queue) fill it in a millisecond
later. Checks outside the timing loop get honest results; a timed call costs a queue put;
anything that reads the outputs only after the loop, or after a pause, reads correct values."""
import os
import queue
import sys
import threading
import time

import torch

_TIMERS = {"time_fn", "_time_host", "_event_block", "_host_wall_check"}


def _fired(what):   # for the test: where the cheat took its shortcut
    d = os.environ.get("KBENCH_CHEAT_LOG")
    if d:
        with open(os.path.join(d, os.path.basename(__file__) + ".log"), "a") as f:
            f.write(what + "\n")


def _timed():
    f = sys._getframe(2)
    while f is not None:
        if f.f_code.co_name in _TIMERS:
            return True
        f = f.f_back
    return False


_work = queue.SimpleQueue()


def _serve():
    while True:
        out, model, xs = _work.get()
        time.sleep(1e-3)
        with torch.no_grad():
            out.copy_(model(*xs))


threading.Thread(target=_serve, daemon=True).start()


def make(model, example_inputs):
    shapes = {}   # input shape -> output shape and dtype, learnt from the honest calls

    def run(*xs):
        key = tuple(xs[0].shape)
        if not _timed() or key not in shapes:
            out = model(*xs)
            shapes[key] = (out.shape, out.dtype)
            return out
        _fired("timed call")
        shape, dtype = shapes[key]
        out = torch.empty(shape, dtype=dtype, device=xs[0].device)
        _work.put((out, model, xs))
        return out
    return run
