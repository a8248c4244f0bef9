"""The sandbox, the tuner's side (docs/DESIGN.md, "The sandbox"): a worker process per GPU
(sandbox_worker.py), started lazily and reused, runs each candidate kernel's first launches before
the user's process launches it at all. A trap poisons a CUDA context for good and a hang holds it,
so a candidate that does either must do it there: the user's process launches only candidates the
sandbox passed. What a candidate is sent is plain data (its CUBIN, entry names, launch geometry, and
its arguments as items the worker makes itself), one group per size the verification will use; a
watchdog bounds each request, and a worker that does not answer in time or dies is killed with its
process group and replaced for the next candidate."""
from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

import torch

from .. import verify
from .sandbox_worker import MAX_REPLY_BYTES, ProtocolError, decode, encode, read_frame, write_frame

# The watchdog: a request may take WATCHDOG_MARGIN times what moving its bytes takes at
# WATCHDOG_BANDWIDTH (below any GPU kbench tunes on), and never less than WATCHDOG_FLOOR_S: a
# correct kernel, however badly scheduled, stays far inside it; one that spins never answers.
WATCHDOG_FLOOR_S = 5.0
WATCHDOG_MARGIN = 100.0
WATCHDOG_BANDWIDTH = 500e9
STARTUP_TIMEOUT_S = 180.0   # a worker's start: Python, torch, a CUDA context
# A worker idle this long is stopped: its CUDA context holds device memory the user's process may
# want; the next candidate (a backward's search at the first backward call) starts another.
IDLE_STOP_S = 300.0
WORKER_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_worker.py")
SERVE = "kbench.tune.sandbox_worker:serve"
KBENCH_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class SandboxUnavailable(RuntimeError):
    """No worker could be started: no candidate can be checked (the message says why)."""


def watchdog_s(nbytes: int) -> float:
    """Seconds a request that moves nbytes (every launch's buffers, summed) may take."""
    return WATCHDOG_FLOOR_S + WATCHDOG_MARGIN * nbytes / WATCHDOG_BANDWIDTH


class Sandbox:
    """One worker process (target: "module:function" run there with the pipe; the sandbox's own
    by default, tests hand a stand-in), started at the first request and again after one died or
    was killed. request() never raises for what the worker does: a timeout, a death or a reply
    outside the protocol comes back as {"fate": ...} with the worker killed."""

    def __init__(self, device: int = 0, target: str = SERVE, kwargs=None, startup_timeout: float = STARTUP_TIMEOUT_S,
                 idle_stop: float = IDLE_STOP_S):
        self.device, self.target, self.startup_timeout, self.idle_stop = device, target, startup_timeout, idle_stop
        self.idle_timer = None
        self.kwargs = {"device": device} if kwargs is None else dict(kwargs)
        self.proc = None
        self.wfd = self.rfd = self.err = None
        self.broken = ""          # why a worker could not be started: every request is refused
        self.starts = 0           # workers started (the first, and one per replacement)
        self.lock = threading.Lock()

    @property
    def pid(self):
        return self.proc.pid if self.proc is not None else None

    def _start(self) -> None:
        r1, w1 = os.pipe()   # parent -> worker
        r2, w2 = os.pipe()   # worker -> parent
        err = tempfile.TemporaryFile()
        try:
            # its own session: a kill of its process group takes whatever it started with it
            # -P: the script's folder (kbench/tune) is not put on sys.path, where its modules' names
            # would stand for top-level ones; the init frame gives the path to use
            flags = ["-P"] if sys.version_info >= (3, 11) else []
            proc = subprocess.Popen([sys.executable, *flags, WORKER_PATH, str(r1), str(w2)], pass_fds=(r1, w2),
                                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                                    start_new_session=True)
        except OSError as e:
            for fd in (w1, r2):
                os.close(fd)
            err.close()
            raise SandboxUnavailable(f"the sandbox worker could not be started: {e}") from None
        finally:
            os.close(r1)
            os.close(w2)
        self.proc, self.wfd, self.rfd, self.err = proc, w1, r2, err
        self.starts += 1
        deadline = time.monotonic() + self.startup_timeout
        init = {"path": list(sys.path), "kbench_root": KBENCH_ROOT, "target": self.target, "kwargs": self.kwargs}
        try:
            write_frame(w1, encode(init), deadline)
            ready = decode(read_frame(r2, MAX_REPLY_BYTES, deadline))[0]
            if ready.get("ready") is not True:
                raise ProtocolError(f"it sent {str(ready)[:80]} instead of ready")
        except (TimeoutError, EOFError, OSError, ProtocolError) as e:
            how = self.kill()
            why = f"no answer within {self.startup_timeout:g} s" if isinstance(e, TimeoutError) else f"{how}: {e}"
            self.broken = f"the sandbox worker did not start ({why}{self._tail()})"
            raise SandboxUnavailable(self.broken) from None

    def request(self, header: dict, blobs=(), timeout: float = WATCHDOG_FLOOR_S) -> dict:
        """The worker's reply to one request, within timeout seconds; else {"fate": "hang: ..."}
        (the worker killed) or {"fate": "crash: ..."} (it died). SandboxUnavailable where no
        worker can be started."""
        with self.lock:
            if self.broken:
                raise SandboxUnavailable(self.broken)
            if self.idle_timer is not None:
                self.idle_timer.cancel()
            try:
                return self._request(header, blobs, timeout)
            finally:
                if self.proc is not None:
                    timer = self.idle_timer = threading.Timer(self.idle_stop, lambda: self._stop_idle(timer))
                    timer.daemon = True
                    timer.start()

    def _stop_idle(self, timer) -> None:
        with self.lock:
            if self.idle_timer is timer:   # no request since it was set
                self.idle_timer = None
                self._exit()

    def _request(self, header, blobs, timeout) -> dict:
        if self.proc is None:
            self._start()
        deadline = time.monotonic() + timeout
        try:
            write_frame(self.wfd, encode(header, blobs), deadline)
            reply = decode(read_frame(self.rfd, MAX_REPLY_BYTES, deadline))[0]
        except TimeoutError:
            self.kill()
            return {"fate": f"hang: no answer within {timeout:.3g} s (worker killed)"}
        except (EOFError, OSError):
            how = self.kill()
            return {"fate": f"crash: the worker died ({how}{self._tail()})"}
        except ProtocolError as e:
            self.kill()
            return {"fate": f"crash: the worker answered outside the protocol ({e})"}
        if reply.get("dead"):   # it exits by itself (its context is gone): reaped here
            self.kill()
        return reply

    def _tail(self) -> str:
        """The last line the worker wrote to stderr, where it wrote one."""
        if self.err is None:
            return ""
        try:
            self.err.seek(0)
            lines = [x for x in self.err.read()[-4096:].decode(errors="replace").splitlines() if x.strip()]
        except (OSError, ValueError):
            return ""
        return f"; {lines[-1].strip()[:300]}" if lines else ""

    def kill(self) -> str:
        """Kills the worker and its process group (a no-op where none runs); how it ended."""
        proc = self.proc
        if proc is None:
            return "not running"
        try:   # before the wait: an unreaped worker keeps its group's id from being reused
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            code = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            code = None
        for fd in (self.wfd, self.rfd):
            try:
                os.close(fd)
            except OSError:
                pass
        self.proc = self.wfd = self.rfd = None
        if code is None:
            return "still running after SIGKILL"
        return f"exit code {code}" if code >= 0 else f"killed by signal {-code}"

    def _exit(self) -> None:
        """Asks the worker to exit, then makes sure it has."""
        if self.proc is not None:
            try:
                write_frame(self.wfd, encode({"op": "exit"}), time.monotonic() + 1)
                self.proc.wait(timeout=5)
            except (OSError, TimeoutError, subprocess.TimeoutExpired):
                pass
            self.kill()

    def close(self) -> None:
        with self.lock:
            if self.idle_timer is not None:
                self.idle_timer.cancel()
            self._exit()
            if self.err is not None:
                self.err.close()
                self.err = None


_SANDBOXES: dict[int, Sandbox] = {}
_REGISTRY_LOCK = threading.Lock()


def for_device(index: int) -> Sandbox:
    """The sandbox of GPU `index` (one per GPU per process)."""
    with _REGISTRY_LOCK:
        box = _SANDBOXES.get(index)
        if box is None:
            box = _SANDBOXES[index] = Sandbox(index)
        return box


@atexit.register
def shutdown() -> None:
    for box in list(_SANDBOXES.values()):
        box.close()


# ------------------------------------------------------------------------------------ a candidate

def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def describe(ex, r: int, k, kernel, sizes) -> tuple[dict, int]:
    """A "check" request for a candidate of region r (k: its _C.KernelInfo, for the entry names;
    kernel: as the executor loaded it, for the launch geometry) at each of `sizes` where it may run
    (verify.refused: elsewhere the region runs in eager, and nothing launches it): per size a group
    that runs the kernel and its finishing kernel, and one for the entry point without the saved
    statistics where there is one, the arguments in the order CudaExecutor.launch passes them.
    Also returns the bytes the launches move (the watchdog's measure)."""
    entries = [[k.name, k.smem]]
    finish = nostats = None
    if k.finish_name is not None:
        finish = len(entries)
        entries.append([k.finish_name, 0])
    if k.nostats_name is not None:
        nostats = len(entries)
        entries.append([k.nostats_name, k.smem])
    saved = ex.plan.regions[r].saved
    groups, moved = [], 0
    for symvals in sizes:
        if verify.refused(kernel, r, symvals):   # sizes where the region runs in eager: never launched
            continue
        shapes, grid, ints, workspace, _ = ex.launch_params(kernel, r, symvals)
        ins = [["tensor", list(s), _dtype_name(d), role] for s, d, role in ex.input_roles(r, symvals)]
        outs = [["tensor", list(s), _dtype_name(d), "output"] for s, d in shapes]
        tail = [["int", int(v)] for v in ints] + ([["workspace", int(workspace)]] if workspace else [])
        nbytes = sum(_nbytes(a) for a in ins + outs) + workspace
        variants = [(0, outs)]
        if nostats is not None:
            variants.append((nostats, outs[:len(outs) - saved] + [["null"]] * saved))
        for entry, outputs in variants:
            calls = [[entry, list(grid), kernel.block, kernel.smem]]
            if finish is not None:
                calls.append([finish, list(grid), kernel.block, 0])
            groups.append({"args": ins + outputs + tail, "calls": calls})
            moved += nbytes * len(calls)
    return {"op": "check", "entries": entries, "groups": groups, "seed": getattr(ex, "seed", 0)}, moved


def _nbytes(item) -> int:
    n = 1
    for d in item[1]:
        n *= d
    return n * getattr(torch, item[2]).itemsize


def check(ex, r: int, k, kernel, cubin: bytes, sizes, box: Sandbox | None = None) -> str:
    """Runs a candidate in the sandbox at each of `sizes`: "" where it passed, else its fate
    ("hang: ...", "trap: ...", "out-of-bounds write: ...", "crash: ...", "launch failed: ...").
    torch.cuda.OutOfMemoryError where the worker found no memory for the buffers (the region's
    search ends, as for one in this process); SandboxUnavailable where no worker starts."""
    header, moved = describe(ex, r, k, kernel, sizes)
    if not header["groups"]:   # no size it may run at: nothing to launch (verification refuses it)
        return ""
    if box is None:
        device = getattr(ex, "device", None)
        box = for_device(device.index if device is not None and device.index is not None
                         else torch.cuda.current_device())
    reply = box.request(header, [cubin], timeout=watchdog_s(moved))
    if "error" in reply:
        return f"refused: {str(reply['error'])[:300]}"
    if reply.get("oom"):
        raise torch.cuda.OutOfMemoryError(f"in the sandbox: {str(reply.get('fate'))[:300]}")
    fate = str(reply.get("fate", "crash: a reply without a fate"))[:400]
    return "" if fate == "ok" else fate
