"""Cheat (CUDA): "seen this input object before -> launch the work on a side stream and return
without making the caller's stream wait". Events on the current stream see nothing; the output
is written some time after a consumer on that stream may already have read it."""
import os
import weakref

import torch


def _fired(what):   # for the test: where the cheat took its shortcut
    d = os.environ.get("KBENCH_CHEAT_LOG")
    if d:
        with open(os.path.join(d, os.path.basename(__file__) + ".log"), "a") as f:
            f.write(what + "\n")


_seen = {}
_side = []


def make(model, example_inputs):
    def run(*xs):
        x = xs[0]
        r = _seen.get(id(x))
        if r is not None and r() is x and x.is_cuda:
            _fired("seen before")
            if not _side:
                _side.append(torch.cuda.Stream(x.device))
            _side[0].wait_stream(torch.cuda.current_stream(x.device))   # the inputs are ready
            with torch.cuda.stream(_side[0]):
                torch.cuda._sleep(200_000)
                return model(*xs)
        _seen[id(x)] = weakref.ref(x)
        return model(*xs)
    return run
