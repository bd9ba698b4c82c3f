"""FusedRows on an NVIDIA GPU (run with ``pytest -m gpu`` on the device machine):

- the ahead-of-time binaries of every variant (compiled for N, single pass up to max_cols,
  looped), launched through the CUDA driver with the parameters and grid the C++ launcher
  passes (docs/format.md, kind rows), against the numpy reference of the contract
  (`gpu(ort=False, torch=True)`: needs torch with CUDA, not onnxruntime-gpu);
- optimized models on ONNX Runtime's CUDA execution provider with the custom-op library
  against the originals there, with and without CUDA graphs, at row lengths that are not
  multiples of any block, fp32 and fp16 (`gpu`: needs onnxruntime-gpu)."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from tests.test_rows_codegen import CASES, NP, _strides, assert_outputs, inputs_of, spec_of
from tests.test_rows_patterns import _ln_graph, _moments_ln, _softmax_graph, _w, _written_softmax
from tests.util import model

F, H = TensorProto.FLOAT, TensorProto.FLOAT16


def _arch() -> int:
    import torch

    from onnxfuse.compile import SUPPORTED_ARCHS

    major, minor = torch.cuda.get_device_capability()
    arch = major * 10 + minor
    return arch if arch in SUPPORTED_ARCHS else max(a for a in SUPPORTED_ARCHS if a < arch)


@pytest.mark.gpu(ort=False, torch=True)
def test_aot_variants_launch_with_the_documented_abi(tmp_path):
    import torch

    from onnxfuse.codegen_rows import rows_variants
    from onnxfuse.compile import compile_kernels
    from tests.test_codegen import _Driver

    drv = _Driver()
    tdt = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
    checked = 0
    for i, case in enumerate(CASES):
        spec, forced = spec_of(i, case)
        variants = (dataclasses.replace(forced, index=0),) if case.variant else rows_variants(spec)
        (ck,) = compile_kernels([spec], [_arch()], cache_dir=tmp_path / "cache", variant_override=variants)
        meta = ck.kernel_meta()
        inputs = inputs_of(i, case)
        shape = case.shape
        n_rows = int(np.prod(shape[:case.axis], dtype=np.int64))
        n_cols = int(np.prod(shape[case.axis:], dtype=np.int64))
        for v, vm in zip(variants, meta["variants"], strict=True):
            if vm["cols"] not in (0, n_cols) or 0 < vm["max_cols"] < n_cols:
                continue
            ins = []
            for a in inputs:
                if a.dtype == np.bool_:
                    ins.append(torch.from_numpy(a.astype(np.int8)).cuda())
                elif a.dtype == NP["bf16"]:
                    ins.append(torch.from_numpy(a.view(np.uint16).copy()).view(torch.bfloat16).cuda())
                else:
                    ins.append(torch.from_numpy(np.ascontiguousarray(a)).cuda())
            dts = [dt for _, dt in spec.program.outputs] + ([spec.x_dtype] if spec.x_output else [])
            outs = [torch.full(shape, float("nan"), dtype=tdt[dt], device="cuda") for dt in dts]
            ints = [n_rows, n_cols]
            strided = [a for a, m in zip(inputs, spec.input_modes, strict=True) if m == "strided"]
            if strided:
                ints += list(shape[:case.axis])
                for a in strided:
                    st = _strides(a.shape, shape)
                    ints += st[:case.axis] + [1 if any(st[case.axis:]) else 0]
            b = next(b for b in meta["binaries"] if b["variant"] == v.index and b["format"] == "cubin")
            blob = ck.kernels()[meta["binaries"].index(b)]
            drv.launch(blob, b["entry"], v.grid(n_rows)[0], b["num_warps"], b["shared"],
                       [t.data_ptr() for t in ins + outs] + ints, torch.cuda.current_stream().cuda_stream)
            torch.cuda.synchronize()
            assert_outputs(i, [o.float().cpu().numpy() for o in outs], f"{case.id} variant {v.index} ")
            checked += 1
    assert checked >= len(CASES)


# ---------------------------------------------------------------------------------------
# ONNX Runtime's CUDA EP with the library
# ---------------------------------------------------------------------------------------

def _models() -> list[tuple[str, onnx.ModelProto, dict]]:
    rng = np.random.default_rng(0)
    out = []
    for d in (768, 1000, 77, 10000):  # 10000 > MAX_SINGLE_PASS: the looped kernel
        m = _ln_graph(x_shape=(4, 3, d), square="mul", extra=[helper.make_node("Relu", ["y"], ["z"])])
        out.append((f"ln-{d}", m, {"x": (rng.standard_normal((4, 3, d)) * 3 + 2).astype(np.float32)}))
    m = _ln_graph(x_shape=(8, 768), dtype=H)
    out.append(("ln-fp16-1e4", m, {"x": (rng.standard_normal((8, 768)) * 1e4).astype(np.float16)}))
    nodes = [helper.make_node("Add", ["a", "b"], ["h"]),
             helper.make_node("LayerNormalization", ["h", "g", "be"], ["n"], axis=-1, epsilon=1e-5),
             helper.make_node("Gelu", ["n"], ["y"]), helper.make_node("Mul", ["h", "two"], ["h2"])]
    m = model(nodes, {"a": ("float16", [2, 9, 1024]), "b": ("float16", [2, 9, 1024])},
              {"y": ("float16", [2, 9, 1024]), "h2": ("float16", [2, 9, 1024])},
              {"g": _w(1024).astype(np.float16), "be": _w(1024).astype(np.float16), "two": np.array(2.0, np.float16)},
              opset=20)
    out.append(("prenorm-fp16-x-output", m, {k: rng.standard_normal((2, 9, 1024)).astype(np.float16) for k in "ab"}))
    for s in (77, 300, 3000, 10000):  # dynamic S: the 128, 512, 8192 and looped variants
        m = _softmax_graph(shape=(2, 2, 3, s))
        mask = np.where(rng.random((2, 1, 1, s)) < 0.1, -1e4, 0).astype(np.float32)
        out.append((f"softmax-{s}", m, {"s": (rng.standard_normal((2, 2, 3, s)) * 4).astype(np.float32), "mask": mask}))
    # the written-out forms: a softmax (ReduceMax, Sub, Exp, ReduceSum, Div / Reciprocal-Mul)
    # and a LayerNorm as E[x^2] - E[x]^2 (magnitude 5, where the moments form loses digits)
    for form in ("div", "reciprocal"):
        out.append((f"written-softmax-{form}", _written_softmax(form),
                    {"s": (rng.standard_normal((2, 3, 11)) * 8).astype(np.float32)}))
    for reduce in ("ReduceSum", "ReduceMean"):
        out.append((f"moments-ln-{reduce}", _moments_ln(reduce, 1, n=6, d=300),
                    {"x": (rng.standard_normal((6, 300)) + 5).astype(np.float32)}))
    return out


MODELS = _models()


@pytest.mark.gpu
@pytest.mark.parametrize("index", range(len(MODELS)), ids=[m[0] for m in MODELS])
def test_cuda_op_matches_onnx_runtime(index, tmp_path, monkeypatch):
    import onnxruntime as ort

    from onnxfuse import library_path, optimize_model
    from onnxfuse.compile import local_gpu_archs
    from onnxfuse.kernels import compile_fused

    monkeypatch.setenv("ONNXFUSE_CACHE", str(tmp_path))
    name, m, feeds = MODELS[index]
    r = optimize_model(m, leave_to_ort=False)
    info, _ = compile_fused(r.model, r.fused, local_gpu_archs())
    assert not info["failed"] and any(n.op_type == "FusedRows" for n in r.model.graph.node)

    def session(mm, library, graph=False):
        so = ort.SessionOptions()
        so.log_severity_level = 3
        if library:
            so.register_custom_ops_library(library_path())
        opts = {"use_tf32": "0", **({"enable_cuda_graph": "1"} if graph else {})}
        return ort.InferenceSession(mm.SerializeToString(), so, providers=[("CUDAExecutionProvider", opts)])

    want = session(m, False).run(None, feeds)
    for graph in (False, True):
        got = session(r.model, True, graph).run(None, feeds)
        for e, g in zip(want, got, strict=True):
            assert e.dtype == g.dtype and e.shape == g.shape
            tol = 1e-5 if e.dtype == np.float32 else 1e-2
            scale = float(np.nanmax(np.abs(e.astype(np.float64)), initial=1.0))
            if name == "ln-fp16-1e4":  # ORT's fp16 kernels may lose this row's variance; the fused node does not
                assert np.isfinite(g).all()
                continue
            np.testing.assert_allclose(g.astype(np.float64), e.astype(np.float64), rtol=tol, atol=tol * scale,
                                       equal_nan=True, err_msg=f"{name}, CUDA graph {graph}")
