"""GemmEpilogue on an NVIDIA GPU (run with ``pytest -m gpu`` on the device machine):

- the ahead-of-time binaries of every variant of every kernel case of tests/test_gemm_codegen.py
  (bf16 included), launched through the CUDA driver with the parameters and grid the C++
  launcher passes (docs/format.md, kind gemm), against the numpy reference of the contract
  (`gpu(ort=False, torch=True)`: needs torch with CUDA, not onnxruntime-gpu);
- optimized models on ONNX Runtime's CUDA execution provider with the custom-op library
  against the originals there, with and without CUDA graphs: fp32 at ieee against ORT with
  TF32 off (1e-5 of the scale), fp32 at the default tf32 against the float64 reference within
  2x ORT's own TF32 error plus a floor (onnxfuse bench's gate), fp16 (1e-2);
- split K (codegen_gemm's module docstring) at BERT-base's batch-1 shapes (M = 128) and a
  batched product, where the launcher's rule (`kinds.gemm.launcher_choice`, its mirror) takes
  the split-K variant, through the CUDA EP with and without CUDA graphs; the split variants
  of the kernel cases above launched directly with their workspace and counters;
- the CUDA kernel's kernel_meta checks on "split" (clear errors for bad values);
- cuBLASLt's variants (16-bit product + bias + GELU / ReLU / nothing, float32 + bias at "tf32"
  and "ieee"): run alone (the Triton
  variants taken out of kernel_meta), with and without CUDA graphs, against ORT running the
  original, and their error against float64 no larger than ORT's own."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from tests.test_gemm_codegen import CASES, NP, TOL, extra_strides, geometry, inputs_of, reference, spec_of, y_shape
from tests.test_gemm_patterns import GEMM, _w, ffn1
from tests.util import model

N = helper.make_node


def _arch() -> int:
    import torch

    from onnxfuse.compile import SUPPORTED_ARCHS

    major, minor = torch.cuda.get_device_capability()
    arch = major * 10 + minor
    return arch if arch in SUPPORTED_ARCHS else max(a for a in SUPPORTED_ARCHS if a < arch)


def _launch(image: bytes, entry: str, grid: tuple[int, ...], num_warps: int, shared: int, args: list[int],
            stream: int) -> None:
    """cuModuleLoadData, cuModuleGetFunction, cuLaunchKernel on a 2-D grid (3-D for split K),
    as the C++ launcher."""
    import ctypes as ct

    lib = ct.CDLL("libcuda.so.1")
    mod, fn = ct.c_void_p(), ct.c_void_p()
    assert lib.cuModuleLoadData(ct.byref(mod), ct.c_char_p(image)) == 0
    assert lib.cuModuleGetFunction(ct.byref(fn), mod, entry.encode()) == 0
    values = [ct.c_uint64(a & (2**64 - 1)) for a in args] + [ct.c_uint64(0), ct.c_uint64(0)]
    params = (ct.c_void_p * len(values))(*[ct.cast(ct.byref(v), ct.c_void_p) for v in values])
    if shared > 48 * 1024:
        assert lib.cuFuncSetAttribute(fn, 8, shared) == 0
    gz = grid[2] if len(grid) > 2 else 1
    assert lib.cuLaunchKernel(fn, grid[0], grid[1], gz, 32 * num_warps, 1, 1, shared, ct.c_void_p(stream), params,
                              None) == 0


@pytest.mark.gpu(ort=False, torch=True)
def test_aot_variants_launch_with_the_documented_abi(tmp_path):
    import torch

    from onnxfuse.codegen_gemm import gemm_variants
    from onnxfuse.compile import compile_kernels

    tdt = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
    checked = 0
    for i, case in enumerate(CASES):
        spec, forced = spec_of(i, case)
        variants = (dataclasses.replace(forced, index=0),) if case.variant else gemm_variants(spec)
        (ck,) = compile_kernels([spec], [_arch()], cache_dir=tmp_path / "cache", variant_override=variants)
        meta = ck.kernel_meta()
        inputs = inputs_of(i, case)
        want = reference(i, case).astype(np.float32)
        m, n, k, g, sag, sa, sbg, sb, lead = geometry(case)
        ys = y_shape(case)
        ints = [m, n, k, sag, sa, sbg, sb]
        for (shape, mode) in case.extras:
            if mode == "strided":
                ints += extra_strides(shape, ys, lead)
        for v, vm in zip(variants, meta["variants"], strict=True):
            if vm["max_m"] and m > vm["max_m"]:
                continue
            if vm["stride_multiple"] > 1 and any(s % vm["stride_multiple"] for s in (sag, sa, sbg, sb, n, k)):
                continue
            ins = []
            for a in inputs:
                if a.dtype == NP["bf16"]:
                    ins.append(torch.from_numpy(a.view(np.uint16).copy()).view(torch.bfloat16).cuda())
                else:
                    ins.append(torch.from_numpy(np.ascontiguousarray(a)).cuda())
            y = torch.full(ys, float("nan"), dtype=tdt[spec.program.outputs[0][1]], device="cuda")
            b = next(b for b in meta["binaries"] if b["variant"] == v.index and b["format"] == "cubin")
            blob = ck.kernels()[meta["binaries"].index(b)]
            slices, split_args, keep = 0, [], []
            if vm.get("split"):  # the launcher's slices (2 where it would not split), workspace, zeroed counters
                slices = case.slices or v.slices(m, n, k, g) or 2
                tiles = v.tiles(m, n) * g
                keep = [torch.full((slices * tiles * v.block_m * v.block_n,), float("nan"), device="cuda"),
                        torch.zeros(tiles, dtype=torch.int32, device="cuda")]
                split_args = [t.data_ptr() for t in keep]
            _launch(blob, b["entry"], v.grid(m, n, g, slices), b["num_warps"], b["shared"],
                    [t.data_ptr() for t in [*ins, y]] + ints + split_args, torch.cuda.current_stream().cuda_stream)
            torch.cuda.synchronize()
            got = y.float().cpu().numpy()
            # tf32 on the tensor cores: the operands rounded as the reference rounds them; the sums'
            # order differs
            tol = max(TOL[spec.dtype], TOL[spec.program.outputs[0][1]])
            np.testing.assert_allclose(got, want, rtol=tol, atol=tol * float(np.abs(want).max(initial=1)),
                                       err_msg=f"{case.id} variant {v.index}")
            checked += 1
    assert checked >= len(CASES)


# ---------------------------------------------------------------------------------------
# ONNX Runtime's CUDA EP with the library
# ---------------------------------------------------------------------------------------

def _models() -> list[tuple[str, onnx.ModelProto, dict, bool]]:
    """(name, model, feeds, dynamic_b)."""
    rng = np.random.default_rng(0)
    out = []
    for s, k, n in ((128, 768, 3072), (37, 70, 45), (1, 256, 512)):
        out.append((f"ffn1-{s}x{k}x{n}", ffn1(s=s, k=k, n=n),
                    {"x": rng.standard_normal((8, s, k)).astype(np.float32)}, False))
    out.append(("ffn1-fp16", ffn1("float16", s=128, k=768, n=3072),
                {"x": rng.standard_normal((8, 128, 768)).astype(np.float16)}, False))
    nodes = [N("Gemm", ["x", "w", "c"], ["h"], transB=1, alpha=0.5), N("Relu", ["h"], ["y"])]
    out.append(("gemm-transb", model(nodes, {"x": ("float32", [300, 96])}, {"y": ("float32", [300, 200])},
                                     {"w": _w((200, 96), 3), "c": _w((200,), 4)}),
                {"x": rng.standard_normal((300, 96)).astype(np.float32)}, False))
    nodes = [N("MatMul", ["x", "w"], ["h"]), N("Add", ["h", "b"], ["hb"]), N("Add", ["hb", "r"], ["s"]),
             N("Cast", ["s"], ["y"], to=TensorProto.FLOAT16)]
    out.append(("ffn2-residual-cast", model(nodes, {"x": ("float32", [8, 128, 3072]), "r": ("float32", [8, 128, 768])},
                                            {"y": ("float16", [8, 128, 768])}, {"w": _w((3072, 768)),
                                                                                "b": _w((768,), 2)}),
                {"x": rng.standard_normal((8, 128, 3072)).astype(np.float32),
                 "r": rng.standard_normal((8, 128, 768)).astype(np.float32)}, False))
    # split K (BERT-base at batch 1, M = 128): FFN1 768 -> 3072 + erf-GELU (dynamic batch),
    # FFN2 3072 -> 768 + bias + residual (static), QKV 768 -> 2304 in fp16, and a batched product
    # of two activations (G = 4: one arrival counter per batch and tile)
    out.append(("split-ffn1-b1", ffn1(s=128, k=768, n=3072), {"x": rng.standard_normal((1, 128, 768)).astype(
        np.float32)}, False))
    nodes = [N("MatMul", ["x", "w"], ["h"]), N("Add", ["h", "b"], ["hb"]), N("Add", ["hb", "r"], ["y"])]
    out.append(("split-ffn2-b1-residual", model(nodes, {"x": ("float32", [1, 128, 3072]),
                                                        "r": ("float32", [1, 128, 768])},
                                                {"y": ("float32", [1, 128, 768])},
                                                {"w": _w((3072, 768)), "b": _w((768,), 2)}),
                {"x": rng.standard_normal((1, 128, 3072)).astype(np.float32),
                 "r": rng.standard_normal((1, 128, 768)).astype(np.float32)}, False))
    nodes = [N("MatMul", ["x", "w"], ["h"]), N("Add", ["h", "b"], ["y"])]
    out.append(("split-qkv-b1-fp16", model(nodes, {"x": ("float16", [1, 128, 768])}, {"y": ("float16", [1, 128, 2304])},
                                           {"w": _w((768, 2304), 1, np.float16), "b": _w((2304,), 2, np.float16)}),
                {"x": rng.standard_normal((1, 128, 768)).astype(np.float16)}, False))
    nodes = [N("MatMul", ["p", "v"], ["h"]), N("Relu", ["h"], ["y"])]
    out.append(("split-batched", model(nodes, {"p": ("float32", [4, 64, 1024]), "v": ("float32", [4, 1024, 96])},
                                       {"y": ("float32", [4, 64, 96])}),
                {"p": rng.standard_normal((4, 64, 1024)).astype(np.float32),
                 "v": rng.standard_normal((4, 1024, 96)).astype(np.float32)}, True))
    nodes = [N("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]), N("MatMul", ["q", "kt"], ["s"]),
             N("Mul", ["s", "scale"], ["y"])]
    qk = {"q": ("float32", [2, 12, 128, 64]), "k": ("float32", [2, 12, 128, 64])}
    out.append(("attention-scores", model(nodes, qk, {"y": ("float32", [2, 12, 128, 128])},
                                          {"scale": np.array(0.125, np.float32)}),
                {"q": rng.standard_normal((2, 12, 128, 64)).astype(np.float32),
                 "k": rng.standard_normal((2, 12, 128, 64)).astype(np.float32)}, True))
    return out


MODELS = _models()


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["ieee", "tf32"])
@pytest.mark.parametrize("index", range(len(MODELS)), ids=[m[0] for m in MODELS])
def test_cuda_op_matches_onnx_runtime(index, precision, tmp_path, monkeypatch):
    import onnxruntime as ort

    from onnxfuse import library_path, optimize_model
    from onnxfuse.compile import local_gpu_archs
    from onnxfuse.kernels import compile_fused
    from onnxfuse.reference import evaluate

    monkeypatch.setenv("ONNXFUSE_CACHE", str(tmp_path))
    monkeypatch.setenv("ONNXFUSE_GEMM_ALL", "1")
    name, m, feeds, dynamic_b = MODELS[index]
    if name.startswith("split-"):  # the Triton split-K variants, not cuBLASLt's (test_library_variants)
        monkeypatch.setenv("ONNXFUSE_GEMM_LIBRARY", "0")
    pats = [dataclasses.replace(GEMM, match=dataclasses.replace(GEMM.match, dynamic_b=True))] if dynamic_b else None
    r = optimize_model(m, pats)
    info, _ = compile_fused(r.model, r.fused, local_gpu_archs(), conv_precision=precision)
    assert not info["failed"] and any(n.op_type == "GemmEpilogue" for n in r.model.graph.node), r.report.summary()
    if name.startswith("split-"):  # the launcher takes the split-K variant here (its rule's mirror)
        assert _split_slices(r.model, feeds) >= 2, name

    def session(mm, library, graph=False, tf32=False):
        so = ort.SessionOptions()
        so.log_severity_level = 3
        if library:
            so.register_custom_ops_library(library_path())
        opts = {"use_tf32": "1" if tf32 else "0", **({"enable_cuda_graph": "1"} if graph else {})}
        return ort.InferenceSession(mm.SerializeToString(), so, providers=[("CUDAExecutionProvider", opts)])

    fp32 = m.graph.input[0].type.tensor_type.elem_type == TensorProto.FLOAT
    want = session(m, False).run(None, feeds)
    ort_tf32 = session(m, False, tf32=True).run(None, feeds)
    ref = evaluate(m, feeds) if fp32 and precision == "tf32" else None
    outs = [o.name for o in m.graph.output]
    for graph in (False, True):
        got = session(r.model, True, graph).run(None, feeds)
        for k, (e, g) in enumerate(zip(want, got, strict=True)):
            assert e.dtype == g.dtype and e.shape == g.shape
            what = f"{name}, {precision}, CUDA graph {graph}"
            if ref is not None:  # TF32: no further from float64 than ORT's own TF32 (the gate's rule)
                r64 = np.asarray(ref[outs[k]], np.float64)
                ort_err = np.abs(ort_tf32[k].astype(np.float64) - r64)
                bound = 2 * ort_err.max() + 1e-5 * np.abs(r64).max()
                assert np.abs(g.astype(np.float64) - r64).max() <= bound, what
                continue
            tol = 1e-5 if e.dtype == np.float32 else 1e-2
            scale = float(np.abs(e.astype(np.float64)).max(initial=1.0))
            np.testing.assert_allclose(g.astype(np.float64), e.astype(np.float64), rtol=tol, atol=tol * scale,
                                       err_msg=what)


def _split_slices(m: onnx.ModelProto, feeds: dict, sms: int | None = None) -> int:
    """The K slices the launcher runs the (one) GemmEpilogue node of `m` with on a GPU of `sms`
    multiprocessors (None: this one's), by its rule's mirror (`kinds.gemm.launcher_choice`);
    0: no split K."""
    import json

    from onnxfuse.kinds.gemm import launcher_choice

    (node,) = [n for n in m.graph.node if n.op_type == "GemmEpilogue"]
    meta = json.loads(next(a.s for a in node.attribute if a.name == "kernel_meta"))
    attrs = {a.name: a.i for a in node.attribute if a.type == onnx.AttributeProto.INT}
    a = feeds[node.input[0]]
    b = feeds.get(node.input[1])
    b_shape = b.shape if b is not None else tuple(
        next(t for t in m.graph.initializer if t.name == node.input[1]).dims)
    k = a.shape[-2] if attrs.get("trans_a") else a.shape[-1]
    n = b_shape[-2] if attrs.get("trans_b") else b_shape[-1]
    rows = a.shape[-1] if attrs.get("trans_a") else a.shape[-2]
    if len(b_shape) == 2 and not attrs.get("trans_a"):
        g, rows = 1, int(np.prod(a.shape[:-1]))
    else:
        g = int(np.prod(a.shape[:-2]))
    if sms is None:
        import torch

        sms = torch.cuda.get_device_properties(0).multi_processor_count
    return launcher_choice(meta, rows, n, k, g, sms=sms)[1]


@pytest.mark.gpu(torch=True)
def test_cuda_kernel_meta_split_checks(tmp_path, monkeypatch):
    """The CUDA kernel's kernel_meta reader rejects bad "split" values with a clear error on the
    node's first run (csrc/kinds/gemm_cuda.cc, read_variant)."""
    import json

    from onnxfuse import optimize_model
    from onnxfuse.compile import local_gpu_archs
    from onnxfuse.kernels import compile_fused

    monkeypatch.setenv("ONNXFUSE_CACHE", str(tmp_path))
    monkeypatch.setenv("ONNXFUSE_GEMM_ALL", "1")
    name, m, feeds, _ = next(x for x in MODELS if x[0] == "split-ffn1-b1")
    r = optimize_model(m)
    info, _ = compile_fused(r.model, r.fused, local_gpu_archs(), conv_precision="ieee")
    assert not info["failed"]
    (node,) = [n for n in r.model.graph.node if n.op_type == "GemmEpilogue"]
    attr = next(a for a in node.attribute if a.name == "kernel_meta")
    good = json.loads(attr.s)
    split_at = next(i for i, v in enumerate(good["variants"]) if v.get("split"))

    def run_with(**keys):
        return _run_with_variant(r.model, attr, good, split_at, feeds, keys)

    where = rf"GemmEpilogue node '[^']*' \(CUDA\): kernel_meta: variants\[{split_at}\]"
    for bad in (-1, 65536, 10**6):
        with pytest.raises(Exception, match=where + rf"\.split must be from 2 to 65535 \(the most K slices of a "
                                                   rf"split-K variant; 0, 1 or absent: none\), not {bad}"):
            run_with(split=bad)
    with pytest.raises(Exception, match=where + r"\.split is not an integer"):
        run_with(split=2.5)
    with pytest.raises(Exception, match=where + r" has both split and max_m"):
        run_with(max_m=16)
    with pytest.raises(Exception, match=where + r" has no \"block_k\""):
        run_with(block_k=None)
    # good values run: the optimizer's, and 2 (fewer slices)
    want = evaluate_ffn(m, feeds)
    for ok in (good["variants"][split_at]["split"], 2):
        np.testing.assert_allclose(run_with(split=ok), want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))


def _run_with_variant(m: onnx.ModelProto, attr, good: dict, at: int, feeds: dict, keys: dict) -> np.ndarray:
    """Runs `m` on the CUDA EP with the library, its GemmEpilogue's kernel_meta attribute `attr`
    set to `good` with variant `at`'s keys replaced by `keys` (None: removed)."""
    import json

    import onnxruntime as ort

    from onnxfuse import library_path

    meta = json.loads(json.dumps(good))
    meta["variants"][at].update(keys)
    meta["variants"][at] = {k: v for k, v in meta["variants"][at].items() if v is not None}
    attr.s = json.dumps(meta).encode()
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.register_custom_ops_library(library_path())
    so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    sess = ort.InferenceSession(m.SerializeToString(), so, providers=["CUDAExecutionProvider"])
    return sess.run(None, feeds)[0]


def evaluate_ffn(m: onnx.ModelProto, feeds: dict) -> np.ndarray:
    from onnxfuse.reference import evaluate

    return np.asarray(evaluate(m, feeds)[m.graph.output[0].name], np.float32)


def _library_models() -> list[tuple[str, onnx.ModelProto, dict, bool]]:
    """(name, model, feeds, whether cuBLASLt must take it): fp16 products + bias + erf-GELU at
    BERT-base's b8 and b1 FFN1 shapes, + ReLU, the bias alone, tanh-GELU without a bias; float32
    products + bias at ViT-S's FFN1 shape, at "tf32" and "ieee" (names ending so); fp16 sizes
    that are not multiples of 8 (cuBLASLt may decline them: the Triton variant then runs)."""
    from tests.test_gemm_patterns import erf_consts, erf_gelu

    rng = np.random.default_rng(3)
    h = np.float16
    out = []
    for b in (8, 1):
        out.append((f"bias-gelu-b{b}", ffn1("float16", s=128, k=768, n=3072),
                    {"x": rng.standard_normal((b, 128, 768)).astype(h)}, True))
    nodes = [N("MatMul", ["x", "w"], ["p"]), N("Add", ["p", "b"], ["pb"]), N("Relu", ["pb"], ["y"])]
    out.append(("bias-relu", model(nodes, {"x": ("float16", [4, 64, 256])}, {"y": ("float16", [4, 64, 512])},
                                   {"w": _w((256, 512), 1, h), "b": _w((512,), 2, h)}),
                {"x": rng.standard_normal((4, 64, 256)).astype(h)}, True))
    nodes = [N("MatMul", ["x", "w"], ["p"]), N("Add", ["p", "b"], ["y"])]
    out.append(("bias", model(nodes, {"x": ("float16", [256, 384])}, {"y": ("float16", [256, 1152])},
                              {"w": _w((384, 1152), 1, h), "b": _w((1152,), 2, h)}),
                {"x": rng.standard_normal((256, 384)).astype(h)}, True))
    c = {"c3": np.array(0.044715, h), "ck": np.array(0.7978846, h), "one": np.array(1.0, h), "half": np.array(0.5, h)}
    nodes = [N("MatMul", ["x", "w"], ["p"]), N("Mul", ["p", "p"], ["p2"]), N("Mul", ["p2", "p"], ["p3"]),
             N("Mul", ["p3", "c3"], ["t"]), N("Add", ["p", "t"], ["u"]), N("Mul", ["u", "ck"], ["v"]),
             N("Tanh", ["v"], ["th"]), N("Add", ["th", "one"], ["th1"]), N("Mul", ["p", "th1"], ["m"]),
             N("Mul", ["m", "half"], ["y"])]
    out.append(("tanh-gelu", model(nodes, {"x": ("float16", [2, 128, 768])}, {"y": ("float16", [2, 128, 3072])},
                                   {"w": _w((768, 3072), 1, h), **c}),
                {"x": rng.standard_normal((2, 128, 768)).astype(h)}, True))
    nodes = [N("MatMul", ["x", "w"], ["p"]), N("Add", ["p", "b"], ["y"])]
    for precision in ("tf32", "ieee"):  # float32: ViT's out-projection and FFN2 (their bias alone)
        out.append((f"f32-bias-{precision}", model(nodes, {"x": ("float32", [8, 197, 384])},
                                                   {"y": ("float32", [8, 197, 1536])},
                                                   {"w": _w((384, 1536), 1), "b": _w((1536,), 2)}),
                    {"x": rng.standard_normal((8, 197, 384)).astype(np.float32)}, True))
    nodes = [N("MatMul", ["x", "w"], ["p"]), N("Add", ["p", "b"], ["pb"]), *erf_gelu("pb", "y")]
    out.append(("odd-sizes", model(nodes, {"x": ("float16", [37, 70])}, {"y": ("float16", [37, 45])},
                                   {"w": _w((70, 45), 1, h), "b": _w((45,), 2, h), **erf_consts(dtype=h)}),
                {"x": rng.standard_normal((37, 70)).astype(h)}, False))
    return out


LIBRARY_MODELS = _library_models()


def _library_meta(m: onnx.ModelProto) -> dict:
    """The kernel_meta of `m`'s one GemmEpilogue node."""
    import json

    (node,) = [n for n in m.graph.node if n.op_type == "GemmEpilogue"]
    return json.loads(next(a for a in node.attribute if a.name == "kernel_meta").s)


def _with_variants(m: onnx.ModelProto, variants: list[dict]) -> onnx.ModelProto:
    """A copy of `m` whose GemmEpilogue runs `variants` alone (no Triton binaries)."""
    import json

    out = onnx.ModelProto()
    out.CopyFrom(m)
    (node,) = [n for n in out.graph.node if n.op_type == "GemmEpilogue"]
    attr = next(a for a in node.attribute if a.name == "kernel_meta")
    attr.s = json.dumps({**json.loads(attr.s), "variants": variants, "binaries": []}).encode()
    return out


def _library_session(m: onnx.ModelProto, library: bool, graph: bool = False, **cuda_options: str):
    """An ONNX Runtime session of `m` on the CUDA EP; with the custom-op library, no CPU fallback
    (a node the library cannot run fails the session instead of running on the CPU)."""
    import onnxruntime as ort

    from onnxfuse import library_path

    so = ort.SessionOptions()
    so.log_severity_level = 3
    if library:
        so.register_custom_ops_library(library_path())
        so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    opts = {**cuda_options, **({"enable_cuda_graph": "1"} if graph else {})}
    # ORT refuses the CPU EP listed beside disable_cpu_ep_fallback
    return ort.InferenceSession(m.SerializeToString(), so, providers=[("CUDAExecutionProvider", opts)]
                                + ([] if library else ["CPUExecutionProvider"]))


@pytest.mark.gpu
@pytest.mark.parametrize("index", range(len(LIBRARY_MODELS)), ids=[m[0] for m in LIBRARY_MODELS])
def test_library_variants(index, tmp_path, monkeypatch):
    from onnxfuse import optimize_model
    from onnxfuse.compile import local_gpu_archs
    from onnxfuse.kernels import compile_fused
    from onnxfuse.reference import evaluate

    monkeypatch.setenv("ONNXFUSE_CACHE", str(tmp_path))
    monkeypatch.setenv("ONNXFUSE_GEMM_ALL", "1")
    name, m, feeds, must = LIBRARY_MODELS[index]
    precision = "ieee" if name.endswith("ieee") else "tf32"
    r = optimize_model(m)
    info, _ = compile_fused(r.model, r.fused, local_gpu_archs(), conv_precision=precision)
    meta = _library_meta(r.model)
    assert not info["failed"] and meta["variants"][0].get("library") == "cublaslt", (name, meta["variants"])
    tf32 = "0" if precision == "ieee" else "1"

    want = _library_session(m, False, use_tf32=tf32).run(None, feeds)[0]
    ref = np.asarray(evaluate(m, feeds)[m.graph.output[0].name], np.float64)
    ort_err = float(np.abs(want.astype(np.float64) - ref).max())
    runs = [("with the Triton fallbacks", r.model)]
    if must:  # cuBLASLt alone: a node it declined would fail ("no variant ... takes this product")
        runs.append(("cuBLASLt alone", _with_variants(r.model, meta["variants"][:1])))
        # the heuristic's other algorithms (`gemm-library-ranks`); 15: past those it ranks, its first
        for rank in (1, 3, 15):
            runs.append((f"cuBLASLt alone, rank {rank}",
                         _with_variants(r.model, [{**meta["variants"][0], "rank": rank}])))
    scale = float(np.abs(ref).max())
    for what, mm in runs:
        for graph in (False, True):
            got = _library_session(mm, True, graph, use_tf32=tf32).run(None, feeds)[0]
            assert got.dtype == want.dtype and got.shape == want.shape
            err = float(np.abs(got.astype(np.float64) - ref).max())
            # against float64: no further than ORT's own run (TF32 for float32 at "tf32", as ORT's
            # default; full fp32 at "ieee"), with a floor of a unit of the product's precision at
            # the output's scale (fp16 and TF32: 2^-10; cuBLASLt's GELU is the tanh form, 4.7e-4
            # from erf's), 2^-20 at "ieee"
            floor = (2 ** -20 if precision == "ieee" and want.dtype == np.float32 else 2 ** -10) * scale
            assert err <= max(ort_err, floor), f"{name}, {what}, CUDA graph {graph}: {err} vs ORT {ort_err}"


def _bf16_library_models() -> list[tuple[str, onnx.ModelProto]]:
    """bfloat16 products cuBLASLt takes: + bias (ViT-S's FFN2 at batch 2), + bias + ReLU, bare
    (gemm_library's kind: BERT-base's out-projection at batch 2)."""
    import ml_dtypes

    bf = ml_dtypes.bfloat16
    out = []
    for name, (s, k, n), extra in (("bf16-bias", (197, 1536, 384), ["b"]),
                                   ("bf16-bias-relu", (128, 768, 3072), ["b", "relu"]),
                                   ("bf16-bare", (128, 768, 768), [])):
        nodes = [N("MatMul", ["x", "w"], ["p" if extra else "y"])]
        inits = {"w": _w((k, n), 1, bf)}
        if extra:
            nodes.append(N("Add", ["p", "b"], ["pb" if "relu" in extra else "y"]))
            inits["b"] = _w((n,), 2, bf)
        if "relu" in extra:
            nodes.append(N("Relu", ["pb"], ["y"]))
        out.append((name, model(nodes, {"x": ("bfloat16", [2, s, k])}, {"y": ("bfloat16", [2, s, n])}, inits)))
    return out


BF16_LIBRARY_MODELS = _bf16_library_models()


def _output_as_f32(m: onnx.ModelProto) -> onnx.ModelProto:
    """`m` with its bfloat16 output leaving through an exact Cast to float32 (ONNX Runtime's
    Python API returns no bfloat16 array), added after fusion so that no fusion takes it."""
    out = onnx.ModelProto()
    out.CopyFrom(m)
    (o,) = out.graph.output
    shape = [d.dim_value for d in o.type.tensor_type.shape.dim]
    out.graph.node.append(N("Cast", [o.name], [o.name + "_f32"], to=TensorProto.FLOAT))
    out.graph.value_info.append(o)
    out.graph.output.pop()
    out.graph.output.append(helper.make_tensor_value_info(o.name + "_f32", TensorProto.FLOAT, shape))
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("index", range(len(BF16_LIBRARY_MODELS)), ids=[m[0] for m in BF16_LIBRARY_MODELS])
def test_library_variants_bf16(index, tmp_path, monkeypatch):
    """cuBLASLt's bfloat16 products (csrc/cublaslt.cc's CUDA_R_16BF), alone (the Triton
    variants taken out of kernel_meta) and with them, with and without CUDA graphs: no further
    from the float64 reference than ORT's own run of the original, or a bfloat16 unit (2^-8)
    of the output's scale."""
    import ml_dtypes
    import onnxruntime as ort

    from onnxfuse import optimize_model
    from onnxfuse.compile import local_gpu_archs
    from onnxfuse.kernels import compile_fused
    from onnxfuse.reference import evaluate

    monkeypatch.setenv("ONNXFUSE_CACHE", str(tmp_path))
    monkeypatch.setenv("ONNXFUSE_GEMM_ALL", "1")
    name, m = BF16_LIBRARY_MODELS[index]
    r = optimize_model(m)
    info, _ = compile_fused(r.model, r.fused, local_gpu_archs())
    meta = _library_meta(r.model)
    assert not info["failed"] and meta["variants"][0].get("library") == "cublaslt", (name, meta["variants"])
    shape = [d.dim_value for d in m.graph.input[0].type.tensor_type.shape.dim]
    x = np.random.default_rng(5).standard_normal(shape).astype(ml_dtypes.bfloat16)
    feed = {"x": ort.OrtValue.ortvalue_from_numpy_with_onnx_type(x.view(np.uint16), TensorProto.BFLOAT16)}

    def run(mm, library, graph=False):
        sess = _library_session(_output_as_f32(mm), library, graph)
        return sess.run_with_ort_values(None, feed)[0].numpy().astype(np.float64)

    ref = np.asarray(evaluate(m, {"x": x})[m.graph.output[0].name], np.float64)
    ort_err = float(np.abs(run(m, False) - ref).max())
    floor = 2 ** -8 * float(np.abs(ref).max())
    alone = _with_variants(r.model, meta["variants"][:1])
    for what, mm in (("with the Triton fallbacks", r.model), ("cuBLASLt alone", alone)):
        for graph in (False, True):
            got = run(mm, True, graph)
            assert got.shape == ref.shape
            err = float(np.abs(got - ref).max())
            assert err <= max(ort_err, floor), f"{name}, {what}, CUDA graph {graph}: {err} vs ORT {ort_err}"


@pytest.mark.gpu(torch=True)
def test_cuda_kernel_meta_library_checks(tmp_path, monkeypatch):
    """The CUDA kernel's kernel_meta reader rejects a bad library variant with a clear error on
    the node's first run (csrc/kinds/gemm_cuda.cc, read_variant and check_meta), and a library
    variant of a product it cannot take (here: cuBLASLt asked for float32 without a precision)
    falls to the Triton variant after it."""
    import json

    from onnxfuse import optimize_model
    from onnxfuse.compile import local_gpu_archs
    from onnxfuse.kernels import compile_fused

    monkeypatch.setenv("ONNXFUSE_CACHE", str(tmp_path))
    monkeypatch.setenv("ONNXFUSE_GEMM_ALL", "1")
    name, m, feeds, _ = next(x for x in LIBRARY_MODELS if x[0] == "f32-bias-tf32")
    r = optimize_model(m)
    info, _ = compile_fused(r.model, r.fused, local_gpu_archs())
    assert not info["failed"]
    (node,) = [n for n in r.model.graph.node if n.op_type == "GemmEpilogue"]
    attr = next(a for a in node.attribute if a.name == "kernel_meta")
    good = json.loads(attr.s)
    assert good["variants"][0]["library"] == "cublaslt"

    def run_with(**keys):
        return _run_with_variant(r.model, attr, good, 0, feeds, keys)

    where = r"GemmEpilogue node '[^']*' \(CUDA\): kernel_meta: variants\[0\]"
    with pytest.raises(Exception, match=where + r"\.library \"cutlass\" is unknown"):
        run_with(library="cutlass")
    with pytest.raises(Exception, match=where + r"\.activation \"silu\" is unknown"):
        run_with(activation="silu")
    with pytest.raises(Exception, match=where + r"\.precision \"tf32x3\" is unknown"):
        run_with(precision="tf32x3")
    with pytest.raises(Exception, match=r"a cuBLASLt variant's bias 3 is not an extra input"):
        run_with(bias=3)
    with pytest.raises(Exception, match=where + r"\.rank must be from 0 to 15"):
        run_with(rank=16)
    want = evaluate_ffn(m, feeds)
    scale = float(np.abs(want).max())
    # float32 without a precision: cuBLASLt does not take it, the Triton tile runs (TF32, rounded)
    np.testing.assert_allclose(run_with(precision=None), want, rtol=0, atol=1e-2 * scale)
    np.testing.assert_allclose(run_with(), want, rtol=0, atol=1e-2 * scale)
