"""`onnxfuse analyze`: arithmetic intensity and the roofline, per node, before and after fusion.

For every node: FLOPs and DRAM bytes (`onnxfuse.cost`), intensity = FLOPs / bytes, memory-
or compute-bound against the device's ridge point (peak FLOP/s / bandwidth), and the
roofline time estimate max(FLOPs / peak, bytes / bandwidth). Nodes below ``threshold``
FLOP/B are the fusion candidates. The model is also run through `optimize_model` (in
memory) to show what fusion would do: per fused group, the DRAM round trips and bytes it
removes. On an already optimized model the fused nodes are shown with what they saved.

Roofs: matmul-class nodes (MatMul, Gemm, Conv, ...) use the peak of ``dtype_peak`` (fp32,
tf32 or fp16 tensor cores); every other node uses the fp32 (CUDA-core) peak, since
elementwise kernels cannot use tensor cores. ``--peak-tflops`` sets both.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass, field, replace

from onnxfuse.cost import ModelCost, NodeCost, model_cost
from onnxfuse.errors import OnnxfuseError
from onnxfuse.load import load_model
from onnxfuse.outputs import Outputs
from onnxfuse.pattern import load_patterns
from onnxfuse.pipeline import optimize_model
from onnxfuse.plot import check_path, plot_analysis
from onnxfuse.roofline import DEVICES, DTYPE_PEAKS, Device, Roof, load_device, make_roof  # noqa: F401  (their home before)
from onnxfuse.text import abbreviate
from onnxfuse.tools.shapes import parse_shapes

DEFAULT_THRESHOLD = 10.0


def auto_dtype_peak(cost: ModelCost, tf32: bool = False) -> str:
    """fp16 when most matmul-class FLOPs produce fp16/bf16, else fp32 (tf32 where float32
    matmuls and convolutions run on TF32 tensor cores: ONNX Runtime's CUDA EP by default,
    `use_tf32` 1, and onnxfuse's FusedConv kernels by default)."""
    half = sum(n.flops or 0 for n in cost.known if n.matrix and n.dtype in ("float16", "bfloat16"))
    full = sum(n.flops or 0 for n in cost.known if n.matrix and n.dtype not in ("float16", "bfloat16"))
    return "fp16" if half > full else ("tf32" if tf32 else "fp32")


# ---------------------------------------------------------------------------------------
# The analysis
# ---------------------------------------------------------------------------------------

@dataclass
class Row:
    cost: NodeCost
    time: float | None  # roofline estimate, s
    bound: str | None
    share: float | None  # of the model's estimated time
    candidate: bool

    def to_dict(self) -> dict:
        d = self.cost.to_dict()
        d.update(time_s=self.time, bound=self.bound, share=self.share, candidate=self.candidate)
        return d


@dataclass
class Totals:
    nodes: int
    unknown: int
    flops: int
    bytes: int
    time: float
    memory_bound_time: float

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes if self.bytes else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["intensity"] = self.intensity
        return d


@dataclass
class FusionGroup:
    """One fused node and the subgraph it replaces."""

    node: str
    chain: str  # "Mul→Sigmoid→Mul"
    round_trips_before: int
    flops_before: int
    flops_after: int
    bytes_before: int
    bytes_after: int
    time_before: float
    time_after: float
    existing: bool  # already fused in the input model

    @property
    def saved_bytes(self) -> int:
        return self.bytes_before - self.bytes_after

    def to_dict(self) -> dict:
        d = asdict(self)
        d["saved_bytes"] = self.saved_bytes
        return d


@dataclass
class Analysis:
    model: str
    roof: Roof
    threshold: float
    dims: dict[str, int]
    input_shapes: dict[str, tuple[int, ...]]
    warnings: list[str]
    rows: list[Row]  # sorted from lowest intensity; unknown nodes last
    totals: Totals
    unfused_totals: Totals  # every fused node replaced by its function body
    optimized: ModelCost | None  # what optimize_model makes of the model
    optimized_rows: list[Row]
    optimized_totals: Totals | None
    groups: list[FusionGroup] = field(default_factory=list)
    unfused: list[NodeCost] = field(default_factory=list)  # the unfused equivalent (for the plot)

    def to_dict(self) -> dict:
        return {
            "model": self.model, "roof": self.roof.to_dict(), "threshold": self.threshold, "dims": self.dims,
            "input_shapes": {k: list(v) for k, v in self.input_shapes.items()}, "warnings": self.warnings,
            "nodes": [r.to_dict() for r in self.rows], "totals": self.totals.to_dict(),
            "unfused_totals": self.unfused_totals.to_dict(),
            "fusion": {
                "groups": [g.to_dict() for g in self.groups],
                "optimized_totals": self.optimized_totals.to_dict() if self.optimized_totals else None,
                "optimized_nodes": [r.to_dict() for r in self.optimized_rows],
            },
            "op_types": op_type_summary(self.rows, self.totals),
        }


def rows_for(nodes: list[NodeCost], roof: Roof, threshold: float) -> tuple[list[Row], Totals]:
    times = [roof.time(c) for c in nodes]
    total = sum(t for t in times if t is not None)
    rows = []
    for c, t in zip(nodes, times, strict=True):
        i = c.intensity
        rows.append(Row(c, t, roof.bound(c), (t / total) if t is not None and total > 0 else None,
                        i is not None and i < threshold and (c.bytes or 0) > 0))
    # lowest intensity first; nodes that cost nothing (views), then unknown ones, at the end
    rows.sort(key=lambda r: (r.cost.intensity is None, r.cost.ok and not r.cost.flops and not r.cost.bytes,
                             r.cost.intensity if r.cost.intensity is not None else 0, -(r.time or 0)))
    totals = Totals(
        nodes=len(nodes), unknown=sum(1 for c in nodes if not c.ok),
        flops=sum(c.flops or 0 for c in nodes if c.ok), bytes=sum(c.bytes or 0 for c in nodes if c.ok),
        time=total, memory_bound_time=sum(r.time or 0 for r in rows if r.bound == "memory"),
    )
    return rows, totals


def unfused_nodes(nodes: list[NodeCost]) -> list[NodeCost]:
    """Every fused node replaced by the nodes of its function body."""
    out: list[NodeCost] = []
    for c in nodes:
        if c.body is not None and c.domain == "onnxfuse":
            for b in c.body:
                out.append(replace(b, name=f"{c.name}/{b.name}"))
        else:
            out.append(c)
    return out


def fusion_groups(nodes: list[NodeCost], roof: Roof, existing: set[str]) -> list[FusionGroup]:
    groups = []
    for c in nodes:
        if c.body is None or c.domain != "onnxfuse" or not c.ok:
            continue
        body = [b for b in c.body if b.ok]
        groups.append(FusionGroup(
            node=c.name, chain=c.label, round_trips_before=sum(1 for b in body if (b.bytes or 0) > 0),
            flops_before=sum(b.flops or 0 for b in body), flops_after=c.flops or 0,
            bytes_before=sum(b.bytes or 0 for b in body), bytes_after=c.bytes or 0,
            time_before=sum(roof.time(b) or 0 for b in body), time_after=roof.time(c) or 0,
            existing=c.name in existing,
        ))
    return groups


def analyze(path: str, device: str | Device | None = "h200", peak_tflops: float | None = None,
            bandwidth_tbps: float | None = None, dtype_peak: str = "auto", threshold: float = DEFAULT_THRESHOLD,
            shapes: dict[str, tuple[int, ...]] | None = None, batch: int | None = None,
            pattern_dirs: list[str] | tuple = (), fuse: bool = True) -> Analysis:
    if not (threshold >= 0 and math.isfinite(threshold)):
        raise OnnxfuseError(f"--threshold {threshold}: must be a non-negative number")
    model = load_model(path)
    cost = model_cost(model, shapes, batch)
    roof = make_roof(device, peak_tflops, bandwidth_tbps, auto_dtype_peak(cost) if dtype_peak == "auto" else dtype_peak)
    rows, totals = rows_for(cost.nodes, roof, threshold)
    unfused = unfused_nodes(cost.nodes)
    _, unfused_totals = rows_for(unfused, roof, threshold)
    existing = {c.name for c in cost.nodes if c.domain == "onnxfuse"}
    optimized, opt_rows, opt_totals = None, [], None
    groups_src = cost.nodes
    if fuse:
        patterns = load_patterns(pattern_dirs)  # a bad pattern file is the user's error
        try:
            result = optimize_model(model, patterns)
        except Exception as e:  # noqa: BLE001 - the analysis stands without the fusion preview
            cost.warnings.append(f"optimize failed on this model ({type(e).__name__}: {e}); no fusion preview")
            result = None
        if result is not None and result.fused:
            optimized = model_cost(result.model, shapes, batch)
            opt_rows, opt_totals = rows_for(optimized.nodes, roof, threshold)
            groups_src = optimized.nodes
    groups = fusion_groups(groups_src, roof, existing)
    return Analysis(str(path), roof, threshold, cost.dims, cost.input_shapes, cost.warnings, rows, totals,
                    unfused_totals, optimized, opt_rows, opt_totals, groups, unfused)


def op_type_summary(rows: list[Row], totals: Totals) -> list[dict]:
    agg: dict[str, dict] = {}
    for r in rows:
        a = agg.setdefault(r.cost.op_type, {"op_type": r.cost.op_type, "nodes": 0, "flops": 0, "bytes": 0,
                                            "time_s": 0.0, "unknown": 0})
        a["nodes"] += 1
        if r.cost.ok:
            a["flops"] += r.cost.flops or 0
            a["bytes"] += r.cost.bytes or 0
            a["time_s"] += r.time or 0
        else:
            a["unknown"] += 1
    out = sorted(agg.values(), key=lambda a: -a["time_s"])
    for a in out:
        a["share"] = a["time_s"] / totals.time if totals.time else 0.0
        a["intensity"] = a["flops"] / a["bytes"] if a["bytes"] else None
    return out


# ---------------------------------------------------------------------------------------
# Text
# ---------------------------------------------------------------------------------------

def fmt_si(x: float | None, unit: str) -> str:
    if x is None:
        return "?"
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= factor:
            return f"{x / factor:.3g} {prefix}{unit}"
    return f"{x:.3g} {unit}"


def fmt_time(s: float | None) -> str:
    if s is None:
        return "?"
    for factor, unit in ((1.0, "s"), (1e-3, "ms"), (1e-6, "µs")):
        if abs(s) >= factor:
            return f"{s / factor:.3g} {unit}"
    return f"{s * 1e9:.3g} ns"


def fmt_intensity(i: float | None) -> str:
    if i is None:
        return "?"
    if math.isinf(i):
        return "inf"
    return f"{i:.3g}"


def _short(name: str, width: int) -> str:
    return name if len(name) <= width else name[: width - 1] + "…"


def format_table(rows: list[Row], top: int | None = None, width: int = 36) -> list[str]:
    shown = rows if not top else rows[:top]
    w = min(width, max([len(r.cost.name) for r in shown] + [4]))
    ow = min(22, max([len(r.cost.label if r.cost.body else r.cost.op_type) for r in shown] + [2]))
    lines = [f"  {'node':<{w}}  {'op':<{ow}}  {'FLOPs':>10}  {'bytes':>9}  {'FLOP/B':>7}  {'bound':<7}  "
             f"{'est. time':>9}  {'share':>6}"]
    for r in shown:
        c = r.cost
        mark = "*" if r.candidate else " "
        op = _short(c.label if c.body else c.op_type, ow)
        if c.ok:
            share = f"{100 * r.share:.1f}%" if r.share is not None else "?"
            lines.append(f"{mark} {_short(c.name, w):<{w}}  {op:<{ow}}  {fmt_si(c.flops, ''):>10}  "
                         f"{fmt_si(c.bytes, 'B'):>9}  {fmt_intensity(c.intensity):>7}  {r.bound or '?':<7}  "
                         f"{fmt_time(r.time):>9}  {share:>6}")
        else:
            lines.append(f"  {_short(c.name, w):<{w}}  {op:<{ow}}  {c.status}: {c.note}")
    if top and len(rows) > top:
        lines.append(f"  ... {len(rows) - top} more nodes (--top 0 shows all)")
    return lines


def format_totals(t: Totals, label: str = "total") -> str:
    mem = f", memory-bound nodes {100 * t.memory_bound_time / t.time:.0f}% of it" if t.time else ""
    unknown = f" ({t.unknown} unknown, not counted)" if t.unknown else ""
    return (f"{label}: {t.nodes} nodes{unknown}, {fmt_si(t.flops, 'FLOP')}, {fmt_si(t.bytes, 'B')}, "
            f"{fmt_intensity(t.intensity)} FLOP/B, est. {fmt_time(t.time)}{mem}")


def format_group(g: FusionGroup) -> str:
    ib = g.flops_before / g.bytes_before if g.bytes_before else 0.0
    ia = g.flops_after / g.bytes_after if g.bytes_after else 0.0
    verb = "saved" if g.existing else "saves"
    chain = abbreviate(g.chain.split("→"), "→")
    return (f"  {chain}: {g.round_trips_before} round trips → 1, {verb} {fmt_si(g.saved_bytes, 'B')} per inference "
            f"({fmt_intensity(ib)} → {fmt_intensity(ia)} FLOP/B, est. {fmt_time(g.time_before)} → "
            f"{fmt_time(g.time_after)})")


def format_analysis(a: Analysis, top: int | None = 50) -> str:
    r = a.roof
    lines = [f"model: {a.model}"]
    peaks = f"{r.matrix_peak / 1e12:.3g} TFLOP/s ({r.dtype_peak})"
    if r.vector_peak != r.matrix_peak:
        peaks = (f"{r.matrix_peak / 1e12:.3g} TFLOP/s ({r.dtype_peak}) for matmul-class nodes, "
                 f"{r.vector_peak / 1e12:.3g} TFLOP/s (fp32) for the rest")
    lines.append(f"device: {r.device} [{r.source}]: {r.bandwidth / 1e12:.3g} TB/s, {peaks}")
    ridge = f"ridge point {r.ridge(False):.3g} FLOP/B"
    if r.vector_peak != r.matrix_peak:
        ridge += f" ({r.ridge(True):.3g} for matmul-class nodes)"
    lines.append(f"{ridge}; fusion candidates (*): below {a.threshold:g} FLOP/B")
    if a.input_shapes:
        lines.append("inputs: " + ", ".join(f"{k}={'x'.join(map(str, v))}" for k, v in a.input_shapes.items()))
    lines += [f"warning: {w}" for w in a.warnings]
    lines.append("")
    lines += format_table(a.rows, top)
    lines.append("")
    lines.append(format_totals(a.totals))
    ops = op_type_summary(a.rows, a.totals)[:8]
    if ops:
        lines.append("by op type (est. time share): " + ", ".join(
            f"{o['op_type']} {100 * o['share']:.0f}%" for o in ops if o["time_s"] > 0))
    unknown = [row.cost for row in a.rows if not row.cost.ok]
    if unknown:
        lines.append(f"unknown ({len(unknown)}): " + ", ".join(f"{c.name} ({c.op_type})" for c in unknown[:10])
                     + (" ..." if len(unknown) > 10 else ""))
    lines.append("")
    existing = [g for g in a.groups if g.existing]
    new = [g for g in a.groups if not g.existing]
    if existing:
        lines.append(f"already fused ({len(existing)} node{'s' if len(existing) != 1 else ''}):")
        lines += [format_group(g) for g in existing]
        lines.append(format_totals(a.unfused_totals, "unfused equivalent"))
    if new:
        lines.append(f"what `onnxfuse optimize` fuses ({len(new)} group{'s' if len(new) != 1 else ''}):")
        lines += [format_group(g) for g in new]
    elif not existing:
        lines.append("`onnxfuse optimize` finds nothing to fuse in this model")
    elif a.optimized_totals is None:
        lines.append("`onnxfuse optimize` finds nothing more to fuse")
    if a.optimized_totals is not None:
        t, o = a.totals, a.optimized_totals
        saved = 1 - o.bytes / t.bytes if t.bytes else 0.0
        speed = t.time / o.time if o.time else 0.0
        lines.append(format_totals(o, "after optimize"))
        lines.append(f"  DRAM traffic -{100 * saved:.0f}%, roofline estimate {speed:.2f}x faster")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------
# The command (its arguments: onnxfuse.cli)
# ---------------------------------------------------------------------------------------

def cmd_analyze(args: argparse.Namespace) -> int:
    """The `onnxfuse analyze` command: write --json / --plot, print the tables."""
    if args.plot:
        check_path(args.plot)  # before the work
    with Outputs([args.json, args.plot], [args.model, device_file(args)]) as out:
        a = analyze(args.model, device_arg(args), args.peak_tflops, args.bandwidth_tbps, args.dtype_peak,
                    args.threshold, parse_shapes(args.shape), args.batch, args.patterns or (),
                    fuse=not args.no_fuse)
        if args.json:
            out.text(args.json, json.dumps(a.to_dict(), indent=2, default=_json_default) + "\n")
        if args.plot:
            plot_analysis(a, args.plot, outputs=out)
        out.commit()  # before printing: a reader that stops early (| head) loses no file
    print(format_analysis(a, top=args.top or None))
    for path in (args.json, args.plot):
        if path:
            print(f"wrote {path}")
    return 0


def device_arg(args: argparse.Namespace) -> str | None:
    """--profile-file, else --device (analyze and profile)."""
    return args.profile_file or args.device


def device_file(args: argparse.Namespace) -> str | None:
    """--device or --profile-file when it names a file (an input of the command)."""
    spec = device_arg(args)
    return spec if spec and spec.lower() not in DEVICES else None


def _json_default(x):
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    if isinstance(x, tuple):
        return list(x)
    raise TypeError(f"not JSON serializable: {type(x).__name__}")
