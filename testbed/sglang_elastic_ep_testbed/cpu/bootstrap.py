"""Interpreter-start bootstrap for the CPU testbed (installed as a ``.pth`` line by setup).

SGLang's spawned children unpickle their target (importing ``sglang.srt.managers.scheduler``)
before they call ``load_plugins()``, so CPU import shims must exist earlier than any plugin hook:
at interpreter start. Does nothing unless ``SGLANG_USE_CPU_ENGINE=1``.
"""

from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path

_done = False


def _preload_cuda_stand_ins() -> None:
    """Load stand-in CUDA libraries by soname so ``mooncake.pg`` links without a driver.

    The dynamic loader reuses an already-loaded library whose soname matches a DT_NEEDED entry,
    so no LD_LIBRARY_PATH is needed. Real CUDA (a GPU machine) is never shadowed: we skip this
    when a real ``libcuda.so.1`` loads.
    """
    stubs = Path(os.environ.get("SGLANG_EEP_CUDA_STUBS", Path(sys.prefix) / "cuda-stubs"))
    if not stubs.is_dir():
        return
    try:
        ctypes.CDLL("libcuda.so.1", mode=ctypes.RTLD_GLOBAL)
        return  # a real driver is present
    except OSError:
        pass
    site = Path(sys.prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    cudart = site / "site-packages" / "nvidia" / "cuda_runtime" / "lib" / "libcudart.so.12"
    names = ("libcuda.so.1", "libc10_cuda.so", "libtorch_cuda.so")
    for lib in (cudart, *(stubs / name for name in names)):
        if lib.exists():
            ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)


def run() -> None:
    global _done
    if _done or os.environ.get("SGLANG_USE_CPU_ENGINE", "0") != "1":
        return
    _done = True
    from sglang_elastic_ep_testbed.cpu import sgl_kernel_ops, torch_compat, torchvision_shim

    torchvision_shim.install()
    sgl_kernel_ops.install()
    _preload_cuda_stand_ins()
    if "torch" in sys.modules:
        torch_compat.install()


run()
