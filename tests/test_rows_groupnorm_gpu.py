"""GroupNorm (FusedRows, reduction group_norm) on an NVIDIA GPU (``pytest -m gpu`` on the device
machine), as tests/test_rows_gpu.py does for the other reductions:

- the ahead-of-time binaries of every variant of tests/test_rows_groupnorm_codegen.py's
  cases (NCHW and channels-last, single pass and looped), launched through the CUDA driver
  with the parameters and grid the C++ launcher passes (docs/format.md, kind rows), against
  the numpy reference (`gpu(ort=False, torch=True)`: needs torch with CUDA);
- optimized models on ONNX Runtime's CUDA execution provider with the custom-op library
  against the originals there, with and without CUDA graphs: torch's export at SD-UNet's
  shape (rows of 40960: the looped kernel), fp16, a dynamic image size, GroupNormalization
  of opsets 18 and 21; fp16 at magnitude 1e4 against float64 (`gpu`: needs onnxruntime-gpu)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from onnx import TensorProto

from tests.test_kernel_sources import _group_norm
from tests.test_rows_gpu import _arch
from tests.test_rows_groupnorm import _gn_op
from tests.test_rows_groupnorm_codegen import CASES, inputs_of, physical, reference, spec_of

F, H = TensorProto.FLOAT, TensorProto.FLOAT16


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
        assert (meta["groups"], meta["channels"], meta["channels_last"]) == (
            case.groups, case.shape[1], int(case.channels_last))
        want = reference(i, case)
        n_rows = case.shape[0] * case.groups
        n_cols = int(np.prod(case.shape)) // n_rows
        for v, vm in zip(variants, meta["variants"], strict=True):
            if vm["cols"] not in (0, n_cols) or 0 < vm["max_cols"] < n_cols:
                continue
            ins = []
            for a in inputs_of(i, case):
                if a.dtype.itemsize == 2 and a.dtype != np.float16:  # bfloat16
                    ins.append(torch.from_numpy(a.view(np.uint16).copy()).view(torch.bfloat16).cuda())
                else:
                    ins.append(torch.from_numpy(np.ascontiguousarray(a)).cuda())
            dts = [dt for _, dt in spec.program.outputs] + ([spec.x_dtype] if spec.x_output else [])
            outs = [torch.full(physical(case), float("nan"), dtype=tdt[dt], device="cuda") for dt in dts]
            b = next(b for b in meta["binaries"] if b["variant"] == v.index and b["format"] == "cubin")
            blob = ck.kernels()[meta["binaries"].index(b)]
            drv.launch(blob, b["entry"], v.grid(n_rows)[0], b["num_warps"], b["shared"],
                       [t.data_ptr() for t in ins + outs] + [n_rows, n_cols], torch.cuda.current_stream().cuda_stream)
            torch.cuda.synchronize()
            for k, (o, w) in enumerate(zip(outs, want, strict=True)):
                got, w = o.float().cpu().numpy(), w.astype(np.float32)
                tol = {"f32": 2e-5, "f16": 2e-3, "bf16": 1.6e-2}[dts[k]]
                np.testing.assert_allclose(got, w, rtol=tol, atol=tol * float(np.abs(w).max(initial=1)),
                                           err_msg=f"{case.id} variant {v.index} output {k}")
            checked += 1
    assert checked >= len(CASES)


def _models() -> list[tuple[str, object, dict]]:
    rng = np.random.default_rng(0)

    def feeds(shape, c, dt=np.float32, scale=1.0):
        return {"x": (rng.standard_normal(shape) * scale).astype(dt),
                "t": rng.standard_normal((shape[0], c, 1, 1)).astype(dt)}

    out = [("torch-sd-1x320x64x64", _group_norm(F, [1, 320, 64, 64], 32, "torch"), feeds((1, 320, 64, 64), 320)),
           ("torch-sd-batch8", _group_norm(F, [8, 320, 32, 32], 32, "torch"), feeds((8, 320, 32, 32), 320)),
           ("op21-fp16", _group_norm(H, ["N", 64, 16, 16], 32, "op"), feeds((4, 64, 16, 16), 64, np.float16)),
           ("op21-dynamic-size", _group_norm(F, ["N", 32, "H", "W"], 8, "op"), feeds((2, 32, 37, 29), 32))]
    m18, _, _ = _gn_op(18, 3)
    out.append(("op18-per-group", m18, feeds((2, 12, 4, 5), 12)))
    out.append(("op21-fp16-1e4", _group_norm(H, [2, 64, 16, 16], 32, "op"),
                feeds((2, 64, 16, 16), 64, np.float16, 1e4)))
    return out


MODELS = _models()


@pytest.mark.gpu
@pytest.mark.parametrize("index", range(len(MODELS)), ids=[m[0] for m in MODELS])
def test_cuda_op_matches_onnx_runtime(index, tmp_path, monkeypatch):
    import onnxruntime as ort

    from onnxfuse import library_path, optimize_model
    from onnxfuse.compile import local_gpu_archs
    from onnxfuse.kernels import compile_fused
    from onnxfuse.kinds.rows import Rows

    monkeypatch.setenv("ONNXFUSE_CACHE", str(tmp_path))
    name, m, feeds = MODELS[index]
    r = optimize_model(m, leave_to_ort=False)
    info, _ = compile_fused(r.model, r.fused, local_gpu_archs())
    assert not info["failed"] and [n.op_type for n in r.model.graph.node] == ["FusedRows"]

    def session(mm, library, graph=False):
        so = ort.SessionOptions()
        so.log_severity_level = 3
        if library:
            so.register_custom_ops_library(library_path())
        opts = {"use_tf32": "0", **({"enable_cuda_graph": "1"} if graph else {})}
        return ort.InferenceSession(mm.SerializeToString(), so, providers=[("CUDAExecutionProvider", opts)])

    if name.endswith("1e4"):  # against float64: ORT's fp16 InstanceNormalization may lose the variance
        from onnx import numpy_helper

        node = r.model.graph.node[0]
        values = {**feeds, **{t.name: numpy_helper.to_array(t) for t in r.model.graph.initializer}}
        want = [o.astype(np.float16) for o in Rows().evaluate(node, [values[x] for x in node.input])]
    else:
        want = session(m, False).run(None, feeds)
    for graph in (False, True):
        got = session(r.model, True, graph).run(None, feeds)
        for e, g in zip(want, got, strict=True):
            assert e.dtype == g.dtype and e.shape == g.shape
            tol = 1e-5 if e.dtype == np.float32 else 1e-2
            scale = float(np.abs(e.astype(np.float64)).max(initial=1.0))
            np.testing.assert_allclose(g.astype(np.float64), e.astype(np.float64), rtol=tol, atol=tol * scale,
                                       err_msg=f"{name}, CUDA graph {graph}")
