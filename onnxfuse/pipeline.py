"""optimize(): PASSES, the flat list of passes from an input model to a fused one, and a
report built from the final graph. Each pass is a function (Result, Options) -> Result; the
Options come from `build_options`, for the command line and the Python API alike."""

from __future__ import annotations

import dataclasses
import json
import os
import time
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import onnx
from onnx import ModelProto

from onnxfuse import compile as aot
from onnxfuse import kernels
from onnxfuse import tune as tuning
from onnxfuse.align import pad_columns
from onnxfuse.errors import OnnxfuseError, OnnxfuseWarning
from onnxfuse.fold import fold_batchnorm
from onnxfuse.graph import GraphView
from onnxfuse.groups import Accepted
from onnxfuse.headbias import NOTE as HEAD_BIAS_NOTE
from onnxfuse.headbias import sink_head_biases, split_head_biases
from onnxfuse.heads import lift_merged_heads
from onnxfuse.ir import unproduced_reads
from onnxfuse.kernels import FAILED_REASON, compile_fused, failure_warning
from onnxfuse.kinds import KINDS
from onnxfuse.kinds.attention import find_attention
from onnxfuse.kinds.base import Match
from onnxfuse.kmajor import NOTE as KMAJOR_NOTE
from onnxfuse.kmajor import kmajor_weights
from onnxfuse.load import canonicalize, infer_shapes, load_model, opset_problem, remove_passthrough
from onnxfuse.match import MatchResult, find_matches
from onnxfuse.ort_fusions import OrtFusions, ort_fusions
from onnxfuse.ort_fusions import reason as ort_reason
from onnxfuse.outputs import Outputs
from onnxfuse.pack import bias_after_product, pack_qkv, unpack_interleaved
from onnxfuse.pattern import Pattern, load_patterns
from onnxfuse.rewrite import DOMAIN, FusedNode, rewrite
from onnxfuse.static import fold_known_dims, fold_shape_arithmetic, resolve_dims
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
    notes: dict[str, int] = field(default_factory=dict)  # what else a fusion decided -> nodes (kinds/rows.py)
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
        if self.notes:
            lines.append("notes:")
            lines += [f"  {n} node{'s' if n != 1 else ''}: {note}" for note, n in sorted(self.notes.items())]
        if self.compile is not None:
            c = self.compile
            lines.append(c["summary"] if "summary" in c else f"compile: {c}")
        lines += [f"warning: {w}" for w in self.warnings]
        lines.append(f"time: {self.seconds:.2f} s")
        return "\n".join(lines)


@dataclass(frozen=True)
class Options:
    """Everything the passes are told, built by `build_options` for the command line and
    the Python API alike (one function, one set of defaults).

    target: "auto" (the local GPU, else the default set), "none" (no kernels) or a list like
    "sm_90,sm_80"; layout: "nchw" or "nhwc" ("auto" is resolved when the options are built);
    conv_precision: how fused float32 convs multiply; tune: how the tune pass measures, or
    None for no tuning; jobs: parallel kernel compilations; shapes / batch: the input shapes
    the model will run at (`--shape` / `--batch`): the canonicalize pass makes the model
    static when they give every symbolic dim; pattern_dirs / exclude: the pattern set
    (`--patterns` / `--exclude-pattern`); patterns: an explicit pattern set, matched as
    given (Python API: `optimize_model(model, patterns)`), instead of that set for the layout;
    leave_to_ort: pointwise chains take no node that ONNX Runtime's own fusions would take
    (BiasGelu, LayerNormalization, ...; `onnxfuse.ort_fusions`); False fuses them anyway
    (`--no-leave-to-ort`)."""

    target: str
    layout: str
    conv_precision: str
    tune: tuning.TuneSettings | None
    jobs: int | None
    shapes: dict[str, tuple[int, ...]]
    batch: int | None
    pattern_dirs: tuple[str, ...]
    exclude: tuple[str, ...]
    patterns: tuple[Pattern, ...] | None = None
    leave_to_ort: bool = True


TUNE_MODES = ("auto", "off", "configs")


def build_options(target: str = "auto", layout: str = "auto", conv_precision: str = "tf32", tune: str = "auto",
                  shapes: dict[str, tuple[int, ...]] | None = None, batch: int | None = None,
                  tune_budget: float | None = None, jobs: int | None = None,
                  pattern_dirs: list[str | os.PathLike] | tuple = (), exclude: list[str] | tuple = (),
                  leave_to_ort: bool = True, cuda_graph: bool | None = None) -> Options:
    """The Options of `onnxfuse optimize` from its flags; `onnxfuse.optimize` builds them
    here too, from the same defaults. Every inconsistent choice is a one-line OnnxfuseError.

    layout: "auto" is "nhwc" when kernels are compiled and Triton is installed, else "nchw".
    tune: "auto" (measure when this machine has an NVIDIA GPU and onnxruntime-gpu and kernels
    are compiled), "off", or "configs" (also search kernel configurations; an error where it
    cannot run). cuda_graph: how the written model will run, for tuning's whole-model
    comparison (`TuneSettings.cuda_graph`; without tuning nothing reads it). pattern_dirs /
    exclude: the pattern set is loaded once to check them (the choose-layout pass loads it
    again, for the layout)."""
    if layout not in ("auto", "nchw", "nhwc"):
        raise OnnxfuseError(f"--layout {layout}: choose auto, nchw or nhwc")
    if tune not in TUNE_MODES:
        raise OnnxfuseError(f"tune={tune!r}: choose one of {', '.join(TUNE_MODES)}")
    if tune_budget is not None and not tune_budget > 0:
        raise OnnxfuseError("--tune-budget must be a positive number of seconds")
    if batch is not None and batch < 1:
        raise OnnxfuseError("--batch must be at least 1")
    if layout == "nhwc" and target == "none":
        raise OnnxfuseError("--layout nhwc is for the GPU kernels: it cannot be combined with --target none")
    if layout == "nhwc" and not kernels.triton_available():
        raise OnnxfuseError("--layout nhwc runs with the compiled GPU kernels and needs Triton: "
                            "pip install 'onnxfuse[compile]'")
    # auto: nhwc when kernels are compiled (the NHWC pass runs with them); without Triton the
    # compile pass does nothing
    if layout == "auto":
        layout = "nhwc" if target != "none" and kernels.triton_available() else "nchw"
    shapes = {name: tuple(dims) for name, dims in (shapes or {}).items()}
    settings = None
    if tune == "configs":
        if target == "none":
            raise OnnxfuseError("--tune times compiled kernels: it cannot be combined with --target none")
        if not tuning.available():
            raise OnnxfuseError("--tune needs an NVIDIA GPU and onnxruntime-gpu (CUDA execution provider)")
    if tune == "configs" or (tune == "auto" and target != "none" and tuning.available()):
        settings = tuning.TuneSettings(shapes=dict(shapes), batch=batch, configs=tune == "configs",
                                       explicit=tune == "configs", budget_s=tune_budget or tuning.BUDGET_S,
                                       cuda_graph=cuda_graph)
    if target not in ("none", "auto") and not kernels.triton_available():
        raise OnnxfuseError("--target needs Triton: pip install 'onnxfuse[compile]' (or use --target none)")
    pattern_dirs = tuple(os.fspath(d) for d in pattern_dirs)
    if pattern_dirs or exclude:  # a bad folder or an unknown name fails here, before any work
        select_patterns(load_patterns(pattern_dirs), exclude)
    return Options(target, layout, conv_precision, settings, jobs, shapes, batch, pattern_dirs, tuple(exclude),
                   leave_to_ort=leave_to_ort)


@dataclass
class Result:
    """The state the passes transform (the IR: an onnx ModelProto and the fused nodes in it),
    and the report so far."""

    model: ModelProto
    report: Report
    fused: list[FusedNode] = field(default_factory=list)
    # The input model as given (not a copy: never changed): tuning times it, and writes it
    # unchanged when the optimized model is slower (onnxfuse.tune).
    original: ModelProto | None = None
    # What a pass leaves for later ones (never written out):
    # - canonicalize: why the model is left as it is (an opset this onnxfuse does not know);
    #   the passes up to rewrite then change nothing
    unchanged: str | None = None
    # - infer shapes: producers, consumers, constants, types and shapes of the model before
    #   the rewrite (match and rewrite read it; rewrite drops it)
    view: GraphView | None = None
    # - infer shapes: tensor -> (dims or None, elem_type) (a dim is an int, a dim_param or
    #   None), inferred while optimizing: the NHWC step of the compile pass reads them
    #   (onnxfuse.layout), as the written model keeps only the value_info it came with
    shapes: dict[str, tuple] = field(default_factory=dict)
    # - choose layout: the patterns the match pass applies
    patterns: list[Pattern] = field(default_factory=list)
    # - choose layout: patterns left out because no tuning will time their nodes
    #   (Kind.untuned_reason): reason -> the op types their matches start from
    untuned: dict[str, frozenset[str]] = field(default_factory=dict)
    # - pack: how many attentions had their Q, K and V projections packed into one product
    packed: int = 0
    unpacked: int = 0  # per-head interleaved projections reordered into packed ones (pack_pass)
    lifted: int = 0  # attentions over merged heads rewritten over [B, H, ...] (pack_pass, lift_pass)
    # - head bias: projection biases moved below their head split into a rotary chain
    head_biased: int = 0
    # - align: the products padded to 16-byte rows for cuBLAS (their node names)
    padded: list[str] = field(default_factory=list)
    # - bias: how many products had their bias moved after them, into one of ORT's fusions, and
    #   ORT's fusions of the model where the bias pass asked for them (the match pass's answer)
    biased_after: int = 0
    ort_probe: OrtFusions | None = None
    # - match: what each pattern fuses, and why other nodes do not
    found: MatchResult | None = None
    # - compile, when the tune pass follows: the result as the rewrite left it, from which
    #   tuning rebuilds its candidates
    before_compile: Result | None = None

    def warn(self, message: str) -> None:
        """Record a warning in the report and issue it as an OnnxfuseWarning."""
        self.report.warnings.append(message)
        warnings.warn(message, OnnxfuseWarning, stacklevel=3)

    def drop_fused(self, names: set[str], reason: str) -> None:
        """Forget fused nodes that were turned back into their original nodes
        (`onnxfuse.rewrite.unfuse`): they count as not fused, for `reason`."""
        dropped = [f for f in self.fused if f.node_name in names]
        self.fused = [f for f in self.fused if f.node_name not in names]
        describe_graph(self)
        r = self.report
        if dropped:
            r.not_fused[reason] = r.not_fused.get(reason, 0) + sum(len(f.source_nodes) for f in dropped)


def describe_graph(result: Result) -> Report:
    """The parts of the report that describe the graph as it stands: nodes, patterns applied,
    fused nodes (their kernels as last renamed). Every pass that changes the graph ends here,
    so the report is always the final graph's."""
    r = result.report
    r.nodes_after = len(result.model.graph.node)
    r.patterns_applied = dict(Counter(f.pattern for f in result.fused))
    r.fused = [FusionRecord(f.node_name, f.pattern, f.kernel_name, list(f.source_nodes), len(f.inputs),
                            len(f.outputs)) for f in result.fused]
    return r


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


# ---------------------------------------------------------------------------------------
# The passes: each takes the Result so far and the Options, and returns the Result
# ---------------------------------------------------------------------------------------

def canonicalize_pass(result: Result, options: Options) -> Result:
    """Static input shapes (options.shapes / batch, when they give every symbolic dim): the
    shape arithmetic they decide folded into constants (`onnxfuse.static`), so that ONNX
    Runtime can run every node on the GPU and capture CUDA graphs; otherwise the report says
    which dim was left open. Then exporters' habits undone (`onnxfuse.load.canonicalize`).

    A model whose default-domain opset is newer than this onnxfuse knows (or older than
    `onnxfuse.load.MIN_OPSET`) is left unchanged (a copy), with a warning: an op may mean
    something else in that opset (`onnxfuse.load.opset_problem`)."""
    static, why = (None, None)
    if options.shapes or options.batch is not None:
        static, why = resolve_dims(result.model, dict(options.shapes), options.batch)
    problem = opset_problem(result.model)
    if problem is not None:
        same = ModelProto()
        same.CopyFrom(result.model)
        result.model, result.original, result.unchanged = same, None, problem
        result.report.not_fused = {problem: len(same.graph.node)}
        describe_graph(result)
        result.warn(f"{problem}: the model is left unchanged")
        result.report.static_shapes = why
        return result
    model = result.model
    if static is not None:
        model, folded = fold_shape_arithmetic(model, static)  # Shape -> ... -> Reshape: constants
        result.report.static_shapes = folded.summary()
        result.model = canonicalize(model)
        return result
    model, folded = fold_known_dims(canonicalize(model))  # (in place: canonicalize copies)
    result.model = remove_passthrough(model)  # (the Slices of a whole axis it made Identity)
    if folded.done() or folded.anchored:  # what the static dims of a dynamic model decide
        kinds = ", ".join(f"{op} {k}" for op, k in folded.nodes.most_common())
        said = [f"folded {sum(folded.nodes.values())} nodes of shape arithmetic on static dims ({kinds})"
                if folded.nodes else "", f"dropped {folded.noops_text()}" if folded.noops else "",
                f"{folded.anchored} Shapes read the graph inputs' named dims" if folded.anchored else ""]
        why = "; ".join(x for x in (why, *said) if x)
    result.report.static_shapes = why
    return result


def fold_pass(result: Result, options: Options) -> Result:
    """Conv -> BatchNormalization pairs folded into one Conv (`onnxfuse.fold`)."""
    if result.unchanged is None:
        result.model, result.report.folded_batchnorm = fold_batchnorm(result.model)
    return result


def infer_shapes_pass(result: Result, options: Options) -> Result:
    """Types and shapes of every tensor (`onnxfuse.load.infer_shapes`), indexed with the
    graph's producers, consumers and constants (`onnxfuse.graph.GraphView`)."""
    if result.unchanged is None:
        _set_view(result, GraphView.build(result.model, infer_shapes(result.model)))
    return result


def _set_view(result: Result, view: GraphView) -> None:
    result.view = view
    result.shapes = {name: (shape, view.types.get(name, 0)) for name, shape in view.shapes.items()}


def choose_layout_pass(result: Result, options: Options) -> Result:
    """The patterns for the layout (`options.layout`, decided by `build_options`: "nhwc" when
    kernels are compiled): NHWC_ONLY_PATTERNS only for "nhwc". Without tuning, not the patterns
    of kinds whose nodes are fused only where measured (`Kind.untuned_reason`: the gemm kind).
    The layout itself is applied to the fused nodes in the compile pass (`onnxfuse.layout`),
    whose plan depends on which convs stay fused (declined, failed, or left to ONNX Runtime by
    tuning)."""
    if options.patterns is not None:
        result.patterns = list(options.patterns)
    else:
        result.patterns = for_layout(select_patterns(load_patterns(options.pattern_dirs), options.exclude),
                                     options.layout)
    if options.tune is None:  # kinds fused only where measured (the gemm kind): not matched
        for p in result.patterns:
            reason = p.kind.untuned_reason()
            if reason is not None:
                result.untuned[reason] = result.untuned.get(reason, frozenset()) | p.kind.anchor_ops
        result.patterns = [p for p in result.patterns if p.kind.untuned_reason() is None]
    return result


PACKED = ("attentions whose Q, K and V projections were packed into one MatMul (the attention reads "
          "them in place)")


UNPACKED = ("projections whose Q, K and V columns interleaved head by head were reordered into one packed "
            "product (its Reshape, Transpose and Slices gone)")

LIFTED = ("attentions over merged heads ([B * H, S, D] products, Reshapes around the mask) rewritten over "
          "[B, H, S, D] (onnxfuse.heads), so that they fuse")


def pack_pass(result: Result, options: Options) -> Result:
    """Where the attention pattern is applied: each attention's Q, K and V projections (three
    MatMuls of one input) packed into one product and a Split that the attention then reads in
    place (`onnxfuse.pack`), after each per-head interleaved projection (GPT-NeoX's) is reordered
    into that packed form (`unpack_interleaved`); the shapes inferred again after each change."""
    attention = next((p for p in result.patterns if p.kind.name == "attention"), None)
    if result.unchanged is None and attention is not None:
        lift_pass(result, attention)
        model, unpacked = unpack_interleaved(result.model, result.view)
        if unpacked:
            result.model, result.unpacked = model, unpacked
            infer_shapes_pass(result, options)
        model, packed = pack_qkv(result.model, result.view, attention)
        if packed:
            result.model, result.packed = model, packed
            infer_shapes_pass(result, options)
    return result


def lift_pass(result: Result, attention: Pattern) -> Result:
    """Attentions over merged heads ([B * H, S, D] products, `onnxfuse.heads`) rewritten over
    [B, H, ...], kept only for those that then match as attentions (the others as they were);
    the shapes inferred again where any was."""
    before = result.model
    model, lifted = lift_merged_heads(before, result.view, attention)
    if not lifted:
        return result
    view = GraphView.build(model, infer_shapes(model))
    index = {n.name: i for i, n in enumerate(view.nodes)}
    matched = {old for old, new in lifted.items()
               if isinstance(find_attention(view, index[new], attention, set(), Accepted(len(view.nodes)), {}), Match)}
    if matched != set(lifted):
        model, lifted = lift_merged_heads(before, result.view, attention, matched) if matched else (before, {})
        if not lifted:
            return result
        view = GraphView.build(model, infer_shapes(model))
    result.model, result.lifted = model, len(lifted)
    _set_view(result, view)
    return result


def head_bias_pass(result: Result, options: Options) -> Result:
    """Where the pointwise patterns are applied: each projection bias added before a head split
    that a rotary embedding rotates moved below the split, where the rotary chain takes it in
    (`onnxfuse.headbias`: Qwen2's query and key biases); the shapes inferred again after."""
    if result.unchanged is None and any(p.kind.name == "pointwise" for p in result.patterns):
        model, cut = split_head_biases(result.model, result.view)
        view = GraphView.build(model, infer_shapes(model)) if cut else result.view
        model, moved = sink_head_biases(model, view)
        if moved or cut:
            result.model, result.head_biased = model, moved
            infer_shapes_pass(result, options)
    return result


def align_pass(result: Result, options: Options) -> Result:
    """For the GPU (a kernel target): each large product whose output rows are not a multiple of
    16 bytes (a vocabulary of 50257 tokens) padded to one, and sliced back, so that cuBLAS runs
    its tensor-core kernels (`onnxfuse.align`); the shapes inferred again where any was."""
    if result.unchanged is None and options.target != "none":
        model, padded = pad_columns(result.model, result.view)
        if padded:
            result.model, result.padded = model, padded
            infer_shapes_pass(result, options)
    return result


PADDED = ("products padded to 16-byte output rows and sliced back, so that cuBLAS runs its tensor-core "
          "kernels (onnxfuse.align)")
BIAS_AFTER = ("products whose bias was added after them, where ONNX Runtime's SkipLayerNormalization, BiasGelu "
              "or FastGelu fusion or a fused node takes the Add in (ONNX Runtime's Gemm would add it with a "
              "second kernel)")


# ONNX Runtime's fusions whose nodes a kind's fused node may take where the tune pass will time
# it against them (kind name -> reasons, `onnxfuse.match.Reserved`; a node that loses goes back to
# ORT): its GELU fusions, taken by pointwise chains (BiasGelu: 2.1 TB/s at BERT-base b8 fp16 on
# the H200, FastGelu 1.8; fifteenth session's profile) and left to them by the gemm kind, and its
# layer normalizations, taken by FusedRows (issue 17's encoder at b1 fp32, twentieth session,
# tuning's CUPTI timings: its residual + bias + LayerNorm after FFN2 2.0 µs fused against 3.9
# under ORT; the residual + LayerNorm after attention 2.1 against SkipLayerNormalization's 1.7)
_GELU_FUSIONS = frozenset(ort_reason(f) for f in ("BiasGelu", "FastGelu", "Gelu"))
_NORM_FUSIONS = frozenset(ort_reason(f) for f in ("LayerNormalization", "SkipLayerNormalization",
                                                  "SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization"))
TIMED_AGAINST_ORT: dict[str, frozenset[str]] = {"pointwise": _GELU_FUSIONS, "gemm": _GELU_FUSIONS,
                                                 "rows": _NORM_FUSIONS}


UNTUNED_OFFERED = ("nodes of ONNX Runtime's GELU or layer-normalization fusions: fused only where the tune pass "
                   "measures the fused node faster (not tuned)")


def timed_against_ort(options: Options) -> dict[str, frozenset[str]]:
    """TIMED_AGAINST_ORT where the tune pass will time the fused nodes, else none."""
    return TIMED_AGAINST_ORT if options.tune is not None else {}


def bias_pass(result: Result, options: Options) -> Result:
    """With `leave_to_ort`: each product's bias that ONNX Runtime would run inside its Gemm (a
    broadcast kernel, then the product with beta 1) added after the product instead, where
    ORT's own fusions or a fused node then take that Add in (`onnxfuse.pack.bias_after_product`:
    ORT and the patterns asked on a trial model); the view of the model moved is the trial's when
    every move is kept, else inferred again."""
    if result.unchanged is None and options.leave_to_ort:
        model, moved, result.ort_probe, view = bias_after_product(result.model, result.view, result.patterns,
                                                                  timed_against_ort(options))
        if moved:
            result.model, result.biased_after = model, moved
            if view is None:
                infer_shapes_pass(result, options)
            else:  # the trial model's, kept whole
                _set_view(result, view)
    return result


def match_pass(result: Result, options: Options) -> Result:
    """The groups each pattern fuses (`onnxfuse.match`), and in the report why other nodes do
    not (including those the matcher does not visit: in subgraphs and the model's functions).
    With `leave_to_ort`, the nodes ONNX Runtime's own fusions would take are kept out of
    fused nodes (`onnxfuse.ort_fusions`, asked about the canonical model), but for those of
    TIMED_AGAINST_ORT where the tune pass will time the fused nodes against ORT's."""
    if result.unchanged is None:
        by_ort = (result.ort_probe or ort_fusions(result.model)) if options.leave_to_ort else None
        if by_ort is not None and (by_ort.missing_ort or by_ort.too_large):
            result.warn(f"{by_ort.problem}: nodes its own fusions would take may have been fused "
                        "(--no-leave-to-ort says not to look)")
        result.found = find_matches(result.view, result.patterns, by_ort.absorbed if by_ort else None,
                                    timed_against_ort(options))
        result.report.notes = dict(result.found.notes)
        if result.packed:
            result.report.notes[PACKED] = result.packed
        if result.unpacked:
            result.report.notes[UNPACKED] = result.unpacked
        if result.lifted:
            result.report.notes[LIFTED] = result.lifted
        if result.head_biased:
            result.report.notes[HEAD_BIAS_NOTE] = result.head_biased
        if result.biased_after:
            result.report.notes[BIAS_AFTER] = result.biased_after
        if result.padded:
            result.report.notes[PADDED] = len(result.padded)
        not_fused = dict(result.found.rejected)
        for reason, count in _not_visited(result.model, result.patterns).items():
            not_fused[reason] = not_fused.get(reason, 0) + count
        matched = {i for m in result.found.matches for i in m.nodes}
        for reason, ops in result.untuned.items():
            count = sum(1 for i, n in enumerate(result.model.graph.node)
                        if i not in matched and n.op_type in ops and n.domain in ("", "ai.onnx"))
            if count:
                not_fused[reason] = not_fused.get(reason, 0) + count
        result.report.not_fused = not_fused
    return result


def rewrite_pass(result: Result, options: Options) -> Result:
    """Each match replaced by one custom node in domain `onnxfuse` with its original
    subgraph as a model-local function (`onnxfuse.rewrite`)."""
    if result.unchanged is not None:
        return result
    result.model, result.fused = rewrite(result.model, result.view, result.found.matches)
    result.view, result.found = None, None
    describe_graph(result)
    return result


def kmajor_pass(result: Result, options: Options) -> Result:
    """For the GPU (a kernel target), where float32 products multiply in TF32 (precision tf32,
    ONNX Runtime's default math), untuned: the float32 MatMul / Gemm nodes ONNX Runtime runs
    itself of at least `kmajor.MIN_FLOPS` given their constant weights K-major (`onnxfuse.kmajor`);
    where the tune pass runs, it measures that change instead (from `kmajor.MEASURED_MIN_FLOPS`, `onnxfuse.tune`)."""
    if result.unchanged is not None or options.target == "none" or options.conv_precision != "tf32" \
            or options.tune is not None:
        return result
    model, done = kmajor_weights(result.model, result.shapes)
    if done:
        result.model = model
        result.report.notes[KMAJOR_NOTE] = len(done)
        describe_graph(result)
    return result


def compile_pass(result: Result, options: Options) -> Result:
    """Every fused node's kernel compiled for options.target and attached (no kernels with
    target "none"; a note without Triton): convs the heuristics expect cuDNN to run faster
    left to it, the NHWC layout applied (layout "nhwc", `onnxfuse.layout`), nodes whose
    kernel fails to compile turned back into their original nodes (`onnxfuse.kernels`). The
    report's `compile` entry says what was compiled.

    Tests and scripts compile a Result of `optimize_model` with it:
    `compile_pass(optimize_model(m), build_options(target="sm_90", layout="nhwc", tune="off"))`."""
    if options.target == "none":
        return result
    if not result.fused:
        result.report.compile = {"summary": "kernels: nothing to compile", "kernels": 0}
        if options.tune is not None and _changed(result):
            # no fused node, but the graph changed (shape arithmetic folded at --shape, a
            # BatchNormalization folded): ONNX Runtime may fuse it differently, so the tune pass
            # still checks that the model is not slower than the original
            result.before_compile = tuning.snapshot(result)
        return result
    if not kernels.triton_available():
        result.report.compile = {"summary": "kernels: not compiled (Triton is not installed); fused nodes run "
                                            "through their function bodies or the CPU library", "kernels": 0}
        return result
    if options.tune is not None:
        result.before_compile = tuning.snapshot(result)
    result.report.compile = compile_result(result, _targets(options), options, options.conv_precision)
    return result


def _changed(result: Result) -> bool:
    """Whether the passes changed the model (not only its fused nodes)."""
    return result.original is not None and result.model.SerializeToString() != result.original.SerializeToString()


def tune_pass(result: Result, options: Options) -> Result:
    """With options.tune, on this machine's GPU: fused nodes whose original runs faster left
    to ONNX Runtime, and the original model kept when the optimized one is slower or less
    accurate than ONNX Runtime's default (`onnxfuse.tune`). A tuning that cannot run is an
    error when the user asked for it (`--tune`), else a warning and the heuristics decide."""
    before = result.before_compile
    if options.tune is None or before is None:
        return result
    result.before_compile = None
    targets = _targets(options)
    info = result.report.compile

    def build(res: Result) -> dict:
        return compile_result(res, targets, options, options.conv_precision)

    def build_precise(res: Result) -> dict:  # tried when the tf32 convs fail the accuracy gate
        return compile_result(res, targets, options, tuning.PRECISE)

    try:
        result.report.compile = tuning.tune(
            result, before, info, build, options.tune, targets, conv_precision=options.conv_precision,
            jobs=options.jobs, recompile_precise=build_precise if options.conv_precision == "tf32" else None)
    except Exception as e:  # measuring must not lose the optimized model: the heuristics decide
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if not isinstance(e, OnnxfuseError):
            why = f"{type(e).__name__}: {why}"
        if options.tune.explicit:
            raise OnnxfuseError(f"--tune: {why}") from None
        result.warn(f"not tuned: {why}")
        # nodes of kinds fused only where measured (Kind.untuned_reason), and chains of nodes
        # offered from ORT's fusions (Match.measured_only), go back to ONNX Runtime
        for f in list(result.fused):
            reason = KINDS[f.kind].untuned_reason() or (UNTUNED_OFFERED if f.measured_only else None)
            if reason is not None:
                tuning.unfuse_nodes(result, {f.node_name}, reason)
    describe_graph(result)
    return result


# The pipeline, in order. Each pass is a function (Result, Options) -> Result.
PASSES: tuple[Callable[[Result, Options], Result], ...] = (
    canonicalize_pass,    # static input shapes folded into the graph; exporters' habits undone
    fold_pass,            # Conv -> BatchNormalization: one Conv
    infer_shapes_pass,    # types and shapes, for matching and for the NHWC layout
    choose_layout_pass,   # the patterns for the layout (nchw, or nhwc when kernels are compiled)
    pack_pass,            # attention's Q, K and V projections: one product, read in place
    head_bias_pass,       # a rotated head split's projection bias: below the split, into the rotary chain
    align_pass,           # for the GPU: products of unaligned output rows padded for cuBLAS
    bias_pass,            # a product's bias after it, where ORT's fusions or a fused node take it
    match_pass,           # the groups each pattern fuses, and why other nodes do not
    rewrite_pass,         # custom nodes in domain onnxfuse + their original subgraphs as functions
    kmajor_pass,          # for the GPU: float32 weights of ORT's own products K-major (TF32 kernels)
    compile_pass,         # decline slow convs, lay out NHWC, compile and attach kernels, unfuse failures
    tune_pass,            # on a GPU: measure, keep what is faster and as accurate as ONNX Runtime
)


def _targets(options: Options) -> list[int]:
    return aot.targets(options.target)


def compile_result(result: Result, targets: list[int], options: Options, conv_precision: str) -> dict:
    """Compile (and lay out) the fused nodes of `result` at `conv_precision`; returns the
    compile part of the report, and the report follows the graph. Convs are declined by the
    heuristics unless `--tune` (configs) measures them instead."""
    decline = options.tune is None or not options.tune.configs
    info, result.fused = compile_fused(result.model, result.fused, targets, jobs=options.jobs,
                                       conv_precision=conv_precision, tensors=result.shapes,
                                       decline_slow_convs=decline, layout=options.layout)
    describe_graph(result)
    for reason in dict.fromkeys(d["reason"] for d in info["declined"]):
        result.drop_fused({d["node"] for d in info["declined"] if d["reason"] == reason}, reason)
    if info["failed"]:
        result.drop_fused({f["node"] for f in info["failed"]}, FAILED_REASON)
        for f in info["failed"]:
            result.warn(failure_warning(f))
    return info


def run_passes(result: Result, options: Options, passes=PASSES) -> Result:
    """`result` through `passes` in order. A pass after which the model reads a tensor that
    nothing gives (and the input did not) is an internal error, named, rather than a model
    ONNX Runtime refuses to load (onnx.checker does not see a subgraph's outer reads)."""
    broken = set(unproduced_reads(result.model.graph))
    for step in passes:
        result = step(result, options)
        lost = [x for x in unproduced_reads(result.model.graph) if x not in broken]
        if lost:
            raise OnnxfuseError(f"internal error: after {step.__name__} the model reads {', '.join(lost[:3])}"
                                f"{' and more' if len(lost) > 3 else ''}, which nothing gives; please report it")
    return result


def optimize_model(model: ModelProto, patterns: list[Pattern] | None = None, layout: str | None = None,
                   static_shapes: dict[str, tuple[int, ...]] | None = None, *,
                   leave_to_ort: bool | None = None, options: Options | None = None) -> Result:
    """Fuse a model in memory: PASSES with `options`. The input model is not modified.

    Without options, those of `build_options(target="none")`: no kernels, layout "nchw".
    The keywords adjust them for in-memory use: `patterns`, matched as given (default: the
    built-in ones, for the layout); `layout`, the patterns' layout only (NHWC_ONLY_PATTERNS;
    the NHWC layout itself is applied when kernels are compiled, `compile_pass`);
    `static_shapes` (input name -> dims): as `--shape`; `leave_to_ort`: as Options'."""
    t0 = time.perf_counter()
    options = build_options(target="none") if options is None else options
    if patterns is not None:
        options = dataclasses.replace(options, patterns=tuple(patterns))
    if layout is not None:
        options = dataclasses.replace(options, layout=layout)
    if static_shapes is not None:
        options = dataclasses.replace(options, shapes={k: tuple(v) for k, v in static_shapes.items()})
    if leave_to_ort is not None:
        options = dataclasses.replace(options, leave_to_ort=leave_to_ort)
    result = run_passes(Result(model, Report(nodes_before=len(model.graph.node)), original=model), options)
    result.report.seconds = time.perf_counter() - t0
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
             pattern_dirs: list[str] | tuple = (), exclude: list[str] | tuple = (),
             layout: str = "auto", json_path: str | os.PathLike | None = None,
             shapes: dict[str, tuple[int, ...]] | None = None, batch: int | None = None, *,
             target: str = "auto", conv_precision: str = "tf32", tune: str = "auto",
             tune_budget: float | None = None, jobs: int | None = None, leave_to_ort: bool = True,
             cuda_graph: bool | None = None, options: Options | None = None) -> Report:
    """Read, fuse (PASSES) and atomically write a model file, and with `json_path` the report
    as JSON: both or neither (`Outputs`; no output may be the input).

    With the defaults it does what `onnxfuse optimize IN OUT` does: the keywords are the
    command line's options, made into Options by `build_options` as the command line makes
    them (kernels compiled for the local GPU, else the default targets, `target="none"` for
    none; channels-last when they are; tuned when this machine has an NVIDIA GPU). `options`,
    when given, replaces them all."""
    if options is None:
        options = build_options(target, layout, conv_precision, tune, shapes, batch, tune_budget, jobs,
                                pattern_dirs, exclude, leave_to_ort, cuda_graph)
    t0 = time.perf_counter()
    with Outputs([output_path, json_path], [input_path]) as out:
        result = optimize_model(load_model(input_path), options=options)
        result.original = None  # the input is not needed to write: its memory can take the output's serialization
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
