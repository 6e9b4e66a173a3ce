"""Every phase the SGLang adapters write into upstream's ``scale_phase`` is a ``Phase``.

Read from the adapters' source: each write (an assignment to ``scale_phase`` or
``elastic_scale_phase``, a ``scale_phase=`` argument, or a phase handed to the release's
``enter``) and each comparison with one must name ``Phase`` members, pass upstream's own value
through, or write the value of something typed ``Phase`` (a machine's phase); a bare string would
let a phase the status cannot map slip in unseen.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from sglang_elastic_ep.core.phases import Phase

ADAPTERS = Path(__file__).resolve().parents[2] / "python" / "sglang_elastic_ep" / "sglang"
PHASE_ATTRS = {"scale_phase", "elastic_scale_phase"}
# Calls that write their last argument as the phase (the release's steps).
PHASE_SETTERS = {"enter", "enter_phase"}
# Upstream's own phase, only compared with (never written): ``upstream.RECOVERY_UNSUPPORTED``.
UPSTREAM_ONLY = {"RECOVERY_UNSUPPORTED"}


def _is_phase_attr(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr in PHASE_ATTRS


def _phase_uses(tree: ast.AST) -> list[tuple[str, int, ast.expr]]:
    """(kind, line, value) of every write to, or comparison with, a phase attribute."""
    uses: list[tuple[str, int, ast.expr]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(_is_phase_attr(t) for t in node.targets):
            uses.append(("write", node.lineno, node.value))
        elif isinstance(node, ast.Call):
            uses += [("write", kw.value.lineno, kw.value) for kw in node.keywords
                     if kw.arg == "scale_phase"]
            name = node.func.attr if isinstance(node.func, ast.Attribute) else \
                getattr(node.func, "id", "")
            if name in PHASE_SETTERS:
                uses += [("write", arg.lineno, arg) for arg in node.args[-1:]]
        elif isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(_is_phase_attr(side) for side in sides):
                uses += [("compare", node.lineno, side) for side in sides
                         if not _is_phase_attr(side)]
    return uses


def _is_typed_phase(value: ast.expr) -> bool:
    """``phase``, ``phase.value`` or ``<machine>.phase.value``: something typed ``Phase`` (a
    parameter so named, a machine's phase) or its value."""
    if isinstance(value, ast.Name) and value.id == "phase":
        return True
    if not (isinstance(value, ast.Attribute) and value.attr == "value"):
        return False
    inner = value.value
    return (isinstance(inner, ast.Name) and inner.id == "phase") or (
        isinstance(inner, ast.Attribute) and inner.attr == "phase")


def _phase_members(value: ast.expr) -> set[str]:
    return {n.attr for n in ast.walk(value) if isinstance(n, ast.Attribute)
            and isinstance(n.value, ast.Name) and n.value.id == "Phase"}


def _written_phases() -> set[str]:
    written: set[str] = set()
    for path in sorted(ADAPTERS.glob("*.py")):
        for kind, line, value in _phase_uses(ast.parse(path.read_text(), str(path))):
            where = f"{path.name}:{line}"
            literals = [n.value for n in ast.walk(value)
                        if isinstance(n, ast.Constant) and isinstance(n.value, str)]
            assert not literals, f"{where}: bare phase string {literals}; use Phase"
            members = _phase_members(value)
            unknown = members - set(Phase.__members__)
            assert not unknown, f"{where}: Phase has no {sorted(unknown)}"
            passed_through = _is_phase_attr(value)  # upstream's own value, handed on
            upstream_only = (kind == "compare" and isinstance(value, ast.Name)
                             and value.id in UPSTREAM_ONLY)
            assert members or passed_through or upstream_only or _is_typed_phase(value), (
                f"{where}: {ast.unparse(value)} is not a Phase"
            )
            if kind == "write":
                written |= members
    return written


def test_every_phase_the_adapters_write_is_a_phase() -> None:
    written = _written_phases()
    # The scan finds the writes it is meant to check (the release's steps; the machines'
    # own phases are written as ``machine.phase.value``, typed Phase).
    assert {"MOVING_EXPERTS", "SWITCHING_PLACEMENT", "RELEASING", "SERVING_CONTRACTED",
            "RELEASED"} <= written


@pytest.mark.parametrize("phase", sorted(Phase, key=lambda p: p.value))
def test_the_operation_watcher_maps_every_phase(phase: Phase) -> None:
    """The watcher turns the schedulers' ``scale_phase`` into the operation's phase; a value
    missing there would be dropped from the status."""
    from sglang_elastic_ep.sglang.upstream_engine import UPSTREAM_PHASES

    assert UPSTREAM_PHASES[phase.value] is phase


def test_awaiting_replacement_is_a_phase() -> None:
    assert Phase("awaiting_replacement") is Phase.AWAITING_REPLACEMENT
