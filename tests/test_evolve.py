"""The schedule search on the CPU: the evolve_* binding over real partitions, and kbench.search's
driver (ask/tell loop, budgets, finalist re-timing order, the default-kept rule, failures, the
record) with a fake bench whose compile, gate, timing and verification are Python stand-ins;
then the real CudaRegionBench's plumbing against a CPU stand-in executor, compiling the asked
kernels with NVRTC where it is installed."""
import threading
import time
import types

import pytest
import torch

from kbench import _C, kernels, verify
from kbench.runtime.interp import run_region
from kbench.tune import cache, sandbox, search

# ---------------------------------------------------------------------------------------- graphs


def layernorm_graph(rows=512, n=768, dtype="f32", pinned=True):
    g = _C.Graph()
    s = g.add_symbol("s0", rows)
    S = (1, (s,))
    N = n if pinned else S
    full, keep, row1 = [S, N], [S, 1], [1, N]
    x = g.add_input("x", "user", dtype, full)
    w = g.add_input("w", "param", dtype, [N])
    b = g.add_input("b", "param", dtype, [N])
    mean = g.add_node("mean", [x], dtype, keep, axes=2)
    xc = g.add_node("sub", [x, g.add_node("expand", [mean], dtype, full)], dtype, full)
    var = g.add_node("mean", [g.add_node("mul", [xc, xc], dtype, full)], dtype, keep, axes=2)
    eps = g.add_node("const", [], dtype, keep, scalars=(1e-5, 0.0))
    rs = g.add_node("rsqrt", [g.add_node("add", [var, eps], dtype, keep)], dtype, keep)
    xn = g.add_node("mul", [xc, g.add_node("expand", [rs], dtype, full)], dtype, full)
    we = g.add_node("expand", [g.add_node("reshape", [w], dtype, row1)], dtype, full)
    be = g.add_node("expand", [g.add_node("reshape", [b], dtype, row1)], dtype, full)
    g.add_output(g.add_node("add", [g.add_node("mul", [xn, we], dtype, full), be], dtype, full))
    return g


def softmax_graph(rows=512, n=1000, dtype="f32"):
    g = _C.Graph()
    s = g.add_symbol("s0", rows)
    full, keep = [(1, (s,)), n], [(1, (s,)), 1]
    x = g.add_input("x", "user", dtype, full)
    m = g.add_node("expand", [g.add_node("max", [x], dtype, keep, axes=2)], dtype, full)
    e = g.add_node("exp", [g.add_node("sub", [x, m], dtype, full)], dtype, full)
    t = g.add_node("expand", [g.add_node("sum", [e], dtype, keep, axes=2)], dtype, full)
    g.add_output(g.add_node("div", [e, t], dtype, full))
    return g


def gelu_graph(rows=4096, n=1024, dtype="f32"):
    g = _C.Graph()
    s = g.add_symbol("s0", rows)
    full = [(1, (s,)), n]
    x = g.add_input("x", "user", dtype, full)
    g.add_output(g.add_node("gelu", [x], dtype, full))
    return g


def region_of_kind(p, kind):
    for r in range(len(p)):
        if p.region(r)["kind"] == kind:
            return r
    raise AssertionError(f"no {kind} region in\n{p}")


def parse(genome):
    """A genome's canonical text (a record's name for it) as {gene: value}."""
    out = {}
    for part in genome.split():
        k, _, v = part.partition("=")
        out[k] = v if k == "cache" else int(v)
    return out


def texts(genomes):
    """Asked genomes as the search's records name them: their canonical texts."""
    return [str(g) for g in genomes]


# ---------------------------------------------------------------------------------------- binding


def test_binding_asks_legal_unique_and_repeatable():
    g = layernorm_graph()
    p = g.partition()
    r = region_of_kind(p, "ROW")
    h = _C.evolve_new(p, r, [512], None, 7, 8)
    first = _C.evolve_ask(h, 3)
    assert first[0] == _C.genome_default(p, r, [512])      # the default is asked first
    seen = list(first)
    seen += _C.evolve_ask(h, 100)                           # the rest of generation 0, no more
    assert len(seen) == 8 and _C.evolve_generation(h) == 0
    for t in seen:
        _C.evolve_tell(h, t, 1.0 + t.threads / 1024)
    for _ in range(5):
        batch = _C.evolve_ask(h, 8)
        assert len(batch) == 8
        seen += batch
        for t in batch:
            assert _C.genome_legal(p, r, [512], None, t)
            _C.evolve_tell(h, t, -1.0 if t.vec == 2 else 1.0 + t.threads / 1024)
    assert _C.evolve_generation(h) == 5
    assert len(set(seen)) == len(seen) == 48 and len(set(texts(seen))) == 48
    best, ms = _C.evolve_best(h)
    assert best.threads == 32 and ms == pytest.approx(1 + 32 / 1024)
    doms = _C.evolve_domains(h)
    assert doms["threads"] == [32, 64, 128, 256, 512, 1024] and doms["col_split"] == [1]
    assert set(doms["cache"]) == {"regs", "smem", "reread"}

    # the same seed and the same tells give the same asks; another seed does not
    def run(seed):
        hh = _C.evolve_new(p, r, [512], {"num_sms": 132}, seed, 8)
        out = []
        for _ in range(4):
            batch = _C.evolve_ask(hh, 8)
            out += batch
            for t in batch:
                _C.evolve_tell(hh, t, t.items + t.rows / 7)
        return out
    assert run(3) == run(3)
    assert run(3) != run(4)


def test_binding_errors_and_lifetime():
    g = layernorm_graph()
    p = g.partition()
    r = region_of_kind(p, "ROW")
    h = _C.evolve_new(p, r, [512], None, 0, 0)
    assert _C.evolve_best(h) is None
    assert len(_C.evolve_ask(h, 64)) == 12       # population 0: the default (12)
    assert _C.evolve_ask(h, 0) == []
    with pytest.raises(ValueError, match="not legal"):
        _C.evolve_tell(h, _C.Genome.parse("threads=256 vec=4 rows=1 col_split=4"), 1.0)
    with pytest.raises(ValueError):
        _C.evolve_tell(h, _C.Genome.parse("threads=256 bogus=1"), 1.0)
    with pytest.raises(ValueError):
        _C.evolve_tell(h, _C.genome_default(p, r, [512]), float("nan"))
    with pytest.raises(ValueError):
        _C.genome_legal(p, r, [512], None, _C.Genome.parse("threads="))
    with pytest.raises(TypeError):   # a Genome, not its text
        _C.evolve_tell(h, str(_C.genome_default(p, r, [512])), 1.0)
    with pytest.raises(TypeError):
        _C.genome_legal(p, r, [512], None, str(_C.genome_default(p, r, [512])))
    with pytest.raises(IndexError):
        _C.evolve_new(p, len(p), [512], None, 0, 8)
    with pytest.raises(ValueError):
        _C.evolve_new(p, r, [512, 3], None, 0, 8)     # one symbol, two values
    with pytest.raises(ValueError):
        _C.evolve_new(p, r, [512], None, 0, 1)        # population of one
    with pytest.raises(TypeError):
        _C.evolve_new(g, r, [512], None, 0, 8)
    with pytest.raises((TypeError, ValueError)):
        _C.evolve_ask(object(), 4)
    # a genome told from elsewhere (a cache) is remembered and may be the best
    t = _C.Genome.parse("threads=128 vec=4 rows=1 items=1 cache=regs two_pass=1 fast_math=0 persistent=1 col_split=1")
    assert _C.genome_legal(p, r, [512], None, t)
    _C.evolve_tell(h, t, 0.01)
    assert _C.evolve_best(h) == (t, 0.01)
    # the handle keeps the partition (and its graph) alive
    del g, p
    for _ in range(3):
        for x in _C.evolve_ask(h, 12):
            assert x != t
            _C.evolve_tell(h, x, 1.0)


def test_genome_legal_rules():
    p = layernorm_graph(n=770).partition()
    r = region_of_kind(p, "ROW")
    rest = _C.Genome(threads=256, two_pass=1, fast_math=0, persistent=0, col_split=1)
    assert _C.genome_legal(p, r, [512], None, rest.replace(vec=2, rows=1, items=1, cache="regs"))
    assert not _C.genome_legal(p, r, [512], None, rest.replace(vec=4, rows=1, items=1, cache="regs"))
    assert not _C.genome_legal(p, r, [512], {"max_smem_per_block": 1024},
                               rest.replace(vec=2, rows=1, items=1, cache="smem"))
    assert _C.genome_legal(p, r, [512], None, rest.replace(vec=2, rows=1, items=1, cache="smem"))
    p = layernorm_graph(pinned=False).partition()
    r = region_of_kind(p, "ROW")
    assert not _C.genome_legal(p, r, [512], None, rest.replace(vec=1, rows=1, items=1, cache="regs"))
    assert _C.genome_legal(p, r, [512], None, rest.replace(vec=1, rows=1, items=4, cache="reread"))
    p = gelu_graph(dtype="bf16").partition()
    assert _C.genome_legal(p, 0, [4096], None, rest.replace(vec=8, rows=1, items=2, cache="regs"))
    assert not _C.genome_legal(p, 0, [4096], None, rest.replace(vec=8, rows=2, items=2, cache="regs"))


# ---------------------------------------------------------------------------------------- fake bench


class FakeKernel:
    def __init__(self, genome):
        self.genome, self.regs, self.spills = genome, 40, 0


class FakeBench:
    """Synthetic device: time = cost(genome text); genomes (their texts) in the sets fail where
    named. Its kernels carry their genome's text, as the search's records name them."""

    def __init__(self, cost, *, codegen_fail=(), compile_fail=(), slow=(), gate_fail=(), trap=(), verify_fail=(),
                 real_partition=None, noise=0.0, sandbox=None):
        self.cost, self.noise = cost, noise
        self.fates = dict(sandbox or {})      # genome -> what the sandbox answers for it (else it passes)
        self.codegen_fail, self.compile_fail, self.slow = set(codegen_fail), set(compile_fail), dict(slow)
        self.gate_fail, self.trap, self.verify_fail = set(gate_fail), set(trap), set(verify_fail)
        self.real_partition = real_partition
        self.calls = []                       # ("time", genome, reps) / ("verify", genome) / ...
        self.rounds = []                      # the kernel objects of each interleaved round
        self.compiled = []
        self.lock = threading.Lock()
        self.rng = __import__("random").Random(0)

    def generate(self, genome):
        if str(genome) in self.codegen_fail:
            raise ValueError("codegen: genome: not for this region\nsecond line\nthird line")
        if self.real_partition is not None:
            p, r = self.real_partition
            return _C.generate(p, r, 90, genome, None)
        return _C.KernelInfo(source=f"// genome: {genome}\n__global__ void k_{abs(hash(genome))}() {{}}\n", name="k",
                             block=genome.threads, smem=0, genome=genome, grid_units=1, units_per_block=1, nkernels=1,
                             workspace_bytes_per_unit=0, max_blocks=0)

    def compile(self, k):
        g = str(k.genome)
        with self.lock:
            self.compiled.append(g)
        if g in self.slow:
            time.sleep(self.slow[g])
        if g in self.compile_fail:
            raise _C.CompileError("kernel.cu(3): error: identifier \"x\" is undefined\nline two\nline three")

    def load(self, k):
        self.calls.append(("load", str(k.genome)))
        return FakeKernel(str(k.genome))

    def sandbox(self, k, kernel):
        self.calls.append(("sandbox", kernel.genome))
        fate = self.fates.get(kernel.genome, "")
        if isinstance(fate, BaseException):
            raise fate
        return fate

    def gate(self, kernel):
        self.calls.append(("gate", kernel.genome))
        if kernel.genome in self.trap:
            raise _C.CudaError("cuStreamSynchronize: CUDA_ERROR_ILLEGAL_ADDRESS: an illegal memory access")
        return "output 0: 12 element(s) NaN where eager is not (unwritten or wrong)" if kernel.genome in self.gate_fail else ""

    def time(self, kernel, reps, warmup=2):
        self.calls.append(("time", kernel.genome, reps))
        c = self.cost(kernel.genome)
        return [c * (1 + self.noise * (self.rng.random() - 0.5)) for _ in range(reps)]

    def time_each(self, kernels, round_index=0):
        self.calls.append(("round", round_index, tuple(k.genome for k in kernels)))
        self.rounds.append(list(kernels))
        return [self.time(k, 1, warmup=0)[0] for k in kernels]

    def verify(self, kernel):
        self.calls.append(("verify", kernel.genome))
        if kernel.genome in self.verify_fail:
            return verify.Verdict(False, "output 0 at sizes [7], large inputs: error 0.3 of the norm exceeds 0.00032")
        return verify.Verdict(True, checked=9)


def executor_for(p):
    return types.SimpleNamespace(plan=types.SimpleNamespace(partition=p), dev=None, seed=0)


def ln_cost(genome):
    import math
    g = parse(genome)
    return (1.0 + 0.10 * abs(math.log2(g["threads"]) - 7) + 0.15 * abs(math.log2(g["vec"]) - 2)
            + 0.08 * math.log2(g["rows"]) + 0.04 * math.log2(g["items"])
            + {"regs": 0, "smem": 0.2, "reread": 0.3}[g["cache"]] + 0.05 * g["two_pass"] + 0.03 * (1 - g["persistent"]))


LN_BEST = "threads=128 vec=4 rows=1 items=1 cache=regs two_pass=1 fast_math=0 persistent=1 col_split=1"


@pytest.fixture(scope="module")
def ln():
    g = layernorm_graph(rows=4096)
    p = g.partition()
    return g, p, region_of_kind(p, "ROW")


def run_search(ln, bench, budget="max", seed=0, **kw):
    g, p, r = ln
    return search.search_region(executor_for(p), r, [4096], budget=budget, seed=seed, bench=bench, **kw)


# ---------------------------------------------------------------------------------------- driver


def test_search_finds_the_optimum_and_records_everything(ln):
    progress = []
    bench = FakeBench(ln_cost)
    res = run_search(ln, bench, progress=lambda r, gen, best: progress.append((r, gen, best)))
    assert res.best_genome == LN_BEST and res.best_ms == pytest.approx(ln_cost(LN_BEST))
    assert str(res.best_k.genome) == LN_BEST and res.kernel.genome == LN_BEST and res.verdict
    assert res.default_genome == res.candidates[0]["genome"] == str(_C.genome_default(ln[1], ln[2], [4096]))
    assert res.default_ms == pytest.approx(ln_cost(res.default_genome))
    assert len(res.candidates) == 160 and len({c["genome"] for c in res.candidates}) == 160
    assert res.generations == 10 and [p[1] for p in progress] == list(range(10))
    assert all(p[0] == ln[2] for p in progress)
    bests = [p[2] for p in progress]
    assert bests == sorted(bests, reverse=True) and bests[-1] == pytest.approx(ln_cost(LN_BEST))
    for c in res.candidates:
        assert set(cache.CANDIDATE_FIELDS) <= set(c) and "_ok" not in c
        assert c["compile_status"] == "ok" and c["verify"] in ("gate ok", "full ok") and c["time_ms"] > 0
        assert c["regs"] == 40 and c["spills"] == 0 and c["seed"] == 0
    assert sum(c["verify"] == "full ok" for c in res.candidates) == 1
    assert res.seconds > 0 and not res.note


def test_finalists_retimed_interleaved_then_verified_in_order(ln):
    bench = FakeBench(ln_cost, verify_fail={LN_BEST})
    res = run_search(ln, bench)
    b = search.BUDGETS["max"]
    # after the generations: a warm-up call per load of each finalist (LOADS of each), then rounds
    # of A B C D (E = default), round n on load n % LOADS of each
    tail = [c for c in bench.calls if c[0] == "time" and c[2] <= 1]
    warm = [c[1] for c in tail if c[2] == 0]
    names = warm[::search.LOADS]
    assert warm == [g for g in names for _ in range(search.LOADS)]
    assert [c[2] for c in tail] == [0] * len(warm) + [1] * (len(tail) - len(warm))
    first_round = bench.calls.index(("round", 0, tuple(names)))
    loads = [c[1] for c in bench.calls[:first_round] if c[0] == "load"]
    assert all(loads.count(g) == search.LOADS for g in names)   # the generation's load and LOADS - 1 more
    instances = [{id(k) for rnd in bench.rounds[i::search.LOADS] for k in rnd} for i in range(search.LOADS)]
    assert all(len(ids) == len(names) for ids in instances)      # one instance of each per round ...
    assert len(set().union(*instances)) == search.LOADS * len(names)   # ... a different one each round mod LOADS
    # the finalists: every candidate within FINALIST_BAND of the fastest, those within KEEP_DEFAULT first,
    # each in asked order; the default last
    timed = [c["genome"] for c in res.candidates if c["time_ms"] is not None and "same_kernel_as" not in c]
    top = min(map(ln_cost, timed))
    near = [g for g in timed if ln_cost(g) <= top * (1 + search.FINALIST_BAND)]
    assert b.finalists <= len(near) <= search.FINALIST_CAP_FACTOR * b.finalists and res.default_genome not in near
    eligible = [g for g in near if ln_cost(g) <= top * (1 + search.KEEP_DEFAULT)]   # the tie band, first
    assert names == eligible + [g for g in near if g not in eligible] + [res.default_genome]
    one = [c[1] for c in tail if c[2] == 1]
    assert one == names * b.rounds                    # A B C D E A B C D E ...: no noise, clear at once
    # verified: those within KEEP_DEFAULT of every finalist, in asked order; the first failed, the next won
    assert len(eligible) >= 2 and eligible[0] == LN_BEST
    verified = [c[1] for c in bench.calls if c[0] == "verify"]
    assert verified == eligible[:2] and res.best_genome == eligible[1]
    rec = {c["genome"]: c for c in res.candidates}
    assert rec[LN_BEST]["verify"].startswith("full: output 0")
    assert rec[eligible[1]]["verify"] == "full ok" and "final_ms" in rec[eligible[1]]
    assert {rec[g]["tie"] for g in names} == {"in", "out"} and rec[res.default_genome]["tie"] == "out"
    assert [rec[g]["tie"] == "in" for g in names] == [g in eligible for g in names]
    assert {rec[g]["final_rounds"] for g in names} == {b.rounds}


def test_default_kept_within_two_percent(ln):
    g, p, r = ln
    default = str(_C.genome_default(p, r, [4096]))

    def near(genome):
        return 1.0 if genome == default else 0.99 if parse(genome)["items"] == 2 else 1.5
    res = run_search(ln, FakeBench(near), budget="default")
    assert res.best_genome == default and res.best_ms == res.default_ms == 1.0

    def far(genome):
        return 1.0 if genome == default else 0.9 if parse(genome)["items"] == 2 else 1.5
    res = run_search(ln, FakeBench(far), budget="default")
    assert parse(res.best_genome)["items"] == 2 and res.best_ms == pytest.approx(0.9) and res.default_ms == 1.0


def test_near_ties_pick_the_earliest_asked(ln):
    # one generation (fast: its asks are fixed by the seed) where many candidates tie within the
    # noise (any persistent genome but the default): whatever order the noise
    # gives them, the earliest asked get in (all near ones, up to a cap) and the earliest asked wins
    default = str(_C.genome_default(ln[1], ln[2], [4096]))

    def cost(genome):
        return 1.0 if parse(genome)["persistent"] == 1 and genome != default else 2.0
    winners = set()
    for noise_seed in range(4):
        bench = FakeBench(cost, noise=0.01)
        bench.rng.seed(noise_seed)
        res = run_search(ln, bench, budget="fast", seed=5)
        winners.add(res.best_genome)
        finals = [c["genome"] for c in res.candidates if "final_ms" in c]
        assert finals[0] == default
        tied = [c["genome"] for c in res.candidates if cost(c["genome"]) == 1.0]
        near = tied[:search.FINALIST_CAP_FACTOR * search.BUDGETS["fast"].finalists]   # all within the band
        assert len(tied) > 3 and finals[1:] == near and res.best_genome == tied[0]
    assert len(winners) == 1


def test_failures_are_recorded_and_the_search_goes_on(ln):
    g, p, r = ln
    first = texts(_C.evolve_ask(_C.evolve_new(p, r, [4096], None, 0, 16), 16))   # the seed population, as searched
    bad = {"codegen": first[1], "compile": first[2], "slow": first[3], "gate": first[4]}
    bench = FakeBench(ln_cost, codegen_fail={bad["codegen"]}, compile_fail={bad["compile"]}, slow={bad["slow"]: 1.5},
                      gate_fail={bad["gate"]})
    budget = search.Budget(candidates=40, seconds=60, population=16, compile_timeout=0.3, reps=3, finalists=2,
                           rounds=3)
    res = run_search(ln, bench, budget=budget)
    rec = {c["genome"]: c for c in res.candidates}
    assert rec[bad["codegen"]]["compile_status"] == "codegen rejected"
    assert rec[bad["codegen"]]["compile_log"] == "codegen: genome: not for this region\nsecond line"
    assert rec[bad["compile"]]["compile_status"] == "compile error"
    assert rec[bad["compile"]]["compile_log"].count("\n") == 1 and "undefined" in rec[bad["compile"]]["compile_log"]
    assert rec[bad["slow"]]["compile_status"] == "compile timeout"
    assert rec[bad["gate"]]["compile_status"] == "ok" and rec[bad["gate"]]["verify"].startswith("gate: output 0")
    for k in bad.values():
        assert rec[k]["time_ms"] is None
    assert len(res.candidates) == 40 and res.best_k is not None and res.verdict
    assert res.best_genome not in bad.values()
    # a failed candidate is never asked again
    assert len(rec) == len(res.candidates)


def test_a_trap_here_stops_the_search_and_keeps_nothing(ln):
    # a kernel the sandbox passed traps in this process: the search stops, and nothing unverified
    # is kept (not the default either): no winner, the context marked as possibly unusable
    g, p, r = ln
    first = texts(_C.evolve_ask(_C.evolve_new(p, r, [4096], None, 0, 12), 12))
    bench = FakeBench(ln_cost, trap={first[5]})
    res = run_search(ln, bench, budget="fast")
    assert res.note.startswith("search stopped: ") and "ILLEGAL_ADDRESS" in res.note and res.poisoned
    assert res.best_k is None and res.kernel is None and res.verdict is None and res.best_genome == ""
    rec = {c["genome"]: c for c in res.candidates}
    assert rec[first[5]]["verify"].startswith("trap: ") and rec[first[5]]["sandbox"] == "ok"
    assert all(rec[t]["verify"].startswith("search stopped") for t in first[6:])
    assert not [c for c in bench.calls if c[0] in ("gate", "verify") and c[1] in first[6:]]


def test_the_sandbox_refuses_candidates_before_anything_runs_here(ln):
    # a hang, a trap, an out-of-bounds write, a crashed worker: each candidate refused with its fate,
    # never gated or timed here, and the search goes on with the others
    g, p, r = ln
    first = texts(_C.evolve_ask(_C.evolve_new(p, r, [4096], None, 0, 12), 12))
    fates = {first[1]: "hang: no answer within 5 s (worker killed)", first[2]: "trap: CUDA error: unspecified launch failure",
             first[3]: "out-of-bounds write: past the end of argument 3 (output) (size 0)",
             first[4]: "crash: the worker died (killed by signal 11)"}
    bench = FakeBench(ln_cost, sandbox=fates)
    res = run_search(ln, bench, budget="fast")
    rec = {c["genome"]: c for c in res.candidates}
    for genome, fate in fates.items():
        assert rec[genome]["sandbox"] == fate and rec[genome]["verify"] == f"sandbox: {fate}"
        assert rec[genome]["time_ms"] is None
    assert not [c for c in bench.calls if c[0] in ("gate", "time", "verify") and c[1] in fates]
    assert all(rec[t]["sandbox"] == "ok" for t in first if t not in fates)
    assert res.best_k is not None and res.verdict and not res.poisoned and not res.note
    # every candidate refused: no winner, and the note says what became of them
    res = run_search(ln, FakeBench(ln_cost, sandbox={t: "hang: no answer within 5 s (worker killed)" for t in first}),
                     budget="fast")
    assert res.best_k is None and not res.poisoned
    assert res.note == ("no candidate compiled and passed the sandbox and the gate: 12 of 12 compiled, 12 refused "
                        "by the sandbox (first: hang: no answer within 5 s (worker killed))")
    # every finalist fails full verification: no winner either, the default not kept
    res = run_search(ln, FakeBench(ln_cost, verify_fail=set(first)), budget="fast")
    assert res.best_k is None and res.kernel is None and not res.poisoned
    assert res.note == ("no candidate passed full verification (first: output 0 at sizes [7], large inputs: "
                        "error 0.3 of the norm exceeds 0.00032)")


def test_no_sandbox_stops_the_search(ln):
    g, p, r = ln
    first = texts(_C.evolve_ask(_C.evolve_new(p, r, [4096], None, 0, 12), 12))
    bench = FakeBench(ln_cost, sandbox={first[0]: sandbox.SandboxUnavailable("the sandbox worker did not start (x)")})
    res = run_search(ln, bench, budget="fast")
    assert res.best_k is None and not res.poisoned
    assert res.note == "search stopped: the sandbox worker did not start (x)"
    assert [c[1] for c in bench.calls if c[0] == "sandbox"] == [first[0]]


def test_out_of_memory_ends_the_search(ln):
    g, p, r = ln
    first = texts(_C.evolve_ask(_C.evolve_new(p, r, [4096], None, 0, 12), 12))

    class Oom(FakeBench):
        def gate(self, kernel):
            if kernel.genome == first[3]:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            return super().gate(kernel)
    bench = Oom(ln_cost)
    res = run_search(ln, bench, budget="fast")
    assert res.best_k is None and res.note.startswith("out of GPU memory: CUDA out of memory")
    assert [c["genome"] for c in res.candidates][:4] == first[:4]
    assert not [c for c in bench.calls if c[0] in ("gate", "sandbox") and c[1] in first[4:]]


def test_budget_in_seconds(ln):
    def slow_cost(genome):
        return ln_cost(genome)

    class Slow(FakeBench):
        def compile(self, k):
            time.sleep(0.05)

    budget = search.Budget(candidates=10_000, seconds=0.6, population=8, compile_timeout=5, reps=1, finalists=2,
                           rounds=2)
    t = time.perf_counter()
    res = run_search(ln, Slow(slow_cost), budget=budget)
    took = time.perf_counter() - t
    assert 8 <= len(res.candidates) < 200 and took < 5
    assert res.best_k is not None


def test_same_kernel_is_measured_once(ln):
    g, p, r = ln
    bench = FakeBench(ln_cost, real_partition=(p, r))
    budget = search.Budget(candidates=24, seconds=60, population=12, compile_timeout=30, reps=2, finalists=2, rounds=2)
    res = run_search(ln, bench, budget=budget)
    dups = [c for c in res.candidates if "same_kernel_as" in c]
    timed = [c for c in bench.calls if c[0] == "time" and c[2] == budget.reps]
    assert len(timed) == len(res.candidates) - len(dups) == 24
    by = {c["genome"]: c for c in res.candidates}
    for c in dups:
        assert c["time_ms"] == by[c["same_kernel_as"]]["time_ms"]
        assert c["source_hash"] == by[c["same_kernel_as"]]["source_hash"]
    # fast stops after its one generation, duplicates or not
    res = run_search(ln, FakeBench(ln_cost, real_partition=(p, r)), budget="fast")
    assert len(res.candidates) == 12 and {c["generation"] for c in res.candidates} == {0}
    assert res.generations == 1


def test_bad_budget(ln):
    with pytest.raises(ValueError):
        run_search(ln, FakeBench(ln_cost), budget="huge")


# ---------------------------------------------------------------------------------------- the real bench on the CPU


class CpuKernel:
    def __init__(self, k, wrong=False):
        self.genome, self.regs, self.spills, self.wrong = str(k.genome), 32, 0, wrong


class CpuExecutor:
    """The executor methods CudaRegionBench uses, on the CPU: a 'kernel' is the float64 reference
    cast to the output dtype (or, for a 'wrong' genome, the reference plus one)."""

    def __init__(self, graph, wrong=()):
        self.graph = graph
        self.plan = types.SimpleNamespace(partition=graph.partition())
        self.dev, self.sm, self.arch, self.seed = None, 90, "sm_90", 0
        self.device = torch.device("cpu")
        self.wrong = set(wrong)
        self.verified = []
        self.launched = []    # (input pointers, output pointers or None) per launch

    def region_inputs(self, r, symvals, dist, gen):
        reg = self.plan.partition.region(r)
        out = []
        for v in reg["inputs"]:
            dt = {"f32": torch.float32, "bf16": torch.bfloat16}[self.graph.node(v)["dtype"]]
            out.append(verify.fill(torch.empty(self.graph.sizes(v, symvals), dtype=dt), dist, gen))
        return out

    def reference(self, r, symvals, inputs):
        reg = self.plan.partition.region(r)
        ins = [x.double().contiguous() for x in inputs]
        outs = [torch.empty(self.graph.sizes(v, symvals), dtype=torch.float64) for v in reg["outputs"]]
        _interp_double(self.plan.partition, r, symvals, ins, outs, self.graph)
        return outs

    def load(self, k):
        return CpuKernel(k, wrong=str(k.genome) in self.wrong)

    def launch_params(self, kernel, r, symvals):
        reg = self.plan.partition.region(r)
        shapes = [(torch.Size(self.graph.sizes(v, symvals)),
                   {"f32": torch.float32, "bf16": torch.bfloat16}[self.graph.node(v)["dtype"]]) for v in reg["outputs"]]
        return shapes, (1, 1, 1), tuple(symvals), 0, 0

    def launch(self, kernel, r, symvals, inputs, poison=False, outs=None):
        self.launched.append(([x.data_ptr() for x in inputs], None if outs is None else [o.data_ptr() for o in outs]))
        ref = self.reference(r, symvals, inputs)
        got = [(x + (1.0 if kernel.wrong else 0.0)).to(dt) for x, (_, dt) in
               zip(ref, self.launch_params(kernel, r, symvals)[0])]
        if outs is None:
            return got
        for o, x in zip(outs, got):
            o.copy_(x)
        return outs

    def verify(self, r, kernel, symvals):
        self.verified.append(kernel.genome)
        return verify.Verdict(not kernel.wrong, "" if not kernel.wrong else "wrong")


def _interp_double(p, r, symvals, ins, outs, graph):
    """Region r by the C interpreter; inputs in their graph dtype, outputs converted to double."""
    reg = p.region(r)
    typed_in = []
    for v, x in zip(reg["inputs"], ins):
        dt = {"f32": torch.float32, "bf16": torch.bfloat16}[graph.node(v)["dtype"]]
        typed_in.append(x.to(dt).contiguous())
    typed_out = run_region(p, r, symvals, typed_in)
    for o, t in zip(outs, typed_out):
        o.copy_(t.double())


def test_cuda_bench_plumbing_on_cpu():
    g = softmax_graph(rows=64, n=1000)
    ex = CpuExecutor(g)
    r = region_of_kind(ex.plan.partition, "ROW")
    bench = search.CudaRegionBench(ex, r, [64])
    assert not bench.cuda and bench.flush is None
    k = bench.generate(_C.genome_default(ex.plan.partition, r, [64]))
    assert k.source and "// genome: " in k.source
    kern = bench.load(k)
    assert bench.gate(kern) == ""
    kern.wrong = True
    assert bench.gate(kern).startswith("output 0: error")
    times = bench.time(kern, 3)
    assert len(times) == 3 and all(t >= 0 for t in times)
    each = bench.time_each([kern, kern])    # the finalists' round: one repetition of each
    assert len(each) == 2 and all(t >= 0 for t in each)


def test_a_slow_candidate_is_timed_once(monkeypatch):
    """A candidate whose one call times every rep past half the hang timeout (one block over a
    huge row) is launched once and that call stands for its reps: its timing cannot turn into a
    hang that stops the search."""
    g = softmax_graph(rows=64, n=1000)
    ex = CpuExecutor(g)
    r = region_of_kind(ex.plan.partition, "ROW")
    bench = search.CudaRegionBench(ex, r, [64])
    kern = bench.load(bench.generate(_C.genome_default(ex.plan.partition, r, [64])))
    ex.launched.clear()
    times = bench.time(kern, 5)
    assert len(times) == 5 and len(ex.launched) == 1 + 1 + 5       # the first call, the warm-up, the reps
    monkeypatch.setattr(search, "GATE_TIMEOUT_S", 1e-9)
    ex.launched.clear()
    times = bench.time(kern, 5)
    assert len(ex.launched) == 1 and len(times) == 5 and len(set(times)) == 1

def test_layouts_fit_and_spread():
    """_layout: layout 0 at offset 0 without gaps; the others inside the arena, 256-byte aligned,
    with gaps and offsets that differ from one layout to the next, the same in every call."""
    for sizes, room in (([256000, 256000], 64 << 20), ([25 << 20, 25 << 20, 1536], 800 << 20),
                        ([1 << 20], (1 << 20) + 512), ([4096, 4096], 8192)):
        assert search._layout(0, sizes, room) == (0, 0)
        seen = [search._layout(k, sizes, room) for k in range(1, 400)]
        assert seen == [search._layout(k, sizes, room) for k in range(1, 400)]
        for offset, gap in seen:
            assert offset % 256 == 0 and gap % 256 == 0 and offset >= 0 and gap >= 0
            assert offset + sum(sizes) + gap * len(sizes) <= room
        if room - sum(sizes) >= 64 << 20:   # room to spread: most layouts are new ones
            assert len(set(seen)) > 390 and len({g for _, g in seen}) > 350
            offsets = sorted(o for o, _ in seen)
            assert offsets[0] < (room - sum(sizes)) / 8 and offsets[-1] > (room - sum(sizes)) / 2


def test_finalists_rounds_each_on_a_layout_of_their_own(monkeypatch):
    """Each interleaved round runs on layout round_index of one arena (ARENA_SPANS x the buffers,
    capped by PLACEMENT_BYTES): the inputs copied there, the outputs after them, gap bytes apart;
    every finalist of a round on the same buffers, each round on others, the same ones for the
    same round in another search. A candidate's generation timing runs on layout 0; with no room
    for one copy, on the gate's own inputs."""
    g = softmax_graph(rows=64, n=1000)
    ex = CpuExecutor(g)
    r = region_of_kind(ex.plan.partition, "ROW")
    kern = search.CudaRegionBench(ex, r, [64]).load(types.SimpleNamespace(genome="g"))
    size = 64 * 1000 * 4   # the f32 input and the output, each 256-byte aligned already
    rounds = 40
    for cap, arena_bytes in ((1 << 40, search.ARENA_MIN_BYTES), (3 * size, 3 * size)):
        monkeypatch.setattr(search, "PLACEMENT_BYTES", cap)
        relative = []
        for _ in range(2):   # two searches: the same layouts, wherever their arenas are
            bench = search.CudaRegionBench(ex, r, [64])
            ex.launched.clear()
            spans = []
            for i in range(rounds):
                bench.time_each([kern, kern], i)
                ins, outs, sp = bench.layout[1]
                assert bench.layout[0] == i
                assert all(torch.equal(x, y) for x, y in zip(ins, bench.inputs)) and ins[0] is not bench.inputs[0]
                assert outs[0].shape == (64, 1000) and outs[0].dtype == torch.float32
                spans.append(sp.tolist())
                # what the touch after each flush reads: (address, bytes) of every buffer of the layout
                assert sp.tolist() == [v for t in ins + outs for v in (t.data_ptr(), t.numel() * t.element_size())]
            arena = bench.arena
            assert arena.numel() == arena_bytes
            base, end = arena.data_ptr(), arena.data_ptr() + arena.numel()
            launched = ex.launched
            assert all(o is not None for _, o in launched)                 # outputs of the layout, not new ones
            assert all(launched[2 * i] == launched[2 * i + 1] for i in range(rounds))   # one layout per round
            by_round = [launched[2 * i] for i in range(rounds)]
            for (ins_p, outs_p), sp in zip(by_round, spans):
                assert base <= ins_p[0] < outs_p[0] and outs_p[0] + size <= end
                assert (outs_p[0] - ins_p[0] - size) % 256 == 0 and [ins_p[0], size, outs_p[0], size] == sp
            assert by_round[0] == ([base], [base + size])                   # layout 0: no offset, no gap
            relative.append([(i[0] - base, o[0] - base) for i, o in by_round])
            if cap > 3 * size:
                assert len(set(relative[-1])) == rounds                     # each round its own
            ex.launched.clear()
            bench.time(kern, 2)                     # the generation's timing: layout 0, warm-up included
            assert ex.launched == [([base], [base + size])] * 4
        assert relative[0] == relative[1]
    # no room for a copy: the gate's inputs themselves and outputs of its own, every round
    monkeypatch.setattr(search, "PLACEMENT_BYTES", 2 * size - 1)
    bench = search.CudaRegionBench(ex, r, [64])
    bench.time_each([kern], 3)
    bench.time_each([kern], 4)
    ins, outs, spans = bench.layout[1]
    assert bench.arena is False and ins is bench.inputs and outs[0].shape == (64, 1000) and spans.numel() == 4


def test_search_compiles_every_candidate_with_nvrtc(nvrtc, tmp_path, monkeypatch):
    """budget='fast' on a softmax region end to end on the CPU stand-in: every asked genome is
    generated and compiled by the real NVRTC for sm_90; a kernel that computes wrong values is
    caught by the gate; the winner is verified."""
    monkeypatch.setenv("KBENCH_CACHE_DIR", str(tmp_path))
    g = softmax_graph(rows=256, n=1000)
    p = g.partition()
    r = region_of_kind(p, "ROW")
    first = texts(_C.evolve_ask(_C.evolve_new(p, r, [256], None, 0, 12), 12))
    ex = CpuExecutor(g, wrong={first[3]})
    ex.plan.partition = p
    res = search.search_region(ex, r, [256], budget="fast", seed=0, verifier=lambda ex_, r_, k, sv: ex.verify(r_, k, sv))
    rec = {c["genome"]: c for c in res.candidates}
    assert [c["genome"] for c in res.candidates] == first
    bad = [c for c in res.candidates if c["compile_status"] != "ok"]
    assert not bad, [(c["genome"], c["compile_status"], c["compile_log"]) for c in bad]
    assert rec[first[3]]["verify"].startswith("gate: output 0")
    assert res.best_k is not None and res.verdict and ex.verified[-1] == res.best_genome
    assert res.best_genome != first[3]


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_the_helper_kernels_compile(nvrtc, arch):
    """The helper kernels (kbench/kernels: the search's touch after each L2 flush, a joint loss
    program's gradient scaling) compile wherever kbench runs (the GPU tests run them)."""
    from kbench.runtime import nvrtc
    assert nvrtc.compile(kernels.source("touch.cu"), arch, use_cache=False)
    assert nvrtc.compile(kernels.source("scale.cu"), arch, use_cache=False)
