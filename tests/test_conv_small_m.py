"""The conv kind's small-M variant and its one-pixel precision (BENCHMARKS.md, Decisions,
`conv-small-m`, `conv-one-pixel-ieee`).

- which convs get the variant, its tile and its kernel_meta keys;
- the launcher's choice (`launcher_choice`, the Python mirror of csrc/kinds/conv_cuda.cc)
  on kernel_meta the compile step writes, at M on both sides of the threshold;
- one-pixel convs (squeeze-excite FCs) compile at "ieee" when the model's precision is tf32;
- the small-M kernel against numpy under ``TRITON_INTERPRET=1`` (this file run as a script in
  a child process, as tests/test_conv_codegen.py does): at "ieee" to fp32 accuracy, and at
  "tf32" as the convolution of TF32-rounded operands (the interpreter's tl.dot is exact fp32);
- on the GPU (`gpu` marker, skipped here): the small-M variant against the node without it
  and against the original under ONNX Runtime's CUDA EP at M in {1, 49, 196}.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from onnxfuse.codegen_conv import ConvSpec, ConvVariant, generate_conv, round_array_to_tf32
from onnxfuse.kinds import KINDS
from onnxfuse.kinds.conv import (
    SMALL_M_MAX,
    SMALL_M_TILE,
    conv_candidates,
    conv_variants,
    launcher_choice,
    node_precision,
)
from onnxfuse.layers import ConvAttrs, PoolAttrs

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from layer_ref import conv2d  # noqa: E402

from tests.test_conv_codegen import SILU, ConvCase, _launch_conv, _load_kernel, _program  # noqa: E402
from tests.util import interpreted_run  # noqa: E402

N = helper.make_node


def _spec(c: int, k: int, kernel: int = 1, pool: PoolAttrs | None = None, group: int = 1, precision: str = "tf32",
          layouts: tuple[str, str, str] = ("nhwc", "nhwc", "krsc"), dtype: str = "f32", name: str = "k") -> ConvSpec:
    pad = (kernel // 2,) * 4
    return ConvSpec(name, _program(SILU, dtype, 0), c, k, ConvAttrs((kernel, kernel), (1, 1), pad, group=group), pool,
                    precision, x_layout=layouts[0], y_layout=layouts[1], w_layout=layouts[2])


def _meta(spec: ConvSpec) -> dict:
    return KINDS["conv"].kernel_meta(spec, conv_variants(spec), [])


# ---------------------------------------------------------------------------------------
# which convs get it, its tile, kernel_meta
# ---------------------------------------------------------------------------------------

def test_channels_last_group1_convs_end_with_the_small_m_variant():
    # EfficientNet-B0's 80 -> 480 expansion: the plain tile (no split: 3 steps), then small M
    variants = conv_variants(_spec(80, 480))
    assert [(v.index, v.split, v.max_m) for v in variants] == [(0, 0, 0), (1, 0, SMALL_M_MAX)]
    small = variants[-1]
    assert (small.block_m, small.block_n, small.block_k, small.num_warps, small.num_stages) == (
        SMALL_M_TILE["block_m"], SMALL_M_TILE["block_n"], SMALL_M_TILE["block_k"], SMALL_M_TILE["num_warps"],
        SMALL_M_TILE["num_stages"])
    assert (small.block_m, small.block_n, small.block_k, small.num_warps) == (16, 64, 64, 2)
    # 1152 -> 192: the plain tile, split K (36 steps: 9 slices of 4), then small M
    variants = conv_variants(_spec(1152, 192))
    assert [(v.index, v.split, v.max_m) for v in variants] == [(0, 0, 0), (1, 9, 0), (2, 0, SMALL_M_MAX)]
    # fp16 too
    assert conv_variants(_spec(192, 1152, dtype="f16"))[-1].max_m == SMALL_M_MAX


@pytest.mark.parametrize("c,block_k", [(16, 16), (24, 32), (48, 64), (80, 64), (1152, 64)])
def test_small_m_block_k_is_64_or_the_channels_to_a_power_of_two(c, block_k):
    assert conv_variants(_spec(c, 64))[-1].block_k == block_k


@pytest.mark.parametrize("spec", [
    _spec(64, 64, 3, pool=PoolAttrs((2, 2), (2, 2))),  # a pool in the epilogue
    _spec(64, 64, 3, group=8),  # grouped: the block-diagonal GEMM
    _spec(64, 64, 3, group=64),  # depthwise: the direct loop
    _spec(3, 64, 3),  # an image: the flat reduction
    _spec(64, 64, 3, layouts=("nchw", "nchw", "rsck")),  # NCHW: not measured
], ids=["pool", "grouped", "depthwise", "flat", "nchw"])
def test_no_small_m_variant(spec):
    assert not any(v.max_m for v in conv_variants(spec))


def test_env_config_turns_it_off(monkeypatch):
    monkeypatch.setenv("ONNXFUSE_CONV_CONFIG", "small_m=0")
    assert [v.max_m for v in conv_variants(_spec(80, 480))] == [0]


def test_kernel_meta_carries_max_m_on_the_small_variant_only():
    meta = _meta(_spec(1152, 192))
    assert [v.get("max_m") for v in meta["variants"]] == [None, None, SMALL_M_MAX]
    assert [v.get("split") for v in meta["variants"]] == [None, 9, None]
    assert meta["variants"][-1] == {"requires": {"max_elements": 2**31 - 1, "ptr_align": 16}, "block_m": 16,
                                    "block_n": 64, "max_m": SMALL_M_MAX}


def test_the_small_kernel_is_the_same_generator():
    """The small-M kernel is the plain implicit GEMM in a 16-row tile: the same source as a
    plain variant with that tile, so its TF32 path rounds as every other kernel's does."""
    spec = _spec(192, 1152)
    small = conv_variants(spec)[-1]
    plain_tile = dataclasses.replace(small, index=0, max_m=0)
    assert generate_conv(spec, small).source == generate_conv(spec, plain_tile).source
    src = generate_conv(spec, small).source
    assert "a = round_to_tf32(a)" in src and 'input_precision="tf32"' in src


def test_generator_rejects_a_small_variant_it_cannot_run():
    with pytest.raises(ValueError, match="small-M variant"):
        generate_conv(_spec(64, 64, 3, pool=PoolAttrs((2, 2), (2, 2))), ConvVariant(0, 16, 64, 64, 2, 3, max_m=64))
    with pytest.raises(ValueError, match="small-M variant"):
        generate_conv(_spec(1152, 192), ConvVariant(0, 16, 64, 64, 2, 3, split=9, max_m=64))


def test_tuning_times_the_heuristic_with_its_small_variant_only():
    spec = _spec(80, 480)
    cands = conv_candidates(spec)
    assert cands[0][1] == conv_variants(spec) and "small-M 16x64x64 (2 warps) up to M 64" in cands[0][0]
    assert all(not any(v.max_m for v in vs) for _, vs in cands[1:])


# ---------------------------------------------------------------------------------------
# the launcher's choice
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("c,k,m,want", [
    (80, 480, 196, "plain"),  # 14² at batch 1: above the threshold
    (80, 480, 65, "plain"),
    (80, 480, 64, "small-M"),  # at the threshold
    (80, 480, 49, "small-M"),  # 7² at batch 1
    (80, 480, 1, "small-M"),  # one pixel
    (192, 1152, 49, "small-M"),  # 6 steps: no split variant
    (1152, 192, 49, "split"),  # split K first where it runs
    (1152, 48, 1, "split"),
    (1152, 192, 4 * 49 * 16, "plain"),  # batch 64 at 7²: too many split tiles, M too large
])
def test_launcher_choice(c, k, m, want):
    meta = _meta(_spec(c, k))
    v = meta["variants"][launcher_choice(meta, m, k)]
    got = "split" if v.get("split") else "small-M" if v.get("max_m") else "plain"
    assert got == want


def test_launcher_takes_the_small_variant_when_no_workspace_is_lent():
    meta = _meta(_spec(1152, 192))
    assert launcher_choice(meta, 49, 192, workspace=False) == 2
    assert launcher_choice(meta, 196, 192, workspace=False) == 0


def test_launcher_choice_on_a_pooled_conv_is_the_plain_one():
    meta = _meta(_spec(64, 64, 3, pool=PoolAttrs((2, 2), (2, 2))))
    assert launcher_choice(meta, 4, 64) == 0


def test_the_cpp_launcher_reads_and_applies_max_m():
    """The C++ side of the rule this file mirrors (no GPU here to run it): conv_cuda.cc reads
    "max_m" and searches the small-M variants after split K and before the plain ones."""
    src = (REPO / "csrc" / "kinds" / "conv_cuda.cc").read_text()
    assert 'var->max_m = cuda::meta_positive(vj, "max_m", where);' in src
    split_at = src.index("/*split=*/true);")
    small_at = src.index("/*split=*/false, m);")
    plain_at = src.index("choose_variant(tg, ptrs, n_out, largest);")
    assert split_at < small_at < plain_at
    driver = (REPO / "csrc" / "cuda_driver.cc").read_text()
    assert "if (m > 0 ? var.max_m < m : var.max_m > 0) continue;" in driver


# ---------------------------------------------------------------------------------------
# one-pixel convs: ieee at tf32
# ---------------------------------------------------------------------------------------

def mbconv_se(c: int = 80, e: int = 480, size: int = 14, seed: int = 3) -> onnx.ModelProto:
    """EfficientNet's MBConv block (BatchNorm folded): 1x1 c -> e + SiLU, 3x3 depthwise +
    SiLU, squeeze-excite (GlobalAveragePool, 1x1 e -> c/4 + SiLU, 1x1 c/4 -> e + Sigmoid, Mul),
    1x1 e -> c, + x. Input x [N, c, size, size]."""
    rng = np.random.default_rng(seed)
    sq = max(1, c // 4)

    def init(name, *shape):
        return numpy_helper.from_array((rng.standard_normal(shape) / np.sqrt(np.prod(shape[1:]))).astype(np.float32),
                                       name)

    inits = [init("w1", e, c, 1, 1), init("b1", e), init("w2", e, 1, 3, 3), init("b2", e), init("w3", sq, e, 1, 1),
             init("b3", sq), init("w4", e, sq, 1, 1), init("b4", e), init("w5", c, e, 1, 1), init("b5", c)]
    nodes = [N("Conv", ["x", "w1", "b1"], ["c1"], kernel_shape=[1, 1], name="expand"),
             N("Sigmoid", ["c1"], ["s1"]), N("Mul", ["c1", "s1"], ["a1"]),
             N("Conv", ["a1", "w2", "b2"], ["c2"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], group=e, name="dw"),
             N("Sigmoid", ["c2"], ["s2"]), N("Mul", ["c2", "s2"], ["a2"]),
             N("GlobalAveragePool", ["a2"], ["g"], name="gap"),
             N("Conv", ["g", "w3", "b3"], ["f1"], kernel_shape=[1, 1], name="se_fc1"),
             N("Sigmoid", ["f1"], ["s3"]), N("Mul", ["f1", "s3"], ["a3"]),
             N("Conv", ["a3", "w4", "b4"], ["f2"], kernel_shape=[1, 1], name="se_fc2"),
             N("Sigmoid", ["f2"], ["gate"]), N("Mul", ["a2", "gate"], ["scaled"]),
             N("Conv", ["scaled", "w5", "b5"], ["c5"], kernel_shape=[1, 1], name="project"),
             N("Add", ["c5", "x"], ["y"], name="residual")]
    g = helper.make_graph(nodes, "mbconv_se",
                          [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", c, size, size])],
                          [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["N", c, size, size])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 10
    return m


def _fused(m: onnx.ModelProto):
    from onnxfuse import optimize_model

    r = optimize_model(m)
    return r, {f.source_nodes[0].split()[-1]: f for f in r.fused if f.kind == "conv"}


def test_one_pixel_convs_compile_at_ieee_the_others_at_tf32():
    r, convs = _fused(mbconv_se(c=32, e=96, size=6))
    assert {"expand", "se_fc1", "se_fc2", "project"} <= set(convs)
    conv = KINDS["conv"]
    for name, f in convs.items():
        one_pixel = name.startswith("se_")
        assert f.params.out_pixels == (1 if one_pixel else 36), name
        spec = conv.spec(r.model, f, "tf32", None)
        want = "ieee" if one_pixel and f.conv.group == 1 else "tf32"
        assert spec.precision == node_precision(f, "tf32") == want, name
        assert conv.multiplies_in_tf32(f, "tf32") == (want == "tf32"), name
        assert conv.reads_tf32(spec) == (want == "tf32" and f.conv.group == 1), name
        assert conv.tf32_initializers(f, spec) == ((f.inputs[1],) if conv.reads_tf32(spec) else ()), name
        # at the other precisions, and in fp16, nothing changes
        for p in ("tf32x3", "ieee"):
            assert conv.spec(r.model, f, p, None).precision == p
    src = generate_conv(conv.spec(r.model, convs["se_fc1"], "tf32", None), ConvVariant(0, 16, 64, 64, 2, 3)).source
    assert 'input_precision="ieee"' in src and "round_to_tf32" not in src


# ---------------------------------------------------------------------------------------
# the small-M kernel under Triton's interpreter
# ---------------------------------------------------------------------------------------

# (id, N, C, H x W, K, precision): M = N·H·W of 1, 7, 49, and 70 (above max_m: the kernel
# runs right at any M), C and K not multiples of the tile
INTERP_CASES = [
    ("m1-se-ieee", 1, 40, (1, 1), 72, "ieee"),
    ("m1-se-tf32", 1, 40, (1, 1), 72, "tf32"),
    ("m7-tf32", 1, 24, (1, 7), 20, "tf32"),
    ("m49-ieee", 1, 80, (7, 7), 70, "ieee"),
    ("m49-tf32", 1, 80, (7, 7), 70, "tf32"),
    ("m70-n2-tf32", 2, 33, (5, 7), 17, "tf32"),
]


def _interp_case(i: int):
    cid, n, c, hw, k, precision = INTERP_CASES[i]
    spec = _spec(c, k, precision=precision, name=f"k_small_{i}")
    small = conv_variants(spec)[-1]
    assert small.max_m
    case = ConvCase(cid, n, c, hw, k, ConvAttrs((1, 1)), body=SILU, layouts=("nhwc", "nhwc"), w_layout="krsc")
    rng = np.random.default_rng(300 + i)
    x = rng.standard_normal((n, c, *hw)).astype(np.float32)
    w = (rng.standard_normal((k, c, 1, 1)) / np.sqrt(c)).astype(np.float32)
    b = rng.standard_normal(k).astype(np.float32)
    return spec, small, case, x, w, b


def _interp_reference(i: int) -> np.ndarray:
    """The conv of the operands the kernel multiplies (TF32-rounded at tf32), in float64, then
    the SiLU epilogue."""
    spec, _, case, x, w, b = _interp_case(i)
    if spec.precision == "tf32":
        x, w = round_array_to_tf32(x), round_array_to_tf32(w)
    y = conv2d(x.astype(np.float64), w.astype(np.float64), b.astype(np.float64), case.conv)
    return y / (1 + np.exp(-y))


def _run_all(workdir: Path) -> None:
    results = {}
    for i in range(len(INTERP_CASES)):
        try:
            spec, small, case, x, w, b = _interp_case(i)
            # weights as the compile step packs them for a tf32 kernel: rounded once
            wk = round_array_to_tf32(w) if spec.precision == "tf32" else w
            for label, v in (("small", small), ("plain", conv_variants(spec)[0])):
                ks = generate_conv(dataclasses.replace(spec, name=f"{spec.name}_{label}"), v)
                fn = _load_kernel(workdir, ks.source, ks.name)
                results[f"{label}{i}"] = _launch_conv(fn, ks, v, case, x, wk, b, [])
        except Exception as e:  # reported by the case's test
            (workdir / f"case{i}_error.txt").write_text(f"{type(e).__name__}: {e}")
    np.savez(workdir / "out.npz", **results)


@pytest.fixture(scope="module")
def interpreted():
    pytest.importorskip("triton")
    pytest.importorskip("torch")
    with interpreted_run(__file__, "onnxfuse-small-m-interp-") as workdir:
        yield workdir


@pytest.mark.parametrize("index", range(len(INTERP_CASES)), ids=[c[0] for c in INTERP_CASES])
def test_small_m_kernel_matches_numpy(interpreted, index):
    err = interpreted / f"case{index}_error.txt"
    if err.exists():
        pytest.fail(err.read_text())
    out = np.load(interpreted / "out.npz")
    want = _interp_reference(index)
    scale = float(np.abs(want).max())
    small, plain = out[f"small{index}"], out[f"plain{index}"]
    assert small.shape == want.shape
    np.testing.assert_allclose(small, want, rtol=1e-5, atol=1e-5 * scale)
    np.testing.assert_allclose(small, plain, rtol=1e-5, atol=1e-5 * scale)  # the same operands, another tile


# ---------------------------------------------------------------------------------------
# on the GPU: ONNX Runtime's CUDA EP
# ---------------------------------------------------------------------------------------

def conv1x1(c: int, k: int, size: int, seed: int = 9) -> onnx.ModelProto:
    """A 1x1 conv c -> k + SiLU on x [N, c, size, size] (M = N · size²)."""
    rng = np.random.default_rng(seed)
    inits = [numpy_helper.from_array((rng.standard_normal((k, c, 1, 1)) / np.sqrt(c)).astype(np.float32), "w"),
             numpy_helper.from_array(rng.standard_normal(k).astype(np.float32), "b")]
    nodes = [N("Conv", ["x", "w", "b"], ["c"], kernel_shape=[1, 1], name="conv"), N("Sigmoid", ["c"], ["s"]),
             N("Mul", ["c", "s"], ["y"])]
    g = helper.make_graph(nodes, "conv1x1",
                          [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", c, size, size])],
                          [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["N", k, size, size])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 10
    return m


def _compiled(m: onnx.ModelProto, small_m: bool, monkeypatch) -> onnx.ModelProto:
    from onnxfuse import optimize_model
    from onnxfuse.pipeline import compile_pass
    from tests.util import kernel_options

    monkeypatch.setenv("ONNXFUSE_CONV_CONFIG", "" if small_m else "small_m=0")
    r = optimize_model(m, layout="nhwc")
    info = compile_pass(r, kernel_options("auto", layout="nhwc")).report.compile
    assert not info["failed"] and not info["declined"], info
    monkeypatch.delenv("ONNXFUSE_CONV_CONFIG")
    # the group-1 convs carry the variant (a depthwise conv, the direct loop, has none)
    group1 = [n for n in r.model.graph.node if n.op_type == "FusedConv"
              and all(a.i == 1 for a in n.attribute if a.name == "group")]
    metas = [json.loads(a.s) for n in group1 for a in n.attribute if a.name == "kernel_meta"]
    assert metas and all(any(v.get("max_m") for v in meta["variants"]) == small_m for meta in metas)
    return r.model


@pytest.mark.gpu(torch=True)
@pytest.mark.parametrize("c,k,size,batch", [
    (80, 480, 14, 1),  # M = 196: the plain tile
    (192, 1152, 7, 1),  # M = 49: the small-M tile (no split K: 6 steps)
    (1152, 192, 7, 1),  # M = 49: split K
    (48, 1152, 1, 1),  # M = 1: one pixel (ieee), the small-M tile
    (48, 1152, 1, 64),  # M = 64: at the threshold
    (192, 1152, 7, 2),  # M = 98: above it
])
def test_small_m_variant_matches_the_original_and_the_plain_variant(c, k, size, batch, monkeypatch, tmp_path):
    """The node with the small-M variant against the same node without it and against the
    original (TF32 off; tests/test_gpu_conv.py's tolerances: tf32 2e-3 x max|y|, one-pixel
    convs at ieee 1e-5). CUDA graphs are test_gpu_conv's split-K test's: the small-M kernel
    takes no workspace."""
    from tests.test_gpu import session
    from tests.test_gpu_conv import check
    from tests.util import random_feeds

    monkeypatch.setenv("ONNXFUSE_CACHE", str(tmp_path))
    m = conv1x1(c, k, size)
    with_small, without = _compiled(m, True, monkeypatch), _compiled(m, False, monkeypatch)
    feeds = random_feeds(m, {"N": batch}, seed=70 + size)
    expected = session(m, library=False).run(None, feeds)
    rel = 1e-5 if size == 1 else 2e-3
    got = session(with_small, library=True).run(None, feeds)
    check(expected, got, rel, f"small-M {c}->{k} at {size}², batch {batch}")
    check(expected, session(without, library=True).run(None, feeds), rel, "without the small-M variant")


@pytest.mark.gpu(torch=True)
def test_mbconv_block_at_batch_1_and_4(monkeypatch, tmp_path):
    """The MBConv block: its SE FCs (one pixel, ieee) and its 1x1 convs at M = 49 (batch 1,
    the small-M variant) and 196 (batch 4, the plain one), against the original."""
    from tests.test_gpu import session
    from tests.test_gpu_conv import check
    from tests.util import random_feeds

    monkeypatch.setenv("ONNXFUSE_CACHE", str(tmp_path))
    m = mbconv_se(c=192 // 6 * 2, e=192, size=7)
    opt = _compiled(m, True, monkeypatch)
    for batch in (1, 4):
        feeds = random_feeds(m, {"N": batch}, seed=80 + batch)
        check(session(m, library=False).run(None, feeds), session(opt, library=True).run(None, feeds), 5e-3,
              f"mbconv batch {batch}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--interpret"]:
        assert os.environ.get("TRITON_INTERPRET") == "1"
        from tests.test_codegen import _install_gpu_max_semantics, _install_libdevice_shims

        _install_libdevice_shims()  # the interpreter has no libdevice (sigmoid uses exp)
        _install_gpu_max_semantics()
        _run_all(Path(sys.argv[2]))
