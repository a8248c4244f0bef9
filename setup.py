# setup.py — builds the C11 extension kbench._C from csrc/'s stage folders (core, fuse, grad, tune,
# codegen, cuda, and python: the CPython module) with the Python C API alone (no libtorch link,
# no CUDA headers: libcuda and NVRTC are dlopen'ed at run time), and kbench._fast from
# csrc/fast/, the CUDA backend's hot path in C++ against the torch being built with (the launch
# and autograd node without Python). _fast needs torch at build time (pip's
# --no-build-isolation); without it kbench runs that path in Python and says so.
import concurrent.futures
import glob
import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class ParallelBuildExt(build_ext):
    """Compiles each extension's sources on every core (extensions one after the other):
    setuptools compiles one file at a time, and kbench._fast's C++ files (torch's headers) take
    most of an install. KBENCH_BUILD_JOBS sets the number of jobs."""

    def build_extension(self, ext):
        compiler = self.compiler
        jobs = int(os.environ.get("KBENCH_BUILD_JOBS", 0)) or os.cpu_count() or 1
        serial = compiler.compile

        def compile_parallel(sources, *args, **kwargs):
            if jobs <= 1 or len(sources) <= 1:
                return serial(sources, *args, **kwargs)
            with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
                parts = pool.map(lambda src: serial([src], *args, **kwargs), sources)
                return [obj for part in parts for obj in part]

        compiler.compile = compile_parallel
        try:
            super().build_extension(ext)
        finally:
            compiler.compile = serial

# the pipeline's stages in order (csrc/Makefile builds the same ones but python/ for its C tests);
# includes are rooted at csrc/: #include "core/kbench.h"
STAGES = ("core", "fuse", "grad", "tune", "codegen", "cuda", "python")
sources = sorted(f for stage in STAGES for f in glob.glob(os.path.join("csrc", stage, "*.c")))
headers = sorted(f for stage in STAGES for pattern in ("*.h", "*.def")
                 for f in glob.glob(os.path.join("csrc", stage, pattern)))
extra = ["-std=c11", "-O2", "-Wall", "-Wextra", "-Wshadow", "-Wno-missing-field-initializers",
         "-fvisibility=hidden"]
if os.environ.get("KBENCH_WERROR"):
    extra.append("-Werror")

extensions = [
    Extension(
        "kbench._C",
        sources=sources,
        depends=headers,
        include_dirs=["csrc"],
        extra_compile_args=extra,
        libraries=["dl", "m"],
    )
]


def fast_extension():
    """kbench._fast, compiled against the torch this build sees; None without one."""
    if os.environ.get("KBENCH_NO_FAST"):
        return None
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError:
        print("kbench: torch is not importable at build time (build isolation?): kbench._fast is not "
              "built and the CUDA backend's launches run in Python. Build with --no-build-isolation.",
              file=sys.stderr)
        return None
    torch_lib = cpp_extension.library_paths()[0]
    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True))
    flags = ["-std=c++20", "-O2", "-Wall", "-Wextra", "-Wno-unused-parameter", "-Wno-missing-field-initializers",
             "-fvisibility=hidden", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-DTORCH_API_INCLUDE_EXTENSION_H"]
    return Extension(
        "kbench._fast",
        sources=sorted(glob.glob(os.path.join("csrc", "fast", "*.cpp"))),
        depends=sorted(glob.glob(os.path.join("csrc", "fast", "*.h"))) + [os.path.join("csrc", "cuda", "launch_api.h")],
        include_dirs=["csrc"] + cpp_extension.include_paths(),
        library_dirs=[torch_lib],
        libraries=["c10", "torch", "torch_cpu", "torch_python"],
        runtime_library_dirs=[torch_lib],
        extra_compile_args=flags,
        language="c++",
    )


fast = fast_extension()
if fast is not None:
    extensions.append(fast)

setup(ext_modules=extensions, cmdclass={"build_ext": ParallelBuildExt})
