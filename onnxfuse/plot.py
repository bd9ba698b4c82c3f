"""Roofline plots (matplotlib, no display needed): `onnxfuse analyze --plot` and `onnxfuse profile --plot`.

Log-log axes: arithmetic intensity (FLOP/byte) against performance (FLOP/s). The device's
bandwidth slope and compute roof(s), the ridge point, the fusion threshold, one marker per
node sized by its share of the time, and for `analyze` the nodes before optimization (grey)
and after (coloured), with an arrow from each fused group's unfused intensity to its fused
node. Nodes without FLOPs (pure data movement) cannot sit on a log axis; their count is
noted on the figure. The format follows the file name: .png, .svg (or .pdf).
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass, field
from pathlib import Path

from onnxfuse.errors import OnnxfuseError
from onnxfuse.outputs import write_bytes

FORMATS = (".png", ".svg", ".pdf")


@dataclass
class Series:
    label: str
    x: list[float] = field(default_factory=list)  # FLOP/B
    y: list[float] = field(default_factory=list)  # FLOP/s
    size: list[float] = field(default_factory=list)  # share of time, 0..1
    names: list[str] = field(default_factory=list)
    color: str | list[str] = "tab:blue"
    hollow: bool = False


@dataclass
class Arrow:
    x0: float
    y0: float
    x1: float
    y1: float
    label: str = ""


def _figure():
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise OnnxfuseError("plots need matplotlib: pip install 'onnxfuse[plot]'") from None
    return Figure(figsize=(9, 6), dpi=110, layout="constrained")


def check_path(path: str | Path) -> Path:
    """The plot path, after checking its format and that matplotlib is installed."""
    p = Path(path)
    if p.suffix.lower() not in FORMATS:
        raise OnnxfuseError(f"{p}: plot file must end in {', '.join(FORMATS)}")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise OnnxfuseError("plots need matplotlib: pip install 'onnxfuse[plot]'") from None
    return p


def roofline_plot(path: str | Path, roof, series: list[Series], arrows: list[Arrow] = (), title: str = "",
                  threshold: float | None = None, notes: list[str] = (), ylabel: str = "attainable",
                  outputs=None) -> Path:
    """Draw and save one roofline figure. roof: an onnxfuse.analyze.Roof. Written atomically
    (`onnxfuse.outputs.write_bytes`), or staged in `outputs` (an `onnxfuse.outputs.Outputs`)."""
    p = check_path(path)
    fig = _figure()
    ax = fig.add_subplot()
    ax.set_xscale("log")
    ax.set_yscale("log")
    xs = [x for s in series for x in s.x] + [a.x0 for a in arrows] + [a.x1 for a in arrows]
    ys = [y for s in series for y in s.y] + [a.y0 for a in arrows] + [a.y1 for a in arrows]
    ridge_v, ridge_m = roof.ridge(False), roof.ridge(True)
    lo = min(xs + [ridge_v / 100]) / 3
    hi = max(xs + [ridge_m * 20]) * 3
    peak_top = max(roof.matrix_peak, roof.vector_peak)
    ylo = min(ys + [roof.bandwidth * lo]) / 3
    # the roofs
    n = 200
    grid = [lo * (hi / lo) ** (k / (n - 1)) for k in range(n)]
    ax.plot(grid, [min(roof.vector_peak, roof.bandwidth * x) for x in grid], color="black", lw=2,
            label=f"roof: {roof.bandwidth / 1e12:.3g} TB/s, {roof.vector_peak / 1e12:.3g} TFLOP/s")
    if roof.matrix_peak != roof.vector_peak:
        ax.plot(grid, [min(roof.matrix_peak, roof.bandwidth * x) for x in grid], color="black", lw=1.2, ls="--",
                label=f"matmul roof ({roof.dtype_peak}): {roof.matrix_peak / 1e12:.3g} TFLOP/s")
        ax.plot([ridge_m], [roof.matrix_peak], marker="D", color="black", ms=5)
    ax.plot([ridge_v], [roof.vector_peak], marker="D", color="black", ms=7, zorder=5)
    ax.annotate(f"ridge {ridge_v:.3g} FLOP/B", (ridge_v, roof.vector_peak), textcoords="offset points",
                xytext=(-10, 8), ha="right", fontsize=9)
    if threshold:
        ax.axvline(threshold, color="tab:orange", ls=":", lw=1.5, label=f"fusion threshold {threshold:g} FLOP/B")
    # the nodes
    for s in series:
        if not s.x:
            continue
        sizes = [18 + 1500 * max(v, 0.0) for v in s.size]
        if s.hollow:
            ax.scatter(s.x, s.y, s=sizes, facecolors="none", edgecolors="grey", linewidths=1.0, alpha=0.8,
                       label=s.label, zorder=3)
        else:
            ax.scatter(s.x, s.y, s=sizes, c=s.color, alpha=0.75, edgecolors="black", linewidths=0.5,
                       label=s.label, zorder=4)
    for a in arrows:
        ax.annotate("", xy=(a.x1, a.y1), xytext=(a.x0, a.y0),
                    arrowprops={"arrowstyle": "->", "color": "tab:red", "lw": 1.3}, zorder=6)
    # labels for the biggest markers of the coloured series, staggered so neighbours stay readable
    labelled = [(s.x[i], s.y[i], s.size[i], s.names[i]) for s in series if not s.hollow for i in range(len(s.x))]
    spots: dict[tuple[float, float], list[str]] = {}
    for x, y, _, name in sorted(labelled, key=lambda t: -t[2])[:6]:
        names = spots.setdefault((round(math.log10(x), 2), round(math.log10(y), 2)), [])
        if name not in names:
            names.append(name)
    for k, ((lx, ly), names) in enumerate(sorted(spots.items())):
        ax.annotate(", ".join(names), (10**lx, 10**ly), textcoords="offset points",
                    xytext=(8, 8 if k % 2 == 0 else -14), fontsize=7, color="dimgray")
    ax.set_xlim(lo, hi)
    ax.set_ylim(ylo, peak_top * 3)
    ax.set_xlabel("arithmetic intensity (FLOP/byte)")
    ax.set_ylabel(f"{ylabel} performance (FLOP/s)")
    ax.set_title(title, fontsize=11)
    ax.grid(True, which="major", alpha=0.3)
    ax.grid(True, which="minor", alpha=0.1)
    if notes:
        ax.text(0.01, 0.99, "\n".join(notes), transform=ax.transAxes, va="top", ha="left", fontsize=8,
                color="dimgray")
    ax.legend(loc="lower right", fontsize=8, markerscale=0.6)
    buf = io.BytesIO()
    fig.savefig(buf, format=p.suffix.lower().lstrip("."))
    if outputs is not None:
        outputs.data(p, buf.getvalue())
    else:
        write_bytes(p, buf.getvalue())
    return p


def _color(c) -> str:
    if c.domain == "onnxfuse":
        return "tab:red"
    return "tab:blue" if c.matrix else "tab:green"


def _points(nodes, roof, total_time: float, label: str, hollow: bool = False) -> tuple[Series, int]:
    s = Series(label, hollow=hollow, color=[])
    skipped = 0
    for c in nodes:
        t = roof.time(c)
        i = c.intensity
        if t is None or i is None or not c.flops or math.isinf(i) or t <= 0:
            skipped += c.ok
            continue
        s.x.append(i)
        s.y.append(c.flops / t)
        s.size.append(t / total_time if total_time else 0.0)
        s.names.append(c.label if c.body else c.name)
        s.color.append(_color(c))
    return s, skipped


def plot_analysis(a, path: str | Path, outputs=None) -> Path:
    """The roofline of an onnxfuse.analyze.Analysis: before (unfused) and after optimization
    (`outputs`: as for `roofline_plot`)."""
    roof = a.roof
    before_nodes = a.unfused
    if a.optimized is not None:
        after_nodes = a.optimized.nodes
    elif any(g.existing for g in a.groups):
        after_nodes = [r.cost for r in a.rows]
    else:
        after_nodes = None
    total = a.unfused_totals.time
    series, notes = [], []
    if after_nodes is None:
        skipped = 0
        prefix = ""
        coloured = before_nodes
    else:
        s0, skipped = _points(before_nodes, roof, total, "before optimize", hollow=True)
        series.append(s0)
        prefix = "after optimize: "
        coloured = after_nodes
    kinds = (("fused nodes", lambda c: c.domain == "onnxfuse"),
             ("matmul-class nodes", lambda c: c.domain != "onnxfuse" and c.matrix),
             ("other nodes", lambda c: c.domain != "onnxfuse" and not c.matrix))
    for label, keep in kinds:
        s, k = _points([c for c in coloured if keep(c)], roof, total, prefix + label)
        if after_nodes is None:
            skipped += k
        if s.x:
            series.append(s)
    arrows = []
    for g in a.groups:
        if g.flops_before and g.bytes_before and g.time_before and g.flops_after and g.bytes_after and g.time_after:
            arrows.append(Arrow(g.flops_before / g.bytes_before, g.flops_before / g.time_before,
                                g.flops_after / g.bytes_after, g.flops_after / g.time_after, g.chain))
    if skipped:
        notes.append(f"{skipped} node(s) without FLOPs (data movement) not shown")
    if arrows:
        notes.append(f"arrows: {len(arrows)} fused group(s), unfused intensity → fused")
    unknown = a.totals.unknown
    if unknown:
        notes.append(f"{unknown} node(s) of unknown cost not shown")
    notes.append("marker area: share of the estimated time")
    title = f"{Path(a.model).name} on {roof.device}"
    return roofline_plot(path, roof, series, arrows, title, a.threshold, notes, outputs=outputs)
