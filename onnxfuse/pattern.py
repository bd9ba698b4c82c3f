"""Declarative fusion patterns: one YAML file each, validated when loaded.

A pattern file names a fusion kind (onnxfuse/kinds/) and that kind's parameters:

    name: pointwise_chain              # unique; becomes part of kernel names
    description: one line for `onnxfuse patterns`
    priority: 100                      # lower runs first; a node joins at most one match
    kind: pointwise                    # the fusion kind: its matcher, node and kernel
    match:                             # the kind's parameters
      ops: [Add, Mul, Sigmoid, ...]    # op types that may join a group
      dtypes: [float32, float16, bfloat16]
      min_nodes: 2
    example:                           # a tiny graph the tests build and optimize
      inputs: {x: [float32, [2, 3]]}
      nodes:
        - [Mul, [x, 2.0], [t]]
        - [Sigmoid, [t], [y]]
      outputs: [y]
      expect: {PointwiseChain: 1}

The kind owns its op type and its kernel (PointwiseChain, FusedConv, FusedMaxPool). Kinds
and their parameters besides ops and dtypes:
- pointwise: min_nodes (default 2). Connected, convex groups of elementwise nodes.
- conv: group (1 or "any"), pool ("none": no MaxPool after the epilogue; "tiling": a
  MaxPool whose windows tile its input must follow), alone (default false; true: a Conv
  with no fusible epilogue matches too, its program the identity). A 2-D Conv and the
  pointwise ops after it (docs/format.md "FusedConv").
- maxpool: min_nodes (default 1; 0: a MaxPool alone matches too). Pointwise ops and the
  2-D MaxPool they feed ("FusedMaxPool").
- rows: reductions (layer_norm, rms_norm, softmax, log_softmax), min_nodes (default 1). A
  normalization or softmax over the trailing dims with the pointwise ops before and after
  it ("FusedRows").

Older files name the kind inside `match` by its matching strategy (`kind:
elementwise_group`, `conv_epilogue` or `pool_prologue`) and carry a `replace` part
(`op_type`, `kernel`); they load as before, and `replace` must say what the kind writes.

An example may declare constant weights: `initializers: {w: [float32, [4, 3, 3, 3]]}` is
seeded random (scaled by 1/sqrt of its fan-in), `{b: [float32, [4], 0.5]}` all 0.5,
`{axes: [int64, [1], -1]}` an int64 constant (a value is required: ReduceMean's axes). Input
dims may be names (symbolic, e.g. N).
"""

from __future__ import annotations

from pathlib import Path

import yaml

from onnxfuse.errors import PatternError
from onnxfuse.files import record_read
from onnxfuse.kinds import KINDS
from onnxfuse.kinds.base import Example, Fields, Kind, Params, Pattern
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
DTYPES = ("float32", "float16", "bfloat16")


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
    top = Fields(data, path)
    top.no_extra({"name", "description", "priority", "kind", "match", "replace", "example"})
    name = top.get("name", str)
    if not name.isidentifier():
        top.fail("name", f"{name!r} must be an identifier (letters, digits, _)")
    description = top.get("description", str)
    priority = top.get("priority", int, 100)

    m = top.sub("match")
    kind = _load_kind(top, m)
    match = _load_match(m, kind)
    _check_replace(top.sub("replace", None), kind)

    example = _load_example(top.sub("example", None), path)
    return Pattern(
        name=name, description=description, priority=priority,
        kind=kind, match=match,
        example=example, source=str(path),
    )


def _load_kind(top: Fields, m: Fields) -> Kind:
    """The pattern's kind: top-level `kind`, or in older files `match.kind` (a kind's
    `match_kind`, or its name)."""
    known = ", ".join(KINDS)
    if "kind" in top.data:
        name = top.get("kind", str)
        if name not in KINDS:
            top.fail("kind", f"unknown kind {name!r} (known: {known})")
        if "kind" in m.data:
            m.fail("match.kind", "the pattern's kind is given once, at the top level")
        return KINDS[name]
    if "kind" not in m.data:
        top.fail("kind", f"is required (one of {known})")
    name = m.get("kind", str)
    kind = next((k for k in KINDS.values() if name in (k.match_kind, k.name)), None)
    if kind is None:
        m.fail("match.kind", f"unknown kind {name!r} (known: {known}; in older files: "
                             f"{', '.join(k.match_kind for k in KINDS.values())})")
    return kind


def _load_match(m: Fields, kind: Kind) -> Params:
    """The `match` part of a pattern file: ops and dtypes, then the kind's parameters."""
    m.no_extra({"ops", "dtypes", *kind.params} | ({"kind"} if "kind" in m.data else set()))
    ops = m.get("ops", list)
    for op in ops:
        if op not in ELEMENTWISE_OPS:
            m.fail("match.ops", f"{op!r} is not an elementwise op onnxfuse can fuse")
    dtypes = m.get("dtypes", list, list(DTYPES))
    for dt in dtypes:
        if dt not in DTYPES:
            m.fail("match.dtypes", f"{dt!r} is not one of {', '.join(DTYPES)}")
    return kind.parse(m, frozenset(ops), frozenset(dtypes))


def _check_replace(r: Fields | None, kind: Kind) -> None:
    """An older file's `replace` part: it must name what the kind writes (the kind owns its
    op type and its kernel)."""
    if r is None:
        return
    r.no_extra({"op_type", "kernel"})
    op_type = r.get("op_type", str)
    kernel = r.get("kernel", str)
    if kernel not in KINDS:
        r.fail("replace.kernel", f"unknown kernel {kernel!r} (known: {', '.join(KINDS)})")
    if kernel != kind.name:
        r.fail("replace.kernel", f"kernel {kernel!r} does not run matches of kind {kind.match_kind} "
                                 f"(use {kind.name})")
    if op_type != kind.op_type:
        r.fail("replace.op_type", f"{op_type!r}: kind {kind.name} writes {kind.op_type} nodes")


def _load_example(e: Fields | None, path: Path) -> Example | None:
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
