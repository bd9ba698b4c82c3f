"""Generated GemmEpilogue Triton kernels (onnxfuse.codegen_gemm) against the numpy reference of
the node contract (onnxfuse.kinds.gemm.evaluate_gemm): under ``TRITON_INTERPRET=1`` in one child
process (this file run as a script, so the interpreter setting never reaches the process where
other tests compile kernels), on the GPU with Triton's JIT (`gpu`), and compiled ahead of time
for sm_80 / sm_90 with no GPU.

The cases cover sizes that are not multiples of the tile (M 37, N 45, K 70: the rows and columns
that wrap around, the masked K tail), tiles larger than the product, transposed operands, a
batched A times a 2-D B (one GEMM of M = batch * rows), equal batch dims, every epilogue input
mode (full, row, scalar, strided), alpha, float32 at the three precisions (tf32: operands
rounded to nearest TF32 as cuBLAS does, B pre-rounded or rounded in the kernel), float16 and
bfloat16; and split K (GemmVariant.split: the K blocks spread over the grid's third axis, the
last program per tile summing the partials and running the epilogue) at several slice
counts, one that leaves a slice empty, fp32 and fp16, a batched product (one counter per
batch and tile), with a bias + erf-GELU + residual epilogue.

Split K in the interpreter: programs run one after another, so the arrival counter's
acquire-release atomic is exercised for its count (the last program of each tile, and only
it, sums and stores), not for its memory ordering; that is the GPU tests' (test_gemm_gpu.py)."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from onnxfuse.codegen_conv import round_array_to_tf32
from onnxfuse.codegen_gemm import (
    SMALL_M,
    GemmSpec,
    GemmVariant,
    gemm_candidates,
    gemm_param_names,
    gemm_variants,
    generate_gemm,
)
from onnxfuse.expr import HEADER, parse
from onnxfuse.kinds.gemm import evaluate_gemm

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tests.util import interpreted_run  # noqa: E402

NP = {"f32": np.float32, "f16": np.float16, "bf16": ml_dtypes.bfloat16}

# Epilogues: {dt} is the product's dtype; the extras follow %0.
IDENTITY = "input %0 {dt}\n%1 = add %0 0.0\noutput %1 {dt}"
BIAS_GELU = ("input %0 {dt}\ninput %1 {dt}\n%2 = add %0 %1\n%3 = mul %2 -0.7071067690849304\n%4 = erfc %3\n"
             "%5 = mul %2 0.5\n%6 = mul %5 %4\noutput %6 {dt}")
BIAS_RESIDUAL = "input %0 {dt}\ninput %1 {dt}\ninput %2 {dt}\n%3 = add %0 %1\n%4 = add %3 %2\noutput %4 {dt}"
BIAS_GELU_RESIDUAL = ("input %0 {dt}\ninput %1 {dt}\ninput %2 {dt}\n%3 = add %0 %1\n%4 = mul %3 -0.7071067690849304\n"
                      "%5 = erfc %4\n%6 = mul %3 0.5\n%7 = mul %6 %5\n%8 = add %7 %2\noutput %8 {dt}")
SILU_CAST_F16 = "input %0 {dt}\n%1 = sigmoid %0\n%2 = mul %0 %1\noutput %2 f16"
SCALE_CLIP = "input %0 {dt}\ninput %1 f32\n%2 = mul %0 %1\n%3 = max %2 0.0\n%4 = min %3 6.0\noutput %4 {dt}"
STRIDED_ADD = "input %0 {dt}\ninput %1 {dt}\n%2 = add %0 %1\noutput %2 {dt}"
STRIDED_SILU = "input %0 {dt}\ninput %1 {dt}\n%2 = add %0 %1\n%3 = sigmoid %2\n%4 = mul %2 %3\noutput %4 {dt}"

SMALL = GemmVariant(0, block_m=16, block_n=32, block_k=16, group_m=2, num_warps=4, num_stages=1)
SPLIT = dataclasses.replace(SMALL, split=16)  # split K, run with Case.slices slices


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    a_shape: tuple[int, ...]  # as stored (trans_a: [..., K, M])
    b_shape: tuple[int, ...]
    program: str
    extras: tuple[tuple[tuple[int, ...], str], ...] = ()  # (shape, mode) per extra
    dtype: str = "f32"
    trans_a: bool = False
    trans_b: bool = False
    alpha: float = 1.0
    precision: str = "ieee"
    b_rounded: bool = False
    variant: GemmVariant | None = SMALL  # None: the first of gemm_variants
    interpreter: bool = True  # False: GPU only (Triton 3.6's interpreter multiplies bf16 bit patterns)
    slices: int = 0  # split-K variants: the grid's z (0: what the launcher would pick, at least 2)
    x_rounded: bool = False  # TF32 at the producer: A arrives rounded, the kernel does not round it
    round_y: bool = False  # ... and the kernel stores Y rounded to TF32


CASES = [
    Case("f32-ieee-bias-gelu-odd", (37, 70), (70, 45), BIAS_GELU, (((45,), "row"),)),
    Case("f32-tf32-rounded-in-kernel", (37, 70), (70, 45), BIAS_GELU, (((45,), "row"),), precision="tf32"),
    Case("f32-tf32-b-prerounded-transb", (37, 70), (45, 70), BIAS_GELU, (((1, 45), "row"),), trans_b=True,
         precision="tf32", b_rounded=True),
    Case("f32-tf32x3-trans-a", (70, 37), (70, 45), IDENTITY, trans_a=True, precision="tf32x3"),
    Case("f32-flattened-batch-residual", (2, 19, 40), (40, 48), BIAS_RESIDUAL,
         (((48,), "row"), ((2, 19, 48), "full"))),
    Case("f32-batched-strided-extra", (3, 17, 33), (3, 33, 20), STRIDED_ADD, (((3, 1, 20), "strided"),)),
    Case("f32-batched-shared-b-trans-a", (3, 33, 17), (33, 20), STRIDED_ADD, (((17, 1), "strided"),), trans_a=True),
    Case("f32-alpha-scalar-clip", (20, 32), (32, 24), SCALE_CLIP, (((1,), "scalar"),), alpha=0.5),
    Case("f32-default-tile-larger-than-product", (37, 70), (70, 45), BIAS_GELU, (((45,), "row"),), variant=None),
    Case("f16-bias-gelu", (37, 70), (70, 45), BIAS_GELU, (((45,), "row"),), dtype="f16"),
    # the default (medium) tile's heavy epilogue runs on four column parts (epilogue_parts)
    Case("f16-default-tile-split-epilogue", (37, 70), (70, 45), BIAS_GELU, (((45,), "row"),), dtype="f16",
         variant=None),
    Case("f32-default-tile-split-epilogue-strided", (2, 40, 33), (2, 33, 72), STRIDED_SILU,
         (((2, 1, 72), "strided"),), variant=None),
    Case("f16-transb-residual", (2, 19, 64), (48, 64), BIAS_RESIDUAL, (((48,), "row"), ((2, 19, 48), "full")),
         dtype="f16", trans_b=True),
    Case("f32-silu-cast-to-f16", (21, 32), (32, 40), SILU_CAST_F16),
    Case("bf16-bias-gelu", (37, 70), (70, 45), BIAS_GELU, (((45,), "row"),), dtype="bf16", interpreter=False),
    # split K (5 K blocks of 16): 2 and 3 slices, 4 (per = 2: the last slice empty), 5 (one block each)
    *(Case(f"split{s}-f32-bias-gelu-residual-odd", (37, 70), (70, 45), BIAS_GELU_RESIDUAL,
           (((45,), "row"), ((37, 45), "full")), variant=SPLIT, slices=s) for s in (2, 3, 4, 5)),
    Case("split3-f16-bias-gelu-residual-odd", (37, 70), (70, 45), BIAS_GELU_RESIDUAL,
         (((45,), "row"), ((37, 45), "full")), dtype="f16", variant=SPLIT, slices=3),
    Case("split2-f16-transb-flattened", (2, 19, 64), (48, 64), BIAS_GELU_RESIDUAL,
         (((48,), "row"), ((2, 19, 48), "full")), dtype="f16", trans_b=True, variant=SPLIT, slices=2),
    Case("split3-f32-tf32-batched-alpha", (3, 17, 70), (3, 70, 45), BIAS_GELU_RESIDUAL,
         (((45,), "row"), ((3, 17, 45), "full")), alpha=0.5, precision="tf32", variant=SPLIT, slices=3),
    Case("split4-f32-batched-shared-b-trans-a-strided", (3, 70, 17), (70, 20), STRIDED_ADD,
         (((17, 1), "strided"),), trans_a=True, variant=SPLIT, slices=4),
    Case("split-default-variant-m128", (128, 768), (768, 64), BIAS_GELU_RESIDUAL,
         (((64,), "row"), ((128, 64), "full")), variant=None),
    # TF32 rounding at the producer (onnxfuse.rounding): A stored rounded by its producer (the
    # kernel rounds B only), and Y stored rounded (in the column-part epilogue and in split K)
    Case("f32-tf32-a-rounded-by-producer", (37, 70), (70, 45), BIAS_GELU, (((45,), "row"),), precision="tf32",
         x_rounded=True),
    Case("f32-tf32-stores-y-rounded-parts", (37, 70), (70, 45), BIAS_GELU, (((45,), "row"),), precision="tf32",
         b_rounded=True, round_y=True, variant=None),
    Case("split3-f32-tf32-a-rounded-stores-rounded", (37, 70), (70, 45), BIAS_GELU_RESIDUAL,
         (((45,), "row"), ((37, 45), "full")), precision="tf32", b_rounded=True, variant=SPLIT, slices=3,
         x_rounded=True, round_y=True),
]


def spec_of(i: int, case: Case) -> tuple[GemmSpec, GemmVariant]:
    prog = parse(f"{HEADER}\n{case.program.format(dt=case.dtype)}\n")
    m, n, k, g = geometry(case)[:4]
    spec = GemmSpec(f"k_gemm_{i}", prog, tuple(mode for _, mode in case.extras), case.trans_a, case.trans_b,
                    case.alpha, case.precision, case.b_rounded, m, n, k, g, x_rounded=case.x_rounded,
                    round_y=case.round_y)
    return spec, case.variant or gemm_variants(spec)[0]


def geometry(case: Case) -> tuple[int, int, int, int, int, int, int, int, int]:
    """(M, N, K, G, stride_ag, stride_a, stride_bg, stride_b, lead) as the C++ launcher computes
    them (csrc/kinds/gemm_cuda.cc); lead: Y's dims before it form G."""
    a, b = case.a_shape, case.b_shape
    am, k = (a[-1], a[-2]) if case.trans_a else (a[-2], a[-1])
    n = b[-2] if case.trans_b else b[-1]
    batch = a[:-2] or b[:-2]
    stride_a, stride_b = (am if case.trans_a else k), (k if case.trans_b else n)
    if len(b) == 2 and not case.trans_a:
        return int(np.prod(batch, dtype=np.int64)) * am, n, k, 1, 0, stride_a, 0, stride_b, 0
    return (am, n, k, int(np.prod(batch, dtype=np.int64)), am * k if a[:-2] else 0, stride_a,
            k * n if b[:-2] else 0, stride_b, len(batch))


def y_shape(case: Case) -> tuple[int, ...]:
    a, b = case.a_shape, case.b_shape
    am = a[-1] if case.trans_a else a[-2]
    n = b[-2] if case.trans_b else b[-1]
    return tuple(a[:-2] or b[:-2]) + (am, n)


def inputs_of(i: int, case: Case) -> list[np.ndarray]:
    rng = np.random.default_rng(5000 + i)
    dt = NP[case.dtype]
    a = rng.standard_normal(case.a_shape).astype(dt)
    b = (rng.standard_normal(case.b_shape) / np.sqrt(case.b_shape[-1])).astype(dt)
    if case.b_rounded:
        b = round_array_to_tf32(b)
    if case.x_rounded:  # as its producer stored it
        a = round_array_to_tf32(a)
    spec, _ = spec_of(i, case)
    extras = [rng.standard_normal(shape).astype(NP[d] if d != "bool" else np.float32)
              for (shape, _), d in zip(case.extras, spec.program.input_dtypes[1:], strict=True)]
    return [a, b, *extras]


def reference(i: int, case: Case) -> np.ndarray:
    spec, _ = spec_of(i, case)
    a, b, *extras = inputs_of(i, case)
    if spec.tf32:  # the kernel's operands as it multiplies them (rounded before, or in the kernel)
        a, b = round_array_to_tf32(a), round_array_to_tf32(b)
    (y,) = evaluate_gemm(spec.program, a, b, extras, case.trans_a, case.trans_b, case.alpha)
    return round_array_to_tf32(y.astype(np.float32)) if spec.stores_rounded else y


def extra_strides(shape: tuple[int, ...], y: tuple[int, ...], lead: int) -> list[int]:
    """The three strides of a strided extra over Y's [G, M, N] view (the launcher's collapse)."""
    padded = (1,) * (len(y) - len(shape)) + tuple(shape)
    st, acc = [0] * len(y), 1
    for d in range(len(y) - 1, -1, -1):
        st[d] = 0 if padded[d] == 1 else acc
        acc *= padded[d]

    def group(lo: int, hi: int) -> int:
        live = [d for d in range(lo, hi) if y[d] != 1]
        return st[live[-1]] if live else 0
    return [group(0, lead), group(lead, len(y) - 1), group(len(y) - 1, len(y))]


def launch(fn, spec: GemmSpec, variant: GemmVariant, constexprs: dict, case: Case, inputs: list[np.ndarray],
           device: str = "cpu") -> np.ndarray:
    """Run a generated kernel with the parameters and grid the C++ launcher passes."""
    import torch

    def tensor(x: np.ndarray):
        if x.dtype == ml_dtypes.bfloat16:
            return torch.from_numpy(x.view(np.uint16).copy()).view(torch.bfloat16).to(device)
        return torch.from_numpy(np.ascontiguousarray(x)).to(device)

    tdt = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
    ys = y_shape(case)
    y = torch.empty(ys, dtype=tdt[spec.program.outputs[0][1]], device=device)
    m, n, k, g, sag, sa, sbg, sb, lead = geometry(case)
    ints = [m, n, k, sag, sa, sbg, sb]
    for (shape, mode) in case.extras:
        if mode == "strided":
            ints += extra_strides(shape, ys, lead)
    slices = 0
    if variant.split_k:  # the launcher's workspace (never read before written: NaN) and zeroed counters
        slices = case.slices or variant.slices(m, n, k, g) or 2
        tiles = variant.tiles(m, n) * g
        ints += [torch.full((slices * tiles * variant.block_m * variant.block_n,), float("nan"), device=device),
                 torch.zeros(tiles, dtype=torch.int32, device=device)]
    fn[variant.grid(m, n, g, slices)](*map(tensor, inputs), y, *ints, **constexprs)
    return y.float().cpu().numpy()


def run_all(workdir: Path, device: str) -> None:
    from benchmarks.conv_kernels import _load

    results = {}
    for i, case in enumerate(CASES):
        if device == "cpu" and not case.interpreter:
            continue
        try:
            spec, v = spec_of(i, case)
            ks = generate_gemm(spec, v)
            fn = _load(ks.source, spec.name, workdir)
            results[f"case{i}"] = launch(fn, spec, v, dict(ks.constexprs), case, inputs_of(i, case), device)
        except Exception as e:  # reported by the case's test
            (workdir / f"case{i}_error.txt").write_text(f"{type(e).__name__}: {e}")
    np.savez(workdir / "out.npz", **results)


# Tolerances relative to the output's scale: the kernel's fp32 sums against the float64
# reference on the same (rounded) operands, then one rounding at the store.
TOL = {"f32": 1e-5, "f16": 2e-3, "bf16": 1.6e-2}


def check(workdir: Path, index: int) -> None:
    case = CASES[index]
    err = workdir / f"case{index}_error.txt"
    if err.exists():
        pytest.fail(f"kernel failed: {err.read_text()}")
    got = np.load(workdir / "out.npz")[f"case{index}"]
    want = reference(index, case).astype(np.float32)
    assert got.shape == want.shape
    spec, _ = spec_of(index, case)
    tol = TOL[spec.program.outputs[0][1]] if spec.dtype == "f32" else max(TOL[spec.dtype],
                                                                          TOL[spec.program.outputs[0][1]])
    if spec.stores_rounded:  # TF32 values, within one TF32 step of the rounded reference
        assert not (got.view(np.uint32) & 0x1FFF).any()
        tol = 2.0**-10
    scale = float(np.abs(want).max(initial=1.0))
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * scale)


@pytest.fixture(scope="module")
def interpreted():
    with interpreted_run(__file__, "onnxfuse-gemm-interp-") as workdir:
        yield workdir


@pytest.mark.parametrize("index", range(len(CASES)), ids=[c.id for c in CASES])
def test_gemm_kernel_matches_reference(interpreted, index):
    if not CASES[index].interpreter:
        pytest.skip("GPU only: Triton 3.6's interpreter multiplies bf16 operands as their bit patterns")
    check(interpreted, index)


def test_tf32_reference_differs_from_ieee():
    """The tf32 cases test something: rounding the operands moves the product by ~1e-4."""
    i = next(i for i, c in enumerate(CASES) if c.id == "f32-tf32-rounded-in-kernel")
    case = CASES[i]
    exact = evaluate_gemm(spec_of(i, case)[0].program, *inputs_of(i, case)[:2], inputs_of(i, case)[2:], False,
                          False)[0]
    assert 1e-5 < float(np.abs(reference(i, case) - exact).max()) < 1e-2


@pytest.mark.gpu(ort=False, torch=True)
def test_gemm_kernels_on_gpu(tmp_path):
    """The same kernels with Triton's JIT on the GPU (tensor cores: tf32 rounding as cuBLAS's)."""
    run_all(tmp_path, "cuda")
    for i in range(len(CASES)):
        check(tmp_path, i)


# ---------------------------------------------------------------------------------------
# variants, source and compile-time checks
# ---------------------------------------------------------------------------------------

def _spec(m: int | None, n: int = 768, k: int = 768, dtype: str = "f32", **kw) -> GemmSpec:
    prog = parse(f"{HEADER}\n{BIAS_GELU.format(dt=dtype)}\n")
    return GemmSpec("onnxfuse_gemm_epilogue_0123456789ab", prog, ("row",), m=m, n=n, k=k, batch=1, **kw)


def test_variant_choice():
    # BERT-base FFN1 at batch 8 x 128: 8 x 24 large tiles > 132 SMs: the large tile, aligned then not
    v = gemm_variants(_spec(1024, 3072, 768))
    assert [(x.block_m, x.block_n, x.block_k, x.num_warps, x.aligned, x.max_m) for x in v] == [
        (128, 128, 32, 8, True, 0), (128, 128, 32, 8, False, 0)]
    assert v[0].requires() == {"max_elements": 2**31 - 1, "ptr_align": 16}
    assert v[1].requires() == {"max_elements": 2**31 - 1}
    assert (v[0].meta()["stride_multiple"], v[1].meta()["stride_multiple"]) == (16, 1)
    # FFN2 (N 768): 8 x 6 = 48 large tiles leave SMs idle: the medium tile
    assert gemm_variants(_spec(1024, 768, 3072))[0].block_m == 64
    # fp16: longer K steps
    assert gemm_variants(_spec(1024, 3072, 768, "f16"))[0].block_k == 64
    # a handful of rows: the small-M tiles
    assert gemm_variants(_spec(8))[0].block_m == 16 and gemm_variants(_spec(SMALL_M))[0].block_m == 32
    # M unknown (dynamic batch): small-M tiles for M <= 16, <= 32, split K on the medium tile,
    # then the large tile
    dyn = gemm_variants(_spec(None))
    assert [(x.block_m, x.max_m, x.aligned, x.split) for x in dyn] == [
        (16, 16, True, 0), (32, 32, True, 0), (64, 0, True, 6), (128, 0, True, 0), (128, 0, False, 0)]
    assert [x.index for x in dyn] == [0, 1, 2, 3, 4]
    labels = [label for label, _ in gemm_candidates(_spec(1024))]
    assert labels[0] == "default" and len(labels) == len(set(labels)) == 6


def test_source_is_deterministic_and_names_its_nodes():
    spec = dataclasses.replace(_spec(1024, 3072), source_nodes=("MatMul mm0", "Add bias0"), precision="tf32",
                               b_rounded=True, trans_b=True)
    v = gemm_variants(spec)[0]
    a, b = generate_gemm(spec, v), generate_gemm(spec, v)
    assert a.source == b.source
    assert "#   MatMul mm0" in a.source and "#   Add bias0" in a.source
    assert [p for p, _ in a.params] == gemm_param_names(spec)
    assert dict(a.constexprs) == {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 32, "GROUP_M": 8}
    # tf32: A rounded to nearest in the kernel, B when compiled; K-major B read with unit stride
    assert "a = round_to_tf32(a)" in a.source and "b = round_to_tf32(b)" not in a.source
    assert 'input_precision="tf32"' in a.source and "offs_k[:, None] + offs_bn[None, :] * stride_b" in a.source
    # the aligned variant hints the pointers, N, K and the four operand strides (without N and
    # K, fp16 B loaded element by element: 25 TFLOP/s on the H200)
    names = [p for p, _ in a.params]
    assert [names[i] for i in a.divisible] == ["a_ptr", "b_ptr", "e0_ptr", "y_ptr", "N", "K", "stride_ag",
                                               "stride_a", "stride_bg", "stride_b"]
    assert generate_gemm(spec, gemm_variants(spec)[1]).divisible == ()
    both = generate_gemm(dataclasses.replace(spec, b_rounded=False), v).source
    assert "b = round_to_tf32(b)" in both
    half = generate_gemm(_spec(1024, 3072, dtype="f16"), v).source
    assert "round_to_tf32" not in half and "acc = tl.dot(a, b, acc)" in half
    assert 'p = (acc).to(tl.float16, fp_downcast_rounding="rtne").to(tl.float32)' in half


def test_heavy_epilogues_on_large_tiles_run_on_column_parts():
    """A transcendental or a division on a tile of 64 accumulator values per thread: the epilogue
    on four column parts (the whole 128 x 128 tile's erf-GELU took 255 registers and spilled);
    a light epilogue, or a small tile, keeps the epilogue on the whole tile."""
    from onnxfuse.codegen_gemm import TILES, epilogue_parts

    gelu = _spec(1024, 3072, dtype="f16")
    light = dataclasses.replace(gelu, program=parse(f"{HEADER}\n{BIAS_RESIDUAL.format(dt='f16')}\n"),
                                input_modes=("row", "full"))
    for tile, parts in (("large", 4), ("medium", 4), ("square", 1), ("small_m", 1), ("small_m32", 1)):
        bm, bn, bk, w, st = TILES[tile]["f16"]
        v = GemmVariant(block_m=bm, block_n=bn, block_k=bk, num_warps=w, num_stages=st)
        assert (epilogue_parts(gelu, v), epilogue_parts(light, v)) == (parts, 1), tile
    v = gemm_variants(gelu)[0]
    src = generate_gemm(gelu, v).source
    assert "left, right = column_halves(acc)" in src and src.count("    epilogue(part_") == 4
    assert "epilogue(part_3, offs_m, offs_n + 3 * (BLOCK_N // 4), pid_g, M, N, e0_ptr, y_ptr)" in src
    whole = generate_gemm(light, v).source
    assert "column_halves" not in whole and "def epilogue" not in whole


def test_split_k_variants():
    """Split K where the product's tiles leave most SMs idle and K is long enough: BERT-base's
    projections at batch 1 (M = 128) and any M <= 256 or so; not at batch 8 (M = 1024)."""
    from onnxfuse.codegen_gemm import SMS, SPLIT_MAX, SPLIT_MIN_BLOCKS

    # M = 128, 768 -> 768, fp32: the medium tile (12 tiles), split K first, at most 24 // 4 = 6 slices
    v = gemm_variants(_spec(128, 768, 768))
    assert [(x.index, x.block_m, x.block_n, x.aligned, x.split) for x in v] == [
        (0, 64, 128, True, 6), (1, 64, 128, True, 0), (2, 64, 128, False, 0)]
    assert v[0].meta()["split"] == 6 and "split" not in v[1].meta() and v[0].requires() == v[1].requires()
    assert "split K up to 6" in v[0].label
    # the launcher's slices: min(split, SMs // tiles, K blocks), evened out so that none is empty
    assert v[0].slices(128, 768, 768, 1) == 6  # 12 tiles x 6 = 72 programs
    assert v[0].slices(128, 768, 768, 1, sms=48) == 4  # 48 // 12
    assert v[0].slices(128, 768, 768, 1, sms=23) == 0  # 12 tiles: more than half of 23 SMs
    assert v[0].slices(1024, 768, 768, 1) == 0  # 96 tiles
    assert v[0].slices(128, 768, 768, 6) == 0  # 72 tiles over the batch
    assert v[0].slices(128, 768, 40, 1) == 2  # 2 K blocks
    assert v[0].slices(128, 768, 32, 1) == 0  # one K block: nothing to split
    assert v[0].slices(64, 128, 7 * 32, 1) == 4  # min(6, 132, 7) = 6 slices -> 2 blocks each -> 4 slices
    # K = 3072 -> 768 (FFN2): 96 blocks, SPLIT_MAX slices at most; at run time 132 // 12 = 11
    ffn2 = gemm_variants(_spec(128, 768, 3072))[0]
    assert ffn2.split == SPLIT_MAX and ffn2.slices(128, 768, 3072, 1) == 11
    # fp16: K steps of 64, so 768 makes 12 blocks: 3 slices
    assert gemm_variants(_spec(128, 768, 768, "f16"))[0].split == 3
    # small M: split K on the small-M tile (K steps of 64: 48 blocks, 12 slices at most)
    assert [(x.block_m, x.split) for x in gemm_variants(_spec(8, 768, 3072))] == [(16, 12), (16, 0), (16, 0)]
    # no split K: M = 1024 (96 medium tiles, more than half of SMS), or K too short for 2 x 4 blocks
    assert all(x.split == 0 for x in gemm_variants(_spec(1024, 3072, 768)))
    assert all(x.split == 0 for x in gemm_variants(_spec(128, 768, 7 * 32)))
    assert gemm_variants(_spec(128, 768, 8 * 32))[0].split == 2
    assert all(x.split == 0 for x in gemm_variants(dataclasses.replace(_spec(128, 768, 768), batch=12)))
    # K unknown: SPLIT_MAX; N wide enough that one row of tiles exceeds half the SMs: none
    assert gemm_variants(_spec(None, 768, None))[2].split == SPLIT_MAX
    assert all(x.split == 0 for x in gemm_variants(_spec(None, 128 * (SMS // 2 + 1), 768)))
    assert SPLIT_MIN_BLOCKS == 4
    # the default candidate `--tune` times holds the split variant; the tile candidates do not
    # (the tune pass compares split K with the plain tiles)
    cands = gemm_candidates(_spec(128, 768, 768))
    assert cands[0][1][0].split == 6 and all(x.split == 0 for _, vs in cands[1:] for x in vs)


def _epilogue_text(src: str) -> str:
    """The epilogue of a GEMM kernel's source: on the whole tile, or the column parts' function."""
    if "# Epilogue on the tile" in src:
        return src.split("# Epilogue on the tile")[1]
    i = src.index("def epilogue(")
    return src[i:src.index("\n\n\n", i)]


def test_split_k_source_and_parameters():
    spec = dataclasses.replace(_spec(128, 768, 768), precision="tf32", b_rounded=True, trans_b=True)
    sv, plain = gemm_variants(spec)[:2]
    ks = generate_gemm(spec, sv)
    names = [p for p, _ in ks.params]
    assert names == gemm_param_names(spec, split=True) and names[-2:] == ["ws_ptr", "cnt_ptr"]
    assert dict(ks.params)["ws_ptr"] == "*fp32" and dict(ks.params)["cnt_ptr"] == "*i32"
    assert names.index("ws_ptr") in ks.divisible and ks.constexprs == generate_gemm(spec, plain).constexprs
    src = ks.source
    assert "    ws_ptr, cnt_ptr,\n    BLOCK_M: tl.constexpr" in src
    for line in ("pid_k = tl.program_id(axis=2)", "split = tl.num_programs(axis=2)", "for k in range(k_lo, k_hi):",
                 "a_ptrs += k_lo * (BLOCK_K)", "b_ptrs += k_lo * (BLOCK_K)",
                 "tile = pid_g * tl.num_programs(axis=0) + pid",
                 'arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")', "last = arrived == split - 1",
                 "mask = (offs_m[:, None] < M) & (offs_n[None, :] < N) & last"):
        assert line in src, line
    # the epilogue is the plain kernel's, after the sum (here a GELU's: the parts' function)
    epilogue = _epilogue_text(generate_gemm(spec, plain).source)
    assert "def epilogue(" in epilogue
    assert _epilogue_text(src) == epilogue.replace("y_ptr):", "y_ptr, last):").replace("< N)\n", "< N) & last\n", 1)
    assert src.count(", y_ptr, last)\n") == 4  # each part's call passes `last`
    light = dataclasses.replace(spec, program=parse(f"{HEADER}\n{BIAS_RESIDUAL.format(dt='f32')}\n"),
                                input_modes=("row", "full"))
    whole = _epilogue_text(generate_gemm(light, plain).source)
    assert _epilogue_text(generate_gemm(light, sv).source) == whole.replace("< N)\n", "< N) & last\n", 1)
    assert "ws_ptr" not in generate_gemm(spec, plain).source
    # trans_a: A's K step is BLOCK_K rows
    t = generate_gemm(dataclasses.replace(spec, trans_a=True), sv).source
    assert "a_ptrs += k_lo * (BLOCK_K * stride_a)" in t
    with pytest.raises(ValueError, match="no M limit"):
        generate_gemm(spec, dataclasses.replace(sv, max_m=16))
    with pytest.raises(ValueError, match="most K slices"):
        generate_gemm(spec, dataclasses.replace(sv, split=-1))
    with pytest.raises(ValueError, match="most K slices"):
        generate_gemm(spec, dataclasses.replace(sv, split=70000))


def test_launcher_choice_mirror():
    """kinds.gemm.launcher_choice, the Python mirror of csrc/kinds/gemm_cuda.cc's rule."""
    from onnxfuse.kinds.gemm import launcher_choice

    def meta(spec):
        return {"name": spec.name, "variants": [{"requires": v.requires(), **v.meta()} for v in gemm_variants(spec)]}

    static = meta(_spec(128, 768, 3072))
    assert launcher_choice(static, 128, 768, 3072) == (0, 11)
    assert launcher_choice(static, 128, 768, 3072, sms=16) == (1, 0)  # 12 tiles: more than half of 16 SMs
    assert launcher_choice(static, 128, 768, 3072, workspace=False) == (1, 0)
    assert launcher_choice(static, 128, 768, 3072, aligned=False) == (2, 0)
    dyn = meta(_spec(None, 768, 768))  # small-M 16, 32, split (medium), large aligned, large
    assert launcher_choice(dyn, 1, 768, 768) == (0, 0)  # the small-M tiles come first
    assert launcher_choice(dyn, 32, 768, 768) == (1, 0)
    assert launcher_choice(dyn, 128, 768, 768) == (2, 6)  # BERT-base at batch 1
    assert launcher_choice(dyn, 512, 768, 768) == (2, 2)  # 48 tiles: 132 // 48 = 2 slices
    assert launcher_choice(dyn, 1024, 768, 768) == (3, 0)
    assert launcher_choice(dyn, 128, 768, 768, aligned=False) == (4, 0)


def test_the_cpp_launcher_reads_and_applies_split():
    """The C++ side of the rule `launcher_choice` mirrors (no GPU here to run it): gemm_cuda.cc
    validates "split", computes the slices as GemmVariant.slices does, and falls back to the
    next variant when the EP lends no workspace; conv and gemm share SplitBuffers."""
    src = (REPO / "csrc" / "kinds" / "gemm_cuda.cc").read_text()
    assert 'cuda::meta_int(vj, "split", where, false, 0)' in src and "has both split and max_m" in src
    assert "if (n_tiles <= 0 || 2 * n_tiles > sms) return 0;" in src
    assert "return (blocks + per - 1) / per;" in src
    assert "start = static_cast<size_t>(v) + 1;" in src and "launch(tg, v, grid_x, geo.g, p, slices);" in src
    for f in ("gemm_cuda.cc", "conv_cuda.cc"):
        assert "cuda::SplitBuffers sb(" in (REPO / "csrc" / "kinds" / f).read_text()


def test_strided_parameters():
    prog = parse(f"{HEADER}\n{BIAS_RESIDUAL.format(dt='f32')}\n")
    spec = GemmSpec("k", prog, ("strided", "full"))
    assert gemm_param_names(spec) == ["a_ptr", "b_ptr", "e0_ptr", "e1_ptr", "y_ptr", "M", "N", "K", "stride_ag",
                                      "stride_a", "stride_bg", "stride_b", "stride_e0_g", "stride_e0_m",
                                      "stride_e0_n"]


def test_rejected_specs():
    spec = _spec(1024, 3072)
    v = gemm_variants(spec)[0]
    with pytest.raises(ValueError, match="input modes"):
        generate_gemm(dataclasses.replace(spec, input_modes=()), v)
    with pytest.raises(ValueError, match="precision"):
        generate_gemm(dataclasses.replace(spec, precision="fp64"), v)
    with pytest.raises(ValueError, match="powers of two"):
        generate_gemm(spec, dataclasses.replace(v, block_n=96))
    with pytest.raises(ValueError, match="at least 16"):
        generate_gemm(spec, dataclasses.replace(v, block_m=8))


def test_aot_compile_for_sm80_and_sm90(tmp_path):
    pytest.importorskip("triton")
    from onnxfuse.compile import compile_kernels

    f32 = dataclasses.replace(_spec(1024, 3072, 768), precision="tf32", b_rounded=True, trans_b=True)
    f16 = _spec(None, dtype="f16")
    out = compile_kernels([f32, f16], [80, 90], cache_dir=tmp_path, jobs=2)
    meta = out[0].kernel_meta()
    assert (meta["kind"], meta["n_extras"], meta["trans_a"], meta["trans_b"], meta["input_modes"]) == (
        "gemm", 1, 0, 1, ["row"])
    assert [(v["block_m"], v["block_n"], v["stride_multiple"], v["max_m"]) for v in meta["variants"]] == [
        (128, 128, 16, 0), (128, 128, 1, 0)]
    assert all(b["global_scratch_size"] == 0 for b in meta["binaries"])
    # sm_90: wgmma on the tensor cores; the PTX embedded is sm_80's (sm_90a's cannot be relaxed)
    assert [(b["variant"], b["arch"], b["format"]) for b in meta["binaries"]] == [
        (0, 80, "cubin"), (0, 90, "cubin"), (0, 80, "ptx"), (1, 80, "cubin"), (1, 90, "cubin"), (1, 80, "ptx")]
    assert [v["max_m"] for v in out[1].kernel_meta()["variants"]] == [16, 32, 0, 0, 0]
    assert [v.get("split") for v in out[1].kernel_meta()["variants"]] == [None, None, 3, None, None]
    again = compile_kernels([f32], [80, 90], cache_dir=tmp_path)
    assert again[0].cache_hits == 4 and again[0].compiled == 0
    assert json.dumps(again[0].kernel_meta()) == json.dumps(meta)


def test_aot_compile_split_k_for_sm90(tmp_path):
    """The split-K kernel compiles ahead of time for sm_90 (wgmma, fp32 and fp16): its counter is
    one acquire-release atomic after a CTA barrier, the partials read back from L2; kernel_meta
    carries the most slices and block_k."""
    pytest.importorskip("triton")
    from onnxfuse.compile import compile_kernels

    f32 = dataclasses.replace(_spec(128, 768, 3072), precision="tf32", b_rounded=True, trans_b=True)
    f16 = dataclasses.replace(_spec(128, 768, 768, "f16"), trans_b=True)
    for spec, most in ((f32, 16), (f16, 3)):
        (out,) = compile_kernels([spec], [90], cache_dir=tmp_path, jobs=2)
        meta = out.kernel_meta()
        assert [v.get("split") for v in meta["variants"]] == [most, None, None]
        assert meta["variants"][0]["block_k"] == (32 if spec.dtype == "f32" else 64)
        assert {(b["variant"], b["format"]) for b in meta["binaries"]} >= {(0, "cubin"), (0, "ptx")}
        b, ptx = next((b, d.decode()) for b, d in zip(meta["binaries"], out.kernels(), strict=True)
                      if b["variant"] == 0 and b["format"] == "ptx")
        assert b["global_scratch_size"] == 0
        assert "atom.global.gpu.acq_rel.add" in ptx and "bar.sync" in ptx and "ld.global.cg" in ptx
        assert "wgmma" in ptx and "%ctaid.z" in ptx and "%nctaid.z" in ptx


def test_aligned_fp16_variant_pipelines_its_loads(tmp_path):
    """The aligned variant's hints (N, K and the strides multiples of 16) let Triton load the
    fp16 tiles 16 bytes at a time through cp.async, pipelined; without N and K it loaded B
    element by element and ran at 25 TFLOP/s on the H200 (BENCHMARKS.md, tenth session). The
    unaligned variant cannot, and is the launcher's last resort."""
    pytest.importorskip("triton")
    from onnxfuse.compile import compile_kernels

    [out] = compile_kernels([_spec(1024, 2304, 768, dtype="f16")], [90], cache_dir=tmp_path)
    ptx = {b["variant"]: blob.decode() for b, blob in zip(out.kernel_meta()["binaries"], out.kernels(), strict=True)
           if b["format"] == "ptx"}
    assert "cp.async.cg.shared.global" in ptx[0] and "ld.global.b16" not in ptx[0]
    assert "cp.async" not in ptx[1]


def _ptxas_info(ptx: str, tmp_path: Path) -> str:
    """ptxas -v's report on a kernel's PTX (Triton's own ptxas), or skip where there is none."""
    import shutil
    import subprocess

    import triton

    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists() and not shutil.which("ptxas"):
        pytest.skip("no ptxas")
    src = tmp_path / "k.ptx"
    src.write_text(ptx)
    target = next(ln.split()[1] for ln in ptx.splitlines() if ln.startswith(".target"))
    out = subprocess.run([str(ptxas) if ptxas.exists() else "ptxas", "-v", "--gpu-name", target, str(src),
                          "-o", str(tmp_path / "k.cubin")], capture_output=True, text=True, check=True)
    return out.stdout + out.stderr


def test_a_rounded_by_its_producer_keeps_the_fp32_wgmma_pipelined(tmp_path):
    """Rounding A to TF32 in the K loop makes ptxas serialize the fp32 wgmma (C7515: "non wgmma
    instructions defining accumulator registers ... between start and end of the pipeline
    stage"); with A rounded by its producer (x_rounded) the kernel does not touch A and the
    warning is gone. The source says which operands it rounds, and round_y rounds the store."""
    pytest.importorskip("triton")
    from onnxfuse.compile import compile_kernels

    base = dataclasses.replace(_spec(1024, 2304, 768), precision="tf32", b_rounded=True)
    shipped, producer = base, dataclasses.replace(base, x_rounded=True, round_y=True)
    src = generate_gemm(producer, gemm_variants(producer)[0]).source
    assert "a = round_to_tf32(a)" not in src and "b = round_to_tf32(b)" not in src
    assert "y_rounded = round_to_tf32(" in src and "A by its producer, B when compiled" in src
    b_here = generate_gemm(dataclasses.replace(producer, b_rounded=False), gemm_variants(producer)[0]).source
    assert "a = round_to_tf32(a)" not in b_here and "    b = round_to_tf32(b)" in b_here
    assert "a = round_to_tf32(a)" in generate_gemm(shipped, gemm_variants(shipped)[0]).source
    infos = {}
    for label, spec in (("shipped", shipped), ("producer", producer)):
        variant = gemm_variants(spec)[0]
        [out] = compile_kernels([spec], [90], cache_dir=tmp_path / label, variant_override=(variant,))
        (ptx,) = [blob.decode() for b, blob in zip(out.kernel_meta()["binaries"], out.kernels(), strict=True)
                  if b["format"] == "ptx"]
        assert "wgmma.mma_async" in ptx
        infos[label] = _ptxas_info(ptx, tmp_path)
    assert "C7515" not in infos["producer"], infos["producer"]


if __name__ == "__main__":
    if sys.argv[1:2] == ["--interpret"]:
        assert os.environ.get("TRITON_INTERPRET") == "1"
        from tests.test_codegen import _install_bf16_rounding_fix, _install_gpu_max_semantics, _install_libdevice_shims
        from tests.test_rows_codegen import install_index_fix

        _install_libdevice_shims()
        _install_bf16_rounding_fix()
        _install_gpu_max_semantics()
        install_index_fix()  # the K loop's bound is a run-time scalar
        run_all(Path(sys.argv[2]), "cpu")
