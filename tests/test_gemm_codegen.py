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
bfloat16."""

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
SILU_CAST_F16 = "input %0 {dt}\n%1 = sigmoid %0\n%2 = mul %0 %1\noutput %2 f16"
SCALE_CLIP = "input %0 {dt}\ninput %1 f32\n%2 = mul %0 %1\n%3 = max %2 0.0\n%4 = min %3 6.0\noutput %4 {dt}"
STRIDED_ADD = "input %0 {dt}\ninput %1 {dt}\n%2 = add %0 %1\noutput %2 {dt}"
STRIDED_SILU = "input %0 {dt}\ninput %1 {dt}\n%2 = add %0 %1\n%3 = sigmoid %2\n%4 = mul %2 %3\noutput %4 {dt}"

SMALL = GemmVariant(0, block_m=16, block_n=32, block_k=16, group_m=2, num_warps=4, num_stages=1)


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
    # the default (medium) tile's heavy epilogue runs on four column parts (epilogue_split)
    Case("f16-default-tile-split-epilogue", (37, 70), (70, 45), BIAS_GELU, (((45,), "row"),), dtype="f16",
         variant=None),
    Case("f32-default-tile-split-epilogue-strided", (2, 40, 33), (2, 33, 72), STRIDED_SILU,
         (((2, 1, 72), "strided"),), variant=None),
    Case("f16-transb-residual", (2, 19, 64), (48, 64), BIAS_RESIDUAL, (((48,), "row"), ((2, 19, 48), "full")),
         dtype="f16", trans_b=True),
    Case("f32-silu-cast-to-f16", (21, 32), (32, 40), SILU_CAST_F16),
    Case("bf16-bias-gelu", (37, 70), (70, 45), BIAS_GELU, (((45,), "row"),), dtype="bf16", interpreter=False),
]


def spec_of(i: int, case: Case) -> tuple[GemmSpec, GemmVariant]:
    prog = parse(f"{HEADER}\n{case.program.format(dt=case.dtype)}\n")
    m, n, k, g = geometry(case)[:4]
    spec = GemmSpec(f"k_gemm_{i}", prog, tuple(mode for _, mode in case.extras), case.trans_a, case.trans_b,
                    case.alpha, case.precision, case.b_rounded, m, n, k, g)
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
    spec, _ = spec_of(i, case)
    extras = [rng.standard_normal(shape).astype(NP[d] if d != "bool" else np.float32)
              for (shape, _), d in zip(case.extras, spec.program.input_dtypes[1:], strict=True)]
    return [a, b, *extras]


def reference(i: int, case: Case) -> np.ndarray:
    spec, _ = spec_of(i, case)
    a, b, *extras = inputs_of(i, case)
    if spec.rounds_a:  # the kernel's operands as it multiplies them (B pre-rounded, or rounded in the kernel)
        a, b = round_array_to_tf32(a), round_array_to_tf32(b)
    (y,) = evaluate_gemm(spec.program, a, b, extras, case.trans_a, case.trans_b, case.alpha)
    return y


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
    fn[variant.grid(m, n, g)](*map(tensor, inputs), y, *ints, **constexprs)
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
    # M unknown (dynamic batch): small-M tiles for M <= 16, <= 32, then the large tile
    dyn = gemm_variants(_spec(None))
    assert [(x.block_m, x.max_m, x.aligned) for x in dyn] == [(16, 16, True), (32, 32, True), (128, 0, True),
                                                             (128, 0, False)]
    assert [x.index for x in dyn] == [0, 1, 2, 3]
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
    from onnxfuse.codegen_gemm import TILES, epilogue_split

    gelu = _spec(1024, 3072, dtype="f16")
    light = dataclasses.replace(gelu, program=parse(f"{HEADER}\n{BIAS_RESIDUAL.format(dt='f16')}\n"),
                                input_modes=("row", "full"))
    for tile, parts in (("large", 4), ("medium", 4), ("square", 1), ("small_m", 1), ("small_m32", 1)):
        bm, bn, bk, w, st = TILES[tile]["f16"]
        v = GemmVariant(block_m=bm, block_n=bn, block_k=bk, num_warps=w, num_stages=st)
        assert (epilogue_split(gelu, v), epilogue_split(light, v)) == (parts, 1), tile
    v = gemm_variants(gelu)[0]
    src = generate_gemm(gelu, v).source
    assert "left, right = column_halves(acc)" in src and src.count("    epilogue(part_") == 4
    assert "epilogue(part_3, offs_m, offs_n + 3 * (BLOCK_N // 4), pid_g, M, N, e0_ptr, y_ptr)" in src
    whole = generate_gemm(light, v).source
    assert "column_halves" not in whole and "def epilogue" not in whole


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
    assert [v["max_m"] for v in out[1].kernel_meta()["variants"]] == [16, 32, 0, 0]
    again = compile_kernels([f32], [80, 90], cache_dir=tmp_path)
    assert again[0].cache_hits == 4 and again[0].compiled == 0
    assert json.dumps(again[0].kernel_meta()) == json.dumps(meta)


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
