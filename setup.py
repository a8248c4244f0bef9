# setup.py — builds the C11 extension kbench._C from csrc/ with the Python C API alone:
# no libtorch link and no CUDA headers (libcuda and libnvrtc are dlopen'ed at run time).
import glob
import os

from setuptools import Extension, setup

sources = sorted(glob.glob(os.path.join("csrc", "*.c")))
extra = ["-std=c11", "-O2", "-Wall", "-Wextra", "-Wshadow", "-Wno-missing-field-initializers",
         "-fvisibility=hidden"]
if os.environ.get("KBENCH_WERROR"):
    extra.append("-Werror")

setup(
    ext_modules=[
        Extension(
            "kbench._C",
            sources=sources,
            depends=sorted(glob.glob(os.path.join("csrc", "*.h")) + glob.glob(os.path.join("csrc", "*.def"))),
            include_dirs=["csrc"],
            extra_compile_args=extra,
            libraries=["dl", "m"],
        )
    ],
)
