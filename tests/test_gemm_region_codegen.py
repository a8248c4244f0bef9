"""A GEMM region's kernel without a GPU (csrc/codegen/gemm_region.c): the captures of
optimize(gemm=True) — an MLP (Linear-bias-GELU-Linear and a residual add), its backward, an
attention block's scaled bmm score — generate GEMM-region kernels in the region ABI that are
deterministic and compile with NVRTC for sm_80 and sm_90; the GEMM genes' text round trip; what
codegen refuses says why (the region then stays in torch)."""
import pytest
import torch
import torch.nn.functional as F

from kbench import _C
from kbench.capture import capture


class MLP(torch.nn.Module):
    def __init__(self, dim=64, hidden=128):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(dim, hidden), torch.nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x))) + x


class Attention(torch.nn.Module):
    """Projections (a pinned head dim), a scaled bmm score, softmax, a bmm with v."""

    def __init__(self, dim=32):
        super().__init__()
        self.q, self.k, self.v = (torch.nn.Linear(dim, dim) for _ in range(3))

    def forward(self, x):
        q, k, v = self.q(x), self.k(x), self.v(x)
        return torch.bmm((torch.bmm(q, k.transpose(1, 2)) * 0.125).softmax(-1), v)


def _graph(model, *args):
    return capture(model.to(torch.bfloat16), tuple(a.to(torch.bfloat16) for a in args), gemm=True).graph


def _gemms(part):
    return [r for r in range(len(part)) if part.region(r)["kind"] == "GEMM"]


def _cases():
    torch.manual_seed(0)
    mlp = _graph(MLP(), torch.randn(2, 16, 64))
    attn = _graph(Attention(), torch.randn(2, 16, 32))
    return {"mlp": mlp.partition(), "mlp_backward": mlp.grad([1] * 5).partition(), "attention": attn.partition()}, attn


@pytest.fixture(scope="module")
def captured():
    return _cases()


@pytest.fixture(scope="module")
def cases(captured):
    return captured[0]


def test_gemm_region_kernels_generate_and_compile(cases, compile_once):
    """Every GEMM region of the three captures has a kernel: its entry named after the region in
    the region ABI (inputs, outputs, symbols), the tile a __device__ body called per tile; the same
    bytes twice; NVRTC compiles it for sm_80 and sm_90 (every variant once: a minute of NVRTC
    otherwise)."""
    items = []
    for name, part in cases.items():
        regions = _gemms(part)
        assert regions, name
        for r in regions:
            region = part.region(r)
            for sm in (80, 90):
                k = _C.generate(part, r, sm, None)
                assert k.source == _C.generate(part, r, sm, None).source, (name, r)
                assert k.name == f"kb_r{r}_gemm" and "gemm=" in str(k.genome) and k.genome.vec == 8
                entry = k.source[k.source.index(f"{k.name}("):]
                params = entry[entry.index("(") + 1:entry.index(")\n")].split(", ")
                assert len(params) == len(region["inputs"]) + len(region["outputs"]) + 2, (name, r, params)
                assert "__device__ __forceinline__ void kb_gemm_bf16" in k.source
                assert "t += gridDim.x" in entry
                # compiled: every kernel of the MLP for both archs; the others (same tile code,
                # other epilogues and layouts) for sm_90, the attention's projections left out
                if sm == 90 or name == "mlp":
                    if name != "attention" or r in regions[-2:]:
                        items.append((k.source, f"sm_{sm}", (name, r)))
    for (_, arch, what), cubin in zip(items, compile_once(items, together=True)):
        assert cubin[:4] == b"\x7fELF", (what, arch)


def test_gemm_region_epilogue_and_outputs(cases):
    """The epilogue is the region's nodes on the product rounded to its dtype: the MLP's bias
    (a vector along N through an EXPAND) and GELU, the residual (a full tensor), the score's scale;
    every output is stored, the backward's saved-product region's two outputs too; a weight
    gradient's K (the rows, varying) is the launch's guard (a multiple of 8)."""
    mlp = cases["mlp"]
    first = _C.generate(mlp, 0, 90, None).source
    assert "kb_mm = __bfloat162float(__float2bfloat16_rn" in first and "erff(" in first
    assert "bias[(i % 128)]" in first
    second = _C.generate(mlp, 1, 90, None).source
    assert "x[i]" in second   # the residual read at the element
    score = _C.generate(cases["attention"], _gemms(cases["attention"])[3], 90, None).source
    assert "0.125f" in score
    back = cases["mlp_backward"]
    for r in _gemms(back):
        src = _C.generate(back, r, 90, None).source
        outs = back.region(r)["outputs"]
        assert src.count("[i] = __float2bfloat16_rn") == 2 * len(outs), r   # each output, at v0 and v1
    weight_grads = [r for r in _gemms(back) if _C.generate(back, r, 90, None).last_multiple == 8]
    assert weight_grads and all(_C.generate(back, r, 90, None).last_dim == (1, (0, 1)) for r in weight_grads)


def test_gemm_genome_text_round_trip(cases):
    """A GEMM region's default genome is the GEMM generator's default at the example sizes,
    written as one gene in the text, which parses back to the same genome; a text without it is
    a genome without GEMM genes (old texts keep their meaning); a bad value is refused."""
    part = cases["mlp"]
    g = _C.genome_default(part, 0, [2, 16], None)
    text = str(g)
    assert text.endswith(" gemm=16x64x64/1x2/s4/b2") and "threads=64 vec=8" in text, text
    assert _C.Genome.parse(text) == g and str(_C.Genome.parse(text)) == text
    plain = text.rsplit(" gemm=", 1)[0]
    assert _C.Genome.parse(plain) != g and "gemm" not in str(_C.Genome.parse(plain))
    other = _C.Genome.parse(plain + " gemm=128x128x32/2x4/s4/b2")
    assert other != g and _C.generate(part, 0, 90, other).block == 256
    for bad in ("gemm=128x128", "gemm=128x128x32/2x4/s4/b3", "gemm=100x128x32/2x4/s4/b2"):
        with pytest.raises(ValueError):
            _C.Genome.parse(plain + " " + bad)
    with pytest.raises(ValueError, match="gemm gene"):
        _C.generate(part, 0, 90, _C.Genome.parse(plain))


def test_gemm_region_refusals():
    """What the kernel cannot do is refused with its reason (the tuner leaves the region to
    torch with it): f32 operands, autocast's cast as a prologue, a pinned K that is no multiple
    of 8, sizes that must be multiples of 8 varying apart; the search itself stays refused
    (a GEMM region runs its default genome)."""
    torch.manual_seed(0)
    x = torch.randn(2, 16, 64)
    f32 = capture(MLP(), (x,), gemm=True).graph.partition()
    with pytest.raises(NotImplementedError, match="bf16 or f16"):
        _C.generate(f32, _gemms(f32)[0], 90, None)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ac = capture(MLP(), (x,), gemm=True).graph.partition()
    with pytest.raises(NotImplementedError, match="prologue"):
        _C.generate(ac, _gemms(ac)[0], 90, None)
    odd = _graph(MLP(dim=12, hidden=16), torch.randn(2, 16, 12)).partition()
    with pytest.raises(NotImplementedError, match="K = 12 is not a multiple of 8"):
        _C.generate(odd, _gemms(odd)[0], 90, None)

    class PV(torch.nn.Module):   # p [b, t, s] @ v [b, s, d], every size its own symbol
        def forward(self, p, v):
            return torch.bmm(p, v)
    pv = _graph(PV(), torch.randn(2, 16, 24), torch.randn(2, 24, 40)).partition()
    with pytest.raises(NotImplementedError, match="no one guard"):
        _C.generate(pv, _gemms(pv)[0], 90, None)
    with pytest.raises(Exception, match="GEMM region"):
        _C.evolve_new(f32, _gemms(f32)[0], [2, 16], None, 7, 8)


def test_gemm_sweep_keeps_multiples_of_8(captured):
    """Verification sweeps a GEMM region's varying M, N and K also at sizes that stay multiples of
    8 (the kernel's guard may be any of them; the others run in torch and are not checked)."""
    from types import SimpleNamespace

    from kbench import verify
    parts, graph = captured
    plan = SimpleNamespace(partition=parts["attention"], graph=graph)
    regions = _gemms(parts["attention"])
    assert verify.vec_symbols(plan, regions[0], [2, 16]) == {0, 1}   # a projection: M = s0 * s1
    assert verify.vec_symbols(plan, regions[-1], [2, 16]) == {1}     # P @ V: M = K = s1
    assert verify.vec_symbols(plan, regions[-1], [2, 15]) == set()


def test_constant_scale_prologue_is_applied_to_the_accumulator():
    """A prologue that scales an operand by a constant ((a * 0.5) @ -w) commutes with the product:
    the kernel loads the operands as stored and scales the accumulator (a cast stays refused:
    test_gemm_region_refusals)."""
    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(32, 24))

        def forward(self, a):
            return torch.matmul(a * 0.5, -self.w)
    part = _graph(Scaled(), torch.randn(2, 16, 32)).partition()
    src = _C.generate(part, _gemms(part)[0], 90, None).source
    assert "kb_acc = v0 * -0.5f;  // the operands' constant prologue factors" in src, src[-3000:]
