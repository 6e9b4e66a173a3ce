"""The product distribution: its declared dependencies, its wheel's files, and no testbed in it.

The CPU testbed (``sglang_elastic_ep_testbed``, its own distribution in ``testbed/``) may import
the product; the product must never import the testbed, and must work where it is absent.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import zipfile
from importlib.metadata import distribution, requires, version
from pathlib import Path

import pytest

import sglang_elastic_ep
from sglang_elastic_ep.plugin import SUPPORTED_SGLANG_VERSION

REPO = Path(__file__).resolve().parents[3]
PRODUCT_DIRS = (REPO / "python" / "sglang_elastic_ep", REPO / "sgl-kernel")
TESTBED = "sglang_elastic_ep_testbed"


def _imported_modules(path: Path) -> set[str]:
    """Every module a file imports statically, or by a literal ``import_module`` name."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant)):
            names.add(str(node.args[0].value))
    return names


def test_product_imports_nothing_from_the_testbed() -> None:
    files = [f for root in PRODUCT_DIRS for f in root.rglob("*.py")]
    assert len(files) > 40
    offenders = {
        str(f.relative_to(REPO)): sorted(m for m in _imported_modules(f)
                                         if m.split(".")[0] == TESTBED)
        for f in files
    }
    assert {f: m for f, m in offenders.items() if m} == {}


def test_the_walk_sees_testbed_imports() -> None:
    """The import walk above must be able to fail: it finds the testbed's own product imports."""
    found = _imported_modules(REPO / "testbed" / TESTBED / "plugin.py")
    assert "sglang_elastic_ep.plugin" in found


def test_dependencies_pin_the_supported_sglang() -> None:
    reqs = requires("sglang-elastic-ep") or []
    assert f"sglang=={SUPPORTED_SGLANG_VERSION}" in [r.replace(" ", "") for r in reqs]
    extras = set(distribution("sglang-elastic-ep").metadata.get_all("Provides-Extra") or [])
    assert {"mooncake", "nixl", "testbed", "test"} <= extras
    assert any(r.startswith("mooncake-transfer-engine") and 'extra == "mooncake"' in r
               for r in reqs)
    assert any(r.startswith("nixl") and 'extra == "nixl"' in r for r in reqs)


def test_testbed_requires_this_very_product_version() -> None:
    product = version("sglang-elastic-ep")
    assert f"sglang-elastic-ep=={product}" in [
        r.replace(" ", "") for r in requires("sglang-elastic-ep-testbed") or []
    ]
    testbed = f"sglang-elastic-ep-testbed=={version('sglang-elastic-ep-testbed')}"
    assert any(r.replace(" ", "").startswith(testbed) for r in requires("sglang-elastic-ep") or [])


def test_built_wheel_holds_the_product_and_no_testbed(tmp_path: Path) -> None:
    """Builds the product wheel from a copy of its sources and lists the files inside."""
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(REPO / "pyproject.toml", src)
    for name in ("python", "sgl-kernel"):
        shutil.copytree(REPO / name, src / name,
                        ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    out = tmp_path / "wheel"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(out), str(src)],
        check=True, capture_output=True, text=True,
    )
    (wheel,) = out.glob("sglang_elastic_ep-*.whl")
    files = zipfile.ZipFile(wheel).namelist()
    tops = {f.split("/")[0] for f in files}
    assert tops == {"sglang_elastic_ep", "sglang_elastic_ep_kernels",
                    f"sglang_elastic_ep-{version('sglang-elastic-ep')}.dist-info"}, tops
    assert "sglang_elastic_ep/plugin.py" in files and "sglang_elastic_ep/hooks.py" in files
    assert not [f for f in files if "testbed" in f or "/cpu/" in f or "nixl_cpu" in f
                or "/cluster/" in f or "tiny_model" in f]


BLOCK_TESTBED = f"""
import importlib.abc, importlib.metadata, sys

class NoTestbed(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == {TESTBED!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None

sys.meta_path.insert(0, NoTestbed())
"""


@pytest.mark.parametrize("check", [
    # every product module imports (torch-free core, adapters that need sglang lazily)
    "import pkgutil, importlib, sglang_elastic_ep\n"
    "for m in pkgutil.walk_packages(sglang_elastic_ep.__path__, 'sglang_elastic_ep.'):\n"
    "    importlib.import_module(m.name)\n"
    "print('imported')",
    # the CLI still builds, without the testbed's subcommand
    "from sglang_elastic_ep.cli.main import main\n"
    "import contextlib, io\n"
    "buf = io.StringIO()\n"
    "with contextlib.redirect_stdout(buf):\n"
    "    code = main(['--help'])\n"
    "assert code == 0 and 'scale' in buf.getvalue(), buf.getvalue()\n"
    "print('imported')",
])
def test_product_works_with_the_testbed_absent(check: str) -> None:
    out = subprocess.run([sys.executable, "-c", BLOCK_TESTBED + check],
                         capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("imported")


def test_package_version_is_the_distribution_version() -> None:
    assert sglang_elastic_ep.__version__ == version("sglang-elastic-ep")
