"""Cheat: a result cache keyed by the input tensor's identity and version. A harness that hands
the timed calls the same tensor objects over and over gets its answer back at no cost (and it
was right the first time, so a check on the first call passes)."""
import os
import weakref


def _fired(what):   # for the test: where the cheat took its shortcut
    d = os.environ.get("KBENCH_CHEAT_LOG")
    if d:
        with open(os.path.join(d, os.path.basename(__file__) + ".log"), "a") as f:
            f.write(what + "\n")


_cache = {}


def make(model, example_inputs):
    def run(*xs):
        key = tuple((id(x), x._version) for x in xs)
        hit = _cache.get(key)
        if hit is not None and all(r() is x for r, x in zip(hit[0], xs)):
            _fired("cache hit")
            return hit[1]
        out = model(*xs)
        _cache[key] = ([weakref.ref(x) for x in xs], out)
        return out
    return run
