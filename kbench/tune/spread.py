"""Tuning across the GPUs of one host (optimize(..., devices=[0, 1]) or devices="all"): the
regions' searches, each independent of the others, spread over the GPUs named. One thread per GPU
takes regions from a shared queue and searches each on an executor of its own on that GPU (its own
driver handle, streams and sandbox worker); what comes back is merged in region order, so the
result does not depend on which thread finished first. The tuner then brings each winner to the
GPU the model runs on, where it is gated and re-timed against the default genome before it is kept
(tuner.Tuner.adopt): one GPU's timings decide nothing for another unless both are the same model,
so every GPU named must be (resolve)."""
from __future__ import annotations

import queue
import threading

import torch

ALL = "all"


def _index(d) -> int:
    """A GPU index from an int, "cuda:N" or torch.device("cuda", N)."""
    if isinstance(d, bool) or not isinstance(d, (int, str, torch.device)):
        raise TypeError(f"devices: a GPU is an index (0, 1, ...) or 'cuda:N', got {d!r}")
    if isinstance(d, int):
        return d
    dev = torch.device(d)
    if dev.type != "cuda" or dev.index is None:
        raise ValueError(f"devices: {str(d)!r} is not a numbered CUDA device ('cuda:0', 'cuda:1', ...)")
    return dev.index


def _model(i: int) -> str:
    """What must agree between two GPUs for one's timings to stand for the other's."""
    major, minor = torch.cuda.get_device_capability(i)
    return f"{torch.cuda.get_device_name(i)} (sm_{major}{minor})"


def resolve(devices, target, *, count=None, model=_model):
    """The GPU indices optimize() searches on, checked; None (devices=None): everything runs on
    the target GPU as it always did. target: the torch.device the model runs on. count (the
    visible GPUs) and model (index -> the GPU's model) are torch.cuda's unless given (tests).
    ValueError or TypeError, before anything is captured, for anything else."""
    if devices is None:
        return None
    target = torch.device(target)
    if target.type != "cuda":
        raise ValueError(f"devices= spreads the cuda backend's search over GPUs; the model runs on {target} "
                         f"(backend 'interp' searches nothing)")
    if count is None:
        count = torch.cuda.device_count()
    if isinstance(devices, str):
        if devices != ALL:
            raise ValueError(f"devices must be None, 'all' or a list of GPU indices, got {devices!r}")
        indices = list(range(count))
        if not indices:
            raise ValueError("devices='all': no CUDA GPU is visible")
    elif isinstance(devices, (list, tuple)):
        indices = [_index(d) for d in devices]
        if not indices:
            raise ValueError("devices is empty: name at least one GPU, 'all', or None (the model's own GPU)")
    else:
        raise TypeError(f"devices must be None, 'all' or a list of GPU indices, got {type(devices).__name__}")
    for d in indices:
        if not 0 <= d < count:
            raise ValueError(f"devices: GPU {d} is not visible ({count} GPU(s) visible: "
                             f"{', '.join(map(str, range(count))) or 'none'})")
    if len(set(indices)) != len(indices):
        raise ValueError(f"devices names a GPU more than once: {indices}")
    t = target.index if target.index is not None else torch.cuda.current_device()
    want = model(t)
    for d in indices:
        got = model(d)
        if got != want:
            raise ValueError(f"devices: GPU {d} is a {got} and the model runs on GPU {t}, a {want}: one GPU's "
                             f"timings decide nothing for another model's, so the search runs on GPUs of the "
                             f"model's own kind only (leave GPU {d} out)")
    return tuple(indices)


def spread(jobs: list, devices, work, stop=lambda result: False) -> list:
    """work(device, job) run once for each job, on one device: a thread per device takes the next
    job from a queue until none is left. Returns, in the jobs' order (whatever order the threads
    finished in), (device, result) per job, or None for a job no device took: a device whose result
    says it can take no more (stop(result): its CUDA context may be unusable) stops taking jobs, and
    where every device stopped, the rest are left. An exception raised by work stops every thread
    after its current job, and the first in the jobs' order is raised once all have stopped."""
    todo: queue.SimpleQueue = queue.SimpleQueue()
    for i in range(len(jobs)):
        todo.put(i)
    done: dict[int, tuple] = {}
    errors: dict[int, BaseException] = {}
    lock = threading.Lock()
    failed = threading.Event()

    def run(device):
        while not failed.is_set():
            try:
                i = todo.get_nowait()
            except queue.Empty:
                return
            try:
                result = work(device, jobs[i])
            except BaseException as e:  # noqa: BLE001 - raised in the caller's thread, below
                with lock:
                    errors[i] = e
                failed.set()
                return
            with lock:
                done[i] = (device, result)
            if stop(result):
                return

    threads = [threading.Thread(target=run, args=(d,), name=f"kbench-search-gpu{d}", daemon=True)
               for d in devices]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[min(errors)]
    return [done.get(i) for i in range(len(jobs))]
