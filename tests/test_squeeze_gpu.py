"""FusedSqueezeExcite on an NVIDIA GPU (``pytest -m gpu`` on the device machine; needs
onnxruntime-gpu):

- one hand-built node per dtype and layout with its kernel compiled for the device, on the
  CUDA execution provider (the library's launcher: the split of each image's pixels over
  programs, the workspace and the arrival counters) against the library's CPU kernel, at
  sizes that give one program per image, many, and many images; three runs each, identical
  (counters left unzeroed by a run would change the next);
- optimized squeeze-excite blocks against the originals, both on the CUDA EP, plain and
  under CUDA graphs."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from onnxfuse import optimize_model
from onnxfuse.codegen_squeeze import SqueezeSpec
from onnxfuse.compile import compile_kernels
from tests.test_squeeze import se_model as block
from tests.test_squeeze_library import act, se_model

SIZES = [(1, 7, 7), (1, 56, 56), (2, 112, 112), (64, 14, 14), (5, 33, 17), (300, 3, 3), (0, 7, 7)]


def _arch() -> int:
    from onnxfuse.compile import SUPPORTED_ARCHS
    from onnxfuse.tools.cuda import local_gpu_archs

    arch = local_gpu_archs()[0]
    return arch if arch in SUPPORTED_ARCHS else max(a for a in SUPPORTED_ARCHS if a < arch)


def _session(m: onnx.ModelProto, ep: str, graph: bool = False):
    import onnxruntime as ort

    from onnxfuse.runtime import library_path

    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.register_custom_ops_library(library_path())
    # TF32 off: the original's convs in fp32, as the fused node's products are
    opts = {"use_tf32": "0", **({"enable_cuda_graph": "1"} if graph else {})} if ep == "CUDAExecutionProvider" else {}
    return ort.InferenceSession(m.SerializeToString(), so, providers=[(ep, opts)])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, layout, a, g, c, cr", [("f32", "NCHW", "relu", "sigmoid", 96, 24),
                                                        ("f32", "NHWC", "hard_swish", "hard_sigmoid", 96, 24),
                                                        ("f16", "NHWC", "relu", "sigmoid", 40, 10),
                                                        ("f16", "NCHW", "hard_swish", "hard_sigmoid", 40, 10)])
def test_node_on_cuda_matches_the_cpu_kernel(dtype, layout, a, g, c, cr, tmp_path):
    spec = SqueezeSpec("onnxfuse_squeeze_excite_gpu", act(a, dtype), act(g, dtype), c, cr, dtype,
                       x_layout=layout.lower(), y_layout=layout.lower())
    [ck] = compile_kernels([spec], [_arch()], cache_dir=tmp_path)
    m = se_model(act(a, dtype), act(g, dtype), x_layout=layout, y_layout=layout, kernel_meta=ck.kernel_meta_json(),
                 **{f"kernel_{i}": k for i, k in enumerate(ck.kernels())})
    cuda, cpu = _session(m, "CUDAExecutionProvider"), _session(m, "CPUExecutionProvider")
    npdt = np.float16 if dtype == "f16" else np.float32
    for n, h, w in SIZES:
        rng = np.random.default_rng(n * 1000 + h)
        x = rng.standard_normal((n, h, w, c) if layout == "NHWC" else (n, c, h, w)) + 0.3
        f = {"x": x, "w1": rng.standard_normal((cr, c)) / np.sqrt(c), "b1": 0.1 * rng.standard_normal(cr),
             "w2": rng.standard_normal((c, cr)) / np.sqrt(cr), "b2": 0.1 * rng.standard_normal(c)}
        f = {k: v.astype(npdt) for k, v in f.items()}
        runs = [cuda.run(None, f)[0] for _ in range(3)]
        for r in runs[1:]:
            np.testing.assert_array_equal(r, runs[0], err_msg=f"runs differ at N={n} H={h} W={w}")
        want = cpu.run(None, f)[0].astype(np.float64)
        tol = 1e-5 if dtype == "f32" else 1e-2
        assert runs[0].shape == want.shape
        np.testing.assert_allclose(runs[0].astype(np.float64), want, rtol=tol,
                                   atol=tol * max(1.0, float(np.abs(want).max(initial=0.0))),
                                   err_msg=f"N={n} H={h} W={w}")


@pytest.mark.gpu
@pytest.mark.parametrize("a, g, dtype", [("silu", "sigmoid", "float32"), ("relu", "hardsigmoid", "float16")])
def test_optimized_blocks_on_cuda_match_the_originals(a, g, dtype, tmp_path, monkeypatch):
    from onnxfuse.pipeline import compile_pass
    from tests.util import kernel_options

    monkeypatch.setenv("ONNXFUSE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("ONNXFUSE_SQUEEZE_ALL", "1")  # fused without tuning's measurement
    m = block(a, g, c=144, cr=36, dtype=dtype, hw=(56, 56))
    r = optimize_model(m)
    info = compile_pass(r, kernel_options(f"sm_{_arch()}")).report.compile
    assert not info["failed"] and [n.op_type for n in r.model.graph.node].count("FusedSqueezeExcite") == 1
    npdt = np.float16 if dtype == "float16" else np.float32
    x = (np.random.default_rng(1).standard_normal((2, 144, 56, 56)) + 0.5).astype(npdt)
    want = _session(m, "CUDAExecutionProvider").run(None, {"x": x})[0].astype(np.float64)
    tol = 2e-5 if dtype == "float32" else 2e-2
    import onnxruntime as ort

    for graph in (False, True):
        # IO binding, as deployments replay graphs: session.run's replays under CUDA graphs
        # return no outputs (the first H200 run of this test)
        s = _session(r.model, "CUDAExecutionProvider", graph)
        io = s.io_binding()
        xv = ort.OrtValue.ortvalue_from_numpy(x, "cuda", 0)
        yv = ort.OrtValue.ortvalue_from_shape_and_type(want.shape, npdt, "cuda", 0)
        io.bind_ortvalue_input("x", xv)
        io.bind_ortvalue_output(r.model.graph.output[0].name, yv)
        for _ in range(3):  # under graphs: captured on the first runs, replayed after
            s.run_with_iobinding(io)
        got = yv.numpy().astype(np.float64)
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol * float(np.abs(want).max()), err_msg=f"graph {graph}")
