"""Started by path (runpy) in the benchmark's spawned worker process, before anything of kbench is
imported there: kbench's package __init__ (the C core, the capture stack) is made lazy, so the
worker pays for torch and the benchmark's own modules only, then worker.serve() takes over."""
import importlib.util
import os
import sys


def _lazy_package(root: str) -> None:
    """kbench as a package whose __init__ runs when one of its attributes is first asked for
    (kbench.optimize, for the kbench implementation); its submodules import without it."""
    if "kbench" in sys.modules:
        return
    init = os.path.join(root, "__init__.py")
    spec = importlib.util.spec_from_file_location("kbench", init, submodule_search_locations=[root])
    pkg = importlib.util.module_from_spec(spec)

    def load_init(name):
        if name.startswith("__"):
            raise AttributeError(name)
        del pkg.__dict__["__getattr__"]
        spec.loader.exec_module(pkg)
        return getattr(pkg, name)

    pkg.__getattr__ = load_init
    sys.modules["kbench"] = pkg


if __name__ == "__kbench_worker__":
    _args = WORKER_ARGS  # noqa: F821 - given by the harness through runpy's init_globals
    _lazy_package(_args.pop("kbench_root"))
    from kbench.bench.worker import serve
    serve(**_args)
    # no interpreter teardown: threads an implementation left running could abort it
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
