"""benchmarks/sass_counts.py without a GPU: its SASS and ptxas parsers on canned output (loops are
backward branches, counted by opcode with predicates and modifiers dropped), and, where nvcc and
cuobjdump are at hand, a real kernel of a benchmark task counted end to end."""
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

SASS = """
        code for sm_90
                Function : kb_r0_row
        .headerflags    @"EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
        /*0000*/                   LDC R1, c[0x0][0x28] ;                   /* 0x00000a00ff017b82 */
        /*0010*/                   S2R R0, SR_TID.X ;                       /* 0x0000000000007919 */
        /*0020*/                   FADD.FTZ R2, R2, R3 ;                    /* 0x0000000302027221 */
        /*0030*/               @P0 FMUL R4, R4, R5 ;                        /* 0x0000000504040220 */
        /*0040*/              @!P1 FADD R2, R2, R4 ;                        /* 0x0000000402029221 */
        /*0050*/                   SHFL.BFLY PT, R6, R2, 0x10, 0x1f ;       /* 0x0e001f0002067f89 */
        /*0060*/               @P2 BRA 0x20 ;                               /* 0xfffffffc00f02947 */
        /*0070*/                   BRA 0x80 ;                               /* 0xfffffffc00fc7947 */
        /*0080*/                   EXIT ;                                   /* 0x000000000000794d */
                Function : kb_r0_row_finish
        /*0000*/                   EXIT ;                                   /* 0x000000000000794d */
"""

PTXAS = """ptxas info    : Compiling entry function 'kb_r0_row_finish' for 'sm_90'
ptxas info    : Used 32 registers, used 1 barriers, 4096 bytes smem
ptxas info    : Compiling entry function 'kb_r0_row' for 'sm_90'
ptxas info    : Used 62 registers, used 1 barriers, 384 bytes smem
"""


@pytest.fixture(scope="module")
def sass_counts():
    spec = importlib.util.spec_from_file_location("sass_counts_under_test", ROOT / "benchmarks" / "sass_counts.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_parse_sass_counts_loop_bodies(sass_counts):
    funcs = sass_counts.parse_sass(SASS)
    assert list(funcs) == ["kb_r0_row", "kb_r0_row_finish"]
    assert funcs["kb_r0_row"]["instructions"] == 9 and funcs["kb_r0_row_finish"]["instructions"] == 1
    (start, end, ops), = funcs["kb_r0_row"]["loops"]        # the forward BRA 0x80 is no loop
    assert (start, end) == (0x20, 0x60)
    assert ops == {"FADD": 2, "FMUL": 1, "SHFL": 1, "BRA": 1}
    assert funcs["kb_r0_row_finish"]["loops"] == []


def test_registers_per_function(sass_counts):
    assert sass_counts.registers(PTXAS) == {"kb_r0_row_finish": 32, "kb_r0_row": 62}


def test_missing_tool_names_the_wheel(sass_counts, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setenv("CUDA_HOME", "/nonexistent")
    monkeypatch.setattr(sass_counts.shutil, "which", lambda name: None)
    monkeypatch.setattr(sass_counts.os, "access", lambda path, mode: False)
    with pytest.raises(FileNotFoundError, match="nvidia-cuda-cuobjdump"):
        sass_counts.find_tool("cuobjdump")


def test_a_task_end_to_end(sass_counts, capsys):
    try:
        sass_counts.find_tool("nvcc"), sass_counts.find_tool("cuobjdump")
    except FileNotFoundError as e:
        pytest.skip(str(e))
    sass_counts.main(["softmax", "--dtype", "bfloat16", "--no-backward"])
    out = capsys.readouterr().out
    assert "forward region 0 ROW [threads=" in out
    assert "kb_r0_row: " in out and " registers, " in out and "loop 0x" in out and "MUFU:" in out
