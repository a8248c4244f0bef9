"""The C core's own tests (csrc/tests), built and run plain and under AddressSanitizer +
UndefinedBehaviorSanitizer, from pytest so that the README's one test command covers them."""
import contextlib
import fcntl
import os
import re
import shutil
import subprocess
import sys

import pytest

from conftest import REQUIRE_NVRTC, nvrtc_missing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOBS = str(os.cpu_count() or 2)


@pytest.fixture(scope="module")
def make():
    """make and a C compiler: the C core's tests are part of the suite (setup.py compiles the
    same core with the same compiler), so their absence fails."""
    missing = [tool for tool in ("make", "cc") if shutil.which(tool) is None]
    if missing:
        pytest.fail(f"the C core's tests need {' and '.join(missing)} (a C toolchain)", pytrace=False)
    return run_make


def run_make(*args, lock=None):
    """make -j: the objects build in parallel; the outputs (csrc/tests/bin) stay for the next run,
    which rebuilds only what changed. lock: a name the runs that build the same objects share, so
    two pytest-xdist workers never build them at once."""
    with _locked(lock):
        proc = subprocess.run(["make", "-j", JOBS, *args], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout


@contextlib.contextmanager
def _locked(name):
    if name is None:
        yield
        return
    folder = os.path.join(ROOT, "csrc", "tests", "bin")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f".{name}.lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


@pytest.mark.parametrize("build,label", [("plain", "plain"), ("asan", "asan+ubsan")])
def test_core_unit_tests(make, build, label):
    """csrc/tests built and run plain and under ASan+UBSan (`make -C csrc check` is both): two
    tests, so that pytest-xdist runs them side by side (their builds go to folders of their own)."""
    out = make("-C", "csrc", f"check-{build}", lock=build)   # asan: the fuzz target links the same objects
    assert f"test binaries passed ({label})" in out and " 0 failed" in out, out[-4000:]


def test_capi_fuzz_smoke(make):
    """kbench._C itself built under ASan+UBSan (`make -C csrc fuzz`) and driven by
    csrc/tests/fuzz_capi.py for 3 s: random graphs and bad arguments through the builder, the
    partition, the interpreter and codegen; a sanitizer report or an exception other than a
    refusal fails it. .ci/run runs the same for a minute after the suite."""
    out = make("-C", "csrc", "fuzz", f"PY={sys.executable}", "FUZZ_SECONDS=3", lock="asan")
    assert "fuzz_capi: ok" in out, out[-4000:]


def test_nvrtc_unit_tests_sanitized(make):
    out = make("-C", "csrc/tests", "-f", "Makefile.cuda", "check")
    if "SKIPPED the compile tests" in out:   # test_nvrtc.c found no NVRTC; its other checks passed
        nvrtc_missing("no NVRTC for csrc/tests/test_nvrtc.c: " + out.split("no NVRTC:", 1)[-1].strip()[:300])
    assert " 0 failed" in out


# ---------------------------------------------------------------- codegen's layers

CODEGEN = os.path.join(ROOT, "csrc", "codegen")
C_KEYWORDS = {"if", "for", "while", "switch", "return", "sizeof", "defined", "__attribute__", "_Alignof",
              "offsetof", "va_start", "va_end"}


def _strip_c(src):
    """C source without comments, string and character literals (kept as empty quotes), or
    preprocessor lines: what is left are declarations, definitions and calls."""
    src = re.sub(r"/\*.*?\*/|//[^\n]*|\"(?:\\.|[^\"\\])*\"|'(?:\\.|[^'\\])*'",
                 lambda m: "\n" * m.group(0).count("\n") if m.group(0)[0] == "/" else '""', src, flags=re.S)
    return re.sub(r"^[ \t]*#(?:[^\n]*\\\n)*[^\n]*", "", src, flags=re.M)


def _functions(path):
    """{function defined in the file: (is static, names it calls)}, from the file's text: a
    definition is a name followed by a parenthesized list and a brace at file scope."""
    s = _strip_c(open(path).read())
    ident = re.compile(r"[A-Za-z_]\w*")
    out, depth, cur, start, i = {}, 0, None, 0, 0
    while i < len(s):
        ch = s[i]
        if ch in "{};":
            depth += (ch == "{") - (ch == "}")
            if depth == 0 and ch != "{":
                cur, start = None, i + 1
            i += 1
            continue
        m = ident.match(s, i)
        if not m:
            i += 1
            continue
        name, j = m.group(0), m.end()
        k = j
        while k < len(s) and s[k].isspace():
            k += 1
        if k < len(s) and s[k] == "(" and name not in C_KEYWORDS:
            if depth == 0:
                level, e = 0, k
                while e < len(s):
                    level += (s[e] == "(") - (s[e] == ")")
                    if level == 0:
                        break
                    e += 1
                f = e + 1
                while f < len(s) and s[f].isspace():
                    f += 1
                if f < len(s) and s[f] == "{":
                    cur = name
                    out[name] = (bool(re.search(r"\bstatic\b", s[start:i])), set())
                    i = f
                    continue
            elif cur:
                out[cur][1].add(name)
        i = j
    return out


def codegen_layers():
    """[(layer name, [files])] from codegen.h's section lines, lowest first."""
    text = open(os.path.join(CODEGEN, "codegen.h")).read()
    found = re.findall(r"^/\* =+ layer (\d+): (\w+) \(([^)]*)\) \*/$", text, flags=re.M)
    assert [int(n) for n, _, _ in found] == list(range(len(found))), found
    return [(name, [f.strip() for f in files.split(",")]) for _, name, files in found]


def test_codegen_layers_never_call_up():
    """codegen/ is layered emit -> index -> expression -> chunk -> kernel -> source (codegen.h):
    a file calls functions of its own layer or of lower ones, never of a higher one, and each
    function codegen.h declares under a layer is defined in that layer's files."""
    layers = codegen_layers()
    layer_of = {f: n for n, (_, files) in enumerate(layers) for f in files}
    files = sorted(f for f in os.listdir(CODEGEN) if f.endswith(".c"))
    assert sorted(layer_of) == files, f"codegen.h's layer lines must name every codegen/*.c once: {files}"
    funcs = {f: _functions(os.path.join(CODEGEN, f)) for f in files}
    home = {name: f for f in files for name, (static, _) in funcs[f].items() if not static}
    assert len(home) > 40, "the parser found too few functions"
    up = []
    for f in files:
        for fn, (_, calls) in funcs[f].items():
            for callee in calls:
                g = home.get(callee)
                if g and callee not in funcs[f] and layer_of[g] > layer_of[f]:
                    up.append(f"{f} ({layers[layer_of[f]][0]}) {fn} -> {callee} in {g} ({layers[layer_of[g]][0]})")
    assert not up, "calls up the codegen layers:\n" + "\n".join(up)
    # codegen.h's sections follow the layers
    raw = open(os.path.join(CODEGEN, "codegen.h")).read()
    marks = [m.start() for m in re.finditer(r"^/\* =+ layer \d+:", raw, flags=re.M)] + [len(raw)]
    declared = 0
    for n, (name, lfiles) in enumerate(layers):
        section = _strip_c(raw[marks[n]:marks[n + 1]])
        for decl in re.findall(r"^\w[\w\s\*]*?\b(cg_\w+)\s*\(", section, flags=re.M):
            assert home.get(decl) in lfiles, f"codegen.h declares {decl} under layer {name}, defined in {home.get(decl)}"
            declared += 1
    assert declared > 40, "codegen.h's layer sections declare too few functions"


# ---------------------------------------------------------------- names in the IR and in kernels

EVIL = 'w\n__global__ void pwn(int*p){*p=1;}//"\\'


def _named_graph(names):
    """x + w0 + w1 + ... over rows of 64, each w a parameter named as given."""
    from kbench import _C
    g = _C.Graph()
    g.add_symbol("s0", 4)
    rows = [(1, (0,)), 64]
    y = g.add_input("x", "user", "f32", rows)
    for name in names:
        w = g.add_input(name, "param", "f32", [64])
        we = g.add_node("expand", [g.add_node("reshape", [w], "f32", [1, 64])], "f32", rows)
        y = g.add_node("add", [y, we], "f32", rows)
    g.add_output(y)
    return g


def test_names_of_any_length_and_any_characters():
    """A node's name is kept whole by the IR (a Hugging Face parameter path is longer than the
    48 bytes names once had), printed escaped on one line, and never becomes code: in a kernel
    it is a comment-safe string and an identifier."""
    from kbench import _C
    path = "m.model.layers.0.post_attention_layernorm.weight"
    g = _named_graph([path * 4, EVIL])
    assert [g.node(v)["name"] for v in g.inputs] == ["x", path * 4, EVIL]
    dump = str(g)
    assert '"w\\x0a__global__ void pwn(int*p){*p=1;}//\\x22\\x5c"' in dump and len(dump.splitlines()) == g.num_nodes + 3
    src = _C.generate(g.partition(), 0, 90, None).source
    assert "pwn(int*p)" not in src and "*p=1" not in src and "\\" not in src
    assert all(not line.lstrip().startswith("__global__ void pwn") for line in src.splitlines())


def test_capture_keeps_long_parameter_paths():
    """torch.nn modules nested as in Hugging Face models capture with their full parameter paths."""
    import torch
    import kbench

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.post_attention_layernorm = torch.nn.LayerNorm(64)

        def forward(self, x):
            return self.post_attention_layernorm(x)

    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.layers = torch.nn.ModuleList([Block()])
    top = torch.nn.Sequential()
    top.add_module("m", torch.nn.Sequential(model.model.layers[0]))
    graph = kbench.capture(top, (torch.randn(8, 64),))
    names = [graph.ir.node(v)["name"] for v in graph.ir.inputs]
    assert "m.0.post_attention_layernorm.weight" in names, names
    deep = torch.nn.Sequential()
    deep.add_module("model_with_a_long_name", torch.nn.Sequential())
    deep.model_with_a_long_name.add_module("layers", torch.nn.Sequential(Block()))
    graph = kbench.capture(deep, (torch.randn(8, 64),))
    names = [graph.ir.node(v)["name"] for v in graph.ir.inputs]
    assert "model_with_a_long_name.layers.0.post_attention_layernorm.weight" in names, names


def _signature(src):
    """The parameter names of a generated source's first entry point, in order."""
    m = re.search(r"__global__ void __launch_bounds__\(\d+\) \w+\(([^)]*)\)", src)
    return [re.findall(r"\w+", p)[-1] for p in m.group(1).split(",")]


def test_kernel_parameters_are_named_after_the_values():
    """Parameters take the IR's names (a parameter path's last component), outputs out, out1, ...,
    saved statistics stat<k> where the IR has no name for them; a name that is not a safe C
    identifier is made one, and one the kernel's code uses (threadIdx's x aside) gets a suffix.
    The order and types (the ABI) are the region's inputs, outputs, symbols, as before."""
    import torch
    from kbench import _C, api
    path = "m.model.layers.0.post_attention_layernorm.weight"
    g = _named_graph([path, EVIL, "layers.0", "b", "n"])
    src = _C.generate(g.partition(), 0, 90, None).source
    assert _signature(src) == ["x", "weight", "w_global_void_pwn_int_p", "layers_0", "b", "n_1", "out", "s0"], _signature(src)
    try:
        from kbench.runtime import nvrtc
        handle = nvrtc.handle()
    except (FileNotFoundError, OSError) as e:
        handle = None
        if REQUIRE_NVRTC:
            pytest.fail(f"no NVRTC here, and KBENCH_REQUIRE_NVRTC is set: {e}", pytrace=False)
    if handle is not None:
        for arch in ("sm_80", "sm_90"):
            assert _C.nvrtc_compile(handle, src, arch, None)[:4] == b"\x7fELF"
    ln = torch.nn.LayerNorm(256)
    part = api._fresh_capture(ln, (torch.randn(8, 256),), "cuda").graph.partition()
    part.save_stats(0)
    k = _C.generate(part, 0, 90, None)
    assert _signature(k.source) == ["input", "weight", "bias", "out", "stat0", "stat1", "s0"], _signature(k.source)
    assert "stat0[row] = " in k.source and k.nostats


def test_preamble_holds_only_what_the_kernel_uses():
    """Every helper the preamble defines is named by the kernel or by another helper, and the
    fp16/bf16 headers come only with their types."""
    import sys
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import test_codegen as tc
    from kbench import _C
    seen = set()
    for name in ("layernorm", "softmax", "bias_gelu", "col_var", "cross_entropy", "row_colsum"):
        for dt in ("f32", "bf16", "f16"):
            g, symvals, _, _ = tc.build(name, dt)
            p = g.partition()
            for r in range(len(p)):
                for genome in tc.variants(p, r, symvals):
                    src = _C.generate(p, r, 90, genome).source
                    start = re.search(r"^(#define KB_NRED|template <bool KB_SAVE>|extern \"C\")", src, flags=re.M).start()
                    pre, code = _strip_c(src[:start]), _strip_c(src[start:])
                    defined = set(re.findall(r"#define (KB_\w+)", src[:start]))
                    defined |= set(re.findall(r"(?:__forceinline__|struct)[^;{]*?\b(kb_\w+)\s*[({]", pre))
                    seen |= defined
                    for h in defined:
                        definitions = len(re.findall(r"(?:__forceinline__|struct)[^;{]*?\b%s\s*[({]" % h, pre))
                        uses = len(re.findall(r"\b%s\b" % h, pre)) - definitions + len(re.findall(r"\b%s\b" % h, code))
                        assert uses > 0, (name, dt, r, str(genome), h)
                    assert ("cuda_bf16.h" in src[:start]) == bool(re.search(r"\b__\w*bfloat16", pre + code)), (name, dt)
                    assert ("cuda_fp16.h" in src[:start]) == bool(re.search(r"\b__\w*half", pre + code)), (name, dt)
    assert {"KB_INF", "kb_vec", "kb_ld", "kb_st", "kb_maxf", "kb_warp_sum", "kb_online_add", "kb_bf16_at"} <= seen, seen
