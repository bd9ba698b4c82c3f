"""Declarative fusion patterns: one YAML file each, validated when loaded.

A pattern file has three parts:

    name: pointwise_chain              # unique; becomes part of kernel names
    description: one line for `onnxfuse patterns`
    priority: 100                      # lower runs first; a node joins at most one match
    match:                             # read by the matcher (onnxfuse.match) only
      kind: elementwise_group          # the matching strategy
      ops: [Add, Mul, Sigmoid, ...]    # op types that may join a group
      dtypes: [float32, float16, bfloat16]
      min_nodes: 2
    replace:                           # read by the rewriter and code generator only
      op_type: PointwiseChain          # custom op in domain onnxfuse
      kernel: pointwise                # code generator, looked up by name
    example:                           # a tiny graph the tests build and optimize
      inputs: {x: [float32, [2, 3]]}
      nodes:
        - [Mul, [x, 2.0], [t]]
        - [Sigmoid, [t], [y]]
      outputs: [y]
      expect: {PointwiseChain: 1}

Match kinds and their fields (besides `kind`):
- elementwise_group: ops, dtypes, min_nodes (default 2)
- conv_epilogue: ops, dtypes, group (1 or "any"), pool ("none": no MaxPool after the
  epilogue; "tiling": a MaxPool whose windows tile its input must follow), alone (default
  false; true: a Conv with no fusible epilogue matches too, its program the identity). A
  2-D Conv and the pointwise ops after it (kernel conv, docs/format.md "FusedConv").
- pool_prologue: ops, dtypes, min_nodes (default 1; 0: a MaxPool alone matches too).
  Pointwise ops and the 2-D MaxPool they feed (kernel maxpool, "FusedMaxPool").
- row_reduction: reductions (layer_norm, rms_norm, softmax, log_softmax), ops, dtypes,
  min_nodes (default 1: pointwise nodes that join besides the reduction's own). A LayerNorm,
  RMSNorm or softmax over the last dims with the pointwise ops before and after it (kernel
  rows, "FusedRows"; onnxfuse/rows.py).

An example may declare constant weights: `initializers: {w: [float32, [4, 3, 3, 3]]}` is
seeded random (scaled by 1/sqrt of its fan-in), `{b: [float32, [4], 0.5]}` all 0.5,
`{axes: [int64, [1], -1]}` an int64 constant (a value is required: ReduceMean's axes). Input
dims may be names (symbolic, e.g. N).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from onnxfuse.codegen_rows import REDUCTIONS
from onnxfuse.errors import PatternError
from onnxfuse.files import record_read
from onnxfuse.ops import ELEMENTWISE_OPS


def _builtin_dir() -> Path:
    """The repository's patterns/ folder: installed as package onnxfuse.patterns, or beside
    the package when it runs from a source checkout (PYTHONPATH=.)."""
    checkout = Path(__file__).resolve().parent.parent / "patterns"
    if checkout.is_dir():
        return checkout
    from importlib.resources import files

    return Path(str(files("onnxfuse.patterns")))


BUILTIN_DIR = _builtin_dir()
MATCH_KINDS = ("elementwise_group", "conv_epilogue", "pool_prologue", "row_reduction")
KERNELS = ("pointwise", "conv", "maxpool", "rows")
KERNEL_OF_KIND = {"elementwise_group": "pointwise", "conv_epilogue": "conv", "pool_prologue": "maxpool",
                  "row_reduction": "rows"}
DTYPES = ("float32", "float16", "bfloat16")
POOL_MODES = ("none", "tiling")


@dataclass(frozen=True)
class ElementwiseGroupMatch:
    """Match connected groups of elementwise nodes."""

    ops: frozenset[str]
    dtypes: frozenset[str]
    min_nodes: int

    @property
    def fused_ops(self) -> frozenset[str]:
        """Every op type a match may contain."""
        return self.ops


@dataclass(frozen=True)
class ConvEpilogueMatch:
    """Match a 2-D Conv, the largest pointwise group after it with one result, and (pool
    "tiling") the MaxPool that reads that result when its windows tile the conv output."""

    ops: frozenset[str]  # op types allowed in the epilogue
    dtypes: frozenset[str]
    group: int | None  # the only Conv group fused; None: any
    pool: str  # one of POOL_MODES
    alone: bool = False  # a Conv without an epilogue matches too (identity program)

    @property
    def fused_ops(self) -> frozenset[str]:
        return self.ops | {"Conv"} | ({"MaxPool"} if self.pool != "none" else set())


@dataclass(frozen=True)
class PoolPrologueMatch:
    """Match a 2-D MaxPool and the pointwise group whose one result it reads."""

    ops: frozenset[str]  # op types allowed in the prologue
    dtypes: frozenset[str]
    min_nodes: int

    @property
    def fused_ops(self) -> frozenset[str]:
        return self.ops | {"MaxPool"}


# --- kind rows (issue 17): the match part of row_reduction patterns; onnxfuse/rows.py matches them
# The ONNX ops each reduction is recognized from (the decomposed forms start at ReduceMean).
REDUCTION_ANCHORS = {
    "layer_norm": frozenset({"ReduceMean", "LayerNormalization"}),
    "rms_norm": frozenset({"ReduceMean", "SimplifiedLayerNormalization", "RMSNormalization"}),
    "softmax": frozenset({"Softmax"}),
    "log_softmax": frozenset({"LogSoftmax"}),
}


@dataclass(frozen=True)
class RowReductionMatch:
    """Match a normalization or softmax over the last dims (`reductions`), the pointwise
    group before it (the prologue: what computes its input) and after it (the epilogue)."""

    reductions: frozenset[str]
    ops: frozenset[str]  # op types allowed in the prologue and the epilogue
    dtypes: frozenset[str]
    min_nodes: int = 1  # prologue and epilogue nodes besides the reduction's own, at least

    @property
    def anchors(self) -> frozenset[str]:
        return frozenset().union(*(REDUCTION_ANCHORS[r] for r in self.reductions))

    @property
    def fused_ops(self) -> frozenset[str]:
        return self.ops | self.anchors


MatchSpec = ElementwiseGroupMatch | ConvEpilogueMatch | PoolPrologueMatch | RowReductionMatch


@dataclass(frozen=True)
class Replacement:
    op_type: str
    kernel: str


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
    name: str
    description: str
    priority: int
    match: MatchSpec
    replace: Replacement
    example: Example | None
    source: str  # the file it came from


def load_patterns(extra_dirs: list[str | Path] | tuple = ()) -> list[Pattern]:
    """Built-in patterns plus those in extra_dirs, sorted by (priority, name)."""
    dirs = [BUILTIN_DIR, *map(Path, extra_dirs)]
    patterns: dict[str, Pattern] = {}
    for d in dirs:
        if d.exists() and not d.is_dir():
            raise PatternError(f"{d}: not a folder: --patterns takes a folder of pattern files (*.yaml)")
        if not d.is_dir():
            raise PatternError(f"{d}: pattern folder does not exist")
        for f in sorted(d.glob("*.yaml")) + sorted(d.glob("*.yml")):
            p = load_pattern_file(f)
            if p.name in patterns and d != BUILTIN_DIR:
                patterns.pop(p.name)  # a user's pattern replaces a built-in one of the same name
            elif p.name in patterns:
                raise PatternError(f"{f}: name: {p.name!r} is already defined in {patterns[p.name].source}")
            patterns[p.name] = p
    return sorted(patterns.values(), key=lambda p: (p.priority, p.name))


class _Fields:
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

    def sub(self, key: str, default: Any = ...) -> _Fields | None:
        value = self.get(key, dict, default)
        return None if value is None else _Fields(value, self.path, self.prefix + key + ".")

    def no_extra(self, allowed: set[str]) -> None:
        for k in self.data:
            if k not in allowed:
                self.fail(self.prefix + str(k), f"unknown field (allowed: {', '.join(sorted(allowed))})")


def load_pattern_file(path: str | Path) -> Pattern:
    path = Path(path)
    record_read(path)
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}" if mark else "(file)"
        raise PatternError(f"{path}: {where}: not valid YAML ({getattr(e, 'problem', e)})") from None
    except OSError as e:
        raise PatternError(f"{path}: cannot read ({e.strerror})") from None
    except UnicodeDecodeError as e:
        raise PatternError(f"{path}: (file): not UTF-8 text (byte {e.start})") from None
    top = _Fields(data, path)
    top.no_extra({"name", "description", "priority", "match", "replace", "example"})
    name = top.get("name", str)
    if not name.isidentifier():
        top.fail("name", f"{name!r} must be an identifier (letters, digits, _)")
    description = top.get("description", str)
    priority = top.get("priority", int, 100)

    m = top.sub("match")
    kind = m.get("kind", str)
    if kind not in MATCH_KINDS:
        m.fail("match.kind", f"unknown kind {kind!r} (known: {', '.join(MATCH_KINDS)})")
    match = _load_match(m, kind)

    r = top.sub("replace")
    r.no_extra({"op_type", "kernel"})
    op_type = r.get("op_type", str)
    kernel = r.get("kernel", str)
    if kernel not in KERNELS:
        r.fail("replace.kernel", f"unknown kernel {kernel!r} (known: {', '.join(KERNELS)})")
    if kernel != KERNEL_OF_KIND[kind]:
        r.fail("replace.kernel", f"kernel {kernel!r} does not run matches of kind {kind} "
                                 f"(use {KERNEL_OF_KIND[kind]})")

    example = _load_example(top.sub("example", None), path)
    return Pattern(
        name=name, description=description, priority=priority,
        match=match,
        replace=Replacement(op_type=op_type, kernel=kernel),
        example=example, source=str(path),
    )


_KIND_FIELDS = {
    "elementwise_group": {"kind", "ops", "dtypes", "min_nodes"},
    "conv_epilogue": {"kind", "ops", "dtypes", "group", "pool", "alone"},
    "pool_prologue": {"kind", "ops", "dtypes", "min_nodes"},
    "row_reduction": {"kind", "reductions", "ops", "dtypes", "min_nodes"},
}


def _load_match(m: _Fields, kind: str) -> MatchSpec:
    """The `match` part of a pattern file, validated for its kind."""
    m.no_extra(_KIND_FIELDS[kind])
    ops = m.get("ops", list)
    for op in ops:
        if op not in ELEMENTWISE_OPS:
            m.fail("match.ops", f"{op!r} is not an elementwise op onnxfuse can fuse")
    dtypes = m.get("dtypes", list, list(DTYPES))
    for dt in dtypes:
        if dt not in DTYPES:
            m.fail("match.dtypes", f"{dt!r} is not one of {', '.join(DTYPES)}")
    if kind == "conv_epilogue":
        group = m.get("group", (int, str), 1)
        if group != "any" and (not isinstance(group, int) or isinstance(group, bool) or group < 1):
            m.fail("match.group", f"{group!r} must be a positive number or 'any'")
        pool = m.get("pool", str, "none")
        if pool not in POOL_MODES:
            m.fail("match.pool", f"{pool!r} is not one of {', '.join(POOL_MODES)}")
        for dt in dtypes:
            if dt not in ("float32", "float16"):
                m.fail("match.dtypes", f"{dt!r}: convolutions are fused for float32 and float16 only")
        alone = m.get("alone", bool, False)
        return ConvEpilogueMatch(frozenset(ops), frozenset(dtypes), None if group == "any" else group, pool, alone)
    if kind == "row_reduction":  # kind rows (issue 17)
        reductions = m.get("reductions", list)
        if not reductions:
            m.fail("match.reductions", "must name at least one reduction")
        for r in reductions:
            if r not in REDUCTIONS:
                m.fail("match.reductions", f"{r!r} is not one of {', '.join(REDUCTIONS)}")
        min_nodes = m.get("min_nodes", int, 1)
        if min_nodes < 0:
            m.fail("match.min_nodes", "must be at least 0")
        return RowReductionMatch(frozenset(reductions), frozenset(ops), frozenset(dtypes), min_nodes)
    default_min = 2 if kind == "elementwise_group" else 1
    min_nodes = m.get("min_nodes", int, default_min)
    if min_nodes < (0 if kind == "pool_prologue" else 1):
        m.fail("match.min_nodes", "must be at least 1" if kind != "pool_prologue" else "must be at least 0")
    if kind == "pool_prologue":
        for dt in dtypes:
            if dt not in ("float32", "float16"):
                m.fail("match.dtypes", f"{dt!r}: max pools are fused for float32 and float16 only")
        return PoolPrologueMatch(frozenset(ops), frozenset(dtypes), min_nodes)
    return ElementwiseGroupMatch(frozenset(ops), frozenset(dtypes), min_nodes)


def _load_example(e: _Fields | None, path: Path) -> Example | None:
    if e is None:
        return None
    e.no_extra({"inputs", "initializers", "nodes", "outputs", "expect"})
    inputs = {}
    for k, v in e.get("inputs", dict).items():
        if not (isinstance(v, list) and len(v) == 2 and v[0] in DTYPES + ("bool",) and isinstance(v[1], list)
                and all(isinstance(d, (int, str)) and not isinstance(d, bool) for d in v[1])):
            e.fail(f"example.inputs.{k}", "must be [dtype, [dims...]] (a dim is a number or a name)")
        inputs[k] = (v[0], tuple(v[1]))
    inits = {}
    for k, v in e.get("initializers", dict, {}).items():
        if not (isinstance(v, list) and len(v) in (2, 3) and v[0] in ("float32", "float16", "int64")
                and isinstance(v[1], list) and all(isinstance(d, int) and not isinstance(d, bool) for d in v[1])
                and (len(v) == 2 or (isinstance(v[2], (int, float)) and not isinstance(v[2], bool)))
                and (len(v) == 3 or v[0] != "int64")):
            e.fail(f"example.initializers.{k}", "must be [dtype, [dims...]] or [dtype, [dims...], value] "
                                                "(dtype float32 or float16; int64 with a value)")
        inits[k] = (v[0], tuple(v[1]), float(v[2]) if len(v) == 3 else None)
    nodes = []
    for i, n in enumerate(e.get("nodes", list)):
        if not (isinstance(n, list) and len(n) in (3, 4) and isinstance(n[0], str)
                and isinstance(n[1], list) and isinstance(n[2], list)):
            e.fail(f"example.nodes[{i}]", "must be [OpType, [inputs], [outputs]] or with a 4th {attrs} item")
        nodes.append((n[0], tuple(n[1]), tuple(n[2]), n[3] if len(n) == 4 else {}))
    outputs = tuple(e.get("outputs", list))
    expect = e.get("expect", dict)
    return Example(inputs, tuple(nodes), outputs, expect, inits)


def example_model(pattern: Pattern, opset: int = 20):
    """Build the tiny ONNX model a pattern file's `example` describes (numbers in node inputs
    become float constants of the first input's dtype; random initializers are seeded)."""
    import numpy as np
    import onnx
    from onnx import helper, numpy_helper

    ex = pattern.example
    if ex is None:
        raise PatternError(f"{pattern.source}: example: pattern has no example")
    types = {"float32": onnx.TensorProto.FLOAT, "float16": onnx.TensorProto.FLOAT16,
             "bfloat16": onnx.TensorProto.BFLOAT16, "bool": onnx.TensorProto.BOOL}
    first_dtype = next(iter(ex.inputs.values()))[0]
    np_dtype = {"float32": np.float32, "float16": np.float16}.get(first_dtype, np.float32)
    inits, nodes = [], []
    rng = np.random.default_rng(0)
    for name, (dt, dims, value) in ex.initializers.items():
        if value is None:
            fan_in = int(np.prod(dims[1:])) if len(dims) > 1 else 1
            arr = rng.standard_normal(dims) / np.sqrt(fan_in)
        else:
            arr = np.full(dims, value)
        np_dt = {"float16": np.float16, "int64": np.int64}.get(dt, np.float32)
        inits.append(numpy_helper.from_array(arr.astype(np_dt), name))
    for k, (op, ins, outs, attrs) in enumerate(ex.nodes):
        names = []
        for j, x in enumerate(ins):
            if isinstance(x, (int, float)) and not isinstance(x, bool):
                name = f"const_{k}_{j}"
                inits.append(numpy_helper.from_array(np.array(x, np_dtype), name))
                names.append(name)
            else:
                names.append(str(x))
        nodes.append(helper.make_node(op, names, list(outs), name=f"{op.lower()}_{k}", **attrs))
    inputs = [helper.make_tensor_value_info(k, types[dt], list(shape)) for k, (dt, shape) in ex.inputs.items()]
    graph = helper.make_graph(nodes, f"{pattern.name}_example", inputs, [], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    known = {vi.name: vi for vi in inferred.graph.value_info}
    for name in ex.outputs:
        if name not in known:
            raise PatternError(f"{pattern.source}: example.outputs: {name!r} is not produced by a node")
        model.graph.output.append(known[name])
    return model
