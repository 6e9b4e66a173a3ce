"""Write one benchmark's section of docs/benchmarks.md (between its own markers)."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Callable
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"
HEADER = (
    "# Benchmarks\n\nEach section is written by the script named in it, with the exact command.\n"
)


def command_line() -> str:
    return "python " + " ".join(shlex.quote(a) for a in sys.argv)


def write_section(name: str, body: str, doc: Path = DOC) -> None:
    begin, end = f"<!-- BEGIN {name} -->", f"<!-- END {name} -->"
    block = f"{begin}\n{body.rstrip()}\n{end}"
    text = doc.read_text() if doc.exists() else HEADER
    if begin in text and end in text:
        before, rest = text.split(begin, 1)
        _, after = rest.split(end, 1)
        text = before + block + after
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(text)


def run_under_load(doc: str, run: Callable[[float], dict[str, float]]) -> dict[str, float]:
    """The CLI the under-load scenarios share: ``--steady-seconds`` of traffic around each
    step; prints and returns what ``run`` measured."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--steady-seconds", type=float, default=15.0)
    result = run(parser.parse_args().steady_seconds)
    print(result, flush=True)
    return result


def load_counts(results: list) -> dict[str, float]:
    """How many requests the load client finished, and how many of them failed."""
    return {"requests": float(len(results)), "failed": float(sum(not r.ok for r in results))}


def seconds_table(title: str, setup: str) -> list[str]:
    """Section title, the command that ran, the set-up, and a ``measure | seconds`` header."""
    return [
        f"## {title}", "", f"Command: `{command_line()}` on {os.cpu_count()} cores.", setup, "",
        "| measure | seconds |", "|---|---:|",
    ]
