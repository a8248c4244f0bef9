"""Test configuration: `gpu`-marked tests are skipped where CUDA is not available."""
import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="session")
def _private_cache_dir(tmp_path_factory):
    """optimize() keeps kernels and captures in $KBENCH_CACHE_DIR (default ~/.cache/kbench): the
    tests use a directory of their own unless one is given."""
    import os
    if "KBENCH_CACHE_DIR" in os.environ:
        yield
        return
    os.environ["KBENCH_CACHE_DIR"] = str(tmp_path_factory.mktemp("kbench-cache"))
    try:
        yield
    finally:
        os.environ.pop("KBENCH_CACHE_DIR", None)
