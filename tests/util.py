"""Helpers for building tiny models and checking a fusion end to end."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from onnxfuse import optimize_model
from onnxfuse.kinds import KINDS
from onnxfuse.load import canonicalize, infer_shapes
from onnxfuse.pipeline import PASSES, Options, Report, Result, build_options, run_passes
from onnxfuse.tune import TuneSettings

NP = {TensorProto.FLOAT: np.float32, TensorProto.FLOAT16: np.float16, TensorProto.DOUBLE: np.float64,
      TensorProto.BOOL: np.bool_, TensorProto.INT64: np.int64, TensorProto.INT32: np.int32,
      TensorProto.BFLOAT16: ml_dtypes.bfloat16}
ONNX_TYPE = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16,
             "bool": TensorProto.BOOL, "int64": TensorProto.INT64, "float64": TensorProto.DOUBLE}
# Relative tolerance per output dtype, for fused vs original.
RTOL = {np.dtype(np.float32): 1e-5, np.dtype(np.float16): 1e-2, np.dtype(ml_dtypes.bfloat16): 2e-2}


def model(nodes, inputs, outputs, initializers=(), opset=20, ir_version=None) -> onnx.ModelProto:
    """inputs/outputs: {name: (dtype, shape)}; initializers: {name: ndarray}."""
    g = helper.make_graph(
        nodes, "test",
        [helper.make_tensor_value_info(k, ONNX_TYPE[dt], shape) for k, (dt, shape) in inputs.items()],
        [helper.make_tensor_value_info(k, ONNX_TYPE[dt], shape) for k, (dt, shape) in outputs.items()],
        [numpy_helper.from_array(np.asarray(v), k) for k, v in dict(initializers).items()],
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = ir_version or 10
    onnx.checker.check_model(m, full_check=True)
    return m


def random_feeds(m: onnx.ModelProto, dims: dict[str, int] | None = None, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    init = {t.name for t in m.graph.initializer}
    feeds = {}
    for i in m.graph.input:
        if i.name in init:
            continue
        tt = i.type.tensor_type
        shape = [d.dim_value if d.HasField("dim_value") else (dims or {}).get(d.dim_param, 3) for d in tt.shape.dim]
        dt = NP[tt.elem_type]
        if dt == np.bool_:
            feeds[i.name] = rng.random(shape) > 0.5
        else:
            feeds[i.name] = np.asarray(rng.standard_normal(shape) * 2).astype(dt)
    return feeds


def run(m: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def assert_close(expected: np.ndarray, actual: np.ndarray, rtol: float | None = None, what: str = "") -> None:
    assert expected.dtype == actual.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert expected.shape == actual.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    rtol = RTOL.get(expected.dtype, 1e-5) if rtol is None else rtol
    e, a = expected.astype(np.float64), actual.astype(np.float64)
    np.testing.assert_allclose(a, e, rtol=rtol, atol=rtol * 1e-1, equal_nan=True, err_msg=what)


def intermediates(m: onnx.ModelProto, feeds: dict) -> dict[str, np.ndarray]:
    """Every tensor of the canonicalized model, by running it with all of them as outputs."""
    c = canonicalize(m)
    inferred = infer_shapes(c)
    types = {vi.name: vi for vi in list(inferred.graph.value_info) + list(inferred.graph.output)}
    outs = [o.name for o in c.graph.output]
    for n in c.graph.node:
        for o in n.output:
            # numpy has no bfloat16 that ONNX Runtime's Python API returns
            if o and o not in outs and o in types and types[o].type.tensor_type.elem_type != TensorProto.BFLOAT16:
                c.graph.output.append(types[o])
                outs.append(o)
    values = dict(zip(outs, run(c, feeds), strict=True))
    values.update(feeds)
    values.update({t.name: numpy_helper.to_array(t) for t in c.graph.initializer})
    return values


def check_programs(m: onnx.ModelProto, result: Result, feeds: dict, rtol: float | None = None) -> None:
    """Each fused node's program, evaluated with numpy on the node's actual inputs, gives the
    original graph's tensors: the check that the expression the kernels run is right."""
    values = intermediates(m, feeds)
    values.update({t.name: numpy_helper.to_array(t) for t in result.model.graph.initializer})  # packed weights
    if any(x not in values for f in result.fused for x in f.inputs):
        # tensors the optimizer made before fusing (onnxfuse.pack's packed projections): the
        # optimized model's own, its fused nodes running their function bodies
        values = {**intermediates(result.model, feeds), **values}
    nodes = {n.name: n for n in result.model.graph.node}
    for f in result.fused:
        if f.kind != "pointwise":  # the other kinds: the node's contract (docs/format.md) in numpy
            got_all = KINDS[f.kind].evaluate(nodes[f.node_name], [values[x] for x in f.inputs])
            for name, got in zip(f.outputs, got_all, strict=True):
                want = values[name]
                tol = RTOL.get(want.dtype, 1e-5) if rtol is None else rtol
                # a convolution sums many products, a norm's error is its row's: the error scales
                # with the output's magnitude
                np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=tol,
                                           atol=tol * float(np.max(np.abs(want), initial=1.0)), equal_nan=True,
                                           err_msg=f"{f.node_name} against the numpy reference of {f.kind}, {name}")
            continue
        # the program on the inputs as the node reads them (transposed, rotated, cut: its attributes)
        outs = KINDS["pointwise"].evaluate(nodes[f.node_name], [values[x] for x in f.inputs])
        for name, got in zip(f.outputs, outs, strict=True):
            assert_close(values[name], got, rtol=rtol, what=f"program of {f.node_name}, output {name}")


def check_fusion(m: onnx.ModelProto, expect_fused: int | None = None, feeds: dict | None = None,
                 rtol: float | None = None, layout: str = "nchw", patterns: list | None = None,
                 leave_to_ort: bool = True, output_rtol: float = 1e-6) -> Result:
    """Optimize, validate, and compare original vs optimized on seeded random inputs (stock
    ONNX Runtime CPU, so fused nodes run their function bodies) and check each program.

    rtol: for the programs, which compute in fp32 where the original rounds intermediates to
    fp16 (default: by output dtype; pass 1e-2 when the group has fp16 intermediates).
    layout: the patterns' layout (onnxfuse.pipeline.NHWC_ONLY_PATTERNS).
    leave_to_ort: False fuses the nodes ONNX Runtime's own fusions would take too.
    output_rtol: for float32 outputs (on the CPU the fused nodes run their function bodies, the
    same float32 operations; a model whose biases the bias pass moved after their products
    rounds each sum in another order)."""
    before = m.SerializeToString()
    result = optimize_model(m, patterns, layout=layout, leave_to_ort=leave_to_ort)
    assert m.SerializeToString() == before, "optimize_model modified its input"
    onnx.checker.check_model(result.model, full_check=True)
    fused_nodes = [n for n in result.model.graph.node if n.domain == "onnxfuse"]
    if expect_fused is not None:
        assert len(fused_nodes) == expect_fused, result.report.summary()
    feeds = random_feeds(m) if feeds is None else feeds
    expected = run(m, feeds)
    actual = run(result.model, feeds)
    assert [o.name for o in result.model.graph.output] == [o.name for o in m.graph.output]
    for o, e, a in zip(m.graph.output, expected, actual, strict=True):
        assert_close(e, a, rtol=output_rtol if e.dtype == np.float32 else rtol, what=o.name)
    check_programs(m, result, feeds, rtol)
    return result


def op_types(m: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in m.graph.node]


def one_line_error(r) -> str:
    """A finished CLI subprocess that failed on bad input: exit 2, one line on stderr, no
    traceback; returns that stderr."""
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert r.stderr.startswith("onnxfuse: error: ")
    return r.stderr


def kernel_options(target: str, layout: str = "nchw", conv_precision: str = "tf32", jobs: int | None = None) -> Options:
    """Options for compiling a Result of `optimize_model` with `onnxfuse.pipeline.compile_pass`:
    kernels for `target`, the NHWC pass with layout "nhwc", no tuning."""
    return build_options(target, layout, conv_precision, "off", jobs=jobs)


def tuned_options(target: str, dims: dict[str, tuple[int, ...]] | None, layout: str = "auto") -> Options:
    """Options as where the tune pass will run (`optimize --shape` on a GPU: the gemm kind
    matched, nothing fused only where measured given back yet), for the passes before it."""
    return dataclasses.replace(build_options(target=target, layout=layout, tune="off", shapes=dims),
                               tune=TuneSettings(budget_s=1.0))


def passes_upto(m: onnx.ModelProto, options: Options, last) -> Result:
    """`m` through the pipeline's passes with `options`, as `optimize_model` runs them, up to
    and with the pass `last`."""
    return run_passes(Result(m, Report(nodes_before=len(m.graph.node)), original=m), options,
                      PASSES[:PASSES.index(last) + 1])


@contextlib.contextmanager
def interpreted_run(script: str, prefix: str) -> Iterator[Path]:
    """Run `python script --interpret DIR` in a child process under Triton's interpreter
    (TRITON_INTERPRET=1 must not reach this process, where other tests compile kernels);
    yields DIR, where the script left its results."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(Path(__file__).resolve().parents[1]))
        proc = subprocess.run([sys.executable, script, "--interpret", tmp], env=env, capture_output=True,
                              text=True, timeout=900)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        yield Path(tmp)


def compile_sm90(ks, tmp_path: Path):
    """triton.compile of a generated kernel for sm_90 on the CPU, as onnxfuse.compile does."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from onnxfuse.compile import COMPILE_OPTIONS, _load_kernel

    fn = _load_kernel(tmp_path, ks)
    with knobs.cache.scope(), knobs.compilation.scope(), knobs.runtime.scope():
        knobs.cache.dir = str(tmp_path / "triton-cache")
        knobs.runtime.override_arch = None
        src = ASTSource(fn, ks.signature, dict(ks.constexprs), ks.attrs)
        options = dict(COMPILE_OPTIONS, num_warps=ks.num_warps, num_stages=ks.num_stages)
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def sass_lines(cubin: bytes, tmp_path: Path) -> list[str]:
    """The instruction lines of a cubin's SASS, by the nvdisasm that ships with triton."""
    import pytest
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    if not tool.exists():
        pytest.skip("triton ships no nvdisasm here")
    path = tmp_path / "k.cubin"
    path.write_bytes(cubin)
    text = subprocess.run([str(tool), "-c", str(path)], capture_output=True, text=True, check=True).stdout
    return [ln for ln in text.splitlines() if re.search(r"/\*[0-9a-f]{4,}\*/", ln)]


def check_library(original: onnx.ModelProto, optimized: onnx.ModelProto, dtype: str) -> None:
    """The optimized model's one output through the custom-op library's CPU kernels against the
    original's in stock ONNX Runtime, on seeded inputs: within 1e-5 (float32) or 1e-2 (float16)
    of it, relative and of its largest magnitude."""
    from tests.test_attention_patterns import _run_with_library

    feeds = random_feeds(original)
    (want,), (got,) = run(original, feeds), _run_with_library(optimized, feeds)
    tol = 1e-5 if dtype == "float32" else 1e-2
    w64 = want.astype(np.float64)
    np.testing.assert_allclose(got.astype(np.float64), w64, rtol=tol, atol=tol * float(np.abs(w64).max()))
