"""kbench._C is safe to call from Python with anything: the interpreter takes buffers checked
against the graph's sizes, never addresses; a graph read without the GIL cannot grow; size and
index arithmetic in the builder's checks cannot wrap into a pass. (The fuzz target that throws
random graphs and arguments at the sanitized module: tests/test_c_core.py and .ci/run.)"""
import array
import os
import subprocess
import sys
import threading

import pytest
import torch

import kbench
from kbench import _C
from kbench.runtime.interp import run_graph, run_region


def exp_graph(n=4):
    g = _C.Graph()
    x = g.add_input("x", "user", "f32", [n])
    g.add_output(g.add_node("exp", [x], "f32", [n]))
    return g


def in_subprocess(code):
    """code run against kbench._C loaded alone (no torch), in a process of its own: a segfault
    there is a failed assertion here, not a dead test run."""
    so = next(f for f in os.listdir(os.path.dirname(kbench.__file__)) if f.startswith("_C.") and f.endswith(".so"))
    head = ("import importlib.util, array\n"
            f"spec = importlib.util.spec_from_file_location('kbench._C', {os.path.join(os.path.dirname(kbench.__file__), so)!r})\n"
            "_C = importlib.util.module_from_spec(spec); spec.loader.exec_module(_C)\n")
    return subprocess.run([sys.executable, "-c", head + code], capture_output=True, text=True, timeout=60)


def test_interp_takes_no_addresses():
    """A number where a buffer belongs is a TypeError: it once was read as an address (a bogus one
    segfaulted; an undersized buffer's was read past its end)."""
    proc = in_subprocess(
        "g = _C.Graph(); x = g.add_input('x', 'user', 'f32', [4]); g.add_output(g.add_node('exp', [x], 'f32', [4]))\n"
        "for ins, outs in (([16], [bytearray(16)]), ([bytearray(16)], [0xdeadbeef]), ([id(g)], [id(g) + 64])):\n"
        "    try:\n"
        "        _C.interp_graph(g, [], ins, outs)\n"
        "    except TypeError as e:\n"
        "        assert 'buffer' in str(e), e\n"
        "    else:\n"
        "        raise SystemExit('accepted an address')\n"
        "print('refused')\n")
    assert proc.returncode == 0 and "refused" in proc.stdout, (proc.returncode, proc.stdout, proc.stderr[-2000:])


def test_interp_checks_each_buffer():
    g = exp_graph()
    x = array.array("f", [0.0, 1.0, 2.0, -1.0])
    out = bytearray(16)
    _C.interp_graph(g, [], [x], [out])
    assert torch.allclose(torch.frombuffer(out, dtype=torch.float32), torch.exp(torch.tensor(x.tolist())))
    cases = [
        ([bytearray(12)], [bytearray(16)], ValueError, "holds 12 bytes"),                 # undersized input
        ([x], [bytearray(20)], ValueError, "needs 16"),                                   # oversized output
        ([x], [memoryview(bytearray(17))[1:]], ValueError, "aligned"),                   # misaligned
        ([x], [bytes(16)], TypeError, "writable"),                                        # read-only output
        ([x], [memoryview(bytearray(32))[::2]], TypeError, "buffer"),                     # not contiguous
        ([out], [out], ValueError, "overlaps"),                                           # output over an input
        ([x], [], ValueError, "1 outputs"),                                               # a missing output
        ([x, x], [out], ValueError, "1 inputs"),
        ([None], [out], TypeError, "buffer"),
    ]
    for ins, outs, exc, match in cases:
        with pytest.raises(exc, match=match):
            _C.interp_graph(g, [], ins, outs)
    p = g.partition()
    with pytest.raises(ValueError, match="needs 16"):
        _C.interp_region(p, 0, [], [bytearray(8)], [bytearray(16)])


def test_symbol_values_are_checked():
    """Symbol values the graph cannot be sized at (negative, or products past int64) are refused
    by every entry point that takes them, instead of wrapping."""
    g = _C.Graph()
    s = g.add_symbol("s0", 4)
    x = g.add_input("x", "user", "f32", [(1, (s,)), (1, (s,))])
    g.add_output(g.add_node("neg", [x], "f32", [(1, (s,)), (1, (s,))]))
    assert g.sizes(x, [3]) == (3, 3)
    for bad, match in (([2 ** 32], "too large"), ([-1], "negative"), ([1, 2], "expected 1")):
        with pytest.raises(ValueError, match=match):
            g.sizes(x, bad)
        with pytest.raises(ValueError, match=match):
            _C.interp_graph(g, bad, [bytearray(4)], [bytearray(4)])
    p = g.partition()
    with pytest.raises(ValueError, match="too large"):
        _C.genome_default(p, 0, [2 ** 32])
    with pytest.raises(OverflowError, match="int32"):   # a device figure was truncated to 32 bits
        _C.genome_default(p, 0, [3], {"num_sms": 2 ** 40})


def test_slice_past_the_end_by_overflow_is_refused():
    """start + (len - 1) * step wrapped negative once, and a slice reading 2^62 elements past its
    operand passed the check (codegen then read out of bounds)."""
    g = _C.Graph()
    x = g.add_input("x", "user", "f32", [8])
    with pytest.raises(ValueError, match="past the end"):
        g.add_node("slice", [x], "f32", [3], axis=0, start=2 ** 62, step=2 ** 62)
    with pytest.raises(ValueError, match="past the end"):
        g.add_node("slice", [x], "f32", [1], axis=0, start=2 ** 63 - 1, step=1)
    with pytest.raises(ValueError, match="coefficients"):
        g.add_node("const", [], "f32", [0, 2 ** 32, 2 ** 32])
    g.add_node("slice", [x], "f32", [3], axis=0, start=1, step=3)   # reads 1, 4, 7


def test_gather_index_larger_than_operand_is_refused():
    """torch.gather needs index.size(d) <= input.size(d) off the axis, where the output reads the
    operand at the index's coordinates; a wider index passed the check, and codegen read past."""
    g = _C.Graph()
    x = g.add_input("x", "user", "f32", [4, 2])
    i = g.add_input("i", "user", "i64", [4, 8])
    with pytest.raises(ValueError, match="larger than the operand on dim 1"):
        g.add_node("gather", [x, i], "f32", [4, 8], axis=0)
    g.add_node("gather", [x, i], "f32", [4, 8], axis=1)                  # along dim 1: any width


def test_graph_freezes_once_read():
    """A partition's arrays are sized by the graph's nodes, and the interpreter reads them without
    the GIL: once either has read a graph, it no longer grows (and a partition the interpreter
    read no longer changes its regions)."""
    g = exp_graph()
    g.add_node("const", [], "f32", [2])
    assert not g.frozen
    run_graph(g, [], [torch.zeros(4)])
    assert g.frozen
    for call in (lambda: g.add_node("const", [], "f32", [2]), lambda: g.add_input("y", "user", "f32", [2]),
                 lambda: g.add_symbol("s9", 2), lambda: g.add_output(0)):
        with pytest.raises(RuntimeError, match="frozen"):
            call()
    h = exp_graph()
    p = h.partition()
    assert h.frozen
    run_region(p, 0, [], [torch.ones(4)])
    with pytest.raises(RuntimeError, match="save statistics before"):
        p.save_stats(0)


def test_graph_growth_while_a_thread_interprets():
    """The interpreter in a thread (no GIL while it runs) and this thread growing the same graph:
    once the interpreter has started, every attempt is refused, and every run is right."""
    n = 1 << 16
    g = exp_graph(n)
    xt = torch.linspace(-3, 3, n)
    want = torch.exp(xt)
    started, go, results, errors = threading.Event(), threading.Event(), [], []

    def work():
        try:
            for k in range(8):
                results.append(run_graph(g, [], [xt])[0])
                if k == 0:
                    started.set()
                    go.wait(60)
        except Exception as e:   # noqa: BLE001 - reported below
            errors.append(e)
        finally:
            started.set()

    t = threading.Thread(target=work)
    t.start()
    started.wait(60)
    attempts = 0
    while True:   # at least once; then as long as the interpreter runs
        with pytest.raises(RuntimeError, match="frozen"):
            g.add_node("const", [], "f32", [2])
        attempts += 1
        go.set()
        if not t.is_alive():
            break
    t.join()
    assert not errors and len(results) == 8, errors
    assert all(torch.allclose(r, want) for r in results)


def test_launch_takes_function_objects():
    """launch's kernel is the object get_function returns (it keeps its module loaded), checked
    before anything else: a number is never called as a CUfunction."""
    with pytest.raises(TypeError, match="cuda_function"):
        _C.launch(None, 0xdeadbeef, 1, 32, 0, None, ())


def test_run_graph_checks_what_bytes_cannot_show():
    g = exp_graph()
    with pytest.raises(TypeError, match="dtype"):
        run_graph(g, [], [torch.zeros(4, dtype=torch.int32)])
    with pytest.raises(ValueError, match="shape"):
        run_graph(_graph_2x3(), [], [torch.zeros(3, 2)])
    out = torch.empty(4)
    assert run_graph(g, [], [torch.zeros(4)], [out])[0] is out and torch.equal(out, torch.ones(4))


def _graph_2x3():
    g = _C.Graph()
    x = g.add_input("x", "user", "f32", [2, 3])
    g.add_output(g.add_node("neg", [x], "f32", [2, 3]))
    return g
