"""Where NVRTC comes from, and compiling through it with the on-disk CUBIN cache.

Search order (docs/DESIGN.md, "Data flow"): $KBENCH_NVRTC, the nvidia/*/lib folders of the installed
torch wheel (and of the nvidia-cuda-nvrtc wheel), $CUDA_HOME, /usr/local/cuda, the loader's path."""
from __future__ import annotations

import functools
import glob
import os
import sys

from .. import _C, keyfile


def cache_dir() -> str:
    return os.path.join(keyfile.cache_root(), "cubin")


def wheel_lib_dirs() -> list[str]:
    """nvidia/<pkg>/lib folders of pip-installed CUDA wheels (torch's, nvidia-cuda-nvrtc)."""
    dirs = []
    for base in sys.path:
        if not base or not os.path.isdir(os.path.join(base, "nvidia")):
            continue
        dirs += sorted(glob.glob(os.path.join(base, "nvidia", "*", "lib")))
    seen, out = set(), []
    for d in dirs:
        if d not in seen:
            seen.add(d)
            out.append(d)
    return out


@functools.lru_cache(maxsize=1)
def handle():
    """The process's NVRTC (opened once). FileNotFoundError names every place looked."""
    return _C.nvrtc_open(wheel_lib_dirs())


def info() -> tuple[str, int]:
    """(path of the loaded libnvrtc, version as major*1000 + minor*10)."""
    return _C.nvrtc_info(handle())


def compile(source: str, arch: str, *, use_cache: bool = True) -> bytes:
    """CUDA C → CUBIN for arch ("sm_90"); kbench.CompileError carries NVRTC's log. The file cache
    is signed with the user's key (kbench.keyfile); without a trusted key it is not used."""
    key = None
    if use_cache:
        key, why = keyfile.load()
        if key is None:
            keyfile.warn_once(why)
    return _C.nvrtc_compile(handle(), source, arch, cache_dir() if key else None, key)
