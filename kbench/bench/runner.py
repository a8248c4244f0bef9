"""Where an implementation runs, as the harness sees it (docs/benchmarking.md, "The trust
boundary"): LocalRunner runs trusted callables (the built-in baselines, callables handed to the
harness) in this process; WorkerRunner runs implementation files in a worker process started
with multiprocessing's "spawn", and reads back only JSON and tensor bytes it checks. Both give
the harness the same answers (worker.Session's), so its checks do not depend on where the code
ran."""
from __future__ import annotations

import copy
import glob
import json
import math
import multiprocessing
import os
import runpy
import tempfile
import time
import uuid
import weakref
from typing import Callable, Optional

import torch

from . import worker

MAX_REPLY_BYTES = 16 << 20
# Seconds a worker may take to answer, by request: loading a .cu file compiles it; building
# kbench's implementation searches kernels; one call should be quick; timing runs many.
TIMEOUTS = {"load": 1200.0, "build": 3600.0, "call": 600.0, "time": 1200.0, "state": 300.0,
            "set_state": 300.0, "drop": 60.0, "arena": 60.0, "profile": 120.0}
ARENA_MIN_BYTES = 1 << 20


class WorkerError(Exception):
    """The worker died, hung, or answered outside the protocol. The message says which."""


class Tampered(WorkerError):
    """The implementation replaced the harness's code in the worker: nothing it reports can be
    trusted, whatever the request was."""


def _nbytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts if isinstance(t, torch.Tensor))


def _proc_cpu_s(pid: int) -> Optional[float]:
    """CPU seconds process `pid` has run, all threads, read by this process from /proc (Linux),
    so the worker cannot alter it; None where it cannot be read. The larger of two counts: the
    live threads' schedstat (nanoseconds, but a thread that has ended drops out) and the
    process's utime + stime (which keep ended threads, in clock ticks)."""
    fine = 0
    try:
        for path in glob.glob(f"/proc/{pid}/task/*/schedstat"):
            with open(path) as f:
                fine += int(f.read().split()[0])
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        coarse = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
    return max(fine * 1e-9, coarse)


class _Marks:
    """The wall-clock loop as the runner's own clocks saw it: (wall s, CPU s or None) per loop."""

    def __init__(self, cpu: Callable[[], Optional[float]]):
        self.cpu, self.loops, self._start = cpu, [], None

    def __call__(self, label: str) -> None:
        now = (time.perf_counter(), self.cpu())
        if label == "wall-start":
            self._start = now
        elif label == "wall-end" and self._start is not None:
            (t0, c0), (t1, c1) = self._start, now
            self.loops.append((t1 - t0, None if c0 is None or c1 is None else c1 - c0))
            self._start = None


class LocalRunner:
    """Trusted code, run in this process through the same Session the worker uses. The model it
    gets is a copy: the harness's own model stays untouched."""

    def __init__(self, factory: Callable, device):
        self.factory = factory
        self.device = torch.device(device)
        self.session = worker.Session(device)

    def build(self, key, task, cfg, dtype, init, seed, model) -> None:
        self.session.build(key, copy.deepcopy(model), self.factory,
                           task.inputs(cfg, dtype, self.device, seed=seed))

    def drop(self, key) -> None:
        self.session.drop(key)

    def set_state(self, key, values) -> None:
        self.session.set_state(key, values)

    def state(self, key) -> list:
        return [t.clone() for t in self.session.state(key)]

    def call(self, key, xs, gouts, backward, poison_kind, expect, model_first=False) -> dict:
        return self.session.call(key, xs, gouts, backward, poison_kind, expect, model_first)

    def time(self, key, arg_sets, gouts, backward, **opts) -> dict:
        marks = _Marks(time.process_time)
        r = self.session.time(key, [worker.clone_args(a) for a in arg_sets], gouts, backward,
                              mark=marks, **opts)
        r["marks"] = marks.loops
        return r

    def profile(self, key, xs, gouts, backward) -> dict:
        return clean_profile(self.session.profile(key, worker.clone_args(xs), gouts, backward))

    def close(self) -> None:
        self.session = worker.Session(self.device)


class Worker:
    """One worker process, started with multiprocessing's "spawn" on first use and again after
    it died, and the exchange file shared with it. Replies are read as JSON (never unpickled);
    a reply that breaks the protocol, a death or a request unanswered within its timeout stops
    the worker and raises WorkerError."""

    def __init__(self, device, timeouts=None):
        self.device = torch.device(device)
        self.timeouts = dict(TIMEOUTS, **(timeouts or {}))
        self.proc = self.conn = self.arena = self._finalizer = None
        self.dead: Optional[str] = None   # why the last process stopped answering
        self.loaded: dict = {}            # spec -> the implementation's name, in this process
        self.keys: set = set()            # what is built in this process
        self.state_bytes = 1 << 20        # the largest model state sent (room for answers)

    @property
    def running(self) -> bool:
        return self.proc is not None

    def start(self) -> None:
        if self.proc is not None:
            return
        ctx = multiprocessing.get_context("spawn")
        mine, theirs = ctx.Pipe()
        self.arena = _new_arena(ARENA_MIN_BYTES)
        args = {"conn": theirs, "arena_path": self.arena.path, "arena_bytes": self.arena.nbytes,
                "device": str(self.device), "threads": torch.get_num_threads(),
                "kbench_root": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
        self.proc = ctx.Process(target=runpy.run_path, args=(worker.boot_path(),),
                                kwargs={"run_name": "__kbench_worker__",
                                        "init_globals": {"WORKER_ARGS": args}},
                                name="kbench-bench-worker")
        self.proc.start()
        theirs.close()
        self.conn, self.dead, self.loaded, self.keys = mine, None, {}, set()
        self._finalizer = weakref.finalize(self, _stop, self.proc, self.conn, self.arena.path)

    def close(self) -> None:
        if self._finalizer is not None:
            self._finalizer()
        self.proc = self.conn = self._finalizer = None
        self.loaded, self.keys = {}, set()

    def fail(self, why: str):
        self.dead = why
        self.close()
        raise WorkerError(why)

    def request(self, req: dict, on_mark: Optional[Callable] = None) -> dict:
        op = req["op"]
        if self.proc is None:
            raise WorkerError(self.dead or "the worker is not running")
        timeout = self.timeouts.get(op, 600.0)
        try:
            self.conn.send(req)
        except (OSError, ValueError) as e:
            self.fail(f"the worker process is gone ({self._exit()}): {e}")
        deadline = time.monotonic() + timeout
        while True:
            if not self.conn.poll(max(0.0, deadline - time.monotonic())):
                if not self.proc.is_alive():
                    self.fail(f"the worker process died ({self._exit()})")
                self.fail(f"the worker did not answer a {op!r} request in {timeout:g} s "
                          f"(stopped)")
            try:
                data = self.conn.recv_bytes(MAX_REPLY_BYTES)
            except (EOFError, OSError):
                self.fail(f"the worker process died ({self._exit()}) during a {op!r} request")
            try:
                msg = json.loads(data.decode())
                if not isinstance(msg, dict):
                    raise ValueError("not an object")
            except (ValueError, UnicodeDecodeError) as e:
                self.fail(f"the worker sent a reply that is not JSON ({e})")
            if "mark" in msg and "reply" not in msg:
                if on_mark is not None and msg["mark"] in ("wall-start", "wall-end"):
                    on_mark(msg["mark"])
                continue
            if msg.get("reply") != op:
                self.fail(f"the worker answered {str(msg.get('reply'))[:40]!r} to a {op!r} "
                          f"request")
            if msg.get("tampered"):
                names = ", ".join(str(n)[:80] for n in list(msg["tampered"])[:6])
                why = (f"the implementation replaced the harness's code in the worker "
                       f"({names}): nothing it reports can be trusted (worker stopped)")
                self.dead = why
                self.close()
                raise Tampered(why)
            if "error" in msg:
                raise WorkerError(str(msg["error"])[:2000])
            return msg

    def _exit(self) -> str:
        self.proc.join(timeout=5)
        code = self.proc.exitcode
        if code is None:
            return "still running"
        return f"exit code {code}" if code >= 0 else f"killed by signal {-code}"

    def room(self, nbytes: int) -> None:
        """Make the exchange file at least nbytes long (a new, larger file)."""
        if nbytes <= self.arena.nbytes:
            return
        old = self.arena
        self.arena = _new_arena(max(nbytes, 2 * old.nbytes))
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _stop, self.proc, self.conn, self.arena.path)
        try:
            self.request({"op": "arena", "path": self.arena.path, "nbytes": self.arena.nbytes})
        finally:
            _unlink(old.path)

    def put_all(self, groups: list, extra: int) -> tuple:
        """Write lists of tensors at the start of the file, with room for `extra` bytes of
        answer after them: their descriptions, and where the answer may start."""
        need = sum(_nbytes(g) + worker.Arena.ALIGN * (len(g) + 1) for g in groups)
        self.room(need + extra + worker.Arena.ALIGN)
        off, out = 0, []
        for g in groups:
            descs = []
            for t in g:
                if t is None:
                    descs.append(None)
                    continue
                d, off = self.arena.write(t.detach().cpu(), off)
                descs.append(d)
            out.append(descs)
        return out, off

    def get(self, desc) -> Optional[torch.Tensor]:
        if desc is None:
            return None
        try:
            return self.arena.read(desc).to(self.device, copy=True)
        except worker.ProtocolError as e:
            self.fail(f"the worker described a tensor outside the protocol: {e}")

    def gets(self, descs) -> list:
        if not isinstance(descs, list):
            self.fail("the worker sent a malformed reply (a list was expected)")
        return [self.get(d) for d in descs]


class WorkerRunner:
    """An implementation given by spec (a file, or a built-in's name), loaded and run in a
    Worker and nowhere else. Several specs may share one Worker (with_spec)."""

    def __init__(self, spec: str, device, budget: Optional[str] = None, timeouts=None,
                 proc: Optional[Worker] = None):
        self.spec, self.budget = spec, budget
        self.device = torch.device(device)
        self.w = proc or Worker(device, timeouts)
        self.load_error: Optional[str] = None   # why loading failed: not tried again

    def with_spec(self, spec: str) -> "WorkerRunner":
        return WorkerRunner(spec, self.device, self.budget, proc=self.w)

    def start(self) -> str:
        """Start the worker if needed and load the implementation there; its name. Raises
        WorkerError, with the worker's reason where it gave one. A failed load (a kernel that
        does not compile) is remembered and raised again, not retried: a compile takes minutes."""
        if self.load_error is not None:
            raise WorkerError(self.load_error)
        self.w.start()
        if self.spec not in self.w.loaded:
            try:
                r = self.w.request({"op": "load", "spec": self.spec, "budget": self.budget})
            except WorkerError as e:
                self.load_error = f"{e} (loading {self.spec})"   # the reason first: rows cut it
                raise WorkerError(self.load_error) from None
            self.w.loaded[self.spec] = str(r.get("name", os.path.basename(self.spec)))[:200]
        return self.w.loaded[self.spec]

    def close(self) -> None:
        self.w.close()

    def _key(self, key: str) -> str:
        k = f"{self.spec}::{key}"
        if k not in self.w.keys or not self.w.running:
            raise WorkerError(self.w.dead or f"nothing built under {key!r} in the worker")
        return k

    def build(self, key, task, cfg, dtype, init, seed, model) -> None:
        from .tasks import TASKS
        suite = getattr(task, "suite_spec", None)   # a public suite's task: the worker imports it
        if suite is None and TASKS.get(task.name) is not task:
            raise WorkerError(f"task {task.name!r} is not a registered task: an implementation "
                              f"file runs in a worker, which builds registered tasks only")
        self.start()
        state = list(model.state_dict(keep_vars=True).values())
        self.w.state_bytes = max(self.w.state_bytes, _nbytes(state))
        (descs,), _ = self.w.put_all([state], 0)
        k = f"{self.spec}::{key}"
        self.w.request({"op": "build", "key": k, "spec": self.spec, "task": task.name,
                        "cfg": cfg, "dtype": str(dtype), "init": init, "seed": seed,
                        "state": descs, "suite": suite})
        self.w.keys.add(k)

    def drop(self, key) -> None:
        k = f"{self.spec}::{key}"
        if k in self.w.keys and self.w.running:
            self.w.keys.discard(k)
            self.w.request({"op": "drop", "key": k})

    def set_state(self, key, values) -> None:
        k = self._key(key)
        (descs,), _ = self.w.put_all([list(values)], 0)
        self.w.request({"op": "set_state", "key": k, "state": descs})

    def state(self, key) -> list:
        k = self._key(key)
        self.w.room(2 * self.w.state_bytes + (1 << 20))
        r = self.w.request({"op": "state", "key": k, "out_start": 0})
        if r.get("full"):
            self.w.fail("the worker's model state did not fit the exchange file")
        return self.w.gets(r.get("state"))

    def call(self, key, xs, gouts, backward, poison_kind, expect, model_first=False) -> dict:
        k = self._key(key)
        # room for the answer: the outputs, the gradients (inputs and parameters), the inputs
        answer = 2 * (_nbytes(expect) + _nbytes(xs)) + self.w.state_bytes + (1 << 20)
        (in_d, g_d), start = self.w.put_all([list(xs), list(gouts or [])], answer)
        r = self.w.request({"op": "call", "key": k, "inputs": in_d,
                            "gouts": g_d if gouts is not None else None, "backward": backward,
                            "poison": poison_kind, "model_first": model_first,
                            "expect": [(str(e.dtype), list(e.shape)) for e in expect],
                            "out_start": start})
        facts, gfacts = r.get("facts"), r.get("grad_facts")
        if not isinstance(facts, list) or not isinstance(gfacts, list):
            self.w.fail("the worker sent a malformed reply (no output facts)")
        outs, grads = self.w.gets(r.get("outs")), self.w.gets(r.get("grads"))
        if r.get("full"):
            return {"error": "the outputs did not fit the exchange file (far larger than "
                             "expected)"}
        return {"facts": [_clean_fact(f) for f in facts],
                "grad_facts": [_clean_fact(f) for f in gfacts], "outs": outs, "grads": grads,
                "inputs_after": self.w.gets(r.get("inputs_after")),
                "late": [i for i in r.get("late", []) if type(i) is int]}

    def time(self, key, arg_sets, gouts, backward, *, reps, warmup, flush=True,
             max_samples=worker.MAX_SAMPLES, sample_bytes=None) -> dict:
        k = self._key(key)
        if sample_bytes is None:
            sample_bytes = worker.SAMPLE_BYTES.get(self.device.type, 64 << 20)
        groups = [list(a) for a in arg_sets] + [list(gouts or [])]
        descs, start = self.w.put_all(groups, sample_bytes + (1 << 20))
        pid = self.w.proc.pid
        marks = _Marks(lambda: _proc_cpu_s(pid))
        r = self.w.request({"op": "time", "key": k, "sets": descs[:-1],
                            "gouts": descs[-1] if gouts is not None else None,
                            "backward": backward, "reps": reps, "warmup": warmup,
                            "flush": flush, "max_samples": max_samples,
                            "sample_bytes": sample_bytes, "out_start": start}, on_mark=marks)
        t, samples = r.get("timing"), r.get("samples")
        if not isinstance(t, dict) or not isinstance(samples, list):
            self.w.fail("the worker sent a malformed timing reply")
        out = []
        for smp in samples:
            if (not isinstance(smp, dict) or type(smp.get("call")) is not int
                    or type(smp.get("set")) is not int or not 0 <= smp["set"] < len(arg_sets)):
                self.w.fail("the worker sent a malformed sample")
            out.append((smp["call"], smp["set"], self.w.gets(smp.get("outs"))))
        timing_dict = {str(k2): v for k2, v in t.items()
                       if isinstance(v, (int, float, str, bool, list, type(None)))}
        return {"timing": timing_dict, "samples": out, "marks": marks.loops,
                "problems": [str(p)[:300] for p in r.get("problems", [])][:50]}

    def profile(self, key, xs, gouts, backward) -> dict:
        """One profiled call in the worker (worker.profile_call), its summary cleaned."""
        k = self._key(key)
        (in_d, g_d), start = self.w.put_all([list(xs), list(gouts or [])], 0)
        r = self.w.request({"op": "profile", "key": k, "inputs": in_d, "out_start": start,
                            "gouts": g_d if gouts is not None else None, "backward": backward})
        return clean_profile(r.get("profile"))


def _line(x, n: int) -> str:
    """x as printable one-line text of at most n characters."""
    return "".join(c if c.isprintable() else " " for c in str(x))[:n]


def _num(x) -> float:
    return float(x) if type(x) in (int, float) and math.isfinite(x) and x >= 0 else 0.0


def clean_profile(p) -> dict:
    """A profile summary (worker.profile_call) reduced to its fields, types and bounds: the
    worker's process wrote it, so it is advisory text and numbers, never a score."""
    if not isinstance(p, dict):
        return {"unavailable": "malformed profile"}
    if "unavailable" in p:
        return {"unavailable": _line(p["unavailable"], 300)}
    top = p.get("top") if isinstance(p.get("top"), list) else []
    return {"device": _line(p.get("device", "?"), 8), "device_ms": _num(p.get("device_ms")),
            "launches": int(_num(p.get("launches"))), "host_ms": _num(p.get("host_ms")),
            "top": [{"name": _line(t.get("name", "?"), 160), "self_ms": _num(t.get("self_ms")),
                     "count": int(_num(t.get("count")))}
                    for t in top[:worker.PROFILE_TOP] if isinstance(t, dict)]}


def _clean_fact(f) -> dict:
    """A worker's description of one output, reduced to the fields and types compare expects."""
    if not isinstance(f, dict) or not isinstance(f.get("type"), str):
        return {"type": "malformed description"}
    if f["type"] != "Tensor":
        return {"type": f["type"][:60]}
    try:
        return {"type": "Tensor", "dtype": str(f["dtype"])[:40],
                "shape": [int(d) for d in f["shape"]][:worker.MAX_DIMS],
                "device": str(torch.device(str(f["device"])[:40])),
                "aliases_input": f["aliases_input"] is True}
    except (KeyError, TypeError, ValueError, RuntimeError):
        return {"type": "malformed description"}


def _new_arena(nbytes: int) -> worker.Arena:
    """A new exchange file: in /dev/shm where it has room (memory), else the temp directory."""
    nbytes = max(ARENA_MIN_BYTES, -(-int(nbytes) // (1 << 20)) * (1 << 20))
    for d in ("/dev/shm", tempfile.gettempdir()):
        try:
            st = os.statvfs(d)
        except OSError:
            continue
        if st.f_bavail * st.f_frsize >= 2 * nbytes + (64 << 20):
            path = os.path.join(d, f"kbench-bench-{os.getpid()}-{uuid.uuid4().hex[:12]}")
            with open(path, "wb") as f:
                f.truncate(nbytes)
            return worker.Arena(path, nbytes)
    raise WorkerError(f"no room for a {nbytes >> 20} MB exchange file in /dev/shm or "
                      f"{tempfile.gettempdir()}")


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _stop(proc, conn, arena_path) -> None:
    """Ask the worker to exit, then make sure it has; remove the exchange file."""
    try:
        conn.send({"op": "exit"})
    except (OSError, ValueError):
        pass
    proc.join(timeout=5)
    if proc.is_alive():
        proc.kill()
        proc.join(timeout=5)
    try:
        conn.close()
    except OSError:
        pass
    _unlink(arena_path)
