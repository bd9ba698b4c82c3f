"""Load a model with clear errors, undo exporters' habits, and infer shapes.

Steps (each a function from ModelProto to ModelProto):
- `load_model`: read the file (external data too) and check it, or raise OnnxfuseError.
- `canonicalize`: Constant nodes become initializers, initializers listed as graph inputs
  (IR < 4) become plain constants (from IR 4 on they are defaults the caller may override,
  and stay inputs), Identity and inference-mode Dropout nodes are removed.
- `infer_shapes`: ONNX shape inference, returned as a separate model so the output keeps
  only the value_info the user had.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import onnx
from google.protobuf.message import DecodeError
from onnx import ModelProto, numpy_helper

from onnxfuse.errors import OnnxfuseError
from onnxfuse.files import record_read
from onnxfuse.ir import copy_fields, serialized_bytes, subgraphs

# Oldest and newest default-domain opsets the optimizer accepts.
MIN_OPSET = 7
MAX_OPSET = onnx.defs.onnx_opset_version()


def read_model(path: str | os.PathLike) -> ModelProto:
    """Parse an ONNX model file without its external data; a one-line OnnxfuseError when
    the file is missing, a folder, not ONNX or truncated."""
    p = Path(path)
    if not p.exists():
        raise OnnxfuseError(f"{p}: no such file")
    if p.is_dir():
        raise OnnxfuseError(f"{p}: is a directory, not an ONNX model")
    try:
        model = onnx.load(str(p), load_external_data=False)
    except (DecodeError, RuntimeError, ValueError, OSError) as e:
        raise OnnxfuseError(f"{p}: not a valid ONNX model ({_first_line(e) or 'cannot parse protobuf'})") from None
    if not model.graph.node and not model.graph.output:
        raise OnnxfuseError(f"{p}: not a valid ONNX model (empty or truncated file)")
    record_read(p)
    for t in _all_tensors(model):
        if t.data_location == onnx.TensorProto.EXTERNAL:
            loc = next((kv.value for kv in t.external_data if kv.key == "location"), None)
            if loc is not None:
                record_read(p.parent / loc)
    return model


def load_model(path: str | os.PathLike) -> ModelProto:
    """Read and check an ONNX model file; every failure is a one-line OnnxfuseError."""
    p = Path(path)
    model = read_model(p)
    _check_external_data(model, p.parent)
    try:
        onnx.load_external_data_for_model(model, str(p.parent))
    except (OSError, ValueError, onnx.checker.ValidationError) as e:  # the last: a file outside p's folder
        raise OnnxfuseError(f"{p}: cannot read external data ({_first_line(e)})") from None
    check_opsets(model, str(p))
    if opset_problem(model) is not None:
        return model  # an opset newer than onnx knows cannot be checked; optimize leaves it unchanged
    try:
        if serialized_bytes(model) < 2**31 - 1:
            onnx.checker.check_model(model)
        else:
            onnx.checker.check_model(str(p))
    except onnx.checker.ValidationError as e:
        raise OnnxfuseError(f"{p}: invalid ONNX model ({_first_line(e)})") from None
    return model


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _check_external_data(model: ModelProto, base: Path) -> None:
    for t in _all_tensors(model):
        if t.data_location == onnx.TensorProto.EXTERNAL:
            loc = next((kv.value for kv in t.external_data if kv.key == "location"), None)
            if loc is None or not (base / loc).is_file():
                raise OnnxfuseError(f"missing external data file {loc!r} for tensor {t.name!r} (looked in {base})")


def _all_tensors(model: ModelProto):
    from onnx.external_data_helper import _get_all_tensors

    return _get_all_tensors(model)


def check_opsets(model: ModelProto, where: str = "model") -> None:
    """Raise OnnxfuseError for a default-domain opset older than MIN_OPSET, or for
    default-domain nodes without a default-domain opset import. Newer opsets are not an
    error: `opset_too_new` says why such a model is left unchanged."""
    for imp in model.opset_import:
        if imp.domain in ("", "ai.onnx"):
            if imp.version < MIN_OPSET:
                raise OnnxfuseError(f"{where}: opset {imp.version} is older than supported (>= {MIN_OPSET})")
            return
    if model.graph.node and any(n.domain in ("", "ai.onnx") for n in model.graph.node):
        raise OnnxfuseError(f"{where}: no default-domain opset import")


def opset_problem(model: ModelProto) -> str | None:
    """Why the model cannot be optimized safely because of its default-domain opset, or None.

    Newer than the installed onnx knows: any op may have a new version there, with other
    semantics, and the opset applies to every node, so no node is known to be safe. Older
    than MIN_OPSET: not supported. Other domains' opsets do not matter (onnxfuse fuses
    default-domain ops only)."""
    v = default_opset(model)
    if v is not None and v > MAX_OPSET:
        return f"opset {v} is newer than this onnxfuse knows (<= {MAX_OPSET}, from onnx {onnx.__version__})"
    if v is not None and v < MIN_OPSET:
        return f"opset {v} is older than supported (>= {MIN_OPSET})"
    return None


def default_opset(model: ModelProto) -> int | None:
    """The model's ai.onnx opset version, or None when it imports none."""
    return next((i.version for i in model.opset_import if i.domain in ("", "ai.onnx")), None)


def canonicalize(model: ModelProto) -> ModelProto:
    """Return a copy with Constants as initializers, IR-3 input initializers as constants,
    and Identity, inference-mode Dropout and one-input Concat nodes removed (graph I/O names
    kept)."""
    m = ModelProto()
    m.CopyFrom(model)
    g = m.graph
    _constants_to_initializers(g)
    init_names = {t.name for t in g.initializer}
    # From IR 4 on, an initializer that is also a graph input is the input's default value,
    # which the caller may override: it stays an input (and is not a constant).
    kept_inputs = [i for i in g.input if i.name not in init_names or m.ir_version >= 4]
    if len(kept_inputs) != len(g.input):
        del g.input[:]
        g.input.extend(kept_inputs)
    _remove_passthrough(g)
    # IR < 4 requires every initializer to be a graph input; ours are constants now.
    m.ir_version = max(m.ir_version, 4)
    return m


def _constants_to_initializers(g: onnx.GraphProto) -> None:
    keep = []
    for n in g.node:
        if n.op_type == "Constant" and n.domain in ("", "ai.onnx") and len(n.attribute) == 1:
            t = _constant_value(n)
            if t is not None and n.output[0] not in {o.name for o in g.output}:
                t.name = n.output[0]
                g.initializer.append(t)
                continue
        keep.append(n)
    if len(keep) != len(g.node):
        del g.node[:]
        g.node.extend(keep)


def _constant_value(n: onnx.NodeProto) -> onnx.TensorProto | None:
    a = n.attribute[0]
    import numpy as np

    if a.name == "value":
        t = onnx.TensorProto()
        t.CopyFrom(a.t)
        return t
    if a.name == "value_float":
        return numpy_helper.from_array(np.array(a.f, dtype=np.float32))
    if a.name == "value_floats":
        return numpy_helper.from_array(np.array(a.floats, dtype=np.float32))
    if a.name == "value_int":
        return numpy_helper.from_array(np.array(a.i, dtype=np.int64))
    if a.name == "value_ints":
        return numpy_helper.from_array(np.array(a.ints, dtype=np.int64))
    return None


def _is_passthrough(n: onnx.NodeProto, init: dict) -> bool:
    if n.domain not in ("", "ai.onnx"):
        return False
    if n.op_type == "Identity":
        return True
    if n.op_type == "Concat" and len([x for x in n.input if x]) == 1 and len(n.input) == 1:
        return True  # of one input: a copy (HF's key/value cache concat with no past, as exported)
    if n.op_type == "Dropout":
        if len(n.output) > 1 and n.output[1]:
            return False  # the mask is used
        if len(n.input) > 2 and n.input[2]:
            t = init.get(n.input[2])
            return t is not None and not bool(numpy_helper.to_array(t))
        return True
    return False


def remove_passthrough(model: ModelProto) -> ModelProto:
    """`model` (changed in place) without its Identity and inference-mode Dropout nodes, as
    `canonicalize` removes them (graph I/O names kept)."""
    _remove_passthrough(model.graph)
    return model


def _remove_passthrough(g: onnx.GraphProto) -> None:
    init = {t.name: t for t in g.initializer}
    graph_inputs = {i.name for i in g.input}
    graph_outputs = {o.name for o in g.output}
    rename: dict[str, str] = {}
    drop: set[int] = set()
    producer = {o: i for i, n in enumerate(g.node) for o in n.output if o}
    for idx, n in enumerate(g.node):
        if not _is_passthrough(n, init):
            continue
        src, dst = n.input[0], n.output[0]
        src = rename.get(src, src)
        if dst not in graph_outputs:
            rename[dst] = src
            drop.add(idx)
        elif src in producer and src not in graph_outputs and src not in graph_inputs and src not in init:
            # The graph output keeps its name: the producer writes it directly.
            rename[src] = dst
            drop.add(idx)
    if not drop:
        return
    # Resolve chains of renames.
    def resolve(name: str) -> str:
        seen = set()
        while name in rename and name not in seen:
            seen.add(name)
            name = rename[name]
        return name

    nodes = [n for i, n in enumerate(g.node) if i not in drop]
    for n in nodes:
        for k, name in enumerate(n.input):
            if name:
                n.input[k] = resolve(name)
        for k, name in enumerate(n.output):
            if name:
                n.output[k] = resolve(name)
        _rename_in_subgraphs(n, resolve)
    del g.node[:]
    g.node.extend(nodes)
    dropped_names = {g_out for g_out in rename}
    vi = [v for v in g.value_info if v.name not in dropped_names]
    del g.value_info[:]
    g.value_info.extend(vi)


def _rename_in_subgraphs(n: onnx.NodeProto, resolve) -> None:
    for sg in subgraphs(n):
        local = {i.name for i in sg.input} | {t.name for t in sg.initializer}
        local |= {o for sn in sg.node for o in sn.output}
        for sn in sg.node:
            for k, name in enumerate(sn.input):
                if name and name not in local:
                    sn.input[k] = resolve(name)
            _rename_in_subgraphs(sn, resolve)
        for o in sg.output:
            if o.name not in local:
                o.name = resolve(o.name)


def infer_shapes(model: ModelProto) -> ModelProto:
    """Shape-inferred copy of the model (for analysis only; never written out). Large
    initializers are replaced by empty stand-ins first: inference needs their shapes, not
    their values, and models over 2 GB cannot go through the checker's protobuf otherwise."""
    light = light_copy(model)
    _name_unknown_dims(light.graph)
    _drop_stale_symbols(light.graph)
    return infer_light(light)


def infer_light(light: ModelProto) -> ModelProto:
    """`infer_shapes` of a model whose weights are stand-ins already (`light_copy`): ONNX's
    shape inference, its gaps filled (`_fill_inference_gaps`), then the dims it could not
    relate filled from ONNX Runtime's symbolic shape inference where that is installed
    (`_fill_symbolic_dims`); `light` itself when ONNX's inference fails."""
    try:
        out = onnx.shape_inference.infer_shapes(light, strict_mode=False, data_prop=True)
        if _fill_inference_gaps(out.graph):
            out = onnx.shape_inference.infer_shapes(out, strict_mode=False, data_prop=True)
    except Exception:  # inference is best effort: unknown shapes only block fusion
        return light
    _fill_symbolic_dims(out, light)
    return out


_SSI = "onnxfuse._ort_symbolic_shape_infer"


def _symbolic_shape_infer():
    """ONNX Runtime's `onnxruntime/tools/symbolic_shape_infer.py`, loaded from its file: the
    package `onnxruntime.tools` imports torch wherever torch is installed (a quarter of a GB and
    a second or two for an optimize that needs none of it); the module imports only onnx,
    numpy, sympy and packaging. Through the package where the file is not found."""
    import importlib.util
    import sys

    if _SSI in sys.modules:
        return sys.modules[_SSI]
    spec = importlib.util.find_spec("onnxruntime")
    path = Path(spec.origin).parent / "tools" / "symbolic_shape_infer.py" if spec and spec.origin else None
    if path is None or not path.is_file():
        from onnxruntime.tools import symbolic_shape_infer

        return symbolic_shape_infer
    module_spec = importlib.util.spec_from_file_location(_SSI, path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    sys.modules[_SSI] = module
    return module


def _ort_symbolic_shapes(light: ModelProto) -> ModelProto | None:
    """ONNX Runtime's symbolic shape inference of `light` (what it infers: it may leave some
    tensors unknown), or None: not installed, it failed, or it assumed what a valid model need
    not hold. With auto merge it equates the dims a broadcast meets, which need not be equal where
    one of them is 1: a merge `_merge_holds` cannot show to hold drops the whole result. Run as
    its static `infer_shapes` runs it, but without the file that writes to the working directory
    where some tensor stays unknown."""
    try:
        import contextlib
        import io
        import logging

        ssi = _symbolic_shape_infer()
    except Exception:  # noqa: BLE001 -- onnxruntime or sympy not installed
        return None
    shaped = ModelProto()  # the weights' stand-ins as graph inputs: it reads their shapes, never their values
    copy_fields(light, shaped, skip="graph")
    copy_fields(light.graph, shaped.graph, skip="initializer")
    for t in light.graph.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL and any(
                e.key == "location" and e.value == PLACEHOLDER for e in t.external_data):
            shaped.graph.input.append(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
        else:
            shaped.graph.initializer.append(t)
    light = shaped
    quiet = logging.getLogger(ssi.__name__)  # (its merges' warnings)
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            run = ssi.SymbolicShapeInference(2**31 - 1, True, False, 0)
            run._preprocess(light)
            while run.run_:
                run._infer_impl()
            run._update_output_from_vi()
        named = {d.dim_param for vi in light.graph.input for d in vi.type.tensor_type.shape.dim if d.dim_param}
        if not all(_merge_holds(merged, to, named) for merged, to in run.suggested_merge_.items()):
            return None
        return run.out_mp_
    except Exception:  # noqa: BLE001 -- it fails on this model (or its internals changed): ONNX's shapes
        return None
    finally:
        quiet.setLevel(level)


def _merge_holds(merged: str, to, named: set[str]) -> bool:
    """Whether ONNX Runtime's merge of dim `merged` into `to` (a broadcast met them) holds in every
    run the model can make: `to` an input's named dim s and `merged` an expression of s alone that
    equals s wherever either is 1 (a broadcast of 1 against the other would succeed with them
    unequal), and elsewhere equals s or is another size than 1, which a broadcast refuses. Position
    ids' Min(512, seq) against seq holds; Min(2, a) - 1 against b, or s - 1 against s, does not;
    neither does any merge into a size or of two inputs' dims."""
    if not isinstance(to, str) or to not in named or merged in named:
        return False
    import sympy

    s = sympy.Symbol(to, integer=True, positive=True)
    try:
        e = sympy.sympify(merged, locals={to: s})
    except (sympy.SympifyError, TypeError, SyntaxError):
        return False
    if e.free_symbols != {s}:
        return False
    f = sympy.lambdify(s, e, "math")
    for v in range(1, 4097):  # (far enough for exports' Min(512, seq), Min(2048, seq))
        try:
            ev = f(v)
        except (ArithmeticError, ValueError, TypeError):
            return False
        if ev != int(ev) or (int(ev) != v and (int(ev) == 1 or v == 1)):
            return False
    return True


def _unknown(d: onnx.TensorShapeProto.Dimension) -> bool:
    return not d.HasField("dim_value") and (not d.dim_param or bool(_INFERENCE_SYMBOL.fullmatch(d.dim_param)))


def _fill_symbolic_dims(out: ModelProto, light: ModelProto) -> int:
    """Where ONNX's inference left a dim unknown (no size, or a name of its own such as
    "unk__9"), take the shape ONNX Runtime's symbolic shape inference gives, when it agrees
    with every size ONNX's gives; returns how many shapes changed. ONNX's inference does not
    multiply or divide symbolic dims: a Reshape of [batch, seq, 768] to [batch, seq, -1, 64]
    (every exporter's head split when the batch is dynamic) leaves it the heads unknown, and all
    that follows (the attention's Transposes, repeat_kv, B * H) with them; ORT's (sympy) knows
    12, and B * H as "12*batch" (`_ort_symbolic_shapes`: which of its merges it trusts).
    Optional: it needs onnxruntime and sympy (`pip install onnxfuse[cpu]` or `[gpu]`);
    without them, or where it fails, ONNX's shapes stay as they are."""
    infos = {vi.name: vi for vi in [*out.graph.value_info, *out.graph.output]}
    if all(not _unknown(d) for vi in infos.values() for d in vi.type.tensor_type.shape.dim) \
            and all(o in infos for n in out.graph.node for o in n.output if o):
        return 0
    sym = _ort_symbolic_shapes(light)
    if sym is None:
        return 0
    changed = 0
    for vi in [*sym.graph.value_info, *sym.graph.output]:
        t = vi.type.tensor_type
        if not vi.type.HasField("tensor_type") or not t.HasField("shape") or any(
                not d.HasField("dim_value") and not d.dim_param for d in t.shape.dim):
            continue
        mine = infos.get(vi.name)
        if mine is None:
            out.graph.value_info.append(vi)
            changed += 1
            continue
        m = mine.type.tensor_type
        if not m.HasField("shape"):
            m.shape.CopyFrom(t.shape)
            changed += 1
            continue
        if len(m.shape.dim) != len(t.shape.dim) or not any(_unknown(d) for d in m.shape.dim):
            continue
        if any(d.HasField("dim_value") and (not e.HasField("dim_value") or e.dim_value != d.dim_value)
               for d, e in zip(m.shape.dim, t.shape.dim, strict=True)):
            continue  # the two disagree: ONNX's stays
        for d, e in zip(m.shape.dim, t.shape.dim, strict=True):
            if _unknown(d):
                d.CopyFrom(e)
        changed += 1
    return changed


def light_copy(model: ModelProto) -> ModelProto:
    """A copy of `model` whose initializers of more than 4096 bytes are empty stand-ins (name,
    type and shape kept): what shape inference reads of them, without copying the weights."""
    light = ModelProto()
    copy_fields(model, light, skip="graph")  # field by field: the weights are never read
    g, lg = model.graph, light.graph
    copy_fields(g, lg, skip="initializer")
    for t in g.initializer:
        if declared_bytes(t) <= 4096:
            lg.initializer.add().CopyFrom(t)
        else:
            stand_in = lg.initializer.add(name=t.name, data_type=t.data_type)
            stand_in.dims.extend(t.dims)
            _make_placeholder(stand_in)
    return light


def declared_bytes(t: onnx.TensorProto) -> int:
    """A tensor's size by its dims and type (its data is not read; strings count 8 bytes each)."""
    try:
        size = onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
    except (KeyError, TypeError, ValueError):
        size = 8
    n = 1
    for d in t.dims:
        n *= d
    return n * max(size, 1)


def _fill_inference_gaps(g: onnx.GraphProto) -> bool:
    """Give Reshape(t, Shape(s)) the shape of s where inference left it unknown (onnx 1.23
    does not propagate it: torch's GroupNorm export reshapes back so), and GroupNormalization's
    output its input's type; True if any changed."""
    infos = {vi.name: vi for vi in [*g.input, *g.value_info, *g.output]}
    producer = {o: n for n in g.node for o in n.output}

    def shape(name: str):
        vi = infos.get(name)
        if vi is None or not vi.type.tensor_type.HasField("shape"):
            return None
        return vi.type.tensor_type.shape

    changed = False
    for n in g.node:
        if n.op_type == "GroupNormalization" and n.domain in ("", "ai.onnx") and n.input[0] in infos \
                and n.output[0] not in infos:
            # onnx 1.23 infers nothing for opset 18's GroupNormalization (deprecated): y is x's shape
            vi = onnx.ValueInfoProto()
            vi.CopyFrom(infos[n.input[0]])
            vi.name = n.output[0]
            g.value_info.append(vi)
            infos[vi.name] = vi
            changed = True
            continue
        if n.op_type != "Reshape" or n.domain not in ("", "ai.onnx") or len(n.input) < 2 or shape(n.output[0]):
            continue
        p = producer.get(n.input[1])
        if p is None or p.op_type != "Shape" or any(a.name in ("start", "end") for a in p.attribute):
            continue
        src, data = shape(p.input[0]), infos.get(n.input[0])
        if src is None or data is None or not data.type.tensor_type.elem_type:
            continue
        vi = onnx.helper.make_tensor_value_info(n.output[0], data.type.tensor_type.elem_type, None)
        vi.type.tensor_type.shape.CopyFrom(src)
        if n.output[0] in infos:
            infos[n.output[0]].type.CopyFrom(vi.type)
        else:
            g.value_info.append(vi)
            infos[n.output[0]] = vi
        changed = True
    return changed


# Prefix of the names `infer_shapes` gives to graph-input dims that have neither a size nor
# a name, so that inference can tell tensors derived from the same input have equal dims.
UNKNOWN_DIM = "onnxfuse_unknown_"


# the dims ONNX's shape inference names where it cannot relate a dim to another ("unk__12")
_INFERENCE_SYMBOL = re.compile(r"unk__\d+")


def _drop_stale_symbols(g: onnx.GraphProto) -> None:
    """Drop the value_info entries whose shapes hold a dim an earlier run of ONNX's shape inference
    named (a converter's, such as onnxconverter-common's fp16 conversion): such a name is fresh for
    each tensor inference could not relate, and kept it would stay, where inference run now
    relates the dims to the inputs' own names (a dynamic fp16 decoder's Q: ('unk__50', 'unk__51',
    'unk__52', 32) against the rotated Q's ('unk__34', ...) made the rotary chain's shapes differ)."""
    keep = [vi for vi in g.value_info if not any(
        _INFERENCE_SYMBOL.fullmatch(d.dim_param) for d in vi.type.tensor_type.shape.dim if d.dim_param)]
    if len(keep) != len(g.value_info):
        del g.value_info[:]
        g.value_info.extend(keep)


def _name_unknown_dims(g: onnx.GraphProto) -> None:
    k = 0
    for vi in g.input:
        if vi.type.HasField("tensor_type") and vi.type.tensor_type.HasField("shape"):
            for d in vi.type.tensor_type.shape.dim:
                if not d.HasField("dim_value") and not d.dim_param:
                    d.dim_param = f"{UNKNOWN_DIM}{k}"
                    k += 1


PLACEHOLDER = "onnxfuse-placeholder"  # the location of a stand-in's (absent) external data


def _make_placeholder(t: onnx.TensorProto) -> None:
    """Drop a tensor's values, keeping name, type and shape (as an empty external tensor)."""
    t.ClearField("raw_data")
    for f in ("float_data", "int32_data", "int64_data", "double_data", "uint64_data", "string_data"):
        t.ClearField(f)
    t.data_location = onnx.TensorProto.EXTERNAL
    del t.external_data[:]
    kv = t.external_data.add()
    kv.key, kv.value = "location", PLACEHOLDER
