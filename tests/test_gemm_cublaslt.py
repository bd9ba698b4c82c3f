"""cuBLASLt's variants of GemmEpilogue (codegen_gemm's module docstring), on the CPU: which
programs cuBLASLt's epilogue computes (`library_epilogue`, told by values), the variants and
kernel_meta a 16-bit product + bias + GELU gets (float32 ones: the exact forms), and the match
that takes ONNX Runtime's GELU fusion into the product where tuning will time it
(`kinds.gemm._library_group`). The kernels run on the GPU in tests/test_gemm_gpu.py
(`test_library_variants`)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from onnxfuse.codegen_gemm import LIBRARY_RANKS, GemmSpec, gemm_candidates, gemm_variants, library_epilogue
from onnxfuse.expr import parse
from onnxfuse.kinds.gemm import launcher_choice

HEADER = "onnxfuse.pointwise v1\n"


def program(dt: str, body: str, extras: int = 1):
    inputs = "".join(f"input %{i} {dt}\n" for i in range(1 + extras))
    return parse(HEADER + inputs + body)


ERF_GELU = "%2 = add %0 %1\n%3 = round_{dt}\n%4 = mul %3 0.7071823477745056\n%5 = neg %4\n%6 = erfc %5\n" \
           "%7 = mul %3 %6\n%8 = mul %7 0.5\noutput %8 {dt}\n"


def erf_gelu(dt: str = "f16"):
    rounded = f"round_{dt} %2" if dt != "f32" else "add %2 0.0"
    return program(dt, ERF_GELU.replace("round_{dt}", rounded).replace("{dt}", dt))


def test_forms_are_told_apart_by_their_values():
    g = library_epilogue(erf_gelu(), ("row",))
    assert (g.activation, g.bias, g.form) == ("gelu", 0, "gelu_erf")
    assert library_epilogue(erf_gelu("bf16"), ("row",)).form == "gelu_erf"
    relu = program("f16", "%2 = add %0 %1\n%3 = max %2 0.0\noutput %3 f16\n")
    assert library_epilogue(relu, ("row",)).activation == "relu"
    bias = program("f16", "%2 = add %1 %0\noutput %2 f16\n")
    assert library_epilogue(bias, ("row",)).activation == "none"
    tanh = program("f16", "%1 = mul %0 %0\n%2 = mul %1 %0\n%3 = mul %2 0.044715\n%4 = add %0 %3\n"
                          "%5 = mul %4 0.7978845608028654\n%6 = tanh %5\n%7 = add %6 1.0\n%8 = mul %0 %7\n"
                          "%9 = mul %8 0.5\noutput %9 f16\n", extras=0)
    assert library_epilogue(tanh, ()) == library_epilogue(tanh, ()).__class__("gelu", -1, "gelu_tanh")


@pytest.mark.parametrize("dt", ["f16", "bf16"])
def test_what_cublaslt_cannot_compute_is_refused(dt):
    # QuickGELU x sigmoid(1.702 x): within bf16's rounding of GELU at x = 1, not within 1e-4
    quick = program(dt, f"%2 = add %0 %1\n%3 = mul %2 1.702\n%4 = sigmoid %3\n%5 = mul %2 %4\noutput %5 {dt}\n")
    assert library_epilogue(quick, ("row",)) is None
    silu = program(dt, f"%2 = add %0 %1\n%3 = sigmoid %2\n%4 = mul %2 %3\noutput %4 {dt}\n")
    assert library_epilogue(silu, ("row",)) is None
    scaled = program(dt, f"%2 = mul %0 %1\noutput %2 {dt}\n")  # a product by the extra, not a bias
    assert library_epilogue(scaled, ("row",)) is None
    g = erf_gelu(dt)
    assert library_epilogue(g, ("full",)) is None  # a residual, not a bias over N
    assert library_epilogue(g, ("strided",)) is None
    leaky = program(dt, f"%2 = add %0 %1\n%3 = mul %2 0.01\n%4 = max %2 %3\noutput %4 {dt}\n")
    assert library_epilogue(leaky, ("row",)) is None


def test_float32_takes_the_exact_forms_only():
    relu = program("f32", "%2 = add %0 %1\n%3 = max %2 0.0\noutput %3 f32\n")
    assert library_epilogue(relu, ("row",)) == library_epilogue(relu, ("row",)).__class__("relu", 0, "relu", "tf32")
    assert library_epilogue(relu, ("row",), "ieee").precision == "ieee"
    assert library_epilogue(relu, ("row",), "tf32x3") is None
    # erf's GELU: cuBLASLt's tanh form is 4.7e-4 away, a 16-bit unit, not a float32 one
    assert library_epilogue(erf_gelu("f32"), ("row",)) is None
    tanh = program("f32", "%1 = mul %0 %0\n%2 = mul %1 %0\n%3 = mul %2 0.044715\n%4 = add %0 %3\n"
                          "%5 = mul %4 0.7978845608028654\n%6 = tanh %5\n%7 = add %6 1.0\n%8 = mul %0 %7\n"
                          "%9 = mul %8 0.5\noutput %9 f32\n", extras=0)
    assert library_epilogue(tanh, ()).form == "gelu_tanh"
    assert library_epilogue(tanh, (), "ieee") is None


def test_other_outputs_stay_triton():
    cast = program("f16", "%2 = add %0 %1\noutput %2 f32\n")  # Y of another dtype
    assert library_epilogue(cast, ("row",)) is None
    mixed = parse(HEADER + "input %0 f16\ninput %1 f32\n%2 = add %0 %1\noutput %2 f16\n")  # an fp32 bias
    assert library_epilogue(mixed, ("row",)) is None


def _spec(**kw) -> GemmSpec:
    g = erf_gelu()
    return GemmSpec("k", g, ("row",), m=1024, n=3072, k=768, batch=1, library=library_epilogue(g, ("row",)), **kw)


def test_variants_and_meta_of_a_library_spec(monkeypatch):
    from onnxfuse.kinds.gemm import Gemm

    spec = _spec()
    variants = gemm_variants(spec)
    assert variants[0].library is not None and all(v.library is None for v in variants[1:])
    assert [v.index for v in variants] == list(range(len(variants)))
    # no Triton tile is timed against it: cuBLASLt's algorithms ranked 2 to LIBRARY_RANKS are
    # (`gemm-library-ranks`), each followed by the default's Triton fallbacks, in every tuning
    cands = gemm_candidates(spec)
    assert cands[0] == ("default", variants) and len(cands) == LIBRARY_RANKS
    assert [c[1][0].rank for c in cands] == list(range(LIBRARY_RANKS))
    assert all(c[1][1:] == variants[1:] for c in cands)
    assert cands[1][0] == "cuBLASLt, epilogue gelu_erf + bias, algorithm ranked 2"
    assert Gemm().searches(spec, None) and not Gemm().searches(dataclasses.replace(spec, library=None), None)
    meta = Gemm().kernel_meta(spec, variants, [])
    assert meta["variants"][0] == {"requires": {}, "library": "cublaslt", "activation": "gelu", "bias": 0}
    assert Gemm().kernel_meta(spec, cands[2][1], [])["variants"][0]["rank"] == 2
    assert "block_m" in meta["variants"][1]
    assert launcher_choice(meta, 1024, 3072, 768) == (0, 0)
    assert launcher_choice(meta, 1024, 3072, 768, library=False) == (1, 0)
    assert launcher_choice(meta, 128, 3072, 768, g=2)[0] == 1
    monkeypatch.setenv("ONNXFUSE_GEMM_LIBRARY", "0")
    assert all(v.library is None for v in gemm_variants(spec))
    with pytest.raises(ValueError, match="cuBLASLt's"):
        from onnxfuse.codegen_gemm import generate_gemm
        generate_gemm(spec, variants[0])


def test_compile_leaves_the_library_variant_without_binaries(tmp_path):
    from onnxfuse.compile import compile_kernels

    spec = dataclasses.replace(_spec(), name="lib_gelu_kernel")
    (ck,) = compile_kernels([spec], [90], cache_dir=tmp_path)
    meta = ck.kernel_meta()
    assert meta["variants"][0]["library"] == "cublaslt"
    assert {b["variant"] for b in meta["binaries"]} == {1, 2}


def _tuned_passes(arch: str, dtype: str, last, target: str = "none"):
    """The small twin of a suite transformer (fp16 through models.fp16) run through the passes
    up to `last` as they run where tuning will time the fused nodes (batch 2)."""
    from models import transformers as mt
    from models.fp16 import to_fp16
    from tests.util import passes_upto, tuned_options

    m = mt.export(arch, small=True)
    if dtype == "float16":
        m = to_fp16(m)
    dims = {k: (2, *v) for k, v in mt.input_dims(arch, small=True).items()}
    return m, dims, passes_upto(m, tuned_options(target, dims), last)


def _matches(dtype):
    from onnxfuse.pipeline import match_pass

    _, _, r = _tuned_passes("bert_base", dtype, match_pass)
    return r, [[r.view.nodes[i].op_type for i in x.nodes] for x in r.found.matches if x.kind == "gemm"]


def test_with_tuning_a_16bit_ffn1_takes_its_gelu_into_the_product():
    """BERT's fp16 FFN1 where the tune pass will run: the gemm kind takes MatMul + bias + GELU
    (ORT's MatMul + Add into Gemm and Gelu fusions, whole), whose program cuBLASLt computes; the
    bias stays where it was (no Reshape, Gemm, Reshape from the bias pass) and no chain is left;
    the out-projections and FFN2s, their bias after them, are bare products (`gemm_library`)."""
    pytest.importorskip("torch")
    r, gemms = _matches("float16")
    ffn1 = [g for g in gemms if "Erf" in g]
    assert ffn1 == [["MatMul", "Add", "Div", "Erf", "Add", "Mul", "Mul"]] * 2, r.report.summary()
    assert [g for g in gemms if "Erf" not in g] == [["Reshape", "Gemm", "Reshape"]] * 4, gemms
    assert not [x for x in r.found.matches if x.kind == "pointwise" and x.measured_only]
    assert r.biased_after == 4  # the out-projections and FFN2s; FFN1's bias stays in the product's epilogue


def test_with_tuning_a_float32_ffn1_keeps_its_gelu_chain():
    pytest.importorskip("torch")
    r, gemms = _matches("float32")
    assert not gemms  # erf's GELU in float32: no cuBLASLt form, the chain is timed against BiasGelu
    assert len([x for x in r.found.matches if x.kind == "pointwise" and x.measured_only]) == 2


def test_library_variant_off_leaves_the_chain(monkeypatch):
    pytest.importorskip("torch")
    monkeypatch.setenv("ONNXFUSE_GEMM_LIBRARY", "0")
    r, gemms = _matches("float16")
    assert not gemms and len([x for x in r.found.matches if x.kind == "pointwise" and x.measured_only]) == 2


def test_values_are_exact_in_16_bits():
    from onnxfuse.codegen_gemm import _BIASES, _PRODUCTS

    for v in (_PRODUCTS, _BIASES):
        assert np.array_equal(v.astype(np.float16).astype(np.float64), v)


def test_the_report_says_which_nodes_run_cublaslt(tmp_path, monkeypatch):
    """`onnxfuse optimize`'s kernel summary counts the nodes whose first variant is cuBLASLt's,
    and their kernel_meta names it; a float32 erf-GELU product has none."""
    import json

    from onnxfuse.pipeline import build_options, optimize_model
    from tests.test_gemm_patterns import ffn1

    monkeypatch.setenv("ONNXFUSE_CACHE", str(tmp_path))
    monkeypatch.setenv("ONNXFUSE_GEMM_ALL", "1")
    for dtype, want in (("float16", 1), ("float32", 0)):
        r = optimize_model(ffn1(dtype), leave_to_ort=False, options=build_options(target="sm_90", tune="off"))
        assert r.report.compile["library"] == want, r.report.compile["summary"]
        assert ("run cuBLASLt's product" in r.report.compile["summary"]) == bool(want)
        (node,) = [n for n in r.model.graph.node if n.op_type == "GemmEpilogue"]
        meta = json.loads(next(a.s for a in node.attribute if a.name == "kernel_meta"))
        assert (meta["variants"][0].get("library") == "cublaslt") == bool(want)


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_gpt2_conv1d_is_read_through_its_reshapes(dtype, tmp_path, monkeypatch):
    """GPT-2's FFN1 (Conv1D: Reshape, Gemm, Reshape; the bias pass puts its bias after the
    second Reshape) with its tanh-GELU where tuning will time it: one GemmEpilogue reading the
    3-D input as a batched product (`kinds.gemm._read_through`), cuBLASLt's variant first (at
    float32 too: tanh's GELU is cuBLASLt's own form, at TF32), and the model on the CPU (the
    library's kernels, compiled for sm_90 but not run) computes what the original does."""
    pytest.importorskip("torch")
    import json

    import onnxruntime as ort

    from models import transformers as mt
    from onnxfuse import runtime
    from onnxfuse.pipeline import compile_pass

    monkeypatch.setenv("ONNXFUSE_CACHE", str(tmp_path))
    m, dims, r = _tuned_passes("gpt2_small", dtype, compile_pass, target="sm_90")
    npdt = np.float16 if dtype == "float16" else np.float32
    bare = r.report.patterns_applied.get("gemm_library", 0)  # fp16: the other products, bare
    assert bare == (7 if dtype == "float16" else 0), r.report.patterns_applied
    assert r.report.compile["library"] == 2 + bare, r.report.compile["summary"]
    nodes = [n for n in r.model.graph.node if n.op_type == "GemmEpilogue"
             and json.loads(next(a.s for a in n.attribute if a.name == "kernel_meta"))["variants"][0]["activation"]
             == "gelu"]
    (body,) = [f for f in r.model.functions if f.name == "GemmEpilogue"
               and any(b.op_type == "Tanh" for b in f.node)]
    # the body: the flattening Reshape, the product (float32: of the packed weights transposed back), ...
    assert [b.op_type for b in body.node if b.op_type not in ("Constant", "Transpose")][:4] == \
        ["Reshape", "Gemm", "Reshape", "Add"]
    assert len(nodes) == 2
    producers = {o: p.op_type for p in r.model.graph.node for o in p.output}
    for n in nodes:  # A is the 3-D input itself (the LayerNorm's output), not its flattened rows
        assert producers[n.input[0]] == "FusedRows"
        meta = json.loads(next(a.s for a in n.attribute if a.name == "kernel_meta"))
        assert meta["variants"][0]["activation"] == "gelu"
        assert meta["variants"][0].get("precision") == (None if dtype == "float16" else "tf32")
    feeds = mt.feeds("gpt2_small", dims, npdt, small=True, seed=1)
    want = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    got = runtime.InferenceSession(r.model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    # without the library ONNX Runtime runs the function bodies: Reshape, Gemm, Reshape, bias, GELU
    body = ort.InferenceSession(r.model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    scale = float(np.abs(want).max())
    # fp16: as tests/test_transformers.py's fp16 twins; float32: the packed weights are rounded to TF32
    tol = 2e-2 * scale if dtype == "float16" else 1e-3 * scale
    for y in (got, body):
        assert float(np.abs(y.astype(np.float64) - want).max()) <= tol


def _conv1d(out_shape=(2, 5, 16), c: bool = False, extra_reader: bool = False):
    """x [2, 5, 8] -> Reshape [-1, 8] -> Gemm (W [8, 16], C when `c`) -> Reshape `out_shape` -> y."""
    from onnx import helper

    from tests.util import model

    rng = np.random.default_rng(0)
    N = helper.make_node
    nodes = [N("Reshape", ["x", "rows"], ["xr"]), N("Gemm", ["xr", "w", *(["c"] if c else [])], ["h"]),
             N("Reshape", ["h", "back"], ["y"])]
    outputs = {"y": ("float16", list(out_shape))}
    if extra_reader:
        nodes.append(N("Neg", ["xr"], ["z"]))
        outputs["z"] = ("float16", [10, 8])
    inits = {"rows": np.array([-1, 8], np.int64), "back": np.array(out_shape, np.int64),
             "w": rng.standard_normal((8, 16)).astype(np.float16),
             **({"c": rng.standard_normal(16).astype(np.float16)} if c else {})}
    return model(nodes, {"x": ("float16", [2, 5, 8])}, outputs, inits)


def test_read_through_takes_only_a_gemm_between_rows_and_back():
    from onnxfuse.graph import GraphView
    from onnxfuse.kinds.gemm import _read_through, find_core
    from onnxfuse.load import infer_shapes
    from onnxfuse.pattern import load_patterns

    gemm = next(p for p in load_patterns() if p.kind.name == "gemm")

    def read(m):
        view = GraphView.build(m, infer_shapes(m))
        i = next(k for k, n in enumerate(view.nodes) if n.op_type == "Gemm")
        return view, _read_through(view, find_core(view, i, gemm, set()), set())

    view, core = read(_conv1d())
    assert core is not None and core.a == "x" and core.flatten and core.product == "y"
    assert tuple(core.y_shape) == (2, 5, 16) and [view.nodes[r].op_type for r in core.reshapes] == ["Reshape"] * 2
    assert read(_conv1d(out_shape=(10, 16)))[1] is None  # the rows not given back as x's leading dims
    assert read(_conv1d(out_shape=(5, 2, 16)))[1] is None
    assert read(_conv1d(c=True))[1] is None  # C: the bias pass moves it after the Reshape first
    assert read(_conv1d(extra_reader=True))[1] is None  # the flattened rows read elsewhere too
