"""Result tables of the demo: mean ± std cells, written as Markdown and CSV."""

from __future__ import annotations

import csv
import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

MISSING = "—"


@dataclass(frozen=True)
class Stat:
    """A number measured once per seed: printed as mean ± std (sample std, ddof=1) over the seeds."""

    values: tuple[float, ...]
    digits: int = 3

    @property
    def mean(self) -> float:
        return statistics.fmean(self.values)

    @property
    def std(self) -> float:
        return statistics.stdev(self.values) if len(self.values) > 1 else 0.0

    def __str__(self) -> str:
        if any(math.isnan(v) for v in self.values):
            return MISSING
        if len(self.values) == 1:
            return f"{self.mean:.{self.digits}f}"
        return f"{self.mean:.{self.digits}f} ± {self.std:.{self.digits}f}"


Cell = str | int | float | Stat


def text(cell: Cell) -> str:
    if isinstance(cell, int):
        return f"{cell:,}"
    if isinstance(cell, float):
        return MISSING if math.isnan(cell) else f"{cell:.3f}"
    return str(cell)


@dataclass(frozen=True)
class Table:
    """Rows of cells under ``columns``; ``Stat`` cells become two CSV columns (mean, std)."""

    title: str
    columns: tuple[str, ...]
    rows: tuple[tuple[Cell, ...], ...]
    note: str = ""

    def markdown(self) -> str:
        lines = [
            "| " + " | ".join(self.columns) + " |",
            "|" + "|".join("---" if i == 0 else "---:" for i in range(len(self.columns))) + "|",
        ]
        lines += ["| " + " | ".join(text(cell) for cell in row) + " |" for row in self.rows]
        return "\n".join([f"**{self.title}**", "", *lines, *(["", self.note] if self.note else [])])

    def csv_rows(self) -> list[list[str]]:
        stat_columns = [any(isinstance(row[i], Stat) for row in self.rows) for i in range(len(self.columns))]
        header: list[str] = []
        for column, is_stat in zip(self.columns, stat_columns, strict=True):
            header += [f"{column} mean", f"{column} std"] if is_stat else [column]
        body = []
        for row in self.rows:
            cells: list[str] = []
            for cell, is_stat in zip(row, stat_columns, strict=True):
                if isinstance(cell, Stat) and str(cell) != MISSING:
                    cells += [repr(cell.mean), repr(cell.std)]
                else:
                    cells += ["", ""] if is_stat else [str(cell)]
            body.append(cells)
        return [header, *body]

    def write(self, stem: Path) -> None:
        """Write ``stem``.md and ``stem``.csv."""
        stem.with_suffix(".md").write_text(self.markdown() + "\n")
        with stem.with_suffix(".csv").open("w", newline="") as handle:
            csv.writer(handle).writerows(self.csv_rows())


def seed_stat(values: Iterable[float], digits: int = 3) -> Stat:
    return Stat(tuple(float(v) for v in values), digits)
