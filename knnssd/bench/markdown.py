"""Markdown tables: the one writer of the benchmarks' reports (``knnssd bench``'s, bench-throughput's, the GPU
check's) and of the tables the scripts in ``benchmarks/`` print, row by row as they measure."""
from __future__ import annotations

from collections.abc import Iterable, Sequence


def row(cells: Iterable[object]) -> str:
    """One row; an empty cell is written ``| |``."""
    return "|" + "".join(f" {c} |" if c != "" else " |" for c in cells)


def rule(align: str) -> str:
    """The line under a header: a column per letter of ``align``, ``l`` left (``---``), ``r`` right (``---:``)."""
    return "|" + "".join({"l": "---|", "r": "---:|"}[a] for a in align)


def head(columns: Sequence[str], align: str | None = None) -> list[str]:
    """The header and its rule (every column left-aligned where ``align`` is not given)."""
    return [row(columns), rule(align or "l" * len(columns))]


def table(columns: Sequence[str], rows: Iterable[Iterable[object]], align: str | None = None) -> list[str]:
    """A whole table's lines: ``head``, then a ``row`` each."""
    return [*head(columns, align), *(row(r) for r in rows)]
