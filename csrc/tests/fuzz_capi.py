"""fuzz_capi.py — random graphs and random bad arguments through kbench._C's builder, partition,
interpreter and codegen entry points, meant for the module built under ASan+UBSan (`make -C csrc
fuzz`, which preloads the sanitizer): a memory error or undefined behaviour aborts the process,
and any exception other than the documented refusals fails the run with the seed that made it.
Needs no torch: buffers are bytearrays and array.arrays, as kbench._C takes them.

    python csrc/tests/fuzz_capi.py [--module path/to/_C.so] [--seconds 60] [--seed 0]
"""
import argparse
import array
import importlib.util
import math
import random
import sys
import threading
import time
import traceback

# what kbench._C raises for input it refuses; anything else is a bug
REFUSALS = (ValueError, TypeError, IndexError, OverflowError, NotImplementedError, RuntimeError, MemoryError)
DTYPES = ["f32", "f16", "bf16", "f64", "i64", "i32", "bool"]
ITEM = {"f32": 4, "f16": 2, "bf16": 2, "f64": 8, "i64": 8, "i32": 4, "bool": 1}
EXTREME = [0, 1, -1, 2, 2**31, 2**32, 2**62, 2**63 - 1, -2**63]
MAX_ELEMENTS = 1 << 16     # a run allocates every value it computes: keep them small in all


def load(path):
    """kbench._C from a file (the sanitized build), without importing the kbench package."""
    if path is None:
        from kbench import _C
        return _C
    spec = importlib.util.spec_from_file_location("kbench._C", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Fuzz:
    def __init__(self, C, rnd):
        self.C, self.rnd = C, rnd
        self.ops = sorted(C.ops().items())
        self.stats = {"graphs": 0, "nodes": 0, "refused": 0, "interp_ok": 0, "interp_refused": 0,
                      "regions": 0, "kernels": 0, "split_kernels": 0, "grads": 0, "runtime_refused": 0,
                      "gemm_kernels": 0, "gemm_refused": 0}

    # ------------------------------------------------------------------ building

    def dim(self, nsym):
        r = self.rnd.random()
        if r < 0.6 or nsym == 0:
            return self.rnd.choice([0, 1, 1, 2, 3, 4, 5]) if r < 0.97 else self.rnd.choice(EXTREME)
        syms = sorted(self.rnd.sample(range(nsym), self.rnd.randint(1, min(2, nsym))))
        return (self.rnd.choice([1, 1, 2, 3]) if r < 0.97 else self.rnd.choice(EXTREME), tuple(syms))

    def odd(self, value):
        """Now and then an extreme or ill-typed stand-in for a well-formed argument."""
        r = self.rnd.random()
        if r < 0.04:
            return self.rnd.choice(EXTREME)
        if r < 0.05:
            return self.rnd.choice([None, "x", 1.5, [1, [2]], (2**70,), object()])
        return value

    def build(self):
        rnd, C = self.rnd, self.C
        g = C.Graph()
        nsym = rnd.randint(0, 2)
        for s in range(nsym):
            g.add_symbol(f"s{s}", rnd.choice([0, 1, 2, 3, 5]))
        vals = []   # (id, dtype, dims)

        def add_input(dtype=None, dims=None):
            dtype = dtype or rnd.choice(DTYPES)
            dims = dims if dims is not None else [self.dim(nsym) for _ in range(rnd.randint(0, 3))]
            try:
                v = g.add_input(f"in{len(vals)}", rnd.choice(["user", "param", "buffer"]), dtype, self.odd(dims))
            except REFUSALS:
                self.stats["refused"] += 1
                return None
            vals.append((v, dtype, list(dims)))
            return vals[-1]

        for _ in range(rnd.randint(1, 3)):
            add_input()
        for _ in range(rnd.randint(0, 14)):
            if not vals:
                add_input()
                continue
            name, info = rnd.choice(self.ops)
            if name == "input":
                add_input()
                continue
            prop = self.propose(name, info, vals, nsym, add_input)
            if prop is None:
                continue
            inputs, dtype, dims, kw = prop
            kw = {k: self.odd(v) for k, v in kw.items()}
            try:
                v = g.add_node(name, self.odd(inputs), dtype, self.odd(dims), **kw)
            except REFUSALS:
                self.stats["refused"] += 1
                continue
            self.stats["nodes"] += 1
            vals.append((v, dtype, list(dims)))
        for _ in range(rnd.randint(1, 3)):
            v = rnd.choice(vals)[0] if vals and rnd.random() < 0.95 else rnd.choice(EXTREME)
            try:
                g.add_output(v)
            except REFUSALS:
                self.stats["refused"] += 1
        self.stats["graphs"] += 1
        return g

    def propose(self, name, info, vals, nsym, add_input):
        """A node that is often valid: operands and sizes drawn to fit the op."""
        rnd = self.rnd
        kind, x = info["kind"], rnd.choice(vals)
        same = [v for v in vals if v[2] == x[2]] or [x]
        if kind == "unary":
            kw = {"scalars": (rnd.uniform(-3, 3), rnd.uniform(0, 30))} if rnd.random() < 0.3 else {}
            return [x[0]], rnd.choice(DTYPES) if name == "cast" else x[1], x[2], kw
        if kind == "binary":
            y = rnd.choice(same)
            out = "bool" if name in ("lt", "le", "gt", "ge", "eq", "ne", "and", "or") else x[1]
            return [x[0], y[0]], out, x[2], {}
        if kind == "ternary":
            cond = [v for v in same if v[1] == "bool"] or [x]
            return [rnd.choice(cond)[0], x[0], rnd.choice(same)[0]], x[1], x[2], {}
        if kind == "reduce":
            rank = len(x[2])
            if rank == 0:
                return [x[0]], x[1], [], {"axes": 1}
            axes = rnd.randint(1, (1 << rank) - 1)
            keep = rnd.random() < 0.5
            dims = [1 if axes >> d & 1 else x[2][d] for d in range(rank)] if keep else \
                [x[2][d] for d in range(rank) if not axes >> d & 1]
            return [x[0]], x[1], dims, {"axes": axes}
        if kind == "view":
            rank = len(x[2])
            if name == "permute":
                perm = list(range(rank))
                rnd.shuffle(perm)
                return [x[0]], x[1], [x[2][p] for p in perm], {"perm": perm}
            if name == "expand":
                return [x[0]], x[1], [self.dim(nsym) if d == 1 else d for d in x[2]], {}
            if name == "reshape":
                return [x[0]], x[1], self.flat(x[2]), {}
            if rank == 0:
                return None
            axis = rnd.randrange(rank)
            dims = list(x[2])
            dims[axis] = rnd.choice([0, 1, 2, 3, dims[axis]]) if rnd.random() < 0.9 else self.dim(nsym)
            start = rnd.choice([0, 0, 1, 2, 3]) if rnd.random() < 0.9 else rnd.choice(EXTREME)
            step = rnd.choice([1, 1, 2, 3]) if rnd.random() < 0.9 else rnd.choice(EXTREME)
            return [x[0]], x[1], dims, {"axis": axis, "start": start, "step": step}
        if kind == "gather":
            rank = len(x[2])
            if rank == 0:
                return None
            axis = rnd.randrange(rank)
            dims = [d if rnd.random() < 0.8 else self.dim(nsym) for d in x[2]]
            idx = add_input(rnd.choice(["i64", "i64", "i32", "f32"]), dims)
            if idx is None:
                return None
            return [x[0], idx[0]], x[1], dims, {"axis": axis}
        if kind == "leaf":   # const, iota
            dims = [self.dim(nsym) for _ in range(rnd.randint(0, 3))]
            kw = {"scalars": (rnd.choice([0.0, 1.5, -2.0, math.inf, math.nan]), 0.0)}
            if name == "iota":
                kw = {"axis": rnd.randrange(len(dims)) if dims else 0}
            return [], rnd.choice(DTYPES), dims, kw
        # extern: anything in, anything out
        return [v[0] for v in rnd.sample(vals, rnd.randint(0, min(3, len(vals))))], rnd.choice(DTYPES), \
            [self.dim(nsym) for _ in range(rnd.randint(0, 2))], {"index": rnd.randint(0, 3), "axis": 0}

    def flat(self, dims):
        """A reshape target holding as many elements, sometimes not."""
        coef, syms = 1, []
        for d in dims:
            c, s = (d, ()) if isinstance(d, int) else d
            coef *= c
            syms += list(s)
        one = coef if not syms else (coef, tuple(sorted(syms)))
        choice = self.rnd.random()
        if choice < 0.4:
            return [one]
        if choice < 0.7:
            return [1, one] if self.rnd.random() < 0.5 else [one, 1]
        if choice < 0.9:
            return list(dims)
        return [self.rnd.choice([0, 1, 2, 7])]

    # ------------------------------------------------------------------ running

    def device(self):
        """None (the default device), or some of device_info()'s figures, some of them absurd."""
        if self.rnd.random() < 0.5:
            return None
        keys = ["sm", "num_sms", "max_smem_per_block", "regs_per_sm", "l2_bytes"]
        return {k: self.rnd.choice([0, 1, -1, 7, 80, 132, 49152, 2**31 - 1, -2**31]) for k in keys
                if self.rnd.random() < 0.5}

    def symvals(self, g):
        rnd, n = self.rnd, g.num_symbols
        r = rnd.random()
        if r < 0.5:
            return [s[1] for s in g.symbols]
        if r < 0.9:
            return [rnd.randint(0, 6) for _ in range(n)]
        return self.odd([rnd.choice(EXTREME) for _ in range(n + (rnd.random() < 0.3))])

    def fill(self, dtype, count):
        """count random elements of dtype: small integers (valid gather indices, mostly), random
        floats with NaN and infinities, arbitrary bits."""
        rnd = self.rnd
        if dtype in ("i64", "i32"):
            code = "q" if dtype == "i64" else "i"
            return bytearray(array.array(code, [rnd.choice([0, 1, 2, -1, 5, 2**31 - 1]) for _ in range(count)]))
        if dtype == "f64":
            return bytearray(array.array("d", [rnd.choice([0.0, -1.5, 3.0, math.nan, math.inf]) for _ in range(count)]))
        return bytearray(rnd.randbytes(count * ITEM[dtype]))

    def buffers(self, g, ids, symvals, inputs):
        """Correct buffers for the values ids (symvals: sizes g takes, small)."""
        out = []
        for v in ids:
            n = math.prod(g.sizes(v, symvals))
            dtype = g.node(v)["dtype"]
            out.append(self.fill(dtype, n) if inputs else bytearray(n * ITEM[dtype]))
        return out

    def spoil(self, ins, outs):
        """One argument made wrong in one of the ways a caller gets it wrong."""
        rnd = self.rnd
        pool = [("in", j) for j in range(len(ins))] + [("out", j) for j in range(len(outs))]
        how = rnd.randrange(10)
        if how == 0 or not pool:
            return (ins[:-1] if ins else ins + [bytearray(8)]), outs
        where, j = rnd.choice(pool)
        seq = ins if where == "in" else outs
        buf = seq[j]
        bad = [rnd.choice(EXTREME + [0xdeadbeef, id(buf)]),              # an address
               None, bytes(buf),                                       # read-only for an output
               bytearray(max(0, len(buf) + rnd.choice([-1, 1, 8]))),   # the wrong size
               memoryview(bytearray(len(buf) + 1))[1:],                 # misaligned
               memoryview(bytearray(2 * len(buf) + 2))[::2],           # not contiguous
               ins[0] if ins else bytearray(1),                        # an output over an input
               outs[0] if outs else bytearray(1),                      # two outputs in one buffer
               [buf]][how - 1]
        seq = list(seq)
        seq[j] = bad
        return (seq, outs) if where == "in" else (ins, seq)

    def run_interp(self, call, g, in_ids, out_ids, symvals, sized):
        """call(symvals, inputs, outputs) with the right buffers (symvals are sizes g takes:
        sized), now and then one spoiled, or with stand-ins where they cannot be made."""
        ins = self.buffers(g, in_ids, symvals, True) if sized else None
        outs = self.buffers(g, out_ids, symvals, False) if ins is not None else None
        if ins is None or outs is None:   # refused before it runs: a run could be too large
            ins, outs = [None] * max(1, len(in_ids)), [None] * max(1, len(out_ids))
        elif self.rnd.random() < 0.3:
            ins, outs = self.spoil(ins, outs)
        try:
            call(symvals, ins, outs)
        except REFUSALS:
            self.stats["interp_refused"] += 1
            return False
        self.stats["interp_ok"] += 1
        return True

    def runtime_calls(self):
        """The CUDA entry points with bad handles and junk arguments: each is refused (TypeError)
        before anything reaches NVRTC or the driver, on a machine with a GPU or without."""
        rnd, C = self.rnd, self.C
        junk = [None, 0, 2**64 - 1, -1, 0xdeadbeef, 1.5, "x", b"\x7fELF", (), [0] * 9, object(), bytearray(8)]
        pick = lambda: rnd.choice(junk)   # noqa: E731
        calls = [(C.launch, 7), (C.synchronize, rnd.choice([1, 2])), (C.get_function, 4), (C.module_load, 2),
                 (C.nvrtc_compile, rnd.choice([4, 5])), (C.device_info, 2), (C.nvrtc_info, 1),
                 (C.lt_matmul, 12), (C.lt_info, 1)]
        fn, n = rnd.choice(calls)
        try:
            fn(*[pick() for _ in range(n)])
        except TypeError:
            self.stats["runtime_refused"] += 1
            return
        raise AssertionError(f"{fn.__name__} took junk arguments")

    def gemm_calls(self):
        """The GEMM generator (gemm_generate, gemm_genome_check, gemm_genomes) on specs and genomes
        mostly plausible, now and then absurd: a source or a refusal, nothing else."""
        rnd, C = self.rnd, self.C
        pick = rnd.choice
        spec = {"ab": pick(["bf16", "f16", "bf16", "f16", "f32", "i64"]), "out": pick(["bf16", "f16", "f32", "bool"]),
                "a_transposed": pick([0, 1]), "b_transposed": pick([0, 1]), "a_broadcast": pick([0, 1]),
                "b_broadcast": pick([0, 1]),
                "alpha": pick([False, True]), "bias_n": pick([None, "bf16", "f32", "i32"]),
                "bias_m": pick([None, "f16"]), "residual": pick([None, "bf16"]),
                "act": pick([None, "gelu_tanh", "relu", "leaky_relu", "add", "softplus", "nope"]),
                "act_scalars": pick([(), (0.1,), (1.0, 20.0), (float("nan"),), (1e300, -1e300)])}
        for key in rnd.sample(sorted(spec), rnd.randint(0, 3)):
            spec[key] = self.odd(spec[key])
        if rnd.random() < 0.05:
            spec[pick(["bias", 3, None])] = 1
        genome = [pick([16, 32, 64, 128, 256]), pick([16, 32, 64, 128, 256]), pick([16, 32, 64]),
                  pick([1, 2, 4]), pick([1, 2, 4]), pick([2, 3, 4]), pick([1, 2])]
        genome = [self.odd(x) for x in genome]
        if rnd.random() < 0.5:
            genome = pick([[128, 128, 32, 2, 4, 4, 2], [64, 32, 16, 2, 1, 2, 1], [16, 64, 64, 1, 2, 4, 2]])
        if rnd.random() < 0.05:
            genome = self.odd(genome[:rnd.randint(0, 8)])
        calls = [lambda: C.gemm_generate(self.odd(spec), genome, self.odd(pick([80, 90, 75])), self.device()),
                 lambda: C.gemm_genome_check(genome, self.device()),
                 lambda: C.gemm_genomes(*[self.odd(pick([0, 1, 17, 4096])) for _ in range(4)], self.device())]
        try:
            out = pick(calls)()
        except REFUSALS:
            self.stats["gemm_refused"] += 1
            return
        if isinstance(out, tuple) and len(out) == 6:
            assert isinstance(out[0], str) and out[1] in out[0], out[1]
            self.stats["gemm_kernels"] += 1

    def exercise(self, g):
        rnd, C = self.rnd, self.C
        if rnd.random() < 0.3:
            self.runtime_calls()
        if rnd.random() < 0.3:
            self.gemm_calls()
        str(g)
        sv = self.symvals(g)
        try:   # sizes the graph takes, small enough to compute every value at
            sizes_ok = isinstance(sv, list) and \
                sum(math.prod(g.sizes(v, sv)) for v in range(g.num_nodes)) <= MAX_ELEMENTS
        except REFUSALS:
            sizes_ok = False
        if not sizes_ok or rnd.random() < 0.2:
            sv, sizes_ok = self.odd(sv), False
        if rnd.random() < 0.6 and self.run_interp(lambda s, i, o: C.interp_graph(g, s, i, o), g, g.inputs,
                                                  g.outputs, sv, sizes_ok):
            expect_frozen(g)   # it read the graph without the GIL: the graph no longer grows
        if rnd.random() < 0.15 and sizes_ok:
            self.race(g, sv)
        if rnd.random() < 0.2:
            try:
                wrt = [rnd.random() < 0.7 for _ in g.inputs]
                d = g.grad(self.odd(wrt), saved=rnd.choice([0, 0, 1]))
                self.stats["grads"] += 1
                str(d.simplify())
            except REFUSALS:
                pass
        try:
            p = g.partition()
        except REFUSALS:
            return
        expect_frozen(g)
        str(p)
        if rnd.random() < 0.3:
            try:
                p.save_stats(rnd.choice([0, 64, 1 << 20]))
            except REFUSALS:
                pass
        for r in range(len(p)):
            reg = p.region(r)
            self.stats["regions"] += 1
            try:
                str(p.region_graph(r))
            except REFUSALS:
                pass
            self.run_interp(lambda s, i, o, r=r: C.interp_region(p, r, s, i, o), g, reg["inputs"], reg["outputs"],
                            sv, sizes_ok)
            if reg["kind"] != "EXTERN" and rnd.random() < 0.3:
                try:
                    C.generate(p, r, rnd.choice([80, 90]), None, self.device())
                    self.stats["kernels"] += 1
                    gn = C.genome_default(p, r, sv, self.device())
                    if reg["kind"] == "ROW":   # its rows split over blocks (refused where they do not merge)
                        C.generate(p, r, 90, gn.replace(row_split=rnd.choice([2, 3, 64]), rows=1, persistent=0))
                        self.stats["split_kernels"] += 1
                except REFUSALS:
                    pass
            if reg["kind"] != "EXTERN" and rnd.random() < 0.1:
                self.search(p, r, sv)
        try:   # once the interpreter has read it, its regions stay as they are (RuntimeError)
            p.save_stats(0)
        except REFUSALS:
            pass
        for call in (lambda: C.interp_region(p, self.odd(len(p)), sv, [], []), lambda: p.region(self.odd(len(p))),
                     lambda: g.node(self.odd(g.num_nodes)), lambda: g.sizes(self.odd(g.num_nodes - 1), sv),
                     lambda: p.region_graph(self.odd(0))):
            try:
                call()
            except REFUSALS:
                pass

    def search(self, p, r, sv):
        """A few generations of the schedule search, each asked genome generated, told a time
        or a failure; and a legality test of each."""
        rnd, C = self.rnd, self.C
        try:
            h = C.evolve_new(p, r, sv, self.device(), rnd.getrandbits(64), rnd.choice([0, 1, 4, 12]))
        except REFUSALS:
            return
        for _ in range(rnd.randint(1, 3)):
            try:
                asked = C.evolve_ask(h, rnd.choice([1, 4, 16, 0, -1]))
            except REFUSALS:
                return
            for gn in asked:
                try:
                    C.genome_legal(p, r, sv, None, gn)
                    C.generate(p, r, 90, gn)
                    ms = rnd.uniform(0.01, 2.0)
                except REFUSALS:
                    ms = -1.0
                try:
                    C.evolve_tell(h, gn, self.odd(ms))
                except REFUSALS:
                    pass
        C.evolve_best(h), C.evolve_generation(h), C.evolve_domains(h)

    def race(self, g, sv):
        """The interpreter in a thread (no GIL while it runs) while this one tries to grow the
        graph: either the graph is frozen and refuses, or the growth came first."""
        if any(g.node(v)["op"] == "extern" for v in range(g.num_nodes)):
            return
        ins, outs = self.buffers(g, g.inputs, sv, True), self.buffers(g, g.outputs, sv, False)
        errors, ran = [], []

        def work():
            for _ in range(5):
                try:
                    self.C.interp_graph(g, sv, ins, outs)
                    ran.append(1)
                except REFUSALS:
                    pass
                except BaseException as e:   # noqa: BLE001 - reported by the main thread
                    errors.append(e)

        t = threading.Thread(target=work)
        t.start()
        for _ in range(20):
            try:
                g.add_node("const", [], "f32", [3], scalars=(1.0, 0.0))
            except RuntimeError:
                pass
        t.join()
        if errors:
            raise errors[0]
        if ran:
            expect_frozen(g)


def expect_frozen(g):
    try:
        g.add_node("const", [], "f32", [2], scalars=(0.0, 0.0))
    except RuntimeError as e:
        assert "frozen" in str(e), e
    else:
        raise AssertionError("a graph the interpreter or a partition read still grows")
    assert g.frozen


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--module", help="the _C shared object to load (default: the installed kbench._C)")
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    C = load(args.module)
    end = time.monotonic() + args.seconds
    seed, fuzz = args.seed, None
    while seed == args.seed or time.monotonic() < end:
        fuzz_seed = seed
        rnd = random.Random(fuzz_seed)
        fuzz = Fuzz(C, rnd) if fuzz is None else fuzz
        fuzz.rnd = rnd
        try:
            fuzz.exercise(fuzz.build())
        except Exception:   # noqa: BLE001 - anything the module was not meant to raise
            traceback.print_exc()
            print(f"fuzz_capi: FAILED at seed {fuzz_seed} (rerun: --seed {fuzz_seed} --seconds 0.001)")
            return 1
        seed += 1
    stats = " ".join(f"{k}={v}" for k, v in (fuzz.stats if fuzz else {}).items())
    print(f"fuzz_capi: ok, seeds {args.seed}..{seed - 1}: {stats}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
