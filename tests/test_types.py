"""kbench._C's typed data across the boundary: Genome (a region's schedule; its canonical text is
its identity in the kernel cache and in reports) and KernelInfo (a generated kernel: source, entry
points, launch geometry), and the tuner's round trip of a KernelInfo through the cache's stored
launch fields. No GPU, no NVRTC."""
import copy
import json
import pickle
import re

import pytest
import torch

from kbench import _C
from kbench.bench.tasks import TASKS
from kbench.capture import capture
from kbench.runtime.plan import SAVE_STATS_MIN_ROW_BYTES
from kbench.tune import cache
from kbench.tune.tuner import stored_kernel, stored_launch

import test_codegen as tc

GENES = ("threads", "vec", "rows", "items", "cache", "two_pass", "fast_math", "persistent", "col_split", "row_split")
FLOAT = ("f32", "bf16", "f16", "f64")


# ---------------------------------------------------------------------------------------- Genome


def task_partitions():
    """(label, partition, example sizes) of every task's forward (its statistics saved, as
    optimize() has them) and each compute region's backward, f32 and bf16, at the filter config."""
    for name, task in sorted(TASKS.items()):
        cfg = task.filter_config()
        for dtype in ("float32", "bfloat16"):
            with torch.no_grad():
                g = capture(task.build(cfg, dtype, "cpu"), tuple(task.inputs(cfg, dtype, "cpu"))).graph
            symvals = [v for _, v in g.symbols]
            p = g.partition()
            p.save_stats(SAVE_STATS_MIN_ROW_BYTES)
            yield f"{name}/{dtype}", p, symvals
            for r in range(len(p)):
                reg = p.region(r)
                wrt = [g.node(v)["dtype"] in FLOAT for v in reg["inputs"]]
                if reg["kind"] == "EXTERN" or not any(wrt):
                    continue
                try:
                    bg = p.region_graph(r).grad(wrt, saved=reg["saved"], outputs=reg["saved_outputs"])
                except NotImplementedError:
                    continue
                yield f"{name}/{dtype}/backward of {r}", bg.partition(), symvals


def canonical_text(g):
    """Each gene as its attribute says, in the order of the C struct; row_split only where it is
    not 1 (a genome without a split keeps the text it had before the gene)."""
    return " ".join(f"{gene}={getattr(g, gene)}" for gene in GENES if gene != "row_split" or g.row_split != 1)


def test_every_default_genome_of_every_task_round_trips_through_its_text():
    """str(g) is the canonical text (canonical_text); Genome.parse gives back an equal genome with
    the same hash and the same text; repr evaluates to it; generate() of the default genome carries
    it."""
    n, kinds, split = 0, set(), 0
    for label, p, symvals in task_partitions():
        for r in range(len(p)):
            if p.region(r)["kind"] == "EXTERN":
                continue
            g = _C.genome_default(p, r, symvals)
            text = str(g)
            split += g.row_split > 1
            assert text == canonical_text(g), (label, r, text)
            back = _C.Genome.parse(text)
            assert back == g and hash(back) == hash(g) and str(back) == text, (label, r, text)
            assert eval(repr(g), {"Genome": _C.Genome}) == g
            assert _C.Genome(**{gene: getattr(g, gene) for gene in GENES}) == g
            assert _C.generate(p, r, 90, g).genome == g
            kinds.add(p.region(r)["kind"])
            n += 1
    assert n > 100 and kinds == {"POINTWISE", "ROW"}, (n, kinds)
    assert split > 0, "no task's default splits a row (cross_entropy_32k's 4 rows of 32000 did)"


def test_genome_equality_hash_and_immutability():
    base = _C.Genome()
    assert base == _C.Genome.parse("") == _C.Genome.parse(str(base))
    assert str(base) == "threads=256 vec=1 rows=1 items=1 cache=regs two_pass=1 fast_math=0 persistent=0 col_split=1"
    g = _C.Genome(threads=128, vec=4, cache="smem", persistent=True)
    assert (g.threads, g.vec, g.cache, g.persistent, g.rows) == (128, 4, "smem", 1, 1)
    assert g == base.replace(threads=128, vec=4, cache="smem", persistent=1) and g != base
    assert g.replace() == g and g.replace(vec=2) != g and g.vec == 4      # replace makes a new one
    for gene, value in (("threads", 64), ("vec", 2), ("rows", 4), ("items", 2), ("cache", "reread"),
                        ("two_pass", 0), ("fast_math", 1), ("persistent", 0), ("col_split", 8), ("row_split", 3)):
        other = g.replace(**{gene: value})
        assert other != g and getattr(other, gene) == value, gene      # every gene takes part in ==
    # hashed by value: equal genomes are one key; the text is another key
    same = _C.Genome.parse(str(g))
    assert same is not g and hash(same) == hash(g) and {g: 1}[same] == 1 and len({g, same, base}) == 2
    assert g != str(g) and str(g) not in {g}
    assert len({base.replace(threads=t, vec=v) for t in (32, 64, 128, 256) for v in (1, 2, 4, 8)}) == 16
    # a gene given twice in a text: the last value
    assert _C.Genome.parse(f"{g} vec=8") == g.replace(vec=8)
    with pytest.raises(AttributeError):
        g.threads = 64
    with pytest.raises(AttributeError):
        g.extra = 1
    assert pickle.loads(pickle.dumps(g)) == g and copy.deepcopy(g) == g and copy.copy(g) == g


def test_row_split_text_round_trips_and_old_texts_still_parse():
    """row_split is appended last, and only where it is not 1: a text written before the gene
    (every cached winner's) parses with row_split=1 and prints as it was; a split prints and
    parses back; "row_split=1" given explicitly is the same genome as the old text."""
    old = "threads=512 vec=4 rows=1 items=4 cache=reread two_pass=0 fast_math=0 persistent=0 col_split=1"
    g = _C.Genome.parse(old)
    assert g.row_split == 1 and str(g) == old and g == _C.Genome.parse(old + " row_split=1")
    split = g.replace(row_split=66)
    assert str(split) == old + " row_split=66" and split != g
    back = _C.Genome.parse(str(split))
    assert back == split and hash(back) == hash(split) and back.row_split == 66
    assert eval(repr(split), {"Genome": _C.Genome}) == split and "row_split=66" in repr(split)
    assert pickle.loads(pickle.dumps(split)) == split
    assert _C.Genome(row_split=4096).row_split == 4096
    for bad in ("row_split=0", "row_split=4097", "row_split=x"):
        with pytest.raises(ValueError, match="row_split"):
            _C.Genome.parse(bad)


@pytest.mark.parametrize("text,message", [
    ("threads=256 warps=4", 'genome: unknown gene "warps"'),
    ("cache=disk", 'genome: bad value "disk" for cache'),
    ("vec=x", 'genome: bad value "x" for vec (1..16)'),
    ("threads=2048", 'genome: bad value "2048" for threads (1..1024)'),
    ("vec", 'genome: expected key=value at "vec"'),
    ("threads=", 'genome: bad value "" for threads'),
])
def test_bad_text_is_a_value_error_with_the_parsers_message(text, message):
    with pytest.raises(ValueError) as e:
        _C.Genome.parse(text)
    assert re.fullmatch(r"genome\.c:\d+: " + re.escape(message) + r".*", str(e.value)), str(e.value)


def test_bad_genes_by_keyword():
    with pytest.raises(ValueError, match=r"genome\.c:\d+: genome: bad value 0 for threads \(1\.\.1024\)"):
        _C.Genome(threads=0)
    with pytest.raises(ValueError, match="col_split"):
        _C.Genome().replace(col_split=5000)
    with pytest.raises(ValueError, match="cache"):
        _C.Genome(cache="disk")
    with pytest.raises(ValueError, match="threads"):
        _C.Genome(threads=1 << 40)
    with pytest.raises(TypeError, match="cache"):
        _C.Genome(cache=1)                 # by name: regs, smem, reread
    with pytest.raises(TypeError, match="vec"):
        _C.Genome(vec=4.0)
    with pytest.raises(TypeError, match="warps"):
        _C.Genome(warps=4)
    with pytest.raises(TypeError):
        _C.Genome(256)                     # keyword genes only
    with pytest.raises(TypeError):
        _C.Genome.parse(b"threads=256")
    with pytest.raises(ValueError):
        _C.Genome.parse("threads=256\0 vec=4")


def test_the_c_functions_take_genomes_not_texts():
    g, _, _, _ = tc.build("softmax", "f32")
    p = g.partition()
    default = _C.genome_default(p, 0, [5, 300])
    assert isinstance(default, _C.Genome)
    h = _C.evolve_new(p, 0, [5, 300], None, 0, 4)
    asked = _C.evolve_ask(h, 4)
    assert all(isinstance(x, _C.Genome) for x in asked) and asked[0] == default
    for bad in (str(default), None, {"threads": 256}):
        with pytest.raises(TypeError, match="Genome"):
            _C.evolve_tell(h, bad, 1.0)
        with pytest.raises(TypeError, match="Genome"):
            _C.genome_legal(p, 0, [5, 300], None, bad)
    with pytest.raises(TypeError, match="Genome"):
        _C.generate(p, 0, 90, str(default))
    _C.evolve_tell(h, asked[0], 1.0)
    best, ms = _C.evolve_best(h)
    assert best == asked[0] and ms == 1.0


# ---------------------------------------------------------------------------------------- KernelInfo


def g_midcol(dt):
    """A sum over a middle axis: a COL region whose height may be split (col_split > 1)."""
    b = tc.Builder(s0=3)
    x = b.input("x", dt, ["s0", 512, 64])
    b.g.add_output(b.op("sum", [x], dt, ["s0", 1, 64], axes=2))
    return b, ["COL"], 1


ROW8 = "threads=256 vec=4 rows=8 items=1 cache=regs two_pass=1 fast_math=0 persistent=0 col_split=1"
SMEM = "threads=256 vec=4 rows=1 items=4 cache=smem two_pass=1 fast_math=0 persistent=0 col_split=1"
SPLIT = "threads=32 vec=4 rows=1 items=8 cache=reread two_pass=1 fast_math=0 persistent=0 col_split=4"
COLSUM = "threads=512 vec=2 rows=8 items=1 cache=regs two_pass=1 fast_math=0 persistent=1 col_split=1"
GELU = "threads=128 vec=8 rows=1 items=1 cache=regs two_pass=1 fast_math=1 persistent=0 col_split=1"
REREAD = "threads=32 vec=1 rows=4 items=4 cache=reread two_pass=1 fast_math=0 persistent=0 col_split=1"

# What generate()'s dict held for these regions and genomes before it returned a KernelInfo
# (graphs of test_codegen.py; "stats": the partition's statistics saved, as a forward's are).
OLD_DICTS = [
    ("softmax", "f32", 0, ROW8, False,
     dict(name="kb_r0_row", block=256, smem=0, grid_units=(1, (0,)), units_per_block=8, max_blocks=0, nkernels=1,
          workspace_bytes_per_unit=0, workspace_bytes_per_block=0, nostats=0)),
    ("softmax", "f32", 0, SMEM, False,
     dict(name="kb_r0_row", block=256, smem=4000, grid_units=(1, (0,)), units_per_block=1, max_blocks=0,
          nkernels=1, workspace_bytes_per_unit=0, workspace_bytes_per_block=0, nostats=0)),
    ("midcol", "bf16", 0, SPLIT, False,
     dict(name="kb_r0_col", block=32, smem=0, grid_units=(256, (0,)), units_per_block=128, max_blocks=0,
          nkernels=2, workspace_bytes_per_unit=4, workspace_bytes_per_block=0, nostats=0)),
    ("layernorm", "f32", 0, ROW8, True,
     dict(name="kb_r0_row", block=256, smem=0, grid_units=(1, (0,)), units_per_block=8, max_blocks=0, nkernels=1,
          workspace_bytes_per_unit=0, workspace_bytes_per_block=0, nostats=1)),
    ("col_sum", "bf16", 0, COLSUM, False,
     dict(name="kb_r0_row", block=512, smem=0, grid_units=(1, (0, 1)), units_per_block=8, max_blocks=528, nkernels=2,
          workspace_bytes_per_unit=0, workspace_bytes_per_block=16384, nostats=0)),
    ("bias_gelu", "bf16", 0, GELU, False,
     dict(name="kb_r0_pointwise", block=128, smem=0, grid_units=(768, (0,)), units_per_block=1024, max_blocks=0,
          nkernels=1, workspace_bytes_per_unit=0, workspace_bytes_per_block=0, nostats=0)),
    ("cross_entropy", "f32", 1, REREAD, False,
     dict(name="kb_r1_row", block=32, smem=0, grid_units=1, units_per_block=4, max_blocks=0, nkernels=1,
          workspace_bytes_per_unit=0, workspace_bytes_per_block=0, nostats=0)),
    ("row_colsum", "f32", 0, COLSUM, True,
     dict(name="kb_r0_row", block=512, smem=0, grid_units=(1, (0,)), units_per_block=8, max_blocks=528, nkernels=2,
          workspace_bytes_per_unit=0, workspace_bytes_per_block=16384, nostats=1)),
]


def generated(name, dt, r, text, stats):
    build = g_midcol if name == "midcol" else tc.GRAPHS[name]
    p = build(dt)[0].g.partition()
    if stats:
        p.save_stats(0)
    return _C.generate(p, r, 90, _C.Genome.parse(text))


@pytest.mark.parametrize("name,dt,r,text,stats,old", OLD_DICTS, ids=[f"{c[0]}-{c[1]}-{c[2]}" for c in OLD_DICTS])
def test_kernel_info_fields_are_the_old_dicts(name, dt, r, text, stats, old):
    k = generated(name, dt, r, text, stats)
    assert isinstance(k, _C.KernelInfo)
    assert {f: getattr(k, f) for f in old} == old
    assert str(k.genome) == text and k.genome == _C.Genome.parse(text)
    assert k.source.startswith("// kbench: region") and k.name in k.source
    assert f"// genome: {text}" in k.source


@pytest.mark.parametrize("name,dt,r,text,stats,old", OLD_DICTS, ids=[f"{c[0]}-{c[1]}-{c[2]}" for c in OLD_DICTS])
def test_entry_points_are_named_by_the_kernel_info(name, dt, r, text, stats, old):
    """entries: the main entry, the finishing kernel's where nkernels == 2, the one without the
    saved statistics where nostats; each one a kernel of the source, and no other."""
    k = generated(name, dt, r, text, stats)
    want = [k.name] + [k.name + "_finish"] * (k.nkernels == 2) + [k.name + "_nostats"] * k.nostats
    assert list(k.entries) == want and isinstance(k.entries, tuple)
    assert k.finish_name == (k.name + "_finish" if k.nkernels == 2 else None)
    assert k.nostats_name == (k.name + "_nostats" if k.nostats else None)
    defined = re.findall(r'extern "C" __global__ void __launch_bounds__\(\d+\) (\w+)\(', k.source)
    assert sorted(defined) == sorted(k.entries), (defined, k.entries)


def test_kernel_info_is_read_only_and_checks_its_fields():
    k = generated(*OLD_DICTS[4][:5])
    for field in ("name", "block", "genome", "entries", "nostats", "source", "grid_units", "finish_name"):
        with pytest.raises(AttributeError):
            setattr(k, field, getattr(k, field))
    assert repr(k).startswith("<KernelInfo kb_r0_row block=512 smem=0 grid_units=(1, (0, 1))") and COLSUM in repr(k)
    g = _C.Genome.parse(COLSUM)
    ok = dict(name="k", genome=g, block=256, grid_units=[4, [1, 0]], units_per_block=2)
    made = _C.KernelInfo(**ok)
    assert (made.source, made.smem, made.max_blocks, made.nkernels, made.nostats) == ("", 0, 0, 1, False)
    assert made.entries == ("k",) and made.finish_name is None and made.nostats_name is None
    assert made.grid_units == (4, (0, 1))   # a list (JSON's) becomes generate()'s tuple, symbols sorted
    for missing in ("name", "genome", "block", "grid_units", "units_per_block"):
        with pytest.raises(TypeError, match=missing):
            _C.KernelInfo(**{f: v for f, v in ok.items() if f != missing})
    for bad, err in ((dict(genome=COLSUM), TypeError), (dict(name=""), TypeError), (dict(block=0), ValueError),
                     (dict(nkernels=3), ValueError), (dict(smem=-1), ValueError), (dict(units_per_block=0), ValueError),
                     (dict(grid_units="s0"), TypeError), (dict(grid_units=(1, (0, 99))), ValueError),
                     (dict(block=1.5), TypeError), (dict(unknown=1), TypeError)):
        with pytest.raises(err):
            _C.KernelInfo(**{**ok, **bad})
    with pytest.raises(TypeError):
        _C.KernelInfo("k", g, 256, 1, 1)    # keywords only


@pytest.mark.parametrize("case", [0, 2, 3, 7], ids=["softmax", "col_split", "nostats", "finish+nostats"])
def test_a_cached_winner_rebuilds_the_same_kernel_info(case):
    """The tuner stores a winner's launch fields and entry names (JSON) and rebuilds its
    KernelInfo from them on a hit: the same launch, the same entry points, no source."""
    k = generated(*OLD_DICTS[case][:5])
    w = cache.Winner(genome=str(k.genome), source_hash="ab" * 32, cubin=b"x", entries=list(k.entries),
                     launch=json.loads(json.dumps(stored_launch(k))), envelope="")
    assert set(w.launch) == set(cache.LAUNCH_FIELDS)
    back = stored_kernel(w)
    fields = ("name", "genome", "block", "smem", "grid_units", "units_per_block", "max_blocks", "nkernels",
              "workspace_bytes_per_unit", "workspace_bytes_per_block", "nostats", "entries", "finish_name",
              "nostats_name")
    assert {f: getattr(back, f) for f in fields} == {f: getattr(k, f) for f in fields}
    assert back.source == ""
    with pytest.raises(ValueError, match="entry points"):   # names that are not the launch's: stale, tuned again
        stored_kernel(cache.Winner(**{**w.__dict__, "entries": [k.name, "other"]}))
