"""kbench._fast without a GPU: it is built (CI builds with torch at hand), it agrees with
kbench._C on the launch API, and it refuses malformed launch descriptions with clear errors
(what it does on a GPU: tests/gpu/test_fast_path.py)."""
import pytest
import torch

from kbench import _C
from kbench.runtime import fast as fastmod


def test_built_and_initialized():
    assert fastmod.module() is not None, "kbench._fast was not built (pip install --no-build-isolation -e .)"
    assert "kbench._C.launch_api" in repr(_C.launch_api())


def test_malformed_launches_are_refused():
    fast = fastmod.module()
    good = dict(cuda=None, keep=None, fn=1, finish=None, grid=(1,), block=128, smem=0, device=0, region=0,
                vec=1, check=[], ints=[], workspace_bytes=0, outs=[], skipped=0)
    with pytest.raises(ValueError, match="cuda handle"):
        fast.Launch(**good)            # no cuda handle
    with pytest.raises(TypeError, match="torch.dtype"):
        fast.Launch(**{**good, "outs": [(-1, (2, 3), "float32")]})
    with pytest.raises(TypeError):
        fast.Launch(**{**good, "grid": None})
    with pytest.raises(TypeError, match="scratch"):
        fast.Launch(**{**good, "scratch": None})
    with pytest.raises(TypeError, match="scratch: input 0 is a int"):   # an address is not a buffer
        fast.Launch(**{**good, "skipped": 1, "scratch": [0x7f0000000000]})
    with pytest.raises(ValueError, match="scratch buffer is not a contiguous CUDA tensor"):
        fast.Launch(**{**good, "skipped": 1, "scratch": [torch.zeros(4)]})
    # the last dim's requirement (a kernel with vectors along a varying one): checked per call
    # before the alignment, with the Python launcher's reason (tests/gpu/test_symvec.py)
    with pytest.raises(ValueError, match="last_multiple must be >= 1"):
        fast.Launch(**{**good, "last_size": 255, "last_multiple": 0})
    with pytest.raises(ValueError, match="last_size >= 0"):
        fast.Launch(**{**good, "last_size": -4, "last_multiple": 4})
    with pytest.raises(TypeError):
        fast.Region(object(), None, (True,), 0, [((2,), torch.float32)], lambda *a: None)
    with pytest.raises(TypeError, match="exception classes"):
        fast.init(_C.launch_api(), 1, 2, 3)
