"""The fusion-kind protocol (`Kind`): what one kind of fused node implements, from a
pattern's parameters to the kernel that runs the node and its numpy reference, and the
values that cross it: `Pattern` (a kind and its parameters), `Match` (the nodes a pattern
matched), `Lowering` (how a match becomes a node), `FusedNode` (the node written), `Spec`
(what to compile). docs/kinds.md describes the protocol; the kinds are listed in
`onnxfuse.kinds.KINDS`."""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol

import numpy as np
from onnx import GraphProto, ModelProto, NodeProto

from onnxfuse.codegen import KernelSource
from onnxfuse.errors import OnnxfuseError, PatternError
from onnxfuse.expr import Program
from onnxfuse.graph import GraphView
from onnxfuse.groups import Accepted
from onnxfuse.layers import ConvAttrs, PoolAttrs

META_VERSION = 1  # kernel_meta's "version" (docs/format.md)


# ---------------------------------------------------------------------------------------
# patterns
# ---------------------------------------------------------------------------------------

class Params(Protocol):
    """A kind's pattern parameters (the `match` part of a pattern file), parsed by
    `Kind.parse`: a frozen value of the kind's own; the pipeline reads only `fused_ops`."""

    @property
    def fused_ops(self) -> frozenset[str]:
        """Every ONNX op type a match may contain."""


@dataclass(frozen=True)
class Example:
    inputs: dict[str, tuple[str, tuple[int | str, ...]]]
    nodes: tuple[tuple[str, tuple[Any, ...], tuple[str, ...], dict], ...]
    outputs: tuple[str, ...]
    expect: dict[str, int]
    # name -> (dtype, dims, fill value or None for seeded random numbers)
    initializers: dict[str, tuple[str, tuple[int, ...], float | None]] = field(default_factory=dict)


@dataclass(frozen=True)
class Pattern:
    """A pattern file: a kind and its parameters (onnxfuse.pattern loads them)."""

    name: str
    description: str
    priority: int
    kind: Kind
    match: Params
    example: Example | None
    source: str  # the file it came from


class Fields:
    """Typed access to a mapping that reports errors as `file: field: problem`."""

    def __init__(self, data: Any, path: Path, prefix: str = ""):
        self.path, self.prefix = path, prefix
        if not isinstance(data, dict):
            self.fail(prefix.rstrip(".") or "(top level)", "must be a mapping")
        self.data = data

    def fail(self, field: str, problem: str):
        raise PatternError(f"{self.path}: {field}: {problem}")

    def get(self, key: str, typ: type | tuple, default: Any = ..., ) -> Any:
        field = self.prefix + key
        if key not in self.data:
            if default is ...:
                self.fail(field, "is required")
            return default
        value = self.data[key]
        if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
            names = typ.__name__ if isinstance(typ, type) else " or ".join(t.__name__ for t in typ)
            self.fail(field, f"must be {names}, got {type(value).__name__}")
        return value

    def sub(self, key: str, default: Any = ...) -> Fields | None:
        value = self.get(key, dict, default)
        return None if value is None else Fields(value, self.path, self.prefix + key + ".")

    def no_extra(self, allowed: set[str]) -> None:
        for k in self.data:
            if k not in allowed:
                self.fail(self.prefix + str(k), f"unknown field (allowed: {', '.join(sorted(allowed))})")


# ---------------------------------------------------------------------------------------
# matches and fused nodes
# ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Match:
    """Nodes one pattern matched, to become one fused node."""

    pattern: Pattern
    nodes: tuple[int, ...]  # node indices, topological order
    outputs: tuple[str, ...]  # tensors the group exposes, in production order
    # layer kinds (conv, maxpool), set by their matchers:
    conv: int | None = None  # the Conv node
    pool: int | None = None  # the MaxPool node, if one is fused
    pointwise: tuple[int, ...] = ()  # the epilogue / prologue nodes, topological order
    conv_attrs: ConvAttrs | None = None
    pool_attrs: PoolAttrs | None = None
    first_input: str = ""  # program input %0: the conv output, or the prologue's X
    result: str = ""  # the program's one output (what the MaxPool reads, if one is fused)
    params: Any = None  # what else a kind's matcher hands its lowering
    # it holds nodes of an ONNX Runtime fusion offered to it because tuning times it against that
    # fusion (`onnxfuse.match.Reserved`): kept only where measured faster
    measured_only: bool = False

    @property
    def kind(self) -> str:
        """The name of the kind of node the match becomes."""
        return self.pattern.kind.name


class NotMine(str):
    """An anchor's reason that says only that the node is not of the kind's shape (a Softmax
    without the attention's MatMuls): any other kind's reason for the same node replaces it."""


class Alone(str):
    """An anchor's reason that says a kind found nothing to fuse with the node: it replaces a
    `NotMine` reason, never another kind's specific one (an attention declined for its batch dims
    stays reported so, not as a lone Softmax)."""


def reason_rank(reason: str) -> int:
    """How specific an anchor's reason is (`onnxfuse.match.find_matches` keeps the most specific,
    the later of equals): NotMine 0, Alone 1, any other 2."""
    return 0 if isinstance(reason, NotMine) else 1 if isinstance(reason, Alone) else 2


@dataclass
class MatchResult:
    matches: list[Match] = field(default_factory=list)
    # reason -> number of nodes it kept out of a fusion
    rejected: Counter = field(default_factory=Counter)
    # anchor node (a Conv, a MaxPool) -> why it did not match: counted once every pattern
    # has run, for the anchors none took, the most specific reason (`reason_rank`) of any
    # pattern (onnxfuse.match.find_matches)
    anchors: dict[int, str] = field(default_factory=dict)
    # what a match decided that the report says besides (which rule of ONNX Runtime's own
    # fusions applied: the rows kind) -> number of nodes fused under it
    notes: Counter = field(default_factory=Counter)


@dataclass(frozen=True)
class Lowering:
    """How a match becomes a node (`Kind.lower`): its program (attribute `program`) with
    the constants folded into it, the node's inputs, the original nodes its function body
    holds (by their tensor names; the body's inputs are `inputs`, or `body_inputs`), its other attributes,
    what else names its kernel (`key`, hashed with the program and the body), and the
    FusedNode's fields besides the common ones."""

    program: Program
    folded: dict[str, float]
    inputs: list[str]
    body: list[NodeProto]
    attrs: dict
    key: str
    rank: int
    input_modes: tuple[str, ...]
    fields: dict = field(default_factory=dict)
    # what the body reads for each input, where a lowering passes the node another tensor of the
    # same value (a mask the graph computes, stored as a constant); None: `inputs`
    body_inputs: list[str] | None = None


@dataclass(frozen=True)
class FusedNode:
    """One fused node, with what code generation needs to know about it."""

    node_name: str
    pattern: str
    kernel_name: str  # also the function overload
    program: Program
    inputs: tuple[str, ...]  # the node's inputs (FusedConv: X, packed W, B, extras...)
    outputs: tuple[str, ...]
    rank: int  # 4 for conv and maxpool nodes
    input_modes: tuple[str, ...]  # per program input (conv/maxpool: %0 is "full")
    source_nodes: tuple[str, ...]  # "OpType name" of each replaced node
    kind: str = "pointwise"  # its Kind.name (onnxfuse.kinds.KINDS): "pointwise", "conv", "maxpool"
    conv: ConvAttrs | None = None  # kind conv
    pool: PoolAttrs | None = None  # kind maxpool, or conv with a fused MaxPool
    # kind conv and maxpool: memory layouts of X and Y ("nchw" or "nhwc"); kind conv: per
    # extra input 0 (as is) or 1 (NHWC); set by onnxfuse.layout (docs/format.md, Layouts)
    x_layout: str = "nchw"
    y_layout: str = "nchw"
    extra_layouts: tuple[int, ...] = ()
    w_layout: str = "rsck"  # packed weights [R, S, C/group, K], or [K, R, S, C/group] ("krsc")
    # kind conv, float32 "tf32": X stored rounded to TF32 by its producers / Y stored rounded
    # for its readers; set by onnxfuse.rounding
    x_rounded: bool = False
    round_y: bool = False
    params: Any = None  # what else a kind keeps about its node (conv: ConvNodeInfo; rows: RowsInfo)
    measured_only: bool = False  # Match.measured_only: goes back to ONNX Runtime when not tuned
    # the precision its kernel multiplies float32 at in place of the model's (`--conv-precision`):
    # tuning's PRECISE where ONNX Runtime multiplied the node's original in fp32 (onnxfuse.tf32probe)
    precision: str | None = None


@dataclass(frozen=True)
class NodeLayouts:
    """How a kind's nodes take part in the NHWC pass (onnxfuse.layout), for kinds whose
    node reads a 4-D X as input 0 and writes a 4-D Y as output 0 in either layout
    (attributes x_layout, y_layout; FusedNode.x_layout, y_layout)."""

    # the first input that is an extra of the program (inputs from here on may each be
    # channels-last on their own: attribute extra_layouts); None: extras stay NCHW
    extras: int | None = None
    y_follows_x: bool = False  # X and Y turn NHWC together (a pool), never one alone
    wants_nhwc: bool = False  # reading a tensor channels-last makes its component worth turning NHWC
    weights: int | None = None  # the input that holds packed weights, repacked to "krsc" (w_layout)


class Spec(Protocol):
    """What to compile for one fused node: every kind's spec has these (and its own fields)."""

    kind: ClassVar[str]  # the `Kind.name` whose kernel it is
    name: str  # the kernel name
    program: Program
    source_nodes: tuple[str, ...]


class Kind(ABC):
    """One kind of fused node: its op type in domain onnxfuse, how patterns of the kind
    match and lower to that node, and how its kernel is specified, configured, generated
    and described to the library (kernel_meta). One instance of each kind is listed in
    `onnxfuse.kinds.KINDS`, by `name`."""

    name: ClassVar[str]  # FusedNode.kind and kernel_meta's "kind": "pointwise", "conv", ...
    op_type: ClassVar[str]  # the custom op in domain onnxfuse (docs/format.md)
    # the name older pattern files give the kind (`match.kind`, with a `replace` part)
    match_kind: ClassVar[str]
    params: ClassVar[frozenset[str]]  # the fields of `match` besides ops and dtypes
    # the NHWC pass: how its nodes take layouts (None: they do not), or layout_free: the
    # node computes the same on channels-last tensors when every input that is not a
    # scalar is channels-last too (elementwise), and carries the layout through
    layouts: ClassVar[NodeLayouts | None] = None
    layout_free: ClassVar[bool] = False
    # tuning (onnxfuse.tune) times these nodes first: ONNX Runtime's own kernels for the
    # nodes they replace may be faster (cuDNN's convs), where fused memory-bound work seldom loses
    measure_first: ClassVar[bool] = False
    # tuning times its kernels' candidate configurations (`candidates`) even without `--tune`,
    # with the budget left after every node's own kernel: its tile heuristic is measured on few
    # shapes, and its nodes repeat per layer (one search per shape)
    search_configs: ClassVar[bool] = False
    # ... and for its nodes offered against ORT's own fused kernels (`Match.measured_only`),
    # where a launch configuration decides whether the fusion beats ORT's (`offered-chains-searched`)
    search_offered: ClassVar[bool] = False
    # the op types whose nodes anchor its matches (the report counts them when its patterns
    # are not matched: `untuned_reason`)
    anchor_ops: ClassVar[frozenset[str]] = frozenset()

    def searches(self, spec, output_shape: tuple[int, ...] | None) -> bool:
        """Whether tuning times this node's candidate configurations without `--tune configs`
        (`search_configs`, by default the kind's); `output_shape`: the node's first output's
        static shape, None where unknown."""
        return self.search_configs

    # ---- patterns ----------------------------------------------------------------------

    @abstractmethod
    def parse(self, m: Fields, ops: frozenset[str], dtypes: frozenset[str]) -> Params:
        """The pattern's parameters: its `match` fields (`m`; ops and dtypes are read and
        checked already), validated; a bad value fails through `m.fail`."""

    def untuned_reason(self) -> str | None:
        """Why the pipeline does not match this kind's patterns when no tuning will time its
        nodes (no GPU, `--no-tune`): its nodes are worth fusing only where measured faster
        than ONNX Runtime. None (the default): they are matched regardless."""
        return None

    # ---- match -------------------------------------------------------------------------

    @abstractmethod
    def match(self, view: GraphView, pattern: Pattern, taken: set[int], accepted: Accepted,
              reserved: dict[int, str]) -> MatchResult:
        """The matches of `pattern` among the nodes not in `taken`. `accepted` holds the
        groups matched so far (count them as one node each: `onnxfuse.groups.reentering`);
        add this pattern's. `reserved`: nodes (-> reason) that ONNX Runtime's own fusions
        take, which pointwise groups leave alone."""

    # ---- rewrite -----------------------------------------------------------------------

    @abstractmethod
    def lower(self, view: GraphView, match: Match, node_name: str, names: set[str], graph: GraphProto) -> Lowering:
        """How `match` becomes node `node_name` (docs/format.md). New tensors (packed
        weights) are initializers added to `graph`, with names not in `names` (add them)."""

    # ---- compile -----------------------------------------------------------------------

    @abstractmethod
    def spec(self, model: ModelProto, f: FusedNode, precision: str, weight_dims: dict | None) -> Spec:
        """What to compile for fused node `f` of `model` (`precision`: `--conv-precision`;
        `weight_dims`: initializer name -> dims, or None to look them up in `model`)."""

    def decline_reason(self, spec: Spec, layout: str) -> str | None:
        """Why the heuristics leave this node to ONNX Runtime rather than compile it (with
        `layout`, the compile pass's), or None to compile it."""
        return None

    @abstractmethod
    def variants(self, spec: Spec) -> tuple:
        """The variants the kernel ships with, most specialized first (docs/format.md,
        "Choosing a binary"); each has an `index` and a `requires()`."""

    @abstractmethod
    def generate(self, spec: Spec, variant) -> KernelSource:
        """The Triton source of one variant, and what `triton.compile` needs beside it."""

    @abstractmethod
    def kernel_meta(self, spec: Spec, variants: tuple, binaries: list[dict]) -> dict:
        """The node's `kernel_meta` object (docs/format.md) for these variants and binaries."""

    def ptx_arch(self, archs: list[int]) -> tuple[int, bool]:
        """The target whose PTX is embedded beside the cubins (of the compiled `archs`, in
        ascending order), and whether its `.target` is relaxed from sm_XXa to sm_XX so that
        newer GPUs JIT it (`onnxfuse.compile.portable_ptx`): the highest target's, relaxed."""
        return archs[-1], True

    def candidates(self, spec: Spec) -> list[tuple[str, tuple]]:
        """(label, variants) of each configuration `--tune` times, the heuristics' first."""
        return [("default", self.variants(spec))]

    def multiplies_in_tf32(self, f: FusedNode, precision: str) -> bool:
        """The node's kernel multiplies in TF32 at this conv precision (`--conv-precision`),
        so tuning checks the model's accuracy against ONNX Runtime's before keeping it."""
        return False

    # ---- TF32 rounding at the producer (onnxfuse.rounding) ------------------------------

    def reads_tf32(self, spec: Spec) -> bool:
        """The kernel rounds its input 0 to TF32 before it multiplies (so a producer may
        store it rounded for it)."""
        return False

    def may_store_tf32(self, spec: Spec) -> bool:
        """The kernel can store its output 0 rounded to TF32 (FusedNode.round_y)."""
        return False

    def tf32_initializers(self, f: FusedNode, spec: Spec) -> tuple[str, ...]:
        """Initializers the kernel reads rounded to TF32: the compile step rounds them."""
        return ()

    def moves_values(self, node: NodeProto, i: int) -> bool:
        """The node only moves the values of its input i into its outputs (so TF32 values
        stay TF32 values through it)."""
        return False

    # ---- the NHWC pass (onnxfuse.layout) -----------------------------------------------

    def node_layouts(self, f: FusedNode) -> NodeLayouts | None:
        """How node f takes part in the NHWC pass: the kind's `layouts` (a kind whose nodes
        differ, FusedRows' group norms, says per node)."""
        return self.layouts

    def transposes_x(self, f: FusedNode, weight_dims: dict) -> bool:
        """With `layouts`: the node reads an NCHW X through a Transpose to channels-last
        (which the pass puts before its first reader) rather than as it is."""
        return False

    # ---- reference ---------------------------------------------------------------------

    @abstractmethod
    def evaluate(self, node: NodeProto, inputs: list[np.ndarray]) -> list[np.ndarray]:
        """The node's outputs for these input values, computed in numpy from its inputs and
        attributes as docs/format.md defines them (not from its function body)."""


def env_config(var: str, cfg: dict, known: tuple[str, ...] | None = None) -> dict:
    """`cfg` updated from ``$var`` ("key=value,..."; integers, but `tile` a name): how the
    tuning experiments override a kind's launch configuration. An unknown key is an error
    naming the known ones (default: cfg's keys)."""
    known = tuple(cfg) if known is None else known
    for item in filter(None, os.environ.get(var, "").split(",")):
        key, _, value = item.partition("=")
        if key not in known:
            raise OnnxfuseError(f"{var}: unknown key {key!r} (known: {', '.join(known)})")
        cfg[key] = value if key == "tile" else int(value)
    return cfg


def xy_layout_meta(x_layout: str, y_layout: str) -> dict[str, str]:
    """kernel_meta's "x_layout" / "y_layout" keys of a kind laid out as a pool (docs/format.md,
    FusedMaxPool): present only when not both "nchw"."""
    return {"x_layout": x_layout, "y_layout": y_layout} if (x_layout, y_layout) != ("nchw", "nchw") else {}


def layout_attr(attrs: dict[str, Any], name: str, default: str, allowed: tuple[str, ...]) -> str:
    """A node's string layout attribute (`onnx.helper.get_attribute_value` values), checked."""
    v = attrs.get(name, default.encode())
    v = v.decode() if isinstance(v, bytes) else v
    if v not in allowed:
        raise ValueError(f"{name} is {v!r}, expected one of {', '.join(map(repr, allowed))}")
    return v
