"""Names never become code: parameter paths, ModuleDict keys (data, from a config file) and
symbol names reach generated CUDA source only as kbench's own identifiers or as escaped, printable,
one-line text in comments, whatever bytes they hold; the source compiles to exactly its kernels."""
import glob
import json
import os
import re
import struct
import subprocess
import sys

import pytest
import torch

import kbench
from kbench import _C

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PWN = "__global__ void pwn(int*p){*p=1;}"
HOSTILE = [
    "w\n" + PWN + "//",           # a newline ends a // comment
    "w*/ " + PWN + " /*",         # '*/' ends a /* */ comment
    "w\r" + PWN + "//",           # a lone carriage return ends a line too
    "w\\\n" + PWN + "//",         # a line splice
    "w\\",                        # a trailing backslash splices the next line into the comment
    "w??/",                       # the trigraph of a backslash
    "w\u00e9\u2028" + PWN,        # non-ASCII, a Unicode line separator
    "#define out 1\n", "#define __global__",
    "x" * 100_000,                # no NUL, very long
    "int", "void", "float", "__global__", "threadIdx", "NAN",          # keywords and CUDA's own names
    "out", "out1", "s0", "i0", "k", "row", "in0", "p3",                 # the kernel's parameters and variables
    "kb_ws", "KB_INF", "CUDART_INF_F", "kb_r0_pointwise",              # reserved prefixes
    '"', "'", "\t\x0b\x0c\x01\x7f",
]
C_KEYWORDS = {"int", "void", "float", "double", "const", "for", "if", "return", "long", "char", "struct"}

# Builds x + w_0 + w_1 + ... (each w a parameter named as given) and prints its kernel's source as
# JSON. In a process of its own, kbench._C alone: a name that made the generator loop (a reserved
# prefix never became free, whatever the suffix) fails the test instead of hanging it.
GENERATE = r"""
import glob, importlib.util, json, sys
spec = importlib.util.spec_from_file_location("kbench._C", glob.glob(sys.argv[1])[0])
_C = importlib.util.module_from_spec(spec)
spec.loader.exec_module(_C)
g = _C.Graph()
g.add_symbol("s0", 4)
rows = [(1, (0,)), 64]
y = g.add_input("x", "user", "f32", rows)
for name in json.loads(sys.stdin.read()):
    w = g.add_input(name, "param", "f32", [64])
    y = g.add_node("add", [y, g.add_node("expand", [g.add_node("reshape", [w], "f32", [1, 64])], "f32", rows)],
                   "f32", rows)
g.add_output(y)
print(json.dumps([str(g), _C.generate(g.partition(), 0, 90, None).source]))
"""


def _generate(names):
    so = os.path.join(ROOT, "kbench", "_C*.so")
    assert glob.glob(so), "kbench._C is not built"
    try:
        run = subprocess.run([sys.executable, "-c", GENERATE, so], input=json.dumps(names), capture_output=True,
                             text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("_C.generate did not return in 60 s: a name made it loop")
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout)


def kernels_of(cubin):
    """The kernels of a CUBIN (an ELF64): its .text.<name> sections."""
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    sections = [struct.unpack_from("<IIQQQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    strtab = sections[shstrndx][4]
    names = [cubin[strtab + s[0]:cubin.index(b"\0", strtab + s[0])].decode() for s in sections]
    return sorted(n[len(".text."):] for n in names if n.startswith(".text."))


def code_of(src):
    """The source without its // comments (generated code has no string literals)."""
    return "\n".join(line.split("//", 1)[0] for line in src.splitlines())


def check_source(src, kernels):
    """Printable ASCII on lines, nothing that splices or ends a comment early, no code of a name:
    every __global__ is one of kernels' definitions."""
    assert all(ch == "\n" or " " <= ch <= "~" for ch in src), "a byte outside printable ASCII"
    assert "\\" not in src and "??" not in src and "*/" not in src and "/*" not in src
    code = code_of(src)
    assert "pwn(" not in code and "*p=1" not in src and "#define out" not in code
    assert sorted(re.findall(r"__global__ void __launch_bounds__\(\d+\) (\w+)\(", code)) == sorted(kernels)
    assert code.count("__global__") == len(kernels)


def signature(src):
    m = re.search(r"__global__ void __launch_bounds__\(\d+\) \w+\(([^)]*)\)", src)
    return [re.findall(r"\w+", p)[-1] for p in m.group(1).split(",")]


def test_hostile_parameter_names_stay_text(compile_once):
    dump, src = _generate(HOSTILE)
    # the IR's dump: each name whole, escaped, on its own line
    assert len(dump.splitlines()) == 4 * len(HOSTILE) + 4
    assert '"w\\x0a__global__ void pwn(int*p){*p=1;}//"' in dump and "x" * 100_000 in dump
    check_source(src, ["kb_r0_pointwise"])
    params = signature(src)
    assert len(params) == len(set(params)) == len(HOSTILE) + 3   # x, the names, out, s0
    assert all(re.fullmatch(r"[A-Za-z]\w{0,23}", p) for p in params), params
    assert not set(params) & C_KEYWORDS and not any(p.startswith(("kb_", "KB_", "CUDART_")) for p in params)
    # the kernel's own parameters keep their names; a model's "out" or "s0" gets a suffix
    assert params[-2:] == ["out_1", "s0"] and params[0] == "x"
    # each name is a quoted one-line comment in the header, cut to 64 characters
    header = [line for line in src.splitlines() if line.startswith("// in ")]
    assert len(header) == len(HOSTILE) + 1 and all(len(line) < 200 for line in header)
    for cubin in compile_once([(src, "sm_80"), (src, "sm_90")]):
        assert kernels_of(cubin) == ["kb_r0_pointwise"] and b"pwn" not in cubin


def test_symbol_names_are_identifiers():
    """A symbol's name is printed as it is (in the dump, in the types of a kernel's header
    comments): only an identifier is taken, also from a capture kept in the cache."""
    g = _C.Graph()
    for bad in ["s\nint pwn;//", "s*/", "s\\", "0s", "s 0", "s\u00e9"]:
        with pytest.raises(ValueError, match="identifier"):
            g.add_symbol(bad, 4)
    assert g.add_symbol("s_0", 4) == 0 and g.symbols == [("s_0", 4)]


KEY = "blk\n" + PWN + "//\r#define x 1 */"   # a ModuleDict key: no '.', anything else


class Hostile(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_parameter("w\n" + PWN + "//", torch.nn.Parameter(torch.randn(16)))
        self.blocks = torch.nn.ModuleDict({KEY: torch.nn.LayerNorm(16), "out": torch.nn.Linear(16, 16)})

    def forward(self, x):
        w = getattr(self, "w\n" + PWN + "//")
        return torch.tanh(self.blocks[KEY](x) * w) + self.blocks["out"](x).sigmoid()


def test_optimize_interp_with_hostile_names(compile_once):
    """The whole path, kbench.optimize(..., backend="interp"), for a module with such a parameter
    name and ModuleDict key: it matches eager forward and backward, its IR keeps the names, and
    each region's kernel holds them as text only."""
    torch.manual_seed(0)
    model = Hostile()
    x = torch.randn(6, 16, requires_grad=True)
    om = kbench.optimize(model, (x,), backend="interp", verbose=False)
    plan = om._kbench_plan
    names = [plan.nodes[v]["name"] for v in plan.graph.inputs]
    assert "w\n" + PWN + "//" in names and f"blocks.{KEY}.weight" in names, names
    y, ref = om(x), model(x)
    torch.testing.assert_close(y, ref)
    gy = torch.randn_like(ref)
    got = torch.autograd.grad(y, [x, *model.parameters()], gy)
    want = torch.autograd.grad(ref, [x, *model.parameters()], gy)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    part = plan.partition
    items = []
    for r in range(len(part)):
        if part.region(r)["kind"] == "EXTERN":
            continue
        k = _C.generate(part, r, 90, None)
        check_source(k.source, [k.name] + ([k.name + "_nostats"] if k.nostats else []) +
                     ([k.name + "_finish"] if "_finish(" in k.source else []))
        items.append((k.source, "sm_90", k.name))
    assert items
    for (src, _, name), cubin in zip(items, compile_once(items)):
        assert name in kernels_of(cubin) and b"pwn" not in cubin
