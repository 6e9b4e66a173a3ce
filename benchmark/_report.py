"""Write one benchmark's section of docs/benchmarks.md (between its own markers), and the CLI
and table layout the under-load scenarios share."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"
HEADER = (
    "# Benchmarks\n\nEach section is written by the script named in it, with the exact command.\n"
)

Row = tuple[str, str, str]  # label, figure key, format spec of the value


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


def section_head(title: str, setup: str) -> list[str]:
    """Section title, the command that ran (the core count matters: load and cluster share
    them), the set-up, a blank line."""
    return [
        f"## {title}", "", f"Command: `{command_line()}` on {os.cpu_count()} cores.", setup, "",
    ]


def requests_text(figures: Mapping[str, float], run: str = "") -> str:
    """``N requests, M failed`` of the load (of run ``run`` when figures are keyed per run)."""
    prefix = f"{run}:" if run else ""
    return f"{int(figures[prefix + 'requests'])} requests, {int(figures[prefix + 'failed'])} failed"


def write_table(
    name: str,
    title: str,
    setup: str,
    figures: Mapping[str, float],
    rows: Sequence[Row],
    note: str,
    runs: Sequence[str] = (),
) -> None:
    """Write section ``name``: its head, a ``measure | seconds`` table of ``rows``, then
    ``note``. With ``runs``, one column per run instead, its figures keyed ``run:key``; a
    figure a run does not have shows as ``-``."""
    columns = list(runs) or ["seconds"]
    lines = [
        *section_head(title, setup),
        f"| measure | {' | '.join(columns)} |",
        "|---|" + "---:|" * len(columns),
    ]
    for label, key, fmt in rows:
        keys = [f"{run}:{key}" for run in runs] or [key]
        cells = [format(figures[k], fmt) if k in figures else "-" for k in keys]
        lines.append(f"| {label} | {' | '.join(cells)} |")
    lines += ["", note]
    write_section(name, "\n".join(lines))
