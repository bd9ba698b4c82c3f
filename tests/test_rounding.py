"""TF32 rounding at the producer (onnxfuse/rounding.py): which fused convs store their output
rounded (round_y, kernel suffix _ry) and which skip rounding their activations (x_rounded,
_rx). The kernels' numerics under both flags (bit-identical to rounding in every reader) are
tests/test_conv_precision.py's; here: the plan on YOLO-like graphs, the function copies, and
that the optimized model still computes the original. Kernels are compiled for sm_90 (no GPU
needed)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from onnxfuse import optimize_model
from onnxfuse.pipeline import compile_pass
from onnxfuse.rounding import plan
from tests.test_layout import c2f, image_model, residual, run, sppf
from tests.util import kernel_options, random_feeds

pytest.importorskip("triton")
N = helper.make_node


def optimized(m: onnx.ModelProto, tmp_path, monkeypatch, precision: str = "tf32", layout: str = "nhwc"):
    monkeypatch.setenv("ONNXFUSE_CACHE", str(tmp_path / "cache"))
    r = optimize_model(m)
    info = compile_pass(r, kernel_options("sm_90", layout=layout, conv_precision=precision)).report.compile
    assert not info["failed"] and not info["declined"]
    onnx.checker.check_model(r.model, full_check=True)
    return r


def check_same(m: onnx.ModelProto, fused: onnx.ModelProto, library: bool) -> None:
    """The optimized model computes the original through its function bodies or the
    library's CPU kernels (which compute in fp32 and ignore the flags), with the weights
    the compile step rounded to TF32: 2**-11 relative per weight at most."""
    feeds = random_feeds(m, {"N": 2}, seed=5)
    for e, a in zip(run(m, feeds, False), run(fused, feeds, library), strict=True):
        assert e.shape == a.shape
        np.testing.assert_allclose(a, e, rtol=0, atol=2e-3 * float(np.abs(e).max()))


def flags(r) -> dict[str, tuple[bool, bool]]:
    """Per FusedConv node (by its first source node's name): (x_rounded, round_y), as the
    FusedNode values and the kernel names say; the two must agree."""
    out = {}
    nodes = {n.name: n for n in r.model.graph.node}
    for f in r.fused:
        if f.kind != "conv":
            continue
        name = f.source_nodes[0].split()[-1]
        out[name] = (f.x_rounded, f.round_y)
        overload = nodes[f.node_name].overload
        assert overload == f.kernel_name
        assert overload.endswith("_rx_ry" if f.x_rounded and f.round_y else "_rx" if f.x_rounded
                                 else "_ry" if f.round_y else "_krsc") or not f.x_rounded and not f.round_y
    return out


@pytest.mark.parametrize("layout", ["nhwc", "nchw"])
def test_c2f_rounds_where_only_convs_read(tmp_path, monkeypatch, layout):
    """conv1's output reaches conv2 (through Split) and conv3 (through Split and Concat) only:
    stored rounded. conv2's is read by the Concat into conv3 only: rounded too. conv3's is the
    graph output: as computed. conv2 and conv3 read only rounded tensors; conv1 reads x."""
    m = c2f()
    r = optimized(m, tmp_path, monkeypatch, layout=layout)
    assert flags(r) == {"conv1": (False, True), "conv2": (True, True), "conv3": (True, False)}
    check_same(m, r.model, library=False)
    check_same(m, r.model, library=True)


def test_another_reader_keeps_the_values_as_computed(tmp_path, monkeypatch):
    """A Sigmoid reads the Concat: conv1 and conv2 (both inside it) store as computed, so
    conv3 rounds its own activations. conv2 still reads conv1's output through Split only,
    but conv1 stores it unrounded for the Sigmoid: conv2 rounds too."""
    r = optimized(c2f(extra_reader=True), tmp_path, monkeypatch)
    assert flags(r) == {"conv1": (False, False), "conv2": (False, False), "conv3": (False, False)}


def test_a_residual_extra_input_is_not_a_rounding_reader(tmp_path, monkeypatch):
    """r1 is conv2's X and the extra input of its epilogue (the Add): stored as computed."""
    r = optimized(residual(), tmp_path, monkeypatch)
    assert flags(r) == {"conv1": (False, False), "conv2": (False, False)}


def test_sppf_pools_move_rounded_values(tmp_path, monkeypatch):
    """conv1 -> three FusedMaxPools -> Concat(conv1, pools) -> conv2: max pools move values, so
    conv1 stores rounded and conv2 reads rounded values only."""
    m = sppf()
    r = optimized(m, tmp_path, monkeypatch)
    assert flags(r) == {"conv1": (False, True), "conv2": (True, False)}
    check_same(m, r.model, library=True)


def upsample(mode: str) -> onnx.ModelProto:
    """conv1 -> Resize x2 (mode) -> Concat(with conv0 on a pooled x) -> conv2, as YOLO's neck."""
    rng = np.random.default_rng(3)

    def w(k, c, s):
        return numpy_helper.from_array((rng.standard_normal((k, c, s, s)) / (3 * c)).astype(np.float32))

    inits = [w(8, 8, 1), w(8, 8, 3), w(8, 16, 3),
             numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales")]
    for t, name in zip(inits, ("w0", "w1", "w2"), strict=False):
        t.name = name
    nodes = [N("Conv", ["x", "w0"], ["c0"], kernel_shape=[1, 1], name="conv0"),
             N("Relu", ["c0"], ["r0"], name="relu0"),
             N("Conv", ["x", "w1"], ["c1"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1], name="conv1"),
             N("Relu", ["c1"], ["r1"], name="relu1"),
             N("Resize", ["r1", "", "scales"], ["up"], mode=mode, name="resize"),
             N("Concat", ["up", "r0"], ["cat"], axis=1, name="concat"),
             N("Conv", ["cat", "w2"], ["c2"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], name="conv2"),
             N("Relu", ["c2"], ["y"], name="relu2")]
    return image_model(nodes, f"upsample_{mode}", 8, 8, [("y", 8)], inits)


@pytest.mark.parametrize("mode", ["nearest", "linear"])
def test_resize_moves_values_in_nearest_mode_only(tmp_path, monkeypatch, mode):
    m = upsample(mode)
    r = optimized(m, tmp_path, monkeypatch, layout="nchw")
    nearest = mode == "nearest"
    assert flags(r) == {"conv0": (False, True), "conv1": (False, nearest), "conv2": (nearest, False)}
    check_same(m, r.model, library=True)


@pytest.mark.parametrize("precision", ["ieee", "tf32x3"])
def test_exact_precisions_round_nothing(tmp_path, monkeypatch, precision):
    r = optimized(c2f(), tmp_path, monkeypatch, precision=precision)
    assert set(flags(r).values()) == {(False, False)}
    assert not any(n.overload.endswith(("_rx", "_ry")) for n in r.model.graph.node)


def test_float16_convs_round_nothing(tmp_path, monkeypatch):
    pytest.importorskip("onnxconverter_common")  # the suite's converter (the bench extra)
    from models.fp16 import to_fp16

    r = optimized(to_fp16(c2f()), tmp_path, monkeypatch)
    assert set(flags(r).values()) == {(False, False)}


def test_function_copies_keep_the_body_and_drop_the_unused(tmp_path, monkeypatch):
    """Each renamed kernel has a function of its overload with the original's body; a
    function no node calls any more is gone."""
    r = optimized(c2f(), tmp_path, monkeypatch)
    overloads = {(n.op_type, n.overload) for n in r.model.graph.node if n.domain == "onnxfuse"}
    functions = {(f.name, f.overload): f for f in r.model.functions if f.domain == "onnxfuse"}
    assert set(functions) == overloads
    base = {}
    for (_, overload), f in functions.items():
        stem = overload.removesuffix("_ry").removesuffix("_rx")
        base.setdefault(stem, []).append([(n.op_type, list(n.input), list(n.output)) for n in f.node])
    for bodies in base.values():
        assert all(b == bodies[0] for b in bodies)


def test_plan_follows_graph_outputs_and_subgraphs():
    """A fused conv whose output is a graph output, or is read inside an If branch, stores
    it as computed."""
    conv = N("FusedConv", ["x", "w", "b"], ["y"], domain="onnxfuse", name="a")
    reader = N("FusedConv", ["y", "w", "b"], ["z"], domain="onnxfuse", name="b")
    branch = helper.make_graph([N("Identity", ["y"], ["o"])], "then", [],
                               [helper.make_tensor_value_info("o", onnx.TensorProto.FLOAT, None)])
    cond = N("If", ["c"], ["u"], then_branch=branch, else_branch=branch)
    for extra, out in (([], "y"), ([cond], "z")):
        g = helper.make_graph([conv, reader, *extra], "g", [], [helper.make_tensor_value_info(out, 1, None)])
        p = plan(helper.make_model(g), {"a", "b"}, {"a", "b"})
        assert "a" not in p.round_y and "b" not in p.x_rounded
    g = helper.make_graph([conv, reader], "g", [], [helper.make_tensor_value_info("z", 1, None)])
    p = plan(helper.make_model(g), {"a", "b"}, {"a", "b"})
    assert p.round_y == {"a"} and p.x_rounded == {"b"}
    # a reader that cannot round (a grouped conv: fp32 FMA) is not a rounding reader
    p = plan(helper.make_model(g), {"a"}, {"a", "b"})
    assert p.round_y == frozenset() and p.x_rounded == frozenset()



@pytest.mark.gpu
@pytest.mark.parametrize("build", [c2f, sppf, lambda: upsample("nearest")], ids=["c2f", "sppf", "upsample"])
def test_on_cuda_the_plan_gives_the_same_bits(tmp_path, monkeypatch, build):
    """On the GPU: the model with the plan (producers store rounded, readers skip rounding)
    gives bit for bit the outputs of the same model compiled without it (every conv rounds
    its own activations). Also checks the plan took effect."""
    from onnxfuse import rounding
    from onnxfuse.compile import local_gpu_archs
    from tests.test_gpu import session

    m = build()
    monkeypatch.setenv("ONNXFUSE_CACHE", str(tmp_path / "cache"))
    arch = ",".join(f"sm_{a}" for a in local_gpu_archs())
    planned = optimize_model(m)
    compile_pass(planned, kernel_options(arch, layout="nhwc"))
    assert any(f.x_rounded for f in planned.fused)
    monkeypatch.setattr(rounding, "plan", lambda model, rounds, may_store: rounding.Plan(frozenset(), frozenset()))
    plain = optimize_model(m)
    compile_pass(plain, kernel_options(arch, layout="nhwc"))
    assert not any(f.x_rounded or f.round_y for f in plain.fused)
    feeds = random_feeds(m, {"N": 3}, seed=11)
    want = session(plain.model, True).run(None, feeds)
    got = session(planned.model, True).run(None, feeds)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))


def test_a_producer_that_fails_to_compile_leaves_its_readers_rounding(tmp_path, monkeypatch):
    """conv1's kernel fails to compile: its node goes back to the original Conv + Relu, which
    writes unrounded values, so conv2 and conv3 (reading them through Split and Concat) must
    round their activations again; conv2 still stores its output rounded for conv3."""
    from onnxfuse import compile as aot

    real = aot.compile_kernels

    def failing(specs, targets, *args, **kw):
        out = real([s for s in specs if "conv1" not in str(s.source_nodes)], targets, *args, **kw)
        it = iter(out)
        return [aot.CompileFailure(s, tuple(targets), "injected") if "conv1" in str(s.source_nodes) else next(it)
                for s in specs]

    monkeypatch.setattr(aot, "compile_kernels", failing)
    monkeypatch.setenv("ONNXFUSE_CACHE", str(tmp_path / "cache"))
    m = c2f()
    r = optimize_model(m)
    info = compile_pass(r, kernel_options("sm_90", layout="nhwc")).report.compile
    assert len(info["failed"]) == 1 and "conv1" in info["failed"][0]["node"]
    assert flags(r) == {"conv2": (False, True), "conv3": (False, False)}
    assert any(n.op_type == "Conv" for n in r.model.graph.node)
    onnx.checker.check_model(r.model, full_check=True)
    check_same(m, r.model, library=True)


def ffn(residual_reader: bool) -> onnx.ModelProto:
    """A transformer FFN in float32: fc1 (bias, erf-GELU) -> fc2 (bias); with
    `residual_reader`, fc1's output is also added to fc2's (a reader that does not round)."""
    rng = np.random.default_rng(4)
    inits = [numpy_helper.from_array((rng.standard_normal(s) / 8).astype(np.float32), name)
             for name, s in (("w1", (32, 64)), ("b1", (64,)), ("w2", (64, 64)), ("b2", (64,)))]
    nodes = [N("MatMul", ["x", "w1"], ["h"], name="fc1"), N("Add", ["h", "b1"], ["hb"]),
             N("Div", ["hb", "sqrt2"], ["s"]), N("Erf", ["s"], ["e"]), N("Add", ["e", "one"], ["e1"]),
             N("Mul", ["hb", "e1"], ["m"]), N("Mul", ["m", "half"], ["g"]),
             N("MatMul", ["g", "w2"], ["h2"], name="fc2"), N("Add", ["h2", "b2"], ["y0"])]
    inits += [numpy_helper.from_array(np.array(v, np.float32), n) for n, v in
              (("sqrt2", 1.4142135), ("one", 1.0), ("half", 0.5))]
    if residual_reader:
        nodes.append(N("Add", ["y0", "g"], ["y"]))
    else:
        nodes.append(N("Identity", ["y0"], ["y"]))
    g = helper.make_graph(nodes, "ffn", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", 16, 32])],
                          [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["N", 16, 64])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("residual_reader", [False, True])
def test_gemm_reads_a_rounded_by_the_gemm_before_it(tmp_path, monkeypatch, residual_reader):
    """fc1's GemmEpilogue output is read only by fc2's GemmEpilogue as its A: fc1 stores it
    rounded (_ry), fc2 skips rounding A (_rx), so its fp32 wgmma stays pipelined (ptxas C7515:
    tests/test_gemm_codegen.py). When the residual Add also reads it, both keep rounding."""
    monkeypatch.setenv("ONNXFUSE_GEMM_ALL", "1")  # the gemm kind, as when tuning
    m = ffn(residual_reader)
    r = optimized(m, tmp_path, monkeypatch, layout="nchw")
    gemms = {f.source_nodes[0].split()[-1]: f for f in r.fused if f.kind == "gemm"}
    assert set(gemms) == {"fc1", "fc2"}, r.report.summary()
    got = {k: (f.x_rounded, f.round_y) for k, f in gemms.items()}
    chained = not residual_reader
    assert got == {"fc1": (False, chained), "fc2": (chained, False)}
    overloads = {n.overload for n in r.model.graph.node if n.domain == "onnxfuse"}
    assert any(o.endswith("_ry") for o in overloads) == chained and any(o.endswith("_rx") for o in overloads) == chained
    check_same(m, r.model, library=True)


def pre_ln(other_reader: bool) -> onnx.ModelProto:
    """A pre-LN transformer block's start in float32: LayerNormalization -> the Q, K and V
    projections (MatMul + bias); with `other_reader` the normalized tensor is a graph
    output too (a reader that does not round)."""
    rng = np.random.default_rng(6)
    inits = [numpy_helper.from_array(v.astype(np.float32), n) for n, v in
             (("gamma", 1 + rng.standard_normal(32) / 8), ("beta", rng.standard_normal(32) / 8),
              *((f"w{p}", rng.standard_normal((32, 32)) / 6) for p in "qkv"),
              *((f"b{p}", rng.standard_normal(32) / 8) for p in "qkv"))]
    # the residual stream h = x + a (the LayerNorm's prologue; h is read on, an output here)
    nodes = [N("Add", ["x", "a"], ["h"], name="stream"),
             N("LayerNormalization", ["h", "gamma", "beta"], ["ln"], axis=-1, epsilon=1e-5, name="ln")]
    for p in "qkv":
        nodes += [N("MatMul", ["ln", f"w{p}"], [f"{p}0"], name=f"proj_{p}"), N("Add", [f"{p}0", f"b{p}"], [p])]
    outs = ["h", "q", "k", "v"]
    if other_reader:  # the normalized tensor is an output too (the caller reads it as computed)
        outs.append("ln")
    vi = [helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, ["N", 16, 32]) for n in ("x", "a")]
    g = helper.make_graph(nodes, "pre_ln", vi,
                          [helper.make_tensor_value_info(o, onnx.TensorProto.FLOAT, ["N", 16, 32]) for o in outs],
                          inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("other_reader", [False, True])
def test_a_layer_norm_stores_rounded_for_the_projections_after_it(tmp_path, monkeypatch, other_reader):
    """The LayerNorm's FusedRows output is read only by the Q, K and V GemmEpilogues (pre-LN):
    it stores it rounded (_ry; the residual stream it also stores stays as computed) and the
    three skip rounding their A (_rx). Another reader of it keeps every kernel as it was."""
    monkeypatch.setenv("ONNXFUSE_GEMM_ALL", "1")  # the gemm kind, as when tuning
    m = pre_ln(other_reader)
    monkeypatch.setenv("ONNXFUSE_CACHE", str(tmp_path / "cache"))
    r = optimize_model(m, leave_to_ort=False)
    info = compile_pass(r, kernel_options("sm_90", layout="nchw", conv_precision="tf32")).report.compile
    assert not info["failed"] and not info["declined"]
    kinds = sorted(f.kind for f in r.fused)
    assert kinds == ["gemm", "gemm", "gemm", "rows"], r.report.summary()
    chained = not other_reader
    for f in r.fused:
        assert (f.x_rounded, f.round_y) == ((chained, False) if f.kind == "gemm" else (False, chained)), f.node_name
        assert f.kernel_name.endswith("_rx" if f.kind == "gemm" else "_ry") == chained
    check_same(m, r.model, library=True)
