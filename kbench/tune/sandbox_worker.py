"""The sandbox's worker process (docs/DESIGN.md, "The sandbox"): the first launches of every candidate
kernel run here, on inputs made here, so that a kernel that hangs, traps or writes out of bounds
costs this process, never the user's. Also the one wire format both sides speak, and the boot.

Started by path (`python sandbox_worker.py RFD WFD`, kbench/tune/sandbox.py), before anything of
kbench or torch is imported: the boot reads an init frame (sys.path, the target function), makes
kbench a package whose __init__ never runs (the worker needs torch, kbench._C and kbench.verify,
not the capture stack), imports the target and hands it the pipe. Frames are a length, then a
JSON header and raw blobs (encode/decode): nothing read from a pipe is unpickled."""
from __future__ import annotations

import json
import os
import select
import struct
import sys
import time

MAGIC = b"KBS1"
_HEAD = struct.Struct("<4sII")      # magic, header bytes, blob count
_U64 = struct.Struct("<Q")          # a frame's length; each blob's length
MAX_BLOBS = 4
MAX_REPLY_BYTES = 1 << 20           # what the parent reads from a worker
MAX_REQUEST_BYTES = 1 << 30         # what a worker reads from the parent (a CUBIN is a few MB at most)
MAX_DIMS = 8
GUARD_BYTES = 64 << 10              # before and after every buffer of a launch
GUARD_BYTE = 0xA5
# the dtypes a launch's tensors may have, by torch's name: a name is looked up on torch only once
# parse_item found it in this list
DTYPES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool")


class ProtocolError(ValueError):
    """A frame, or an item in one, outside the format."""


# ------------------------------------------------------------------------------------ the wire format

def encode(header: dict, blobs=()) -> bytes:
    """One message: the header (a JSON object) and raw byte strings, length-prefixed."""
    head = json.dumps(header, separators=(",", ":"), allow_nan=False).encode()
    blobs = [bytes(b) for b in blobs]
    if len(blobs) > MAX_BLOBS:
        raise ProtocolError(f"{len(blobs)} blobs (at most {MAX_BLOBS})")
    parts = [_HEAD.pack(MAGIC, len(head), len(blobs)), head]
    for b in blobs:
        parts += [_U64.pack(len(b)), b]
    return b"".join(parts)


def decode(data: bytes) -> tuple[dict, list]:
    """encode's inverse; ProtocolError on anything else (a bad magic, a length past the end,
    bytes left over, a header that is not a JSON object)."""
    view = memoryview(data)
    if len(view) < _HEAD.size:
        raise ProtocolError("short frame")
    magic, nhead, nblobs = _HEAD.unpack_from(view, 0)
    if magic != MAGIC:
        raise ProtocolError("bad magic")
    if nblobs > MAX_BLOBS:
        raise ProtocolError(f"{nblobs} blobs (at most {MAX_BLOBS})")
    at = _HEAD.size
    if at + nhead > len(view):
        raise ProtocolError("header past the end of the frame")
    try:
        header = json.loads(bytes(view[at:at + nhead]).decode())
    except (UnicodeDecodeError, ValueError) as e:
        raise ProtocolError(f"header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise ProtocolError("header is not a JSON object")
    at += nhead
    blobs = []
    for _ in range(nblobs):
        if at + _U64.size > len(view):
            raise ProtocolError("blob length past the end of the frame")
        (n,) = _U64.unpack_from(view, at)
        at += _U64.size
        if at + n > len(view):
            raise ProtocolError("blob past the end of the frame")
        blobs.append(bytes(view[at:at + n]))
        at += n
    if at != len(view):
        raise ProtocolError(f"{len(view) - at} bytes after the last blob")
    return header, blobs


def _wait(fd: int, write: bool, deadline) -> None:
    if deadline is None:
        return
    left = deadline - time.monotonic()
    ready = select.select([], [fd], [], max(0.0, left)) if write else select.select([fd], [], [], max(0.0, left))
    if not any(ready):
        raise TimeoutError("no answer before the deadline")


def write_frame(fd: int, payload: bytes, deadline=None) -> None:
    """The payload, length first; TimeoutError where the reader takes none of it by the deadline,
    OSError (EPIPE) where the reader is gone."""
    data = memoryview(_U64.pack(len(payload)) + payload)
    while data:
        _wait(fd, True, deadline)
        n = os.write(fd, data[:1 << 16])
        data = data[n:]


def read_frame(fd: int, max_bytes: int, deadline=None) -> bytes:
    """One frame's payload; EOFError where the writer closed its end (it died), TimeoutError past
    the deadline, ProtocolError where the frame announces more than max_bytes."""
    def exact(n):
        out = bytearray()
        while len(out) < n:
            _wait(fd, False, deadline)
            chunk = os.read(fd, min(n - len(out), 1 << 20))
            if not chunk:
                raise EOFError("the other end closed the pipe")
            out += chunk
        return bytes(out)
    (n,) = _U64.unpack(exact(_U64.size))
    if n > max_bytes:
        raise ProtocolError(f"a frame of {n} bytes (at most {max_bytes})")
    return exact(n)


class Conn:
    """The worker's end of the pipes: blocking recv() of the parent's requests, send() of replies."""

    def __init__(self, rfd: int, wfd: int):
        self.rfd, self.wfd = rfd, wfd

    def recv(self) -> tuple[dict, list]:
        return decode(read_frame(self.rfd, MAX_REQUEST_BYTES))

    def send(self, header: dict, blobs=()) -> None:
        write_frame(self.wfd, encode(header, blobs))


# ------------------------------------------------------------------------------------ a launch's arguments

def parse_item(item) -> tuple:
    """One argument of a launch, as the parent describes it, checked:
      ["tensor", shape, dtype, role]  role: "input" (random normal values), "stat" (a row statistic:
                                      positive, at least any input element), "index:N" (integers in
                                      [0, N): a gather's indices) or "output" (NaN-poisoned)
      ["workspace", bytes]            scratch the kernel may write
      ["int", v], ["float", v], ["null"]"""
    if not isinstance(item, list) or not item or not isinstance(item[0], str):
        raise ProtocolError(f"argument {item!r:.60} is not a tagged list")
    tag = item[0]
    if tag == "tensor" and len(item) == 4:
        _, shape, dtype, role = item
        if not isinstance(shape, list) or len(shape) > MAX_DIMS or \
                not all(type(d) is int and 0 <= d < 1 << 40 for d in shape):
            raise ProtocolError(f"bad shape {shape!r:.60}")
        if dtype not in DTYPES:
            raise ProtocolError(f"bad dtype {dtype!r:.40}")
        if role in ("input", "stat", "output"):
            return ("tensor", tuple(shape), dtype, role, None)
        if isinstance(role, str) and role.startswith("index:") and role[6:].isdigit():
            return ("tensor", tuple(shape), dtype, "index", int(role[6:]))
        raise ProtocolError(f"bad role {role!r:.40}")
    if tag == "workspace" and len(item) == 2 and type(item[1]) is int and 0 <= item[1] < 1 << 40:
        return ("workspace", item[1])
    if tag == "int" and len(item) == 2 and type(item[1]) is int and -(1 << 63) <= item[1] < 1 << 63:
        return ("int", item[1])
    if tag == "float" and len(item) == 2 and type(item[1]) in (int, float):
        return ("float", float(item[1]))
    if tag == "null" and len(item) == 1:
        return ("null",)
    raise ProtocolError(f"bad argument {item!r:.60}")


def parse_check(header: dict, blobs: list) -> tuple:
    """A "check" request: (cubin, entries [(name, smem)], groups [(items, calls)]), each call
    (entry index, grid (3 ints), threads per block, smem). Every group is one size: its arguments
    are made once, then its calls run in order on them (a kernel and its finishing kernel)."""
    if len(blobs) != 1:
        raise ProtocolError("a check carries one CUBIN")
    entries, groups = header.get("entries"), header.get("groups")
    if not isinstance(entries, list) or not entries or not isinstance(groups, list):
        raise ProtocolError("a check needs entries and groups")
    ents = []
    for e in entries:
        if not (isinstance(e, list) and len(e) == 2 and isinstance(e[0], str) and type(e[1]) is int
                and 0 <= e[1] < 1 << 24 and e[0].isidentifier()):
            raise ProtocolError(f"bad entry {e!r:.60}")
        ents.append((e[0], e[1]))

    def dims(v):
        v = [v, 1, 1] if type(v) is int else v
        if not (isinstance(v, list) and len(v) == 3 and all(type(d) is int and 1 <= d < 1 << 31 for d in v)):
            raise ProtocolError(f"bad grid {v!r:.60}")
        return tuple(v)
    out = []
    for g in groups:
        if not isinstance(g, dict) or not isinstance(g.get("args"), list) or not isinstance(g.get("calls"), list):
            raise ProtocolError("a group needs args and calls")
        items = [parse_item(a) for a in g["args"]]
        calls = []
        for c in g["calls"]:
            if not (isinstance(c, list) and len(c) == 4 and type(c[0]) is int and 0 <= c[0] < len(ents)
                    and type(c[2]) is int and 1 <= c[2] <= 1024 and type(c[3]) is int and 0 <= c[3] < 1 << 24):
                raise ProtocolError(f"bad call {c!r:.60}")
            calls.append((c[0], dims(c[1]), c[2], c[3]))
        out.append((items, calls))
    return blobs[0], ents, out


# ------------------------------------------------------------------------------------ the worker

def serve(conn: Conn, device: int = 0) -> None:
    """The sandbox: answers "check" requests until told to exit, the pipe closes, or a kernel
    leaves this process's CUDA context unusable (the reply says so; the parent starts another)."""
    import torch   # here, not above: the boot imports this module before it knows the target

    from kbench import _C
    torch.cuda.set_device(device)
    torch.zeros(1, device=f"cuda:{device}")   # torch makes the primary context, kbench._C uses it
    cuda = _C.cuda_open()
    conn.send({"ready": True, "pid": os.getpid()})
    while True:
        try:
            header, blobs = conn.recv()
        except EOFError:
            return
        if header.get("op") == "exit":
            return
        try:
            if header.get("op") != "check":
                raise ProtocolError(f"unknown op {str(header.get('op'))[:40]!r}")
            seed = header.get("seed", 0)
            if type(seed) is not int:
                raise ProtocolError("the seed is not an int")
            reply = check(cuda, torch.device("cuda", device), *parse_check(header, blobs), seed=seed)
        except ProtocolError as e:
            reply = {"error": f"bad request: {e}"}
        except Exception as e:  # noqa: BLE001 - the candidate is refused with it; the parent decides
            reply = {"error": f"{type(e).__name__}: {_line(e)}"}
        conn.send(reply)
        if reply.get("dead"):
            return


def check(cuda, device, cubin: bytes, entries, groups, seed: int = 0) -> dict:
    """Loads the CUBIN, then per group makes the arguments (inputs random, outputs NaN-poisoned,
    every buffer between guard bytes), runs the calls and looks at the guards. {"fate": "ok"}, or
    why not; "dead": true where the context is unusable after it (a trap)."""
    import torch

    from kbench import _C, verify
    try:
        module = _C.module_load(cuda, cubin)
        fns = [_C.get_function(cuda, module, name, smem)[0] for name, smem in entries]
    except _C.CudaError as e:
        return _after_error(device, "load failed", e)
    gen = torch.Generator(device=device).manual_seed(seed)
    for gi, (items, calls) in enumerate(groups):
        try:
            args, blocks = _make_args(items, device, gen, torch, verify)
        except torch.cuda.OutOfMemoryError as e:
            torch.cuda.empty_cache()
            return {"fate": f"out of memory: {_line(e)}", "oom": True}
        try:
            for fi, grid, block, smem in calls:
                _C.launch(cuda, fns[fi], grid, block, smem, None, args)
            torch.cuda.synchronize(device)
            # per buffer: was a guard byte before it, or after its last byte, changed?
            bad = torch.stack([(part != GUARD_BYTE).any() for _, blk, n in blocks
                               for part in (blk[:GUARD_BYTES], blk[GUARD_BYTES + n:])]).tolist() if blocks else []
        except Exception as e:  # noqa: BLE001 - any failure of the launch is the candidate's fate
            return _after_error(device, "launch failed", e)
        for j, (what, _, _) in enumerate(blocks):
            if bad[2 * j] or bad[2 * j + 1]:
                where = "before the start" if bad[2 * j] else "past the end"
                return {"fate": f"out-of-bounds write: {where} of {what} (sizes {gi + 1} of {len(groups)})"}
        del args, blocks
    torch.cuda.empty_cache()   # the worker holds no memory between requests
    return {"fate": "ok"}


def _make_args(items, device, gen, torch, verify):
    """The launch's arguments, and each buffer as (what it is, its block: guard, data, guard, its
    data's bytes)."""
    args, blocks = [], []
    for i, item in enumerate(items):
        tag = item[0]
        if tag in ("int", "float"):
            args.append(item[1])
            continue
        if tag == "null":
            args.append(None)
            continue
        if tag == "workspace":
            nbytes, dtype, shape, role, high = item[1], torch.uint8, (item[1],), "workspace", None
        else:
            _, shape, name, role, high = item
            dtype = getattr(torch, name)   # a name from DTYPES (parse_item checked it)
            nbytes = _numel(shape) * dtype.itemsize
        padded = -(-nbytes // 256) * 256
        block = torch.empty(GUARD_BYTES + padded + GUARD_BYTES, dtype=torch.uint8, device=device)
        block[:GUARD_BYTES].fill_(GUARD_BYTE)
        block[GUARD_BYTES + nbytes:].fill_(GUARD_BYTE)
        data = block[GUARD_BYTES:GUARD_BYTES + nbytes].view(dtype).view(shape)
        if role == "output":
            data.copy_(verify.poison_like(shape, dtype, device))
        elif role == "stat":
            data.copy_(verify.fill_statistic(data, "normal", gen))
        elif role in ("input", "index"):
            data.copy_(verify.fill(data, "normal", gen, high=high))
        else:   # a workspace: whatever the kernel finds there
            data.fill_(0xFF)
        args.append(data)
        blocks.append((f"argument {i} ({role})", block, nbytes))
    return args, blocks


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _line(e) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else type(e).__name__


def _after_error(device, what: str, e) -> dict:
    """The fate of a candidate whose load or launch raised: a trap where the context no longer
    works (every call after a sticky error fails), else the error itself."""
    import torch
    try:
        torch.cuda.synchronize(device)
        torch.ones(1, device=device).add_(1).item()
    except Exception as e2:  # noqa: BLE001 - the context is gone: this worker is done
        return {"fate": f"trap: {_line(e)}", "dead": True, "after": _line(e2)}
    return {"fate": f"{what}: {_line(e)}"}


def _boot(rfd: int, wfd: int) -> None:
    """Reads the init frame, makes kbench a package that never runs its __init__, calls the target."""
    import importlib
    import importlib.util
    conn = Conn(rfd, wfd)
    init, _ = conn.recv()
    sys.path[:] = [p for p in init["path"] if isinstance(p, str)]
    root = init["kbench_root"]
    if "kbench" not in sys.modules:
        spec = importlib.util.spec_from_file_location("kbench", os.path.join(root, "__init__.py"),
                                                      submodule_search_locations=[root])
        sys.modules["kbench"] = importlib.util.module_from_spec(spec)
    module, _, name = init["target"].partition(":")
    getattr(importlib.import_module(module), name)(conn, **init.get("kwargs", {}))


if __name__ == "__main__":
    _boot(int(sys.argv[1]), int(sys.argv[2]))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)   # no teardown: a CUDA context after a trap can abort it
