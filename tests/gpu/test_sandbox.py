"""The sandbox on a GPU (kbench/tune/sandbox.py): planted kernels that spin forever, call __trap(),
write past their output, or compute the wrong values; each is refused with its own fate (the first
three in the sandbox's worker, which is replaced; the wrong one by the numeric check here), and
this process's CUDA context, torch and optimize() work afterwards. End to end: a search whose every
candidate is one of those leaves its region to torch, with the reason, and the module computes what
eager does. And the memory: checks sized to the free memory, out of memory never an error."""
import io
import json
import re

import pytest
import torch
from torch import nn

import kbench
from kbench import _C, verify
from kbench.runtime import nvrtc
from kbench.runtime.plan import Status
from kbench.tune import cache, sandbox, search
from kbench.tune.tuner import Tuner

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

PLANTED = r"""
extern "C" __global__ void spin(float *y, const float *x, long long n) {
    volatile int *f = (volatile int *)y;
    while (f[0] == f[0]) { }          // two loads of the same word: always equal, never folded
}
extern "C" __global__ void trap(float *y, const float *x, long long n) { __trap(); }
extern "C" __global__ void past(float *y, const float *x, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = 2.0f * x[i];
    if (i == 0) y[n] = 0.0f;          // one element past the end
}
extern "C" __global__ void wrong(float *y, const float *x, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = x[i] + 1.0f;
}
extern "C" __global__ void twice(float *y, const float *x, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = 2.0f * x[i];
}
"""


def _check(name, n):
    grid = (n + 255) // 256
    return {"op": "check", "entries": [[name, 0]],
            "groups": [{"args": [["tensor", [n], "float32", "output"], ["tensor", [n], "float32", "input"], ["int", n]],
                        "calls": [[0, [grid, 1, 1], 256, 0]]}]}


def _arch():
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}"


def _small_model_works():
    """A torch op and a normal optimize() in this process, after whatever the sandbox ran."""
    assert (torch.ones(4, device="cuda") * 2).sum().item() == 8
    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(256), nn.GELU()).cuda().eval()
    x = torch.randn(512, 256, device="cuda")
    opt = kbench.optimize(model, (x,), budget="none", verbose=False)
    assert any(i.status.kernel for i in opt._kbench_plan.regions), opt.kbench_report
    torch.testing.assert_close(opt(x), model(x), rtol=1e-4, atol=1e-4)


def test_planted_kernels_are_refused_with_their_fates():
    cubin = nvrtc.compile(PLANTED, _arch())
    box = sandbox.Sandbox(torch.cuda.current_device())
    n = 1 << 20
    try:
        assert box.request(_check("twice", n), [cubin], timeout=60) == {"fate": "ok"}
        first = box.pid
        hang = box.request(_check("spin", n), [cubin], timeout=3)
        assert hang == {"fate": "hang: no answer within 3 s (worker killed)"} and box.proc is None
        trap = box.request(_check("trap", n), [cubin], timeout=60)
        assert trap["fate"].startswith("trap: ") and trap["dead"] is True, trap
        assert box.proc is None and box.starts == 2            # replaced after the hang; gone after the trap
        past = box.request(_check("past", n), [cubin], timeout=60)
        assert past == {"fate": "out-of-bounds write: past the end of argument 0 (output) (sizes 1 of 1)"}
        assert box.starts == 3 and box.pid != first
        # the wrong one runs cleanly: the sandbox passes it, the numeric check here refuses it
        assert box.request(_check("wrong", n), [cubin], timeout=60) == {"fate": "ok"}
        assert box.starts == 3
    finally:
        box.close()
    cuda = _C.cuda_open()
    module = _C.module_load(cuda, cubin)
    fn = _C.get_function(cuda, module, "wrong", 0)[0]
    x = torch.randn(n, device="cuda")
    y = torch.full((n,), float("nan"), device="cuda")
    _C.launch(cuda, fn, (n + 255) // 256, 256, 0, None, (y, x, n))
    ok, _, why = verify.compare(y, (2 * x).double())
    assert not ok and why.startswith("error"), why
    _small_model_works()


def _planted(real, body, genome, tag):
    """A kernel with the region's own signature and launch (real: what codegen made for the
    genome) and a body of the test's."""
    head = re.search(r'extern "C" __global__ void[^{]*\{', real.source).group(0)
    names = [p.split()[-1] for p in re.search(r"\((.*)\)", head).group(1).split(",")]
    n = re.search(r"const long long n = (.*);", real.source).group(1)
    body = body.replace("IN", names[0]).replace("OUT", names[1])
    source = f"// planted: {tag}\n{head}\n    const long long n = {n};\n    {body}\n}}\n"
    return _C.KernelInfo(name=real.name, genome=genome, source=source, block=real.block, smem=0,
                         grid_units=real.grid_units, units_per_block=real.units_per_block, max_blocks=real.max_blocks,
                         nkernels=1, workspace_bytes_per_unit=0, workspace_bytes_per_block=0)


STRIDE = "for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)"
BAD = [
    ("spin", "volatile int *f = (volatile int *)OUT; while (f[0] == f[0]) { }"),
    ("trap", "__trap();"),
    ("past", STRIDE + " OUT[i] = 2.0f * fmaxf(IN[i], 0.0f) - 0.5f; if (blockIdx.x == 0 && threadIdx.x == 0) OUT[n] = 0.0f;"),
    ("wrong", STRIDE + " OUT[i] = IN[i] + 1.0f;"),
]


def _region_reasons(monkeypatch) -> list:
    """A list that gets (status, reason) of every region the tuner prepares."""
    reasons = []
    prepare_region = Tuner.prepare_region

    def seen(self, ex, info, symvals):
        prepare_region(self, ex, info, symvals)
        reasons.append((info.status, info.reason))
    monkeypatch.setattr(Tuner, "prepare_region", seen)
    return reasons


class Pointwise(nn.Module):
    def forward(self, x):
        return torch.relu(x) * 2 - 0.5


def test_a_region_whose_candidates_are_all_bad_runs_in_torch(monkeypatch, tmp_path):
    """The search's candidates for the one region are the planted kernels (the rest refused by
    "codegen"): each refused with its fate and recorded; the region runs in torch with the reason;
    optimize() completes, its module computes what eager does, and the process still works."""
    monkeypatch.setenv("KBENCH_CACHE_DIR", str(tmp_path))     # no stored winner spares the search
    monkeypatch.setattr(sandbox, "WATCHDOG_FLOOR_S", 3.0)
    generate, asked = search.CudaRegionBench.generate, []

    def planted(self, genome):
        asked.append(str(genome))
        if len(asked) > len(BAD):
            raise ValueError("codegen: not this one (test)")
        tag, body = BAD[len(asked) - 1]
        return _planted(generate(self, genome), body, genome, tag)
    monkeypatch.setattr(search.CudaRegionBench, "generate", planted)
    reasons = _region_reasons(monkeypatch)
    model = Pointwise().cuda().eval()
    x = torch.randn(4096, 512, device="cuda")
    opt = kbench.optimize(model, (x,), budget="fast", verbose=False)
    assert len(asked) == search.BUDGETS["fast"].candidates
    assert reasons and reasons[0][0] is Status.EAGER, reasons
    assert re.match(r"no candidate compiled and passed the sandbox and the gate: 4 of 12 compiled, 3 refused by the "
                    r"sandbox \(first: hang: no answer within 3(\.\d+)? s \(worker killed\)\), 1 failed the gate "
                    r"\(first: output 0: error", reasons[0][1]), reasons
    out = io.StringIO()
    cache.open_cache().export(out, cubins=False)
    rec = {r["genome"]: r for r in map(json.loads, out.getvalue().splitlines()) if r["kind"] == "candidate"}
    fates = [(rec[g]["extra"].get("sandbox"), rec[g]["verify"]) for g in asked[:4]]
    assert fates[0][0].startswith("hang: no answer within") and fates[0][1] == f"sandbox: {fates[0][0]}", fates
    assert fates[1][0].startswith("trap: "), fates
    assert fates[2][0].startswith("out-of-bounds write: past the end of argument 1 (output) (sizes 1 of "), fates
    assert fates[3][0] == "ok" and fates[3][1].startswith("gate: output 0: error"), fates
    assert not any(i.status.kernel for i in opt._kbench_plan.regions)
    torch.testing.assert_close(opt(x), model(x))
    _small_model_works()


def test_an_example_that_fills_the_gpu_is_checked_at_sizes_that_fit():
    """With most of the memory taken, a LayerNorm whose check at the example would not fit is
    checked at the example's sizes halved until they fit, never larger, the envelope says so, and
    the module is right at the example; optimize() raises nothing."""
    torch.manual_seed(0)
    model = nn.LayerNorm(1024).cuda().eval()
    x = torch.randn(1 << 18, 1024, device="cuda")            # 1 GiB
    free = verify.free_bytes(x.device)
    hog = torch.empty(max(0, free - (6 << 30)), dtype=torch.uint8, device="cuda")   # about 6 GiB left
    try:
        opt = kbench.optimize(model, (x,), budget="none", verbose=False, gate=False, cuda_graphs=False)
    finally:
        del hog
        torch.cuda.empty_cache()
    rows = [i for i in opt._kbench_plan.regions if i.kind == "ROW"]
    assert rows and rows[0].status.kernel, opt.kbench_report
    assert "does not fit the free GPU memory" in rows[0].envelope, rows[0].envelope
    top = int(re.search(r"∈\[\d+,(\d+)\]", rows[0].envelope).group(1))
    assert top < x.shape[0], rows[0].envelope
    with torch.no_grad():
        torch.testing.assert_close(opt(x)[::64], model(x)[::64], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("budget", ["none", "fast"])
def test_out_of_memory_in_verification_leaves_the_region_to_torch(monkeypatch, tmp_path, budget):
    monkeypatch.setenv("KBENCH_CACHE_DIR", str(tmp_path))

    def oom(*a, **kw):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 80.00 GiB (test)")
    monkeypatch.setattr(verify, "verify_region", oom)
    reasons = _region_reasons(monkeypatch)
    model = nn.Sequential(nn.LayerNorm(384), nn.ReLU()).cuda().eval()
    x = torch.randn(1000, 384, device="cuda")
    opt = kbench.optimize(model, (x,), budget=budget, verbose=False)
    assert reasons and reasons[0][0] is Status.EAGER and "out of GPU memory" in reasons[0][1], reasons
    assert "80.00 GiB (test)" in reasons[0][1]
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))
