"""Rounded TF32 in the generated conv kernels (codegen_conv.ROUND_TO_TF32).

Triton's ``tl.dot(..., input_precision="tf32")`` truncates fp32 operands to TF32 on the GPU;
cuBLAS and cuDNN round them. The kernels of ``--conv-precision tf32`` round both operands
before every ``tl.dot``. Checked here on the CPU:

- the numpy reference (tests/layer_ref.round_to_tf32) on known values, and against nearest
  rounding done with float64 arithmetic on random values;
- the generated ``round_to_tf32`` bit for bit against it, under ``TRITON_INTERPRET=1``;
- one conv per kernel family (tap loop NCHW, tap loop NHWC with [K, R, S, C] weights, the
  flat loop, split K) in the interpreter, whose ``tl.dot`` computes in full fp32: so its
  output is the float64 conv of the ROUNDED operands up to fp32 summation error, and not
  that of the truncated ones (nor of the operands as they are);
- which sources round: float32 group-1 convs at tf32 only.

The interpreter runs in one child process (this file as a script), as in
tests/test_conv_codegen.py, whose helpers it reuses."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

import onnxfuse.codegen_conv as codegen_conv
from onnxfuse.codegen_conv import ROUND_TO_TF32, ConvSpec, ConvVariant, generate_conv
from onnxfuse.layers import ConvAttrs, PoolAttrs
from tests.test_conv_codegen import RELU, SILU, ConvCase, _launch_conv, _load_kernel, _program

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from layer_ref import conv2d, round_to_tf32, truncate_to_tf32  # noqa: E402

IDENTITY = "output %0 {dt}"  # the conv's own result, so that only the dot's numerics show

# (input bits, bits rounded to the nearest TF32 value)
KNOWN = [
    (0x3F800000, 0x3F800000),  # 1.0: a TF32 value already
    (0x3F800FFF, 0x3F800000),  # just below half of the lowest kept bit: down
    (0x3F801000, 0x3F802000),  # a tie: away from zero
    (0x3F801001, 0x3F802000),  # above half: up
    (0xBF801000, 0xBF802000),  # a negative tie: away from zero, so down
    (0xBF800FFF, 0xBF800000),  # negative, below half: toward zero
    (0x3FFFF000, 0x40000000),  # 1.99951...: rounds up into the next binade, 2.0
    (0xBFFFF800, 0xC0000000),  # and its negative, -2.0
    (0x00000000, 0x00000000),  # +0
    (0x80000000, 0x80000000),  # -0
    (0x00000FFF, 0x00000000),  # subnormals: below half of the lowest kept bit, to zero
    (0x00001000, 0x00002000),  # a subnormal tie: away from zero
    (0x80001800, 0x80002000),  # a negative subnormal
    (0x007FF000, 0x00800000),  # the largest subnormals round up to the smallest normal
    (0x7F7FEFFF, 0x7F7FE000),  # below the tie above the largest TF32 value: stays finite
    (0x7F7FFFFF, 0x7F800000),  # max finite float32: past that tie, so Inf, as cvt.rna does
    (0xFF7FFFFF, 0xFF800000),  # and -Inf
    (0x7F800000, 0x7F800000),  # +Inf
    (0xFF800000, 0xFF800000),  # -Inf
    (0x7FC00000, 0x7FC00000),  # quiet NaN
    (0x7F800001, 0x7F800001),  # NaN with its payload in the dropped bits: stays NaN, not Inf
    (0xFF800FFF, 0xFF800FFF),  # negative NaN, low payload
    (0x7F801000, 0x7F801000),  # NaN whose payload would carry
    (0xFFFFFFFF, 0xFFFFFFFF),  # all ones: a NaN; + 0x1000 would wrap
]


def _bits(values) -> np.ndarray:
    return np.array(values, dtype=np.uint32)


def test_reference_rounds_known_values():
    got = round_to_tf32(_bits([a for a, _ in KNOWN]).view(np.float32)).view(np.uint32)
    want = _bits([b for _, b in KNOWN])
    bad = [(hex(a), hex(g), hex(w)) for (a, _), g, w in zip(KNOWN, got, want, strict=True) if g != w]
    assert not bad, bad
    assert truncate_to_tf32(_bits([0x3F801FFF, 0xBF801FFF]).view(np.float32)).view(np.uint32).tolist() == [
        0x3F800000, 0xBF800000]


def test_reference_is_the_nearest_tf32_value():
    """On random finite bit patterns: the result is the nearer of the two TF32 values around
    x (chosen by float64 distances), ties away from zero."""
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32)
    bits[:1000] = (bits[:1000] & ~np.uint32(0x1FFF)) | np.uint32(0x1000)  # ties
    x = bits.view(np.float32)
    lo_bits = bits & ~np.uint32(0x1FFF)
    finite = np.isfinite(x) & ((lo_bits & 0x7FFFFFFF) < 0x7F7FE000)  # hi below Inf
    x, bits, lo_bits = x[finite], bits[finite], lo_bits[finite]
    lo = lo_bits.view(np.float32).astype(np.float64)  # toward zero
    hi = (lo_bits + np.uint32(0x2000)).view(np.float32).astype(np.float64)  # away from zero
    d_lo, d_hi = np.abs(x - lo), np.abs(hi - x)
    want = np.where(d_hi <= d_lo, hi, lo)
    np.testing.assert_array_equal(round_to_tf32(x).astype(np.float64), want)
    assert (d_hi == d_lo).sum() >= 1000


# ---------------------------------------------------------------------------------------
# kernels in the interpreter
# ---------------------------------------------------------------------------------------

# One per kernel family; "positive" inputs are ReLU-like activations and weights in [0, 1),
# "signed" ones N(0, 1). Small tiles: several programs and ragged edges.
CASES = [
    ("tap-nchw-rsck", ConvCase("tap-nchw", 2, 24, (9, 8), 20, ConvAttrs((3, 3), (1, 1), (1, 1, 1, 1)),
                               body=IDENTITY), "positive"),
    ("tap-nhwc-krsc", ConvCase("tap-nhwc", 2, 32, (7, 9), 24, ConvAttrs((3, 3), (2, 1), (1, 1, 1, 1)),
                               body=IDENTITY, layouts=("nhwc", "nhwc"), w_layout="krsc"), "positive"),
    ("tap-nhwc-krsc-signed", ConvCase("tap-nhwc-signed", 2, 32, (7, 9), 24, ConvAttrs((3, 3), (1, 1), (1, 1, 1, 1)),
                                      body=IDENTITY, layouts=("nhwc", "nhwc"), w_layout="krsc"), "signed"),
    ("flat", ConvCase("flat", 2, 3, (12, 11), 16, ConvAttrs((3, 3), (1, 1), (1, 1, 1, 1)), body=IDENTITY,
                      flat=True), "positive"),
    ("split-k", ConvCase("split", 1, 48, (5, 6), 16, ConvAttrs((3, 3), (1, 1), (1, 1, 1, 1)), body=IDENTITY,
                         layouts=("nhwc", "nhwc"), w_layout="krsc", split=3), "positive"),
]


def _case_spec(i: int, case: ConvCase) -> tuple[ConvSpec, ConvVariant]:
    spec = ConvSpec(f"k_tf32_{i}", _program(case.body, "f32", 0), case.c, case.k, case.conv, None, "tf32",
                    x_layout=case.layouts[0], y_layout=case.layouts[1], w_layout=case.w_layout)
    bm, bn, bk = case.tile
    return spec, ConvVariant(0, bm, bn, bk, 2, 2, flat=case.flat, split=case.split)


def _case_inputs(i: int, case: ConvCase, kind: str):
    """x, weights [K, C, R, S] and a zero bias (the conv alone), float32."""
    rng = np.random.default_rng(3000 + i)
    h, w = case.hw
    shape_x, shape_w = (case.n, case.c, h, w), (case.k, case.c) + case.conv.kernel
    if kind == "positive":
        x, wt = rng.random(shape_x), rng.random(shape_w)
    else:
        x, wt = rng.standard_normal(shape_x), rng.standard_normal(shape_w)
    return x.astype(np.float32), wt.astype(np.float32), np.zeros(case.k, np.float32)


def _helper_module() -> str:
    """The generated round_to_tf32 and a kernel that applies it to a vector."""
    return "\n".join(["import triton", "import triton.language as tl", "", "", *ROUND_TO_TF32, "", "",
                      "@triton.jit",
                      "def apply_round(x_ptr, y_ptr, n, BLOCK: tl.constexpr):",
                      "    offs = tl.program_id(axis=0) * BLOCK + tl.arange(0, BLOCK)",
                      "    x = tl.load(x_ptr + offs, mask=offs < n)",
                      "    tl.store(y_ptr + offs, round_to_tf32(x), mask=offs < n)", ""])


def _helper_inputs() -> np.ndarray:
    rng = np.random.default_rng(1)
    return np.concatenate([_bits([a for a, _ in KNOWN]), rng.integers(0, 2**32, 4096, dtype=np.uint64).astype(
        np.uint32)]).view(np.float32)


def _run_all(workdir: Path) -> None:
    import torch

    fn = _load_kernel(workdir, _helper_module(), "apply_round")
    x = torch.from_numpy(_helper_inputs().copy())
    y = torch.empty_like(x)
    fn[(-(-x.numel() // 1024),)](x, y, x.numel(), BLOCK=1024)
    results = {"helper": y.numpy()}
    for i, (key, case, kind) in enumerate(CASES):
        spec, v = _case_spec(i, case)
        ks = generate_conv(spec, v)
        x, wt, b = _case_inputs(i, case, kind)
        # the weights as the compile step packs them for a "tf32" kernel: rounded
        # (onnxfuse.kernels.compile_fused); the kernel rounds the activations
        assert codegen_conv.prerounds_weights(spec)
        results[key] = _launch_conv(_load_kernel(workdir, ks.source, spec.name), ks, v, case, x,
                                    codegen_conv.round_array_to_tf32(wt), b, [])
    results.update(_run_chains(workdir))
    np.savez(workdir / "out.npz", **results)


# TF32 rounding at the producer (onnxfuse.rounding): conv A feeds conv B. A with round_y
# stores its output rounded; B with x_rounded skips rounding its activations. Per case: A's
# layer (SiLU epilogue: signed outputs, NHWC; then the same with a 2x2 pool in the epilogue,
# then split K) and B's (3x3 NHWC).
CHAIN_A = [
    ("plain", ConvCase("chain-a", 2, 16, (8, 9), 32, ConvAttrs((3, 3), (1, 1), (1, 1, 1, 1)), body=SILU,
                       layouts=("nhwc", "nhwc"), w_layout="krsc")),
    ("pool", ConvCase("chain-a-pool", 2, 16, (8, 10), 32, ConvAttrs((3, 3), (1, 1), (1, 1, 1, 1)),
                      PoolAttrs((2, 2), (2, 2)), body=SILU, layouts=("nhwc", "nhwc"), w_layout="krsc")),
    ("split", ConvCase("chain-a-split", 1, 48, (5, 6), 32, ConvAttrs((3, 3), (1, 1), (1, 1, 1, 1)), body=SILU,
                       layouts=("nhwc", "nhwc"), w_layout="krsc", split=3)),
]


def _chain_b(a: ConvCase) -> ConvCase:
    return ConvCase("chain-b", a.n, a.k, (0, 0), 24, ConvAttrs((3, 3), (1, 1), (1, 1, 1, 1)), body=IDENTITY,
                    layouts=("nhwc", "nhwc"), w_layout="krsc")


def _chain_inputs(i: int, a: ConvCase):
    rng = np.random.default_rng(4000 + i)
    x = rng.standard_normal((a.n, a.c) + a.hw).astype(np.float32)
    wa = rng.standard_normal((a.k, a.c, 3, 3)).astype(np.float32)
    wb = rng.standard_normal((24, a.k, 3, 3)).astype(np.float32)
    return x, wa, np.zeros(a.k, np.float32), wb, np.zeros(24, np.float32)


def _run_chains(workdir: Path) -> dict[str, np.ndarray]:
    """Per A case: A's output plain and stored rounded; B's output on each with and without
    its own rounding."""
    import dataclasses

    out = {}
    for i, (key, a) in enumerate(CHAIN_A):
        x, wa, ba, wb, bb = _chain_inputs(i, a)
        b = _chain_b(a)
        for ry in (False, True):
            spec, v = _case_spec(100 + i, a)
            spec = dataclasses.replace(spec, name=f"k_chain_a{i}_{int(ry)}", program=_program(SILU, "f32", 0),
                                       pool=a.pool, round_y=ry)
            ks = generate_conv(spec, v)
            ya = _launch_conv(_load_kernel(workdir, ks.source, spec.name), ks, v, a, x,
                              codegen_conv.round_array_to_tf32(wa), ba, [])
            out[f"{key}-a-{int(ry)}"] = ya
            b = dataclasses.replace(b, hw=ya.shape[2:])
            for rx in (False, True):
                spec_b, vb = _case_spec(200 + i, b)
                spec_b = dataclasses.replace(spec_b, name=f"k_chain_b{i}_{int(ry)}{int(rx)}", x_rounded=rx)
                ks = generate_conv(spec_b, vb)
                out[f"{key}-b-{int(ry)}{int(rx)}"] = _launch_conv(
                    _load_kernel(workdir, ks.source, spec_b.name), ks, vb, b, ya,
                    codegen_conv.round_array_to_tf32(wb), bb, [])
    return out


@pytest.fixture(scope="module")
def interpreted() -> dict[str, np.ndarray]:
    with tempfile.TemporaryDirectory(prefix="onnxfuse-tf32-interp-") as tmp:
        env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
        proc = subprocess.run([sys.executable, __file__, "--interpret", tmp], env=env, capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        with np.load(Path(tmp) / "out.npz") as out:
            yield dict(out)


def test_generated_helper_is_bit_exact(interpreted):
    x = _helper_inputs()
    np.testing.assert_array_equal(interpreted["helper"].view(np.uint32), round_to_tf32(x).view(np.uint32))


def test_weight_rounding_is_the_helpers():
    """The compile step's numpy rounding of weights equals the reference bit for bit."""
    x = _helper_inputs()
    np.testing.assert_array_equal(codegen_conv.round_array_to_tf32(x).view(np.uint32),
                                  round_to_tf32(x).view(np.uint32))


@pytest.mark.parametrize("index", range(len(CASES)), ids=[c[0] for c in CASES])
def test_tf32_kernel_is_the_conv_of_rounded_operands(interpreted, index):
    key, case, kind = CASES[index]
    x, wt, b = _case_inputs(index, case, kind)
    got = interpreted[key].astype(np.float64)
    exact = conv2d(x, wt, b, case.conv)  # float64, of the operands as they are
    rounded = conv2d(round_to_tf32(x), round_to_tf32(wt), b, case.conv)
    truncated = conv2d(truncate_to_tf32(x), truncate_to_tf32(wt), b, case.conv)
    scale = float(np.abs(exact).max())

    def max_rel(ref: np.ndarray) -> float:
        return float(np.abs(got - ref).max()) / scale

    # fp32 summation error only (the interpreter's dot is fp32 on the rounded operands)
    assert max_rel(rounded) < 1e-6, max_rel(rounded)
    # rounding happened (TF32 is 2^-11 relative per operand) and it is not truncation
    assert max_rel(exact) > 2e-5 and max_rel(truncated) > 2e-5
    assert max_rel(truncated) > 20 * max_rel(rounded)
    if kind == "positive":
        # truncation shrinks every product: a bias of about -7e-4 of the result; rounding
        # has none to speak of
        mean = float(np.abs(exact).mean())
        bias_rounded = float((got - exact).mean()) / mean
        bias_truncated = float((truncated - exact).mean()) / mean
        assert bias_truncated < -3e-4, bias_truncated
        assert abs(bias_rounded) < abs(bias_truncated) / 10, (bias_rounded, bias_truncated)


@pytest.mark.parametrize("key", [k for k, _ in CHAIN_A])
def test_rounding_at_the_producer_gives_the_same_bits(interpreted, key):
    """A conv that stores its output rounded (round_y) stores exactly the rounded values, and
    the conv that reads them without rounding (x_rounded) gives bit for bit what it gives
    rounding them itself. Reading unrounded values without rounding differs (the interpreter's
    dot is fp32): the flags matter, and the test would see a wrong pairing."""
    plain, stored = interpreted[f"{key}-a-0"], interpreted[f"{key}-a-1"]
    np.testing.assert_array_equal(stored.view(np.uint32), round_to_tf32(plain).view(np.uint32))
    assert not np.array_equal(stored, plain)
    reference = interpreted[f"{key}-b-00"]  # A as computed, B rounds: the kernels without the plan
    np.testing.assert_array_equal(interpreted[f"{key}-b-11"].view(np.uint32), reference.view(np.uint32))
    np.testing.assert_array_equal(interpreted[f"{key}-b-10"].view(np.uint32), reference.view(np.uint32))
    assert not np.array_equal(interpreted[f"{key}-b-01"], reference)


# ---------------------------------------------------------------------------------------
# which sources round
# ---------------------------------------------------------------------------------------


def _spec(precision: str = "tf32", dtype: str = "f32", group: int = 1, **kw) -> ConvSpec:
    return ConvSpec("k", _program(RELU, dtype, 0), 16, 16, ConvAttrs((3, 3), (1, 1), (1, 1, 1, 1), group=group),
                    None, precision, **kw)


@pytest.mark.parametrize("variant", [ConvVariant(0, 32, 16, 16), ConvVariant(0, 32, 16, 16, flat=True),
                                     ConvVariant(0, 32, 16, 16, split=3)], ids=["tap", "flat", "split"])
@pytest.mark.parametrize("layouts", [("nchw", "nchw", "rsck"), ("nhwc", "nhwc", "krsc")], ids=["nchw", "nhwc"])
def test_tf32_sources_round_the_activations_before_every_dot(variant, layouts):
    x, y, w = layouts
    spec = _spec(x_layout=x, y_layout=y, w_layout=w)
    src = generate_conv(spec, variant).source
    lines = src.splitlines()
    assert src.count("def round_to_tf32(x):") == 1
    dots = [i for i, ln in enumerate(lines) if "= tl.dot(" in ln]
    assert len(dots) == 1
    for at in dots:
        assert lines[at].strip() == 'acc = tl.dot(a, b, acc, input_precision="tf32")'
        assert lines[at - 1].strip() == "a = round_to_tf32(a)" and "b = round_to_tf32" not in src
    assert "dot precision tf32 (activations rounded to nearest here, weights when packed)" in src
    assert codegen_conv.prerounds_weights(spec)


@pytest.mark.parametrize("variant", [ConvVariant(0, 32, 16, 16), ConvVariant(0, 32, 16, 16, split=3)],
                         ids=["tap", "split"])
def test_producer_rounding_flags_in_the_source(variant):
    """x_rounded: no rounding before the dot (the operands go to tl.dot as loaded); round_y:
    the value stored is round_to_tf32 of the program's output, in either case."""
    both = generate_conv(_spec(x_rounded=True, round_y=True), variant).source
    assert "a = round_to_tf32(a)" not in both and "y_rounded = round_to_tf32(tmp1)" in both
    assert "tl.store(y_ptr + y_offs, y_rounded, mask=mask)" in both
    assert "(activations stored rounded to nearest by their producers, weights when packed)" in both
    only_x = generate_conv(_spec(x_rounded=True), variant).source
    assert "round_to_tf32" not in only_x
    only_y = generate_conv(_spec(round_y=True), variant).source
    assert "a = round_to_tf32(a)" in only_y and "y_rounded = round_to_tf32(tmp1)" in only_y
    # exact precisions and fp16 convs have nothing to round for their readers
    for spec in (_spec("ieee", round_y=True, x_rounded=True), _spec("tf32", "f16", round_y=True)):
        assert "round_to_tf32" not in generate_conv(spec, variant).source


@pytest.mark.parametrize("spec", [_spec("tf32x3"), _spec("ieee"), _spec("tf32", "f16"), _spec(group=4),
                                  _spec(group=16, x_layout="nhwc", y_layout="nhwc", w_layout="krsc")],
                         ids=["tf32x3", "ieee", "fp16", "grouped", "depthwise"])
def test_other_convs_do_not_round(spec):
    src = generate_conv(spec, ConvVariant(0, 32, 16, 16)).source
    assert "round_to_tf32" not in src
    if spec.conv.group != 1:  # the direct loop: fp32 FMA on CUDA cores, no tensor cores
        assert "tl.dot" not in src and "acc += a * b[None, :]" in src


@pytest.mark.parametrize("mode", ["", "ab"])
def test_the_private_switch_gives_the_benchmarks_kernels(monkeypatch, mode):
    """benchmarks/conv_precision.py measures, through _ROUND_TF32, the truncating kernel ("")
    and the one rounding both operands ("ab") beside the shipped one ("a")."""
    spec, v = _spec(), ConvVariant(0, 32, 16, 16)
    shipped = generate_conv(spec, v).source
    monkeypatch.setattr(codegen_conv, "_ROUND_TF32", mode)
    other = generate_conv(spec, v).source
    assert codegen_conv.prerounds_weights(spec) is False
    assert 'input_precision="tf32"' in other
    kernel = [ln.strip() for ln in other.split("@triton.jit")[-1].splitlines()]
    if mode == "":
        assert "round_to_tf32" not in other and "(operands truncated)" in other
    else:
        assert kernel[kernel.index("a = round_to_tf32(a)") + 1] == "b = round_to_tf32(b)"
        assert "(operands rounded to nearest)" in other
    drop = {ln for ln in kernel if "round_to_tf32" in ln or ln.startswith("# To the nearest TF32")}
    strip = [ln for ln in kernel if ln not in drop]
    assert strip == [ln.strip() for ln in shipped.split("@triton.jit")[-1].splitlines()
                     if "round_to_tf32" not in ln and not ln.strip().startswith("# To the nearest TF32")]


def test_compile_rounds_the_weights_of_tf32_kernels_only(tmp_path, monkeypatch):
    """compile_fused rounds the packed weights of "tf32" fp32 convs (their kernels read them
    rounded), and with no other precision."""
    from onnx import numpy_helper

    from models.build import conv_relu_maxpool
    from onnxfuse import optimize_model
    from onnxfuse.kernels import compile_fused

    monkeypatch.setenv("ONNXFUSE_CACHE", str(tmp_path))
    m = conv_relu_maxpool(channels=8, size=16)
    for precision, rounded in (("tf32", True), ("ieee", False)):
        r = optimize_model(m)
        (f,) = r.fused
        before = numpy_helper.to_array(next(t for t in r.model.graph.initializer if t.name == f.inputs[1]))
        compile_fused(r.model, r.fused, [90], conv_precision=precision)
        after = numpy_helper.to_array(next(t for t in r.model.graph.initializer if t.name == f.inputs[1]))
        want = codegen_conv.round_array_to_tf32(before) if rounded else before
        np.testing.assert_array_equal(after.view(np.uint32), want.view(np.uint32))
        assert rounded == (not np.array_equal(after, before))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--interpret"]:
        assert os.environ.get("TRITON_INTERPRET") == "1"
        from tests.test_codegen import _install_libdevice_shims

        _install_libdevice_shims()  # the interpreter has no libdevice (SiLU's sigmoid uses exp)
        _run_all(Path(sys.argv[2]))
