"""The tensor-core GEMM generator (csrc/codegen/gemm.c) without a GPU: its sources compile with
NVRTC for sm_80 and sm_90 over genomes x B layouts x epilogues x dtypes, ptxas keeps the default
schedule out of local memory, the source is deterministic and matches a golden copy, genome
legality and the candidates, and the launcher's refusals (kbench/runtime/gemm.py)."""
import os
import pathlib

import numpy as np
import pytest
import torch

from kbench import _C
from kbench.agent import cubin
from kbench.runtime import gemm

GOLDEN = pathlib.Path(__file__).parent / "golden_cuda"
DEFAULT = (128, 128, 32, 2, 4, 4, 2)
H100 = {"sm": 90, "num_sms": 132, "max_smem_per_block": 232448, "regs_per_sm": 65536}


def spec(ab="bf16", out=None, bt=False, at=False, **epi):
    return {"ab": ab, "out": out or ab, "a_transposed": at, "b_transposed": bt, **epi}


FULL = dict(alpha=True, bias_n="bf16", act="gelu_tanh", residual="bf16")
# (spec, genome, arch): every tile_k (chunks per smem row 2, 4, 8 and, for a row-major B, 4..32),
# both B layouts, f16 and bf16 in, each output dtype, each built-in epilogue term, broadcast and
# batched operands
CASES = [
    (spec("bf16", bt=True, b_broadcast=True, **dict(FULL, act="relu")), DEFAULT, "sm_90"),
    (spec("f16", "f32", bias_m="f32", act="relu", a_broadcast=True), (64, 64, 64, 2, 2, 3, 2), "sm_80"),
    (spec("bf16", "f32", act="silu"), (64, 128, 32, 2, 2, 4, 2), "sm_80"),
    (spec("f16", bt=True, residual="f16", bias_n="f32", act="gelu_tanh"), (16, 64, 64, 1, 2, 4, 2), "sm_80"),
    (spec("bf16", bt=True, act="leaky_relu", act_scalars=(0.1,)), (64, 32, 16, 2, 1, 2, 1), "sm_90"),
    (spec("f16", "bf16", alpha=True, act="gelu"), (32, 64, 64, 1, 2, 4, 2), "sm_80"),
    (spec("bf16", "bf16", alpha=True, at=True), (128, 64, 64, 2, 2, 3, 1), "sm_80"),
    (spec("f16", "f32", at=True, bt=True, bias_n="f16"), (64, 64, 32, 2, 2, 4, 2), "sm_80"),
]


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_gemm_sources_compile(compile_once, arch):
    """Each case's source compiles for its arch (one NVRTC unit per arch), and ptxas puts nothing in
    local memory (no spills) and at most 255 registers a thread in any of them."""
    items = [(_C.gemm_generate(s, g, int(a[3:]), H100)[0], a, (s, g)) for s, g, a in CASES if a == arch]
    blobs = compile_once(items, together=True)
    assert blobs[0][:4] == b"\x7fELF" and all(b is blobs[0] for b in blobs)
    res = cubin.resources(blobs[0])
    assert len(res) == len(items), res
    for name, r in res.items():
        assert r["local_bytes"] == 0 and 0 < r["registers"] <= 255, (name, r)


def test_gemm_source_deterministic_and_golden():
    """The same spec, genome and sm give the same bytes; the default kernel with the full built-in
    epilogue matches tests/golden_cuda/gemm_bf16_nt_bias_gelu_tanh.cu (KBENCH_UPDATE_GOLDEN=1
    rewrites it)."""
    full = spec("bf16", bt=True, b_broadcast=True, **FULL)
    one = _C.gemm_generate(full, DEFAULT, 90, H100)
    assert one == _C.gemm_generate(dict(full), DEFAULT, 90, H100)
    src, name, block, smem, tm, tn = one
    assert (name, block, smem, tm, tn) == ("kb_gemm_bf16_nt_128x128x32_w2x4_s4_b2", 256, 65536, 128, 128)
    assert "__launch_bounds__(256, 2)" in src
    path = GOLDEN / "gemm_bf16_nt_bias_gelu_tanh.cu"
    if os.environ.get("KBENCH_UPDATE_GOLDEN"):
        path.write_text(src)
    assert src == path.read_text(), f"generated source differs from {path}"
    # ops.def's template is the epilogue's math; the sizes are arguments, never constants
    assert "expf(-1.5957691216f * (x + 0.044715f * x * x * x))" in src
    assert "const long long M, const long long N, const long long K" in src
    assert "stride_b" not in src and "stride_a" in src   # B broadcast: no batch stride
    row_major = _C.gemm_generate(spec("bf16"), DEFAULT, 90, H100)[0]
    assert "kb_ldmatrix_x4_trans(" in row_major and "kb_ldmatrix_x4_trans(r" not in src


def test_gemm_genome_legality():
    check = _C.gemm_genome_check
    check(DEFAULT, H100)
    for bad, why in [((128, 128, 64, 2, 4, 8, 1), "shared memory"), ((128, 128, 32, 3, 4, 4, 1), "powers of two"),
                     ((128, 120, 32, 2, 4, 4, 1), "tile_n"), ((128, 128, 24, 2, 4, 4, 1), "tile_k"),
                     ((128, 128, 32, 2, 4, 1, 1), "stages"), ((256, 256, 32, 2, 4, 2, 1), "registers"),
                     ((16, 64, 64, 2, 1, 2, 1), "tile_m"), ((128, 128, 32, 2, 4, 4, 3), "min_blocks"),
                     ((128, 128, 64, 2, 4, 4, 2), "2 x 131072 bytes"), ((256, 128, 32, 4, 2, 3, 2), "2 blocks an SM")]:
        with pytest.raises(ValueError, match=why):
            check(bad, H100)
    small = dict(H100, max_smem_per_block=48 * 1024)   # a device without the opt-in
    with pytest.raises(ValueError, match="shared memory"):
        check(DEFAULT, small)
    with pytest.raises(ValueError, match="shared memory"):
        _C.gemm_generate(spec(), DEFAULT, 90, small)


def test_gemm_genome_default_and_candidates():
    """128x128 where its grid fills the SMs, smaller tiles for small M*N; candidates start with the
    default, are legal and distinct, and skip tiles far larger than the problem."""
    big = _C.gemm_genomes(4096, 4096, 4096, 1, H100)
    assert big[0] == DEFAULT and len(big) == len(set(big)) >= 6
    for g in big:
        _C.gemm_genome_check(g, H100)
    small = _C.gemm_genomes(256, 512, 4096, 1, H100)
    assert small[0][0] * small[0][1] < 128 * 128
    assert all(g[0] <= 2 * 17 + 16 for g in _C.gemm_genomes(17, 4096, 64, 1, H100))
    assert _C.gemm_genomes(4096, 4096, 4096, 1, dict(H100, max_smem_per_block=48 * 1024))[0] != DEFAULT


def test_gemm_generate_refusals():
    with pytest.raises(NotImplementedError, match="bf16 or f16"):
        _C.gemm_generate(spec("f32"), DEFAULT, 90)
    with pytest.raises(NotImplementedError, match="sm_80"):
        _C.gemm_generate(spec(), DEFAULT, 75)
    with pytest.raises(NotImplementedError, match="unary"):
        _C.gemm_generate(spec(act="add"), DEFAULT, 90)
    with pytest.raises(ValueError, match="unknown op"):
        _C.gemm_generate(spec(act="no_such_op"), DEFAULT, 90)
    with pytest.raises(ValueError, match="expected 7 values"):
        _C.gemm_generate(spec(), DEFAULT[:6], 90)
    with pytest.raises(TypeError, match="unknown key"):
        _C.gemm_generate({"ab": "bf16", "bias": "bf16"}, DEFAULT, 90)
    with pytest.raises(NotImplementedError, match="dtype"):
        _C.gemm_generate(spec(bias_n="i64"), DEFAULT, 90)


def _t(*shape, dtype=torch.bfloat16):
    return torch.zeros(shape, dtype=dtype)


def test_gemm_launcher_refusals():
    """What the kernel requires, refused with the reason before anything is generated."""
    cases = [
        ((_t(8, 16, dtype=torch.float32), _t(16, 8, dtype=torch.float32)), {}, "bfloat16 or float16"),
        ((_t(8, 12), _t(12, 8)), {}, "K = 12"),
        ((_t(8, 16), _t(16, 12)), {}, "N = 12"),
        ((_t(8, 16), _t(8, 16)), {}, "rows of K"),
        ((_t(8, 16), _t(16, 8).t()), {"b_transposed": True}, "unit stride"),
        ((_t(8, 24)[:, :16], _t(16, 8)), {}, ""),                     # row stride 24: fine
        ((_t(8, 20)[:, :16], _t(16, 8)), {}, "row stride 20"),
        ((_t(600).as_strided((4, 8, 16), (132, 16, 1)), _t(16, 8)), {}, "a's batch stride 132"),
        ((_t(2, 8, 16), _t(3, 16, 8)), {}, "do not broadcast"),
        ((_t(4 + 128)[4:].view(8, 16), _t(16, 8)), {}, "a's data pointer is not 16-byte aligned"),
        ((_t(8, 16), _t(16, 8)), {"bias": _t(9)}, "bias_n must be a contiguous tensor of shape (8,)"),
        ((_t(8, 16), _t(16, 8)), {"residual": _t(8, 8, dtype=torch.int32)}, "residual must be float32"),
        ((_t(8, 16), _t(16, 8)), {"out_dtype": torch.float64}, "out_dtype"),
        ((_t(8, 16), _t(5, 16)), {"b_transposed": True}, ""),           # any N with b transposed
        ((_t(16, 12), _t(16, 8)), {"a_transposed": True}, "M = 12"),
        ((_t(16, 24), _t(16, 8)), {"a_transposed": True}, ""),          # a stored [K, M]
    ]
    for (a, b), kw, why in cases:
        got = gemm.refusal(a, b, **kw)
        assert (why in got and got) if why else got == "", (why, got)
    with pytest.raises(gemm.GemmRefused, match="CUDA"):
        gemm.gemm(_t(8, 16), _t(16, 8))


# ---------------------------------------------------------------- the fragment mapping, emulated

def _swizzle(cpr, r, c):
    """kb_swizzle<CPR>(r, c) of the generated source (its text is checked below)."""
    q = r * cpr + c
    return (q ^ ((r & 7) if cpr >= 8 else ((q >> 3) & 7))) * 16


def _expr(text):
    """An index expression of the source as a Python function of its variables (C's / on ints)."""
    code = compile(text.replace("/", "//"), "<gemm index>", "eval")
    return lambda **v: eval(code, {}, v)


def _args(call):
    """The two top-level arguments of kb_swizzle<...>(x, y) in call."""
    inner = call[call.index("(") + 1:call.rindex(")")]
    depth = 0
    for i, ch in enumerate(inner):
        depth += (ch == "(") - (ch == ")")
        if ch == "," and depth == 0:
            return inner[:i].strip(), inner[i + 1:].strip()
    raise AssertionError(call)


def _emulate(src, BM, BN, BK, WM, WN, bt, at=False):
    """Runs the source's shared layout, ldmatrix addresses and epilogue coordinates through an
    emulation of ldmatrix.x4 (.trans) and mma.m16n8k16 as the PTX ISA defines their fragments, on
    integer tiles; returns (the block tile it computes, A @ B)."""
    import re
    flat = re.sub(r"\s+", " ", src)
    assert "const int key = CPR >= 8 ? (r & 7) : ((q >> 3) & 7); return (unsigned)(q ^ key) * 16u;" in flat
    a_call = re.search(r"kb_ldmatrix_x4(_trans)?\(a\[i\], sa \+ (kb_swizzle<\d+>\(.*?\))\);", flat)
    assert (a_call.group(1) is not None) == at
    a_call = a_call.group(2)
    b_call = re.search(r"kb_ldmatrix_x4(_trans)?\(r, sb \+ (kb_swizzle<\d+>\(.*?\))\);", flat)
    trans, b_call = b_call.group(1) is not None, b_call.group(2)
    assert trans == (not bt)
    row_e = _expr(re.search(r"const long long row = m0 \+ (.*?);", flat).group(1))
    col_e = _expr(re.search(r"const long long col = n0 \+ (.*?);", flat).group(1))
    ar, ac = map(_expr, _args(a_call))
    br, bc = map(_expr, _args(b_call))
    WTM, WTN, MI, NI = BM // WM, BN // WN, BM // WM // 16, BN // WN // 8
    consts = dict(WTM=WTM, WTN=WTN)
    rng = np.random.default_rng(0)
    A = rng.integers(-4, 5, (BM, BK)).astype(np.float64)
    B = rng.integers(-4, 5, (BK, BN)).astype(np.float64)

    def smem(T):   # a tile in its swizzled shared layout (halves)
        cpr = T.shape[1] // 8
        s = np.full(T.size, np.nan)
        for r in range(T.shape[0]):
            for c in range(cpr):
                o = _swizzle(cpr, r, c) // 2
                assert np.isnan(s[o:o + 8]).all()
                s[o:o + 8] = T[r, c * 8:c * 8 + 8]
        return s, cpr
    sa, acpr = smem(A.T.copy() if at else A)
    sb, bcpr = smem(B.T.copy() if bt else B)
    assert f"kb_swizzle<{acpr}>" in a_call and f"kb_swizzle<{bcpr}>" in b_call

    def ldmatrix(s, cpr, rows, cols, t):
        addrs = [_swizzle(cpr, rows[l], cols[l]) for l in range(32)]
        regs = np.empty((32, 4, 2))
        for q in range(4):
            assert len({a // 16 % 8 for a in addrs[8 * q:8 * q + 8]}) == 8, "shared memory bank conflict"
            m = np.array([s[a // 2:a // 2 + 8] for a in addrs[8 * q:8 * q + 8]])
            for l in range(32):
                regs[l, q] = m[2 * (l % 4):2 * (l % 4) + 2, l // 4] if t else m[l // 4, 2 * (l % 4):2 * (l % 4) + 2]
        return regs

    out = np.full((BM, BN), np.nan)
    lanes = range(32)
    for warp in range(WM * WN):
        v = dict(consts, warp_m=warp % WM, warp_n=warp // WM)
        acc = np.zeros((MI, NI, 32, 4))
        for kk in range(BK // 16):
            a = [ldmatrix(sa, acpr, [ar(**v, i=i, kk=kk, lane=l) for l in lanes],
                          [ac(**v, i=i, kk=kk, lane=l) for l in lanes], at) for i in range(MI)]
            b = [None] * NI
            for j in range(0, NI, 2):
                r = ldmatrix(sb, bcpr, [br(**v, j=j, kk=kk, lane=l) for l in lanes],
                             [bc(**v, j=j, kk=kk, lane=l) for l in lanes], trans)
                b[j], b[j + 1] = r[:, 0:2], r[:, 2:4]
            for i in range(MI):
                for j in range(NI):   # mma.m16n8k16: lane (g, t)'s registers, PTX ISA's fragment tables
                    Af, Bf = np.zeros((16, 16)), np.zeros((16, 8))
                    for l in lanes:
                        g, t = l // 4, l % 4
                        Af[g, 2 * t:2 * t + 2], Af[g + 8, 2 * t:2 * t + 2] = a[i][l, 0], a[i][l, 1]
                        Af[g, 2 * t + 8:2 * t + 10], Af[g + 8, 2 * t + 8:2 * t + 10] = a[i][l, 2], a[i][l, 3]
                        Bf[2 * t:2 * t + 2, g], Bf[2 * t + 8:2 * t + 10, g] = b[j][l, 0], b[j][l, 1]
                    D = Af @ Bf
                    for l in lanes:
                        g, t = l // 4, l % 4
                        acc[i, j, l] += (D[g, 2 * t], D[g, 2 * t + 1], D[g + 8, 2 * t], D[g + 8, 2 * t + 1])
        for i in range(MI):
            for h in range(2):
                for j in range(NI):
                    for l in lanes:
                        row, col = row_e(**v, i=i, h=h, lane=l), col_e(**v, j=j, lane=l)
                        out[row, col], out[row, col + 1] = acc[i, j, l, 2 * h], acc[i, j, l, 2 * h + 1]
    return out, A @ B


@pytest.mark.parametrize("genome", [DEFAULT, (64, 32, 16, 2, 1, 2, 1), (32, 256, 64, 1, 4, 2, 1)])
@pytest.mark.parametrize("at,bt", [(False, True), (False, False), (True, True), (True, False)],
                         ids=["nt", "nn", "tt", "tn"])
def test_gemm_fragment_mapping_emulated(genome, at, bt):
    """The generated source's ldmatrix addresses, swizzle and epilogue coordinates, read from its
    text and run through ldmatrix / mma.m16n8k16 as the PTX ISA defines their fragments, compute
    exactly A @ B for the block tile, every element once, with no bank conflict in any ldmatrix."""
    src = _C.gemm_generate(spec("bf16", bt=bt, at=at), genome, 90, H100)[0]
    out, ref = _emulate(src, *genome[:5], bt, at)
    assert not np.isnan(out).any()
    assert np.array_equal(out, ref)
