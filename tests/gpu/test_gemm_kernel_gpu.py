"""kbench's generated tensor-core GEMM (csrc/codegen/gemm.c through kbench/runtime/gemm.py) on the
GPU, against torch's float32 matmul of the same bf16/f16 inputs (TF32 off): M and N off the tile
(1, 17, 300), K = 8, 40 (a partial k-tile), 4096, both B layouts, batched, broadcast A or B,
each built-in epilogue and output dtype, several genomes. Every output starts NaN-poisoned, so an
element the kernel does not write fails. The error bound: norm-wise relative error within
eps(out) + 2 sqrt(K) eps(f32) (the output's rounding plus f32 accumulation in another order), and
every element within 2 eps(out) |ref| + that bound times the output's RMS."""
import math

import pytest
import torch
import torch.nn.functional as F

from kbench.runtime import gemm as kg

pytestmark = pytest.mark.gpu

DT = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}
DEFAULT = (128, 128, 32, 2, 4, 4, 2)
ACTS = {"gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu, "relu": F.relu, "silu": F.silu,
        "leaky_relu": lambda x: F.leaky_relu(x, 0.1), None: lambda x: x}


@pytest.fixture(autouse=True)
def no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


def poisoned(shape, dtype):
    return torch.full(shape, float("nan"), dtype=dtype, device="cuda")


def reference(a, b, bt, alpha=None, bias=None, bias_m=None, act=None, residual=None, at=False):
    bf = b.float().transpose(-1, -2) if bt else b.float()
    y = torch.matmul(a.float().transpose(-1, -2) if at else a.float(), bf)
    if alpha is not None:
        y = y * alpha
    if bias is not None:
        y = y + bias.float()
    if bias_m is not None:
        y = y + bias_m.float()[:, None]
    y = ACTS[act](y)
    return y + residual.float() if residual is not None else y


def check(out, ref, K, what):
    eps = torch.finfo(out.dtype).eps
    bound = eps + 2 * math.sqrt(K) * torch.finfo(torch.float32).eps
    o = out.float()
    assert not torch.isnan(o).any(), f"{what}: {int(torch.isnan(o).sum())} elements left unwritten (NaN)"
    scale = ref.norm().item() or 1.0
    rel = (o - ref).norm().item() / scale
    assert rel <= bound, f"{what}: relative error {rel:.3g} > {bound:.3g}"
    rms = scale / math.sqrt(max(ref.numel(), 1))
    worst = ((o - ref).abs() - 2 * eps * ref.abs() - bound * rms).max().item()
    assert worst <= 0, f"{what}: an element off by {worst:.3g} beyond its bound"


def run(a, b, bt, genome=DEFAULT, out_dtype=None, at=False, **epi):
    """gemm() into a NaN-poisoned output, checked against the reference."""
    shape = kg.operands(a, b, a_transposed=at, b_transposed=bt, out_dtype=out_dtype, **epi).out_shape
    out = poisoned(shape, out_dtype or a.dtype)
    got = kg.gemm(a, b, a_transposed=at, b_transposed=bt, genome=genome, out_dtype=out_dtype, out=out, **epi)
    assert got is out
    K = a.shape[-2] if at else a.shape[-1]
    check(out, reference(a, b, bt, epi.get("alpha"), epi.get("bias"), epi.get("bias_m"), epi.get("act"),
                         epi.get("residual"), at), K,
          f"{tuple(a.shape)} @ {tuple(b.shape)} at={at} bt={bt} {genome} {epi.keys()}")
    return out


def operands(M, N, K, dt, bt, batch=None, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    lead = () if batch is None else (batch,)
    a = torch.randn(*lead, M, K, device="cuda", generator=g).to(DT[dt])
    b = torch.randn(*lead, *((N, K) if bt else (K, N)), device="cuda", generator=g).to(DT[dt])
    return a, b


@pytest.mark.parametrize("dt", ["bf16", "f16"])
@pytest.mark.parametrize("bt", [True, False], ids=["b_transposed", "b_row_major"])
def test_gemm_sizes_off_the_tile(dt, bt):
    """M, N in {1, 17, 300} (row-major B: N in {8, 24, 296}, its rows need multiples of 8),
    K in {8, 40, 4096}: zero-filled tails along M, N and K, predicated stores (odd N: no pairs)."""
    Ns = (1, 17, 300) if bt else (8, 24, 296)
    for M in (1, 17, 300):
        for N in Ns:
            for K in (8, 40, 4096):
                a, b = operands(M, N, K, dt, bt, seed=M * 7 + N * 3 + K)
                run(a, b, bt)


@pytest.mark.parametrize("bt", [True, False], ids=["b_transposed", "b_row_major"])
def test_gemm_batched_and_broadcast(bt):
    """batch 3 with both operands batched, B shared (a 2-D weight, or a stride-0 expand), A shared;
    and row strides wider than K (a slice of a wider matrix)."""
    a, b = operands(300, 296, 40, "bf16", bt, batch=3)
    run(a, b, bt)
    w = b[0].clone()
    run(a, w, bt)                                    # 2-D B: one weight for every batch
    run(a, w.expand(3, *w.shape), bt)                # stride-0 batch
    run(a[1].clone(), b, bt)                         # 2-D A against batched B
    wide = torch.randn(300, 72, device="cuda").to(torch.bfloat16)[:, :40]
    run(wide, w, bt)                                 # lda = 72


@pytest.mark.parametrize("bt", [True, False], ids=["b_transposed", "b_row_major"])
def test_gemm_a_transposed(bt):
    """A stored [K, M] (a weight gradient's activations, read through ldmatrix.trans): M a multiple
    of 8 but not of the tile, K with a partial k-tile and deep, batched, with an epilogue."""
    for M, N, K in ((8, 24, 8), (296, 24 if not bt else 17, 40), (136, 296, 4096)):
        a = torch.randn(K, M, device="cuda").to(torch.bfloat16)
        b = torch.randn(*((N, K) if bt else (K, N)), device="cuda").to(torch.bfloat16)
        run(a, b, bt, at=True)
    a = torch.randn(3, 40, 296, device="cuda").to(torch.bfloat16)
    b = torch.randn(*((296, 40) if bt else (40, 296)), device="cuda").to(torch.bfloat16)
    run(a, b, bt, at=True, bias=torch.randn(296, device="cuda").to(torch.bfloat16), act="gelu_tanh")
    run(a, b, bt, at=True, genome=(64, 32, 16, 2, 1, 2, 1))


def test_gemm_epilogues():
    """Each built-in epilogue term alone, then all together, each output dtype; a Linear's
    bias + GELU(tanh) at 8192 x 768 -> 3072 sizes' shape class (tails on M)."""
    M, N, K = 300, 300, 136
    a, b = operands(M, N, K, "bf16", True, seed=5)
    g = torch.Generator(device="cuda").manual_seed(9)
    bias = torch.randn(N, device="cuda", generator=g).to(torch.bfloat16)
    bias_m = torch.randn(M, device="cuda", generator=g)
    res = torch.randn(M, N, device="cuda", generator=g).to(torch.bfloat16)
    run(a, b, True, alpha=0.25)
    run(a, b, True, bias=bias)
    run(a, b, True, bias_m=bias_m)
    run(a, b, True, residual=res)
    for act in ("gelu_tanh", "gelu", "relu", "silu"):
        run(a, b, True, act=act)
    run(a, b, True, act="leaky_relu", act_scalars=(0.1,))
    for out_dtype in (torch.float32, torch.float16, torch.bfloat16):
        r = res.to(out_dtype)
        run(a, b, True, out_dtype=out_dtype, alpha=0.5, bias=bias, bias_m=bias_m, act="gelu_tanh", residual=r)


def test_gemm_genomes():
    """Several schedules on one awkward size (M 300, N 296, K 4096): tile_k 16/32/64, 1 to 8 warps,
    2 to 4 stages, 1 or 2 blocks an SM, and the first candidates the sizes' list offers; B's layout alternates (one
    compile per genome)."""
    a, b = operands(300, 296, 4096, "f16", False, seed=3)
    bt = b.transpose(0, 1).contiguous()
    genomes = [(64, 32, 16, 2, 1, 2, 1), (16, 64, 64, 1, 2, 4, 2), (256, 128, 32, 4, 2, 3, 1)]
    genomes += [g for g in kg.genomes(300, 296, 4096, 1, "cuda")[:3] if g not in genomes]
    for i, genome in enumerate(genomes):
        if i % 2:
            run(a, bt, True, genome=genome)
        else:
            run(a, b, False, genome=genome)


def test_gemm_refuses_misaligned_pointers():
    a, b = operands(64, 64, 64, "bf16", True)
    off = torch.empty(64 * 64 + 4, device="cuda", dtype=torch.bfloat16)[4:].view(64, 64)
    off.copy_(a)
    with pytest.raises(kg.GemmRefused, match="16-byte aligned"):
        kg.gemm(off, b, b_transposed=True)
    with pytest.raises(kg.GemmRefused, match="K = 12"):
        kg.gemm(a[:, :12], b[:, :12], b_transposed=True)
