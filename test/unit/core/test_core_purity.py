"""The core must import without sglang or torch, so adapters can be tested without them."""

import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import sglang_elastic_ep.core as core

PYTHON_DIR = Path(core.__file__).resolve().parents[2]


def test_core_modules_import_without_sglang_or_torch() -> None:
    modules = sorted(
        f"sglang_elastic_ep.core.{m.name}" for m in pkgutil.iter_modules(core.__path__)
    )
    assert "sglang_elastic_ep.core.agreement" in modules and len(modules) >= 12
    script = (
        "import importlib, json, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('sglang', 'torch', 'numpy', 'zmq', 'fastapi'))\n"
        "print(json.dumps(heavy))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONPATH": str(PYTHON_DIR)},
    )
    assert json.loads(out.stdout) == []
