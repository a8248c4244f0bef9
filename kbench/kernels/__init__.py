"""Hand-written helper kernels (CUDA source shipped as package data), read by name: scale.cu
(a joint loss program's gradients times the upstream gradient) and touch.cu (the search's
address-translation touch after an L2 flush)."""
from __future__ import annotations

from importlib import resources


def source(name: str) -> str:
    """The CUDA source of kbench/kernels/<name>."""
    return resources.files(__name__).joinpath(name).read_text()
