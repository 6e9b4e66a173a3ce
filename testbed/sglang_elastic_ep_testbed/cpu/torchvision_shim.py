"""A stand-in ``torchvision`` for the CPU engine when the real one cannot be imported.

SGLang and transformers import ``torchvision`` submodules at module level (image-model helpers,
video processors) even when serving a text model. PyPI's torchvision is a CUDA build that fails
beside CPU torch. With this stand-in every ``torchvision.*`` import succeeds and any name can be
referenced (e.g. ``InterpolationMode.BICUBIC`` as a default argument); calling anything raises
an ImportError that says why.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

_MESSAGE = (
    "torchvision is not available with the CPU engine of sglang-elastic-ep "
    "(PyPI's build needs CUDA); image models are not supported here"
)


class _Missing:
    """A name from torchvision: fine to import and reference, an ImportError once used."""

    def __init__(self, path: str) -> None:
        self._path = path

    def __getattr__(self, name: str) -> _Missing:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Missing(f"{self._path}.{name}")

    def __call__(self, *args: object, **kwargs: object) -> None:
        raise ImportError(f"{_MESSAGE} (called {self._path})")

    def __repr__(self) -> str:
        return f"<unavailable {self._path}>"


class _Unavailable(types.ModuleType):
    def __getattr__(self, name: str) -> _Missing:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Missing(f"{self.__name__}.{name}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves ``torchvision`` and any submodule of it as an :class:`_Unavailable` module."""

    def find_spec(self, fullname: str, path: object = None, target: object = None):
        if fullname == "torchvision" or fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _Unavailable(spec.name)
        module.__path__ = []
        module.__version__ = "0.0.0+unavailable"
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def _real_torchvision_imports() -> bool:
    if importlib.util.find_spec("torchvision") is None:
        return False
    try:
        import torchvision  # noqa: F401

        return True
    except Exception:  # a CUDA build beside CPU torch: use the stand-in
        for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
            del sys.modules[name]
        return False


def install() -> None:
    if any(isinstance(f, _Finder) for f in sys.meta_path) or _real_torchvision_imports():
        return
    sys.meta_path.insert(0, _Finder())
