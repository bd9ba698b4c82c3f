"""optimize(): the flat list of stages from an input model to a fused one, plus a report."""

from __future__ import annotations

import json
import os
import time
import warnings
from collections import Counter
from dataclasses import asdict, dataclass, field

import onnx
from onnx import ModelProto

from onnxfuse.errors import OnnxfuseError, OnnxfuseWarning
from onnxfuse.fold import fold_batchnorm
from onnxfuse.graph import GraphView
from onnxfuse.kernels import configure
from onnxfuse.load import canonicalize, infer_shapes, load_model, opset_problem
from onnxfuse.match import find_matches
from onnxfuse.ort_fusions import ort_fusions
from onnxfuse.outputs import Outputs
from onnxfuse.pattern import Pattern, load_patterns
from onnxfuse.rewrite import DOMAIN, FusedNode, rewrite
from onnxfuse.static import fold_shape_arithmetic, resolve_dims
from onnxfuse.text import abbreviate


@dataclass
class FusionRecord:
    node: str
    pattern: str
    kernel: str
    replaces: list[str]
    inputs: int
    outputs: int


@dataclass
class Report:
    """What optimize did; printed by the CLI and written as JSON with --json."""

    nodes_before: int = 0
    nodes_after: int = 0
    patterns_applied: dict[str, int] = field(default_factory=dict)
    fused: list[FusionRecord] = field(default_factory=list)
    not_fused: dict[str, int] = field(default_factory=dict)  # reason -> nodes
    folded_batchnorm: int = 0  # BatchNormalization nodes folded into the Conv before them
    # static input shapes given (--shape): the inputs' dims and the shape arithmetic folded
    # into constants (onnxfuse.static), in one line
    static_shapes: str | None = None
    compile: dict | None = None
    seconds: float = 0.0
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        lines = [f"nodes: {self.nodes_before} -> {self.nodes_after}"]
        if self.static_shapes:
            lines.append(self.static_shapes)
        if self.folded_batchnorm:
            lines.append(f"folded_batchnorm: {self.folded_batchnorm} BatchNormalization into Conv weights")
        if self.patterns_applied:
            for name, count in sorted(self.patterns_applied.items()):
                lines.append(f"{name}: {count} fused")
        else:
            lines.append("nothing fused")
        for rec in self.fused[:20]:
            lines.append(f"  {rec.node}: {abbreviate([op.split(' ')[0] for op in rec.replaces], ' -> ')}")
        if len(self.fused) > 20:
            lines.append(f"  ... and {len(self.fused) - 20} more")
        if self.not_fused:
            lines.append("not fused:")
            for reason, n in sorted(self.not_fused.items(), key=lambda kv: (-kv[1], kv[0])):
                lines.append(f"  {n} node{'s' if n != 1 else ''}: {reason}")
        if self.compile is not None:
            c = self.compile
            lines.append(c["summary"] if "summary" in c else f"compile: {c}")
        lines += [f"warning: {w}" for w in self.warnings]
        lines.append(f"time: {self.seconds:.2f} s")
        return "\n".join(lines)


@dataclass
class Result:
    model: ModelProto
    report: Report
    fused: list[FusedNode]
    # Shapes and element types inferred while optimizing (tensor -> (dims or None, elem_type);
    # a dim is an int, a dim_param or None): the NHWC pass reads them (onnxfuse.layout), as the
    # written model keeps only the value_info it came with.
    tensors: dict[str, tuple] = field(default_factory=dict)
    # The input model as given (not a copy: never changed): tuning times it, and writes it
    # unchanged when the optimized model is slower (onnxfuse.tune).
    original: ModelProto | None = None

    def warn(self, message: str) -> None:
        """Record a warning in the report and issue it as an OnnxfuseWarning."""
        self.report.warnings.append(message)
        warnings.warn(message, OnnxfuseWarning, stacklevel=3)

    def drop_fused(self, names: set[str], reason: str) -> None:
        """Forget fused nodes that were turned back into their original nodes
        (`onnxfuse.rewrite.unfuse`): they count as not fused, for `reason`."""
        dropped = [f for f in self.fused if f.node_name in names]
        self.fused[:] = [f for f in self.fused if f.node_name not in names]
        r = self.report
        r.fused = [rec for rec in r.fused if rec.node not in names]
        r.patterns_applied = dict(Counter(f.pattern for f in self.fused))
        r.nodes_after = len(self.model.graph.node)
        if dropped:
            r.not_fused[reason] = r.not_fused.get(reason, 0) + sum(len(f.source_nodes) for f in dropped)


# Patterns for the GPU kernels' path only (`layout="nhwc"`, what `optimize` uses when it
# compiles kernels): a conv alone gains nothing from fusion, only from staying channels-last
# between fused convs; a max pool alone runs faster as the Triton kernel than as ONNX
# Runtime's CUDA MaxPool, but slower in the library's CPU kernel than in ORT's CPU MaxPool
# (0.56-0.65x on 4x64x112x112, 2-core CPU, BENCHMARKS.md).
# Grouped and depthwise convs likewise (conv_grouped): the Triton direct loop beat cuDNN on
# every MobileNetV3 depthwise layer, the library's CPU kernel took 3-20x ORT's CPU time
# (2-core CPU, 8x72x56² depthwise 3x3: 1.70 vs 0.55 ms; README).
NHWC_ONLY_PATTERNS = frozenset({"conv_alone", "maxpool", "conv_grouped"})


def for_layout(patterns: list[Pattern], layout: str) -> list[Pattern]:
    """`patterns` without NHWC_ONLY_PATTERNS unless layout is "nhwc"."""
    return patterns if layout == "nhwc" else [p for p in patterns if p.name not in NHWC_ONLY_PATTERNS]


def optimize_model(model: ModelProto, patterns: list[Pattern] | None = None, layout: str = "nchw",
                   static_shapes: dict[str, tuple[int, ...]] | None = None, leave_to_ort: bool = True) -> Result:
    """Fuse a model in memory. The input model is not modified. `patterns` defaults to the
    built-in ones, for `layout` (see NHWC_ONLY_PATTERNS; the NHWC pass itself runs with
    the kernels, `onnxfuse.kernels.compile_hook`). `static_shapes` (input name -> dims, every
    input): the written model takes those shapes only, and the shape arithmetic they decide
    is folded into constants first (`onnxfuse.static`), so that ONNX Runtime can run every
    node on the GPU and capture CUDA graphs. `leave_to_ort`: pointwise chains take no node
    that ONNX Runtime's own fusions (BiasGelu, LayerNormalization, ...) would take
    (`onnxfuse.ort_fusions`); False fuses them anyway.

    A model whose default-domain opset is newer than this onnxfuse knows (or older than
    `onnxfuse.load.MIN_OPSET`) comes back unchanged (a copy), with a warning: an op may
    mean something else in that opset (`onnxfuse.load.opset_problem`)."""
    t0 = time.perf_counter()
    patterns = for_layout(load_patterns(), layout) if patterns is None else patterns
    too_new = opset_problem(model)
    if too_new is not None:
        same = ModelProto()
        same.CopyFrom(model)
        n = len(model.graph.node)
        result = Result(same, Report(nodes_before=n, nodes_after=n, not_fused={too_new: n}), [])
        result.warn(f"{too_new}: the model is left unchanged")
        result.report.seconds = time.perf_counter() - t0
        return result
    static = None
    if static_shapes:
        model_in, static = fold_shape_arithmetic(model, static_shapes)  # Shape -> ... -> Reshape: constants
    else:
        model_in = model
    canonical = canonicalize(model_in)                    # exporters' habits undone
    canonical, folded = fold_batchnorm(canonical)         # Conv -> BatchNormalization: one Conv
    inferred = infer_shapes(canonical)                    # types and shapes for matching
    view = GraphView.build(canonical, inferred)           # producers, consumers, constants
    by_ort = ort_fusions(canonical) if leave_to_ort else None  # nodes ORT's own fusions take
    found = find_matches(view, patterns, by_ort.absorbed if by_ort else None)  # groups each pattern fuses
    fused_model, fused = rewrite(canonical, view, found.matches)  # custom nodes + functions
    report = Report(
        nodes_before=len(model.graph.node),
        nodes_after=len(fused_model.graph.node),
        patterns_applied=dict(Counter(f.pattern for f in fused)),
        fused=[FusionRecord(f.node_name, f.pattern, f.kernel_name, list(f.source_nodes),
                            len(f.inputs), len(f.outputs)) for f in fused],
        not_fused=dict(found.rejected),
        folded_batchnorm=folded,
        static_shapes=static.summary() if static is not None else None,
    )
    for reason, count in _not_visited(canonical, patterns).items():
        report.not_fused[reason] = report.not_fused.get(reason, 0) + count
    report.seconds = time.perf_counter() - t0
    tensors = {name: (shape, view.types.get(name, 0)) for name, shape in view.shapes.items()}
    result = Result(fused_model, report, fused, tensors, original=model)
    if by_ort is not None and by_ort.missing_ort:
        result.warn(f"{by_ort.problem}: nodes its own fusions would take may have been fused")
    return result


SUBGRAPH_REASON = "inside an If/Loop/Scan body (subgraphs are not optimized)"
FUNCTION_REASON = "inside a model-local function (functions are not optimized)"


def _not_visited(model: ModelProto, patterns: list[Pattern]) -> Counter:
    """Nodes of fusible op types that the matcher does not look at: in subgraphs (If, Loop,
    Scan bodies) and in the model's own functions (not onnxfuse's)."""
    ops = {op for p in patterns for op in p.match.fused_ops}
    counts: Counter = Counter()

    def fusible(n: onnx.NodeProto) -> bool:
        return n.domain in ("", "ai.onnx") and n.op_type in ops

    def walk(nodes, reason: str, nested: bool) -> None:
        for n in nodes:
            if nested and fusible(n):
                counts[reason] += 1
            for a in n.attribute:
                for sg in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
                    walk(sg.node, reason, True)

    walk(model.graph.node, SUBGRAPH_REASON, False)
    for f in model.functions:
        if f.domain != DOMAIN:
            walk(f.node, FUNCTION_REASON, True)
    return counts


def optimize(input_path: str | os.PathLike, output_path: str | os.PathLike,
             pattern_dirs: list[str] | tuple = (), compile_hook=None, exclude: list[str] | tuple = (),
             layout: str | None = None, json_path: str | os.PathLike | None = None,
             shapes: dict[str, tuple[int, ...]] | None = None, batch: int | None = None, *,
             target: str = "auto", conv_precision: str = "tf32", tune: str = "auto",
             tune_budget: float | None = None, jobs: int | None = None, leave_to_ort: bool = True) -> Report:
    """Read, fuse and atomically write a model file, and with `json_path` the report as JSON:
    both or neither (`Outputs`; no output may be the input).

    With the defaults it does what `onnxfuse optimize IN OUT` does: kernels compiled for the
    local GPU (else the default targets; `target="none"` for none), channels-last when they
    are, tuned when this machine has an NVIDIA GPU (`onnxfuse.kernels.configure`: target,
    layout "auto", conv_precision, tune "auto" / "off" / "configs", tune_budget, jobs).
    compile_hook(result), when given, replaces that step (it may attach kernels and run the
    NHWC pass); `layout` then defaults to the layout the hook was made with, and another is
    an error: the patterns and the pass must agree.
    `shapes` / `batch` (as `--shape` / `--batch`): when they give every symbolic dim, the
    written model takes those input shapes only and its shape arithmetic is folded
    (`optimize_model`'s static_shapes); otherwise the report says which dim was left open.
    `leave_to_ort` as `optimize_model`'s (`--no-leave-to-ort` turns it off)."""
    if compile_hook is None:
        compile_hook, layout = configure(target, layout or "auto", conv_precision, tune, shapes, batch,
                                         tune_budget, jobs)
    hook_layout = getattr(compile_hook, "layout", None)
    if layout is None:
        layout = hook_layout or "nchw"
    elif hook_layout is not None and hook_layout != layout:
        raise OnnxfuseError(f"layout {layout!r} differs from the compile hook's {hook_layout!r}: "
                            "make the hook with compile_hook(..., layout=...) for the same layout")
    t0 = time.perf_counter()
    with Outputs([output_path, json_path], [input_path]) as out:
        patterns = for_layout(select_patterns(load_patterns(pattern_dirs), exclude), layout)
        model = load_model(input_path)
        static, why = (None, None)
        if shapes or batch is not None:
            static, why = resolve_dims(model, dict(shapes or {}), batch)
        result = optimize_model(model, patterns, static_shapes=static, leave_to_ort=leave_to_ort)
        if why:
            result.report.static_shapes = why
        if compile_hook is not None:
            result.report.compile = compile_hook(result)
        out.model(output_path, result.model)
        result.report.seconds = time.perf_counter() - t0
        if json_path is not None:
            out.text(json_path, json.dumps(result.report.to_dict(), indent=2) + "\n")
        out.commit()
    return result.report


def select_patterns(patterns: list[Pattern], exclude: list[str] | tuple) -> list[Pattern]:
    """The patterns without those named in `exclude` (an unknown name is an error)."""
    known = {p.name for p in patterns}
    for name in exclude:
        if name not in known:
            raise OnnxfuseError(f"--exclude-pattern {name}: no such pattern (known: {', '.join(sorted(known))})")
    return [p for p in patterns if p.name not in set(exclude)]
