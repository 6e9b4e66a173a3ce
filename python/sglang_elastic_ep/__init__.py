"""Elastic expert parallelism for SGLang."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("sglang-elastic-ep")
except PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"
