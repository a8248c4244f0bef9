"""The schedule search on a GPU (budget='fast'): on LayerNorm and softmax regions every candidate is
generated, compiled and recorded; the winner passes full verification, is not slower than the
default genome (both re-timed interleaved), and the same seed picks the same winner twice."""
import pytest
import torch
from torch import nn

import kbench
from kbench import cache, search

pytestmark = pytest.mark.gpu


class Softmax(nn.Module):
    def forward(self, x):
        return torch.softmax(x, dim=-1)


MODELS = [
    # sizes large enough (tens of MB) that timing noise stays below the near-tie window
    ("layernorm", lambda: nn.LayerNorm(768), (16384, 768)),
    ("layernorm_4096", lambda: nn.LayerNorm(4096), (4096, 4096)),
    ("softmax", Softmax, (8192, 1000)),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name,factory,shape", MODELS, ids=[m[0] for m in MODELS])
def test_search_fast(name, factory, shape, dtype):
    torch.manual_seed(0)
    model = factory().to(dtype).cuda().eval()
    x = torch.randn(*shape, device="cuda", dtype=dtype)
    fast = kbench.optimize(model, (x,), backend="cuda", budget="fast", verbose=False)
    ex, plan = fast._kbench_executor, fast._kbench_plan
    rows = [info.index for info in plan.regions if info.kind == "ROW"]
    assert rows, str(plan.partition)
    symvals = list(plan.captured.example_symvals)
    seen = []
    with torch.cuda.device(x.device):
        for r in rows:
            res = search.search_region(ex, r, symvals, budget="fast", seed=0,
                                       progress=lambda reg, gen, best: seen.append((reg, gen, best)))
            assert res.best_k is not None and res.verdict, res.note
            assert not res.note
            assert res.best_ms <= res.default_ms * 1.0001, (res.best_genome, res.best_ms, res.default_genome,
                                                             res.default_ms)
            assert len(res.candidates) == search.BUDGETS["fast"].candidates
            assert res.candidates[0]["genome"] == res.default_genome
            for c in res.candidates:
                assert set(cache.CANDIDATE_FIELDS) <= set(c)
                # every legal genome compiles; codegen may still refuse a corner it cannot do
                assert c["compile_status"] in ("ok", "codegen rejected"), c
            # the finalists' re-timing: the budget's rounds, more only where a decision was unclear
            b = search.BUDGETS["fast"]
            for c in res.candidates:
                if "final_ms" in c:
                    assert c["final_rounds"] <= search.MAX_ROUNDS_FACTOR * b.rounds, c
                    assert c["tie"] in ("in", "tie", "out", "not faster than the default"), c
            ok = [c for c in res.candidates if c["time_ms"] is not None]
            assert len(ok) >= len(res.candidates) // 2, res.candidates
            # the winner computes what eager does on a fresh input
            out = ex._launch(res.kernel, r, symvals, ex._region_inputs(r, symvals, "normal",
                                                                       torch.Generator().manual_seed(1)))
            assert all(torch.isfinite(o.float()).all() for o in out if o.is_floating_point())
            again = search.search_region(ex, r, symvals, budget="fast", seed=0)
            if again.best_genome != res.best_genome:   # the whole record, not pytest's truncated repr
                print("first search finalists:", *_finals(res), "second:", *_finals(again), sep="\n  ")
            assert again.best_genome == res.best_genome, (_finals(res), _finals(again))
            assert [c["genome"] for c in again.candidates] == [c["genome"] for c in res.candidates]
    assert seen and all(s[1] == 0 for s in seen)   # fast: one generation


def _finals(res):
    return [(c["genome"], c["time_ms"], c["final_ms"], c["final_rounds"], c["tie"], c["verify"])
            for c in res.candidates if "final_ms" in c]
