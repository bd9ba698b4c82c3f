"""Input shapes: the one ``--shape`` parser and the one dim binder.

``--shape NAME=DIMS`` names a graph input (``x=1x3x224x224``, ``x=1,3,224,224``) or a
symbolic dimension (``seq=128``); ``--batch N`` sizes symbolic leading dims. `resolve_inputs`
turns a model's input signature and those options into a concrete shape per input (bench,
bisect, tune, static shapes); `with_input_dims` writes such shapes into a copy of the model.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from onnx import ModelProto

from onnxfuse.errors import OnnxfuseError

# ONNX TensorProto element types the tools can feed, as numpy dtypes.
NP_OF_ONNX = {1: np.float32, 2: np.uint8, 3: np.int8, 4: np.uint16, 5: np.int16, 6: np.int32, 7: np.int64,
              9: np.bool_, 10: np.float16, 11: np.float64, 12: np.uint32, 13: np.uint64}
ONNX_TYPE_NAMES = {0: "undefined", 8: "string", 14: "complex64", 15: "complex128", 16: "bfloat16"}


@dataclass(frozen=True)
class Input:
    """A graph input as the model declares it."""

    name: str
    elem_type: int
    dims: tuple[int | str | None, ...]   # int (static), str (dim_param) or None (unknown)


@dataclass(frozen=True)
class InputSpec:
    """A graph input at concrete dims."""

    name: str
    dtype: str
    shape: tuple[int, ...]


# ---------------------------------------------------------------------------------------
# Parsing --shape
# ---------------------------------------------------------------------------------------

def parse_dims(text: str) -> tuple[int, ...]:
    """'1x3x224x224', '1,3,224,224', '[1,3,224,224]', '1×3' or '32' -> a tuple of dims."""
    t = text.strip().strip("[]()")
    parts = [p for p in t.replace("x", ",").replace("X", ",").replace("×", ",").split(",")
             if p.strip() != ""] if t else []
    try:
        dims = tuple(int(p) for p in parts)
    except ValueError:
        raise OnnxfuseError(f"bad dimensions {text!r}: expected e.g. 1x3x224x224") from None
    if any(d < 0 for d in dims):
        raise OnnxfuseError(f"bad dimensions {text!r}: negative size")
    return dims


def parse_assignments(items: list[str] | tuple[str, ...] | None, what: str) -> dict[str, str]:
    """``["a=1", "b=x"]`` -> {"a": "1", "b": "x"}; an item without NAME=VALUE is an error
    naming the option `what`."""
    out: dict[str, str] = {}
    for item in items or ():
        name, sep, value = item.partition("=")
        if not sep or not name or not value:
            raise OnnxfuseError(f"{what} {item!r}: expected NAME=VALUE")
        out[name] = value
    return out


def parse_shapes(items: list[str] | tuple[str, ...] | None) -> dict[str, tuple[int, ...]]:
    """``--shape`` options (``["x=1,3,224,224", "seq=128"]``) -> {name: dims}."""
    out = {}
    for name, value in parse_assignments(items, "--shape").items():
        try:
            out[name] = parse_dims(value)
        except OnnxfuseError as e:
            raise OnnxfuseError(f"--shape {name}={value}: {e}") from None
    return out


# ---------------------------------------------------------------------------------------
# Binding dims
# ---------------------------------------------------------------------------------------

def signature(model: ModelProto) -> list[Input]:
    """The model's graph inputs that are not initializers, as declared."""
    init = {t.name for t in model.graph.initializer}
    out = []
    for vi in model.graph.input:
        if vi.name in init:
            continue
        tt = vi.type.tensor_type
        dims: list[int | str | None] = []
        for d in tt.shape.dim:
            if d.HasField("dim_value") and d.dim_value > 0:
                dims.append(d.dim_value)
            elif d.HasField("dim_param") and d.dim_param:
                dims.append(d.dim_param)
            else:
                dims.append(None)
        out.append(Input(vi.name, tt.elem_type, tuple(dims)))
    return out


def input_dtype(inp: Input) -> str | None:
    """The numpy dtype name of an input the tools can feed, else None."""
    return np.dtype(NP_OF_ONNX[inp.elem_type]).name if inp.elem_type in NP_OF_ONNX else None


def resolve_inputs(sig: list[Input], shapes: dict[str, tuple[int, ...]], batch: int | None, where: str,
                   given: frozenset[str] | set[str] | dict = frozenset()) -> tuple[list[InputSpec], list[str]]:
    """Concrete shapes for every input of `sig`, and notes about dimensions set by default:
    `shapes` (an input's dims, or a named dimension's size), then `batch` (or 1) for a
    symbolic leading dim, then 1 for any other unknown dim. `given`: the names of inputs
    whose values are given (``--input``), checked against the signature."""
    names = {i.name for i in sig}
    params = {d for i in sig for d in i.dims if isinstance(d, str)}
    for key, dims in shapes.items():
        if key not in names and key not in params:
            raise OnnxfuseError(f"--shape {key}: {where} has no input or dimension named {key!r} "
                                f"(inputs: {', '.join(sorted(names)) or 'none'})")
        if key not in names and len(dims) != 1:
            raise OnnxfuseError(f"--shape {key}: a named dimension takes one size, got {'x'.join(map(str, dims))}")
    for key in given:
        if key not in names:
            raise OnnxfuseError(f"--input {key}: {where} has no input named {key!r} "
                                f"(inputs: {', '.join(sorted(names)) or 'none'})")
    specs, notes = [], []
    for inp in sig:
        dtype = input_dtype(inp)
        if dtype is None:
            tname = ONNX_TYPE_NAMES.get(inp.elem_type, str(inp.elem_type))
            raise OnnxfuseError(f"{where}: input {inp.name!r} has type {tname}, which bench cannot generate")
        if inp.name in shapes:
            shape = shapes[inp.name]
            if len(shape) != len(inp.dims):
                raise OnnxfuseError(f"--shape {inp.name}: {len(shape)} dims given, the input has {len(inp.dims)}")
            for k, (want, declared) in enumerate(zip(shape, inp.dims, strict=True)):
                if isinstance(declared, int) and want != declared:
                    raise OnnxfuseError(f"--shape {inp.name}: dim {k} is {declared} in the model, {want} given")
            specs.append(InputSpec(inp.name, dtype, tuple(shape)))
            continue
        shape = []
        for k, d in enumerate(inp.dims):
            if isinstance(d, int):
                shape.append(d)
            elif isinstance(d, str) and d in shapes:
                shape.append(shapes[d][0])
            elif k == 0:
                shape.append(batch or 1)
                if batch is None:
                    notes.append(f"input {inp.name!r}: leading dim {d or '?'!s} set to 1 (--batch N to change)")
            else:
                shape.append(1)
                notes.append(f"input {inp.name!r}: dim {k} ({d or 'unnamed'}) set to 1 "
                             f"(--shape {inp.name}=... or --shape {d or 'NAME'}=N to change)")
        specs.append(InputSpec(inp.name, dtype, tuple(shape)))
    return specs, notes


def input_dims(model: ModelProto, shapes: dict[str, tuple[int, ...]], batch: int | None = None,
               where: str = "the model") -> tuple[dict[str, tuple[int, ...]], list[str]]:
    """Every input's dims (`resolve_inputs` on the model's signature), and the notes about
    dims set by default."""
    specs, notes = resolve_inputs(signature(model), shapes, batch, where)
    return {s.name: s.shape for s in specs}, notes


def with_input_dims(model: ModelProto, dims: dict[str, tuple[int, ...]]) -> ModelProto:
    """A copy of `model` whose graph inputs named in `dims` have those static dims (same rank)."""
    out = ModelProto()
    out.CopyFrom(model)
    inits = {t.name for t in out.graph.initializer}
    for vi in out.graph.input:
        if vi.name in inits or vi.name not in dims:
            continue
        shape = vi.type.tensor_type.shape
        want = dims[vi.name]
        if len(shape.dim) != len(want):
            raise OnnxfuseError(f"--shape {vi.name}: {len(want)} dims given, the input has {len(shape.dim)}")
        for d, v in zip(shape.dim, want, strict=True):
            if d.HasField("dim_value") and d.dim_value > 0 and d.dim_value != v:  # -1: dynamic (Paddle)
                raise OnnxfuseError(f"--shape {vi.name}={','.join(map(str, want))}: the model fixes that dim to "
                                    f"{d.dim_value}")
            d.Clear()
            d.dim_value = int(v)
    return out
