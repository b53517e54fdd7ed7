"""The dashboards as pictures: each panel's queries, run against a real Prometheus over a job's
time range, drawn to one PNG per dashboard (what a user would see in Grafana, without Grafana's
server, which cannot be installed here). The demo ends with these.

The queries are the dashboards' own (hlat_operator.dashboards), instantiated for one namespace
and job as Grafana would; the Neuron panels are left out (no Trainium here).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from hlat_operator import dashboards
from hlat_testbed.prometheus import Prometheus, instantiate

COLUMNS = 3


def _legend(template: str, labels: dict[str, str]) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m[1], ""), template)


def draw(prom: Prometheus, namespace: str, job: str, start: float, end: float,
         out_dir: Path) -> dict[Path, dict[str, int]]:
    """One PNG per dashboard; returns each file with the series count of each panel."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written: dict[Path, dict[str, int]] = {}
    for uid, (title, _, panels, _) in dashboards.DASHBOARDS.items():
        shown = [p for p in panels if not p.hardware]
        rows = (len(shown) + COLUMNS - 1) // COLUMNS
        fig, axes = plt.subplots(rows, COLUMNS, figsize=(5 * COLUMNS, 3 * rows), squeeze=False)
        counts: dict[str, int] = {}
        for ax, panel in zip(axes.flat, shown, strict=False):
            counts[panel.title] = _plot(ax, prom, panel, namespace, job, start, end)
        for ax in list(axes.flat)[len(shown):]:
            ax.axis("off")
        fig.suptitle(f"{title}: {namespace}/{job} (from Prometheus, seconds since the job "
                     "was created)")
        fig.tight_layout()
        path = out_dir / f"{uid}.png"
        fig.savefig(path, dpi=80)
        plt.close(fig)
        written[path] = counts
    return written


def _plot(ax: Any, prom: Prometheus, panel: dashboards.Panel, namespace: str, job: str,
          start: float, end: float) -> int:
    """The panel's series over time; an XY panel's (`panel.x`) against its x query's values
    at the same instants, as Grafana joins them on time."""
    series = 0
    xs_at: dict[float, float] = {}
    for expr, legend in panel.queries:
        if legend != panel.x:
            continue
        query = instantiate(expr, namespace, job, end - start)
        for result in prom.query_range(query, start, end):
            xs_at.update((float(t), float(v)) for t, v in result["values"] if v != "NaN")
    for expr, legend in panel.queries:
        if panel.x is not None and legend == panel.x:
            continue
        query = instantiate(expr, namespace, job, end - start)
        for result in prom.query_range(query, start, end):
            points = [(float(t) - start if panel.x is None else xs_at.get(float(t)), float(v))
                      for t, v in result["values"] if v != "NaN"]
            points = [(x, y) for x, y in points if x is not None]
            if not points:
                continue
            xs, ys = zip(*points, strict=True)
            ax.plot(xs, ys, label=_legend(legend, result["metric"]) or panel.title,
                    marker="o" if panel.x else None, markersize=3)
            series += 1
    if panel.x is not None:
        ax.set_xlabel(panel.x, fontsize=8)
    ax.set_title(f"{panel.title} ({panel.unit})", fontsize=10)
    if series and series <= 8:
        ax.legend(fontsize=6)
    if not series:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    return series
