"""Scores over several sampling seeds, summed up as a spread, and the table that shows them.

Owns how the per-run summaries of evaluate.py become one line per measure: the mean over the
runs with its smallest and largest value and standard deviation, and the plain-text table
with one column per setting (greedy, the shipped defaults...). It knows nothing about models
or prompts: it takes the summaries (dicts of measure -> rate) and returns dicts and text.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

# Summary keys that are not rates over the runs' prompts.
NOT_MEASURES = ("items", "seconds", "failures")


@dataclass(frozen=True)
class Setting:
    """Sampling settings a model is scored at: temperature 0 is greedy (one run is enough)."""

    temperature: float
    top_k: int | None  # None: no top-k

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def label(self) -> str:
        if self.greedy:
            return "greedy"
        top_k = "off" if self.top_k is None else str(self.top_k)
        return f"temperature {self.temperature:g}, top-k {top_k}"


def spread(runs: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Each measure of the runs as {mean, min, max, std} (std 0 for one run)."""
    measures = [key for key in runs[0] if key not in NOT_MEASURES]
    out = {}
    for key in measures:
        values = [float(run[key]) for run in runs if key in run]
        out[key] = {
            "mean": round(statistics.fmean(values), 4),
            "min": round(min(values), 4),
            "max": round(max(values), 4),
            "std": round(statistics.pstdev(values), 4) if len(values) > 1 else 0.0,
        }
    return out


def format_cell(stats: dict[str, float], runs: int) -> str:
    """ "97.2% (96-98.5, sd 0.8)" for several runs, "99.0%" for one."""
    if runs == 1:
        return f"{100 * stats['mean']:.1f}%"
    low, high = _percent(stats["min"]), _percent(stats["max"])
    return f"{100 * stats['mean']:.1f}% ({low}-{high}, sd {100 * stats['std']:.1f})"


def _percent(rate: float) -> str:
    """A rate as a percentage with at most one decimal and none when whole: 96, 99.8."""
    return f"{100 * rate:.1f}".removesuffix(".0")


def format_table(results: list[dict[str, Any]]) -> str:
    """One row per measure, one column per setting's result (as evaluate_settings gives)."""
    measures: list[str] = []
    for result in results:
        measures += [m for m in result["spread"] if m not in measures]
    headers = ["measure"] + [
        f"{r['label']}" + (f", {len(r['runs'])} seeds" if len(r["runs"]) > 1 else "")
        for r in results
    ]
    rows = [headers]
    for measure in measures:
        row = [measure]
        for result in results:
            stats = result["spread"].get(measure)
            row.append(format_cell(stats, len(result["runs"])) if stats else "")
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(headers))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(line.rstrip() for line in lines)
