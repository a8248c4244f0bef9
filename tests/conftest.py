"""Test configuration.

- `gpu`-marked tests are skipped where CUDA is not available.
- With pytest-xdist installed, `python -m pytest` runs on every core (`-n`, work stealing) unless
  told otherwise (`-n 0`, `-p no:xdist`, KBENCH_TEST_WORKERS=N), or unless GPU tests may be selected
  (they share one device and time kernels).
- A missing NVRTC skips the compile-only tests, but fails them where KBENCH_REQUIRE_NVRTC=1 (CI,
  whose .ci/run installs NVRTC): `nvrtc_missing`.
- `compile_once` compiles generated sources with NVRTC, each distinct (source, arch) once per test
  session, across xdist's workers too, several at once.
"""
import concurrent.futures as cf
import hashlib
import os

import pytest
import torch


# ---------------------------------------------------------------- pytest-xdist by default

def _worker_count():
    env = os.environ.get("KBENCH_TEST_WORKERS")
    if env:
        return int(env)
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return min(cores, 8)


@pytest.hookimpl(tryfirst=True)   # before xdist's own (tryfirst too; a conftest registers after it)
def pytest_cmdline_main(config):
    """`-n <cores>` where pytest-xdist is installed and no -n, --dist or --tx was given."""
    if hasattr(config, "workerinput") or os.environ.get("PYTEST_XDIST_WORKER"):
        return   # an xdist worker (it parses the same arguments): never workers of its own
    opt = config.option
    if getattr(opt, "numprocesses", "no xdist") is not None or getattr(opt, "dist", "no") != "no" \
            or getattr(opt, "tx", None) or getattr(opt, "distload", False):
        return
    if config.getoption("usepdb", False) or config.getoption("collectonly", False):
        return
    mark = (config.getoption("markexpr", "") or "").replace(" ", "")
    if "gpu" in mark and mark != "notgpu":
        return   # GPU tests share the device and time kernels: one process
    n = _worker_count()
    if n > 1:
        opt.numprocesses = n
        opt.dist = "worksteal"   # a few tests take 10-20 s: idle workers take queued ones


def _one_share_of_the_cores():
    """In an xdist worker: torch's intra-op threads limited to the worker's share of the cores.
    Each worker's OpenMP pool would otherwise take every core, and workers spinning on each
    other's cores make small CPU ops 10-25x slower. Subprocesses a test starts inherit it."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if workers < 1:
        return
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    share = max(1, cores // workers)
    os.environ["OMP_NUM_THREADS"] = str(share)
    torch.set_num_threads(share)


_one_share_of_the_cores()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="session")
def _private_cache_dir(tmp_path_factory):
    """optimize() keeps kernels and captures in $KBENCH_CACHE_DIR (default ~/.cache/kbench): the
    tests use a directory of their own unless one is given."""
    if "KBENCH_CACHE_DIR" in os.environ:
        yield
        return
    os.environ["KBENCH_CACHE_DIR"] = str(tmp_path_factory.mktemp("kbench-cache"))
    try:
        yield
    finally:
        os.environ.pop("KBENCH_CACHE_DIR", None)


def session_dir(tmp_path_factory, name):
    """A folder of this test session shared by its xdist workers (a worker's basetemp is a
    subfolder of the session's), created on first use."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    path = base / name
    path.mkdir(parents=True, exist_ok=True)
    return path


# ---------------------------------------------------------------- NVRTC

REQUIRE_NVRTC = os.environ.get("KBENCH_REQUIRE_NVRTC", "") not in ("", "0")


def nvrtc_missing(why):
    """NVRTC (or its headers) is not there: skip, or fail where KBENCH_REQUIRE_NVRTC=1 (CI)."""
    if REQUIRE_NVRTC:
        pytest.fail(f"{why} (KBENCH_REQUIRE_NVRTC is set: NVRTC must be here)", pytrace=False)
    pytest.skip(why)


@pytest.fixture(scope="session")
def nvrtc():
    """The process's NVRTC handle (kbench.runtime.nvrtc.handle(): the product's search order)."""
    from kbench.runtime import nvrtc as nv
    try:
        return nv.handle()
    except (FileNotFoundError, OSError) as e:
        nvrtc_missing(f"no NVRTC here: {str(e).splitlines()[0]}")


def one_unit(sources):
    """Several generated sources as one CUDA translation unit, for a compile-only check: the
    #includes once at the top, each source's body in a namespace of its own with C++ linkage (so
    kernels of the same name do not clash) and its #defines undone after it. NVRTC then parses
    the headers once for all of them (about 40% of a kernel's compile), and ptxas still builds
    every kernel."""
    includes, bodies = [], []
    for i, src in enumerate(sources):
        lines = src.splitlines()
        includes += [ln for ln in lines if ln.startswith("#include") and ln not in includes]
        defined = [ln.split()[1] for ln in lines if ln.startswith("#define ")]
        body = "\n".join(ln for ln in lines if not ln.startswith("#include")).replace('extern "C" ', "")
        bodies.append(f"namespace kb_unit_{i} {{\n{body}\n}}\n" + "".join(f"#undef {d}\n" for d in defined))
    return "\n".join(includes) + "\n" + "".join(bodies)


@pytest.fixture(scope="session")
def compile_once(nvrtc, tmp_path_factory):
    """compile_once([(source, arch), ...], together=False) -> [CUBIN bytes, ...], in order. Each
    distinct (source, arch) is compiled by NVRTC once in the test session: within a process a
    memo, across xdist's workers NVRTC's own on-disk CUBIN cache (kbench._C.nvrtc_compile's
    cache_dir) in a folder of this session, so every entry was compiled by this session's NVRTC.
    Compiles run in threads (nvrtc_compile releases the GIL). A CompileError propagates with
    NVRTC's log, noted with the item's label. together=True: up to UNIT sources of one arch are
    compiled as one translation unit (one_unit), and each gets that unit's CUBIN, whose kernel
    names are C++-mangled: for tests that only ask whether a source compiles. A unit that fails
    is compiled source by source, so the error names the source at fault."""
    from kbench import _C
    cache = str(session_dir(tmp_path_factory, "nvrtc-cubin"))
    memo = {}
    threads = max(2, _worker_count())
    UNIT = 8

    def key(src, arch, together=False):
        return hashlib.sha256(src.encode()).hexdigest(), arch, together

    secret = hashlib.sha256(cache.encode()).digest()   # one per session folder: every worker's

    def one(src, arch):
        return _C.nvrtc_compile(nvrtc, src, arch, cache, secret)

    def unit(entries):
        """entries: [(key, (src, arch, label)), ...] of one arch -> {key: CUBIN}"""
        arch = entries[0][1][1]
        try:
            cubin = one(one_unit([src for _, (src, _, _) in entries]), arch)
        except _C.CompileError:
            for _, (src, _, label) in entries:
                try:
                    one(src, arch)
                except _C.CompileError as e:
                    if hasattr(e, "add_note"):   # Python 3.11
                        e.add_note(f"compiling {label or ''} for {arch}")
                    raise
            raise   # every source compiles alone: the unit's own error
        return {k: cubin for k, _ in entries}

    def compile_all(items, together=False):
        """items: (source, arch) or (source, arch, label); a label names the item in an error."""
        items = [tuple(it) + (None,) * (3 - len(it)) for it in items]
        todo = {}
        for src, arch, label in items:
            k = key(src, arch, together)
            if k not in memo and k not in todo:
                todo[k] = (src, arch, label)
        if not todo:
            return [memo[key(src, arch, together)] for src, arch, _ in items]
        if together:
            by_arch = {}
            for k, v in todo.items():
                by_arch.setdefault(v[1], []).append((k, v))
            jobs = [(unit, ents[i:i + UNIT]) for ents in by_arch.values() for i in range(0, len(ents), UNIT)]
        else:
            jobs = [(lambda e: {e[0]: one(e[1][0], e[1][1])}, e) for e in todo.items()]
        with cf.ThreadPoolExecutor(max_workers=min(threads, len(jobs))) as pool:
            futures = [(pool.submit(fn, arg), arg) for fn, arg in jobs]
            for f, arg in futures:
                try:
                    memo.update(f.result())
                except Exception as e:
                    if not together and hasattr(e, "add_note"):
                        e.add_note(f"compiling {arg[1][2] or ''} for {arg[1][1]}")
                    raise
        return [memo[key(src, arch, together)] for src, arch, _ in items]

    compile_all.stats = memo
    return compile_all


@pytest.fixture
def exports(monkeypatch):
    """A list that grows by one at each torch.export.export call of the test (a capture that
    should come from the cache, or re-lower one export, runs none or one)."""
    calls = []
    real = torch.export.export

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)
    monkeypatch.setattr(torch.export, "export", counted)
    return calls
