"""Soft verification: what can be said of a CUDA source before anything of it runs on a GPU. It
compiles (NVRTC, for device-only sources), ptxas's resource use fits (kbench/agent/cubin.py), no
host or torch call sits inside device code, and no shared-memory array is read before any write
or read across threads with no barrier since another thread's write. The source analysis is
small and deliberately conservative: a finding is a certain bug in straight-line code; what it
cannot follow (loops carrying a write to the next iteration, arrays passed by pointer, volatile
warp-synchronous code) it leaves to the hardware verification."""
from __future__ import annotations

import dataclasses
import re

from . import cubin as cubin_info

BARRIERS = re.compile(r"__syncthreads(?:_count|_and|_or)?\s*\(|__syncwarp\s*\(|\bbar\.sync\b|\.sync\s*\(\s*\)"
                      r"|\bcg::sync\s*\(|__barrier_sync\s*\(")
# host-side calls a kernel cannot make: torch/ATen functions (their device-usable types are
# allowed), the runtime's allocation/copy/sync calls, a tensor's accessors
HOST_CALL = re.compile(
    r"\b(?:torch|at|c10)::(?!(?:Half|BFloat16|Float8\w*|opmath_type|acc_type|numeric_limits|complex)\b)\w+\s*[(<]"
    r"|\bcuda(?:Malloc\w*|Memcpy\w*|Memset\w*|Free\w*|DeviceSynchronize|StreamSynchronize|GetLastError)\s*\("
    r"|\.(?:data_ptr|item|numel|sizes|contiguous)\s*[(<]|\bstd::(?:cout|cerr|vector|string|printf)\b")
LOCAL_BYTES_LIMIT = 0     # any local memory (spills, local arrays) is reported, not refused


@dataclasses.dataclass
class Finding:
    kind: str       # "compile", "resources", "host call", "shared read before write", "missing barrier"
    where: str      # the kernel (or "source")
    detail: str
    fatal: bool = True


@dataclasses.dataclass
class Verdict:
    passed: bool
    findings: list
    resources: dict     # {kernel: {"registers", "shared_bytes", "local_bytes"}} when it compiled

    def describe(self) -> str:
        if not self.findings:
            return "soft verification: passed"
        return "; ".join(f"{f.kind} in {f.where}: {f.detail}" for f in self.findings)


# ------------------------------------------------------------------------------------ source

def strip_comments_and_strings(src: str) -> str:
    """The source with comments and string/char literals blanked (lengths kept), so braces and
    names inside them are not code."""
    out, i, n = [], 0, len(src)
    while i < n:
        c = src[i]
        if src.startswith("//", i):
            j = src.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif src.startswith("/*", i):
            j = src.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append(re.sub(r"[^\n]", " ", src[i:j]))
            i = j
        elif c in "\"'":
            j = i + 1
            while j < n and src[j] != c:
                j += 2 if src[j] == "\\" else 1
            j = min(j + 1, n)
            out.append(c + " " * (j - i - 2) + c if j - i >= 2 else c)
            i = j
        else:
            out.append(c)
            i += 1
    return "".join(out)


def device_functions(code: str) -> list[tuple[str, bool, str]]:
    """(name, is_kernel, body) of each __global__ / __device__ function defined in code."""
    out = []
    for m in re.finditer(r"\b(__global__|__device__)\b[^;{}()]*?\b(\w+)\s*\(", code):
        depth, j = 0, m.end() - 1
        while j < len(code):          # the parameter list
            depth += {"(": 1, ")": -1}.get(code[j], 0)
            j += 1
            if depth == 0:
                break
        k = j
        while k < len(code) and code[k] not in "{;":
            k += 1
        if k >= len(code) or code[k] == ";":
            continue                  # a declaration
        depth, e = 0, k
        while e < len(code):
            depth += {"{": 1, "}": -1}.get(code[e], 0)
            e += 1
            if depth == 0:
                break
        out.append((m.group(2), m.group(1) == "__global__", code[k + 1:e - 1]))
    return out


def _statements(body: str) -> list[tuple[str, bool]]:
    """The body's statements in order, each with whether it runs under a condition (an if, else,
    switch or loop header around it, or its own `if (...)` prefix): split at ; { } outside
    parentheses (a `for (...)` header's semicolons stay inside it)."""
    out, cur, paren, blocks = [], [], 0, []
    for c in body:
        if c == "(":
            paren += 1
        elif c == ")":
            paren -= 1
        if c in ";{}" and paren == 0:
            text = "".join(cur).strip()
            if c == "{":
                blocks.append(bool(re.match(r"(?:if|else|switch|for|while|do)\b", text)))
            elif text:
                out.append((text, any(blocks) or bool(re.match(r"(?:if|else|for|while)\b", text))))
            if c == "}" and blocks:
                blocks.pop()
            cur = []
        else:
            cur.append(c)
    if "".join(cur).strip():
        out.append(("".join(cur).strip(), any(blocks)))
    return out


_ASSIGN = r"\s*(?:[-+*/%&|^]|<<|>>)?=(?!=)"
_SUBS = r"((?:\s*\[[^\[\]]*\])+)(?!\s*\[)"     # every subscript of an access: a[i][j]


def _shared_findings(name: str, body: str) -> list[Finding]:
    """Shared-memory reads before any write, and reads across threads with no barrier since a
    write, in straight-line order (see the module's docstring for what is left alone)."""
    findings = []
    arrays = [m.group(2) for m in re.finditer(
        r"(?<!volatile )\b__shared__\s+(?!volatile)(?:[\w:<>]+\s+)+?(?:__align__\s*\(\s*\d+\s*\)\s*)?(\*?\s*)(\w+)\s*\[", body)]
    stmts = _statements(body)
    norm = lambda s: re.sub(r"\s+", "", s)   # noqa: E731
    for arr in arrays:
        uses = re.findall(rf"\b{arr}\b(?!\s*\[)", body)
        if len(uses) > 1:   # the declaration's own name aside: passed by pointer or aliased
            continue
        wrote_any, pending = False, []     # pending: (index, under a condition) since the last barrier
        last_write = max((n for n, (t, _) in enumerate(stmts) if re.search(rf"\b{arr}{_SUBS}{_ASSIGN}", t)),
                         default=-1)
        for n, (text, conditional) in enumerate(stmts):
            if BARRIERS.search(text):
                pending = []
                continue
            if "__shared__" in text:
                continue
            writes = [m.group(1) for m in re.finditer(rf"\b{arr}{_SUBS}{_ASSIGN}", text)]
            reads = [m.group(1) for m in re.finditer(rf"\b{arr}{_SUBS}(?!{_ASSIGN})", text)]
            reads += [m.group(1) for m in re.finditer(rf"\b{arr}{_SUBS}\s*(?:[-+*/%&|^]|<<|>>)=", text)]
            found = None
            for idx in reads:
                if not wrote_any and last_write <= n:
                    found = Finding("shared read before write", name,
                                    f"{arr}{idx.strip()} is read and nothing writes {arr}")
                elif not wrote_any and not re.search(r"\b(?:for|while|do)\b", body[:body.find(text)]):
                    found = Finding("shared read before write", name,
                                    f"{arr}{idx.strip()} is read before anything writes {arr}")
                else:
                    # another thread's element: another index, or one constant index a thread
                    # wrote under a condition (the others read what it wrote, or did not yet)
                    other = [w for w, cond in pending if norm(w) != norm(idx)
                             or (cond and re.fullmatch(r"(?:\[\d+\])+", norm(w)))]
                    if other:
                        found = Finding("missing barrier", name,
                                        f"{arr}{idx.strip()} is read after a write of {arr}{other[0].strip()} "
                                        "with no __syncthreads() between (another thread's element)")
                if found:
                    break
            if found:
                findings.append(found)
                break
            if writes:
                wrote_any = True
                pending += [(w, conditional) for w in writes]
    return findings


def analyze(source: str) -> list[Finding]:
    """The source-level findings: host calls in device code and shared-memory misuse."""
    code = re.sub(r"__launch_bounds__\s*\([^)]*\)", lambda m: " " * len(m.group(0)),
                  strip_comments_and_strings(source))
    findings = []
    for name, is_kernel, body in device_functions(code):
        m = HOST_CALL.search(body)
        if m:
            findings.append(Finding("host call", name, f"`{m.group(0).strip()}` inside device code"))
        if is_kernel:
            findings += _shared_findings(name, body)
    return findings


# ------------------------------------------------------------------------------------ the verdict

def check(source: str, *, arch: str = "sm_90", max_shared_bytes: int | None = None, compile_fn=None) -> Verdict:
    """The soft verdict of a CUDA source. compile_fn(source, arch) -> CUBIN bytes (default: kbench's
    NVRTC, uncached); a source with host code (a torch extension: torch/extension.h, PYBIND11)
    is not compiled here and is judged on its source alone. max_shared_bytes: the device's opt-in
    limit per block, where known."""
    findings = analyze(source)
    resources = {}
    host_code = re.search(r"#\s*include\s*<torch/|PYBIND11_MODULE|TORCH_LIBRARY", source)
    if not host_code:
        if compile_fn is None:
            from ..runtime import nvrtc
            compile_fn = lambda s, a: nvrtc.compile(s, a, use_cache=False)   # noqa: E731
        try:
            resources = cubin_info.resources(compile_fn(source, arch))
        except Exception as e:  # noqa: BLE001 - NVRTC's CompileError and its log are the finding
            findings.append(Finding("compile", "source", str(e).strip().splitlines()[0][:300] if str(e).strip() else
                                    type(e).__name__))
        for k, r in resources.items():
            if max_shared_bytes is not None and r["shared_bytes"] > max_shared_bytes:
                findings.append(Finding("resources", k, f"{r['shared_bytes']} bytes of static shared memory, over "
                                        f"the device's {max_shared_bytes}"))
            if r["local_bytes"] > LOCAL_BYTES_LIMIT:
                findings.append(Finding("resources", k, f"{r['local_bytes']} bytes of local memory per thread "
                                        "(spills or a local array)", fatal=False))
    return Verdict(not any(f.fatal for f in findings), findings, resources)
