"""Generated FusedRows Triton kernels (onnxfuse.codegen_rows) against the numpy reference of
the node contract (onnxfuse.kinds.rows.evaluate_rows): under ``TRITON_INTERPRET=1`` in one child process
(this file run as a script, so the interpreter setting never reaches the process where
other tests compile kernels), on the GPU with Triton's JIT (`gpu`), and compiled ahead of
time for sm_80 / sm_90 with no GPU.

The cases cover row lengths that are not multiples of the block (77, 768, 1000, 4100), the
looped kernel (forced with small chunks, and the default for a dynamic row length), several
rows per program, fp16 rows of magnitude 1e4 (whose squares overflow fp16), bf16, every
input mode (full, last, scalar, strided: an attention mask [B, 1, 1, S] over [B, H, S, S]),
bool inputs, an exposed x, and NaN / -inf rows in softmax."""

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
from onnxfuse.codegen_rows import (
    MAX_SINGLE_PASS,
    RowsSpec,
    RowsVariant,
    generate_rows,
    rows_candidates,
    rows_param_names,
    rows_variants,
)
from onnxfuse.expr import HEADER, parse
from onnxfuse.kinds.rows import evaluate_rows

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tests.util import interpreted_run  # noqa: E402

NP = {"f32": np.float32, "f16": np.float16, "bf16": ml_dtypes.bfloat16, "bool": np.bool_}

# Programs, by name. {dt}: the row dtype (the prologue's inputs and output); epilogue
# inputs: the reduction's row values, then the extras.
RESIDUAL = ("input %0 {dt}\ninput %1 {dt}\n%2 = add %0 %1\noutput %2 {dt}", 2)
BIAS_RESIDUAL = ("input %0 {dt}\ninput %1 {dt}\ninput %2 {dt}\n%3 = add %0 %1\n%4 = add %3 %2\noutput %4 {dt}", 3)
IDENTITY = ("input %0 {dt}\noutput %0 {dt}", 1)
CAST_UP = ("input %0 {dt}\noutput %0 f32", 1)
SCALE_MASK = ("input %0 {dt}\ninput %1 f32\n%2 = mul %0 0.125\n%3 = add %2 %1\noutput %3 {dt}", 2)
WHERE_MASK = ("input %0 {dt}\ninput %1 bool\n%2 = select %1 -inf %0\noutput %2 {dt}", 2)
ROW_SCALE = ("input %0 {dt}\ninput %1 f32\n%2 = mul %0 %1\noutput %2 {dt}", 2)  # a per-row temperature
LN_AFFINE = ("input %0 f32\ninput %1 f32\ninput %2 f32\ninput %3 {dt}\ninput %4 {dt}\n%5 = sub %0 %1\n"
             "%6 = add %2 1e-05\n%7 = sqrt %6\n%8 = div 1.0 %7\n%9 = mul %5 %8\n%10 = mul %9 %3\n%11 = add %10 %4\n"
             "output %11 {dt}", 2)
LN_GELU = ("input %0 f32\ninput %1 f32\ninput %2 f32\ninput %3 {dt}\n%4 = sub %0 %1\n%5 = add %2 1e-05\n"
           "%6 = sqrt %5\n%7 = div %4 %6\n%8 = mul %7 %3\n%9 = mul %8 -0.7071067690849304\n%10 = erfc %9\n"
           "%11 = mul %8 0.5\n%12 = mul %11 %10\noutput %12 {dt}\noutput %7 f32", 1)
LN_PLAIN = ("input %0 f32\ninput %1 f32\ninput %2 f32\n%3 = sub %0 %1\n%4 = add %2 1e-05\n%5 = sqrt %4\n"
            "%6 = div %3 %5\noutput %6 {dt}", 0)
RMS_SCALE = ("input %0 f32\ninput %1 f32\ninput %2 {dt}\n%3 = add %1 1e-06\n%4 = sqrt %3\n%5 = div 1.0 %4\n"
             "%6 = mul %0 %5\n%7 = mul %6 %2\noutput %7 {dt}", 1)
RMS_SCALAR = ("input %0 f32\ninput %1 f32\ninput %2 f32\n%3 = add %1 1e-06\n%4 = pow %3 -0.5\n%5 = mul %0 %4\n"
              "%6 = mul %5 %2\n%7 = round_f16 %6\noutput %7 f16", 1)
SOFTMAX_OUT = ("input %0 f32\noutput %0 {dt}", 0)
SOFTMAX_CAST = ("input %0 f32\n%1 = round_f16 %0\noutput %1 f32", 0)


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    reduction: str
    shape: tuple[int, ...]
    axis: int  # the first normalized dim
    prologue: tuple[str, int]
    epilogue: tuple[str, int]
    modes: tuple[str, ...]  # per input: prologue's, then the extras'
    dtype: str = "f32"
    x_output: bool = False
    variant: RowsVariant | None = None  # None: the first of rows_variants (the shipped choice)
    pick: int = 0  # which of rows_variants
    dynamic: bool = False  # N not known when compiling
    scale: float = 1.0  # the inputs' magnitude
    mean: float = 0.0
    special: str = ""  # "nan": NaN and -inf rows
    per_row: bool = False  # strided inputs are one value per row ([B, 1, S, 1]: stride 0 along it)
    round_y: bool = False  # output 0 stored rounded to TF32 (onnxfuse.rounding: GEMMs read it)


CASES = [
    Case("ln-768-residual-affine-xout", "layer_norm", (2, 3, 768), 2, RESIDUAL, LN_AFFINE,
         ("full", "full", "last", "last"), x_output=True),
    # TF32 at the producer: output 0 stored rounded, the residual stream x as computed
    Case("ln-768-stores-rounded-xout", "layer_norm", (2, 3, 768), 2, RESIDUAL, LN_AFFINE,
         ("full", "full", "last", "last"), x_output=True, round_y=True),
    Case("ln-77-rows-per-program", "layer_norm", (5, 7, 77), 2, BIAS_RESIDUAL, LN_AFFINE,
         ("full", "last", "full", "last", "last"), mean=30.0),
    Case("ln-1000-looped-small-chunks", "layer_norm", (3, 1000), 1, RESIDUAL, LN_AFFINE,
         ("full", "full", "last", "last"), variant=RowsVariant(0, 1, 128, 4, looped=True, cols=1000), mean=1000.0,
         scale=100.0),
    Case("ln-4100-single-pass", "layer_norm", (2, 4100), 1, IDENTITY, LN_PLAIN, ("full",)),
    Case("ln-4100-looped-default", "layer_norm", (2, 4100), 1, RESIDUAL, LN_AFFINE,
         ("full", "full", "last", "last"), pick=1, x_output=True),
    Case("ln-fp16-magnitude-1e4", "layer_norm", (4, 768), 1, RESIDUAL, LN_AFFINE, ("full", "full", "last", "last"),
         dtype="f16", scale=1e4, x_output=True),
    Case("ln-fp16-magnitude-1e4-looped", "layer_norm", (2, 1000), 1, RESIDUAL, LN_AFFINE,
         ("full", "full", "last", "last"), dtype="f16", scale=1e4, variant=RowsVariant(0, 1, 256, 4, looped=True)),
    Case("ln-bf16-gelu-two-outputs", "layer_norm", (3, 5, 96), 2, IDENTITY, LN_GELU, ("full", "last"), dtype="bf16"),
    Case("ln-two-normalized-dims", "layer_norm", (3, 4, 10), 1, IDENTITY, LN_AFFINE, ("full", "last", "last")),
    Case("ln-one-row", "layer_norm", (50,), 0, IDENTITY, LN_PLAIN, ("full",)),
    Case("rms-fp16-upcast", "rms_norm", (2, 3, 1000), 2, CAST_UP, RMS_SCALE, ("full", "last"), dtype="f16"),
    Case("rms-scalar-weight-pow", "rms_norm", (6, 64), 1, RESIDUAL, RMS_SCALAR, ("full", "full", "scalar")),
    Case("rms-dynamic-looped", "rms_norm", (3, 300), 1, IDENTITY, RMS_SCALE, ("full", "last"), dynamic=True,
         pick=4),
    Case("softmax-scale-mask-77", "softmax", (2, 3, 77, 77), 3, SCALE_MASK, SOFTMAX_OUT, ("full", "strided"),
         dynamic=True),
    Case("softmax-scale-mask-looped", "softmax", (2, 3, 5, 300), 3, SCALE_MASK, SOFTMAX_OUT, ("full", "strided"),
         dynamic=True, pick=4),
    Case("softmax-fp16-1000", "softmax", (4, 1000), 1, IDENTITY, SOFTMAX_OUT, ("full",), dtype="f16", scale=5.0),
    Case("softmax-bool-mask-where", "softmax", (2, 4, 33), 2, WHERE_MASK, SOFTMAX_CAST, ("full", "strided")),
    Case("softmax-nan-and-masked-rows", "softmax", (6, 40), 1, IDENTITY, SOFTMAX_OUT, ("full",), special="nan"),
    Case("softmax-nan-and-masked-rows-looped", "softmax", (6, 40), 1, IDENTITY, SOFTMAX_OUT, ("full",),
         special="nan", variant=RowsVariant(0, 1, 16, 1, looped=True)),
    Case("log-softmax-looped", "log_softmax", (3, 2000), 1, IDENTITY, SOFTMAX_OUT, ("full",),
         variant=RowsVariant(0, 1, 512, 4, looped=True, cols=2000), scale=10.0),
    Case("log-softmax-coerced-2d", "log_softmax", (2, 3, 4, 5), 1, IDENTITY, SOFTMAX_OUT, ("full",)),
    # BERT's attention softmax: N = 128 compiled in, 8 rows per program, the mask's span hinted
    Case("softmax-mask-128-rows-per-program", "softmax", (2, 3, 19, 128), 3, SCALE_MASK, SOFTMAX_OUT,
         ("full", "strided")),
    Case("softmax-per-row-strided", "softmax", (2, 3, 19, 128), 3, ROW_SCALE, SOFTMAX_OUT, ("full", "strided"),
         per_row=True),
    Case("softmax-per-row-strided-looped", "softmax", (2, 3, 5, 300), 3, ROW_SCALE, SOFTMAX_OUT,
         ("full", "strided"), per_row=True, pick=1),
    # a tile tuning times (rows_candidates): two rows of 768 fp16 per program, five rows
    Case("ln-768-f16-candidate-two-rows", "layer_norm", (5, 768), 1, RESIDUAL, LN_AFFINE,
         ("full", "full", "last", "last"), dtype="f16",
         variant=RowsVariant(0, 2, 1024, 8, cols=768, aligned=True)),
    # the epilogue's inputs loaded before the row (rows_context.py times it) on a candidate
    # tile: gamma and beta over two rows a program; a scalar weight
    Case("ln-768-f16-early-loads", "layer_norm", (5, 768), 1, RESIDUAL, LN_AFFINE,
         ("full", "full", "last", "last"), dtype="f16",
         variant=RowsVariant(0, 2, 1024, 8, cols=768, aligned=True, early_loads=True)),
    Case("rms-scalar-weight-early-loads", "rms_norm", (6, 64), 1, RESIDUAL, RMS_SCALAR, ("full", "full", "scalar"),
         variant=RowsVariant(0, 16, 64, 1, cols=64, early_loads=True)),
]


def _program(text: tuple[str, int], dtype: str):
    return parse(f"{HEADER}\n{text[0].format(dt=dtype)}\n")


def spec_of(i: int, case: Case) -> tuple[RowsSpec, RowsVariant]:
    pro, epi = _program(case.prologue, case.dtype), _program(case.epilogue, case.dtype)
    n = int(np.prod(case.shape[case.axis:]))
    spec = RowsSpec(f"k_rows_{i}", case.reduction, pro, epi, case.modes, case.axis, None if case.dynamic else n,
                    case.x_output, round_y=case.round_y)
    return spec, case.variant or rows_variants(spec)[case.pick]


def _input_shape(mode: str, shape: tuple[int, ...], axis: int, per_row: bool = False) -> tuple[int, ...]:
    if mode == "full":
        return shape
    if mode == "last":
        return shape[axis:]
    if mode == "scalar":
        return (1,)
    if per_row:  # strided, one value per row: [B, 1, S, 1]
        return (shape[0],) + (1,) * (axis - 2) + shape[axis - 1:axis] + (1,) * (len(shape) - axis)
    # strided: [B, 1, 1, S]-like (an attention mask), or [B, 1, ...] for lower ranks
    return (shape[0],) + (1,) * (len(shape) - 2) + (shape[-1],)


def inputs_of(i: int, case: Case) -> list[np.ndarray]:
    spec, _ = spec_of(i, case)
    rng = np.random.default_rng(3000 + i)
    dtypes = list(spec.prologue.input_dtypes) + list(spec.program.input_dtypes[spec.n_row_values:])
    out = []
    for k, (mode, dt) in enumerate(zip(case.modes, dtypes, strict=True)):
        shape = _input_shape(mode, case.shape, case.axis, case.per_row)
        if dt == "bool":
            out.append(rng.random(shape) < 0.3)
            continue
        a = rng.standard_normal(shape)
        if k < spec.n_prologue:
            a = a * case.scale + case.mean
        out.append(a.astype(NP[dt]))
    if case.special == "nan":
        x = out[0]
        x[1, 3] = np.nan
        x[2, :] = -np.inf
        x[4, 7] = np.inf
    return out


def reference(i: int, case: Case) -> list[np.ndarray]:
    spec, _ = spec_of(i, case)
    return evaluate_rows(case.reduction, spec.prologue, spec.program, inputs_of(i, case), case.axis, case.x_output)


def _strides(shape: tuple[int, ...], full: tuple[int, ...]) -> list[int]:
    shape = (1,) * (len(full) - len(shape)) + tuple(shape)
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc if d != 1 else 0)
        acc *= d
    return list(reversed(strides))


def launch(fn, spec: RowsSpec, variant: RowsVariant, constexprs: dict, inputs: list[np.ndarray],
           shape: tuple[int, ...], device: str = "cpu") -> list[np.ndarray]:
    """Run a generated kernel with the parameters and grid the C++ launcher passes."""
    import torch

    def tensor(a: np.ndarray):
        if a.dtype == ml_dtypes.bfloat16:
            return torch.from_numpy(a.view(np.uint16).copy()).view(torch.bfloat16).to(device)
        if a.dtype == np.bool_:
            return torch.from_numpy(a.astype(np.int8)).to(device)
        return torch.from_numpy(np.ascontiguousarray(a)).to(device)

    tdt = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
    out_dts = [dt for _, dt in spec.program.outputs] + ([spec.x_dtype] if spec.x_output else [])
    outs = [torch.empty(shape, dtype=tdt[dt], device=device) for dt in out_dts]
    lead = shape[:spec.lead_rank]
    n_rows, n_cols = int(np.prod(lead, dtype=np.int64)), int(np.prod(shape[spec.lead_rank:], dtype=np.int64))
    ints = [n_rows, n_cols]
    strided = [a for a, m in zip(inputs, spec.input_modes, strict=True) if m == "strided"]
    if strided:
        ints += list(lead)
        for a in strided:
            st = _strides(a.shape, shape)
            trail = st[spec.lead_rank:]
            ints += st[:spec.lead_rank] + [1 if any(trail) else 0]
    fn[variant.grid(n_rows)](*map(tensor, inputs), *outs, *ints, **constexprs)
    return [o.float().cpu().numpy() for o in outs]


def run_all(workdir: Path, device: str) -> None:
    from benchmarks.conv_kernels import _load

    results = {}
    for i, case in enumerate(CASES):
        try:
            spec, v = spec_of(i, case)
            ks = generate_rows(spec, v)
            fn = _load(ks.source, spec.name, workdir)
            outs = launch(fn, spec, v, dict(ks.constexprs), inputs_of(i, case), case.shape, device)
            for k, o in enumerate(outs):
                results[f"case{i}_{k}"] = o
        except Exception as e:  # reported by the case's test
            (workdir / f"case{i}_error.txt").write_text(f"{type(e).__name__}: {e}")
    np.savez(workdir / "out.npz", **results)


def check(workdir: Path, index: int) -> None:
    err = workdir / f"case{index}_error.txt"
    if err.exists():
        pytest.fail(f"kernel failed: {err.read_text()}")
    got_all = np.load(workdir / "out.npz")
    n_out = len(reference(index, CASES[index]))
    assert_outputs(index, [got_all[f"case{index}_{k}"] for k in range(n_out)])


def assert_outputs(index: int, outputs: list[np.ndarray], where: str = "") -> None:
    """A case's kernel outputs (float32 arrays, interpreter or GPU) against its reference: NaN and
    infinities in the same places, the rest within the dtype's tolerance; an output stored rounded
    to TF32 holds TF32 values, each within a TF32 step of the reference's rounded value."""
    case = CASES[index]
    spec, _ = spec_of(index, case)
    dtypes = [dt for _, dt in spec.program.outputs] + ([spec.x_dtype] if spec.x_output else [])
    wants = reference(index, case)
    assert len(outputs) == len(wants)
    for k, (got, want) in enumerate(zip(outputs, wants, strict=True)):
        msg = f"{where}output {k}"
        want = want.astype(np.float32)
        assert got.shape == want.shape, msg
        rounded = k == 0 and spec.stores_rounded
        if rounded:
            assert not (got.view(np.uint32) & 0x1FFF).any(), f"{msg} not rounded to TF32"
            want = round_array_to_tf32(want)
        assert np.array_equal(np.isnan(got), np.isnan(want)), f"{msg}: NaN in different places"
        finite = np.isfinite(want)
        assert np.array_equal(got[~finite], want[~finite], equal_nan=True), msg
        # an output's dtype rounds it; the kernel's fp32 sums differ from the float64 reference by ulps
        tol = 2.0**-10 if rounded else {"f32": 2e-5, "f16": 2e-3, "bf16": 1.6e-2}[dtypes[k]]
        scale = float(np.abs(want[finite]).max(initial=1.0))
        np.testing.assert_allclose(got[finite], want[finite], rtol=tol, atol=tol * scale, err_msg=msg)


@pytest.fixture(scope="module")
def interpreted():
    with interpreted_run(__file__, "onnxfuse-rows-interp-") as workdir:
        yield workdir


@pytest.mark.parametrize("index", range(len(CASES)), ids=[c.id for c in CASES])
def test_rows_kernel_matches_reference(interpreted, index):
    check(interpreted, index)


@pytest.mark.gpu(ort=False, torch=True)
def test_rows_kernels_on_gpu(tmp_path):
    """The same kernels with Triton's JIT on the GPU: libdevice's functions, the real max."""
    run_all(tmp_path, "cuda")
    for i in range(len(CASES)):
        check(tmp_path, i)


# ---------------------------------------------------------------------------------------
# variants, source and compile-time checks
# ---------------------------------------------------------------------------------------


def _spec(n: int | None, dtype: str = "f32", modes=("full", "full", "last", "last")) -> RowsSpec:
    return RowsSpec("onnxfuse_layer_norm_0123456789ab", "layer_norm", _program(RESIDUAL, dtype),
                    _program(LN_AFFINE, dtype), modes, 2, n)


def test_variant_choice():
    # a known row length: one kernel compiled for it, then the looped kernel for any N
    v = rows_variants(_spec(768))
    assert [(x.block_m, x.block_n, x.num_warps, x.looped, x.cols) for x in v] == [
        (1, 1024, 4, False, 768), (1, 1024, 4, True, 0)]
    assert v[0].requires() == {"ptr_align": 16} and v[1].requires() == {}
    assert (v[0].meta()["cols"], v[0].meta()["max_cols"], v[1].meta()["cols"], v[1].meta()["max_cols"]) == (
        768, 768, 0, 0)
    assert [x.index for x in v] == [0, 1]
    # small rows: several per program; 16-bit tensors loop in longer chunks
    assert (rows_variants(_spec(64))[0].block_m, rows_variants(_spec(64, "f16"))[1].block_n) == (16, 2048)
    # longer than MAX_SINGLE_PASS: looped, compiled for N
    big = rows_variants(_spec(MAX_SINGLE_PASS + 1))
    assert big[0].looped and big[0].cols == MAX_SINGLE_PASS + 1 and big[0].meta()["cols"] == MAX_SINGLE_PASS + 1
    # unknown: single-pass kernels up to 128, 512, 2048, 8192 columns, then looped
    dyn = rows_variants(_spec(None))
    assert [x.meta()["max_cols"] for x in dyn] == [128, 512, 2048, 8192, 0]
    assert dyn[-1].looped


def test_candidates_vary_warps_and_rows_of_a_static_single_pass_kernel():
    """`rows-candidates`: BERT-base's 768-wide rows (one row of 1024 lanes per 4-warp program by
    the heuristic) are also timed on 1, 2 and 8 warps and two rows per 8-warp program, each
    followed by the heuristic's fallbacks; other kernels are timed as the heuristic has them."""
    cands = rows_candidates(_spec(768, "f16"))
    assert cands[0] == ("default", rows_variants(_spec(768, "f16")))
    alts = [(v[0].block_m, v[0].num_warps) for _, v in cands[1:]]
    assert alts == [(1, 1), (1, 2), (1, 8), (2, 8)]
    assert [label for label, _ in cands[1:]] == ["tile 1x1024, 1 warps", "tile 1x1024, 2 warps",
                                                 "tile 1x1024, 8 warps", "tile 2x1024, 8 warps"]
    for _, vs in cands[1:]:
        assert vs[0].cols == 768 and vs[0].aligned and not vs[0].looped
        assert vs[1:] == rows_variants(_spec(768, "f16"))[1:] and [v.index for v in vs] == list(range(len(vs)))
        generate_rows(_spec(768, "f16"), vs[0])  # each compiles to source
    # no candidate holds more than 64 fp32 values a thread: 8192-wide rows on one warp would spill
    wide = rows_candidates(_spec(8192))
    assert all(v[0].block_m * v[0].block_n <= 64 * 32 * v[0].num_warps for _, v in wide)
    # dynamic row lengths and looped kernels: the heuristic's alone
    assert len(rows_candidates(_spec(None))) == 1 and len(rows_candidates(_spec(MAX_SINGLE_PASS + 1))) == 1


def test_early_loads_issue_the_epilogue_inputs_before_the_row():
    """`early_loads` (`rows-early-loads`): the shipped single-pass kernel loads gamma and beta
    before the row (the same lines, moved from after the statistics), the looped one after;
    a looped kernel cannot take it."""
    spec = _spec(768, "f16")
    single, looped = rows_variants(spec)
    assert single.early_loads and not looped.early_loads
    early = generate_rows(spec, single).source
    late = generate_rows(spec, dataclasses.replace(single, early_loads=False)).source
    e0 = next(ln.strip() for ln in late.splitlines() if ln.strip().startswith("e0 = tl.load"))
    assert late.index(e0) > late.index("tl.sum(x, axis=1)") > late.index("x0 = tl.load")
    assert early.index(e0) < early.index("x0 = tl.load") < early.index("tl.sum(x, axis=1)")
    assert early.count("e0 = tl.load") == late.count("e0 = tl.load") == 1
    with pytest.raises(ValueError, match="single-pass"):
        generate_rows(spec, dataclasses.replace(looped, early_loads=True))


def test_source_is_deterministic_and_names_its_nodes():
    spec = dataclasses.replace(_spec(768), source_nodes=("ReduceMean mean0", "Div div0"))
    v = rows_variants(spec)[0]
    a, b = generate_rows(spec, v), generate_rows(spec, v)
    assert a.source == b.source
    assert "#   ReduceMean mean0" in a.source and "#   Div div0" in a.source
    assert [p for p, _ in a.params] == rows_param_names(spec)
    assert dict(a.constexprs) == {"BLOCK_M": 1, "BLOCK_N": 1024, "N_COLS": 768}
    # the variance is of deviations from the mean, in both kernels
    assert "diff = tl.where(mask, x - mean[:, None], 0.0)" in a.source
    looped = generate_rows(spec, rows_variants(spec)[1]).source
    assert "chunk_diff = tl.where(mask, x - chunk_mean[:, None], 0.0)" in looped and "N_COLS" not in looped
    assert looped.count("for start in range(0, n_cols, BLOCK_N):") == 2


def test_strided_parameters():
    spec = RowsSpec("k", "softmax", _program(SCALE_MASK, "f32"), _program(SOFTMAX_OUT, "f32"), ("full", "strided"),
                    3, None)
    assert rows_param_names(spec) == ["x0_ptr", "x1_ptr", "y0_ptr", "n_rows", "n_cols", "size0", "size1", "size2",
                                      "stride_x1_0", "stride_x1_1", "stride_x1_2", "stride_x1_col"]


def test_rejected_specs():
    spec = _spec(768)
    v = rows_variants(spec)[0]
    with pytest.raises(ValueError, match="unknown reduction"):
        generate_rows(dataclasses.replace(spec, reduction="median"), v)
    with pytest.raises(ValueError, match="input modes"):
        generate_rows(dataclasses.replace(spec, input_modes=("full",)), v)
    with pytest.raises(ValueError, match="BLOCK_N >="):
        generate_rows(spec, dataclasses.replace(v, block_n=512))
    with pytest.raises(ValueError, match="BLOCK_M 1"):
        generate_rows(spec, dataclasses.replace(v, looped=True, block_m=2))
    with pytest.raises(ValueError, match="powers of two"):
        generate_rows(spec, dataclasses.replace(v, block_n=1000))
    with pytest.raises(ValueError, match="no prologue input has x's shape"):
        generate_rows(dataclasses.replace(spec, input_modes=("last", "last", "last", "last")), v)


def test_aot_compile_for_sm80_and_sm90(tmp_path):
    pytest.importorskip("triton")
    from onnxfuse.compile import compile_kernels

    ln = dataclasses.replace(_spec(768, "f16"), x_output=True)
    sm = RowsSpec("onnxfuse_softmax_0123456789ab", "softmax", _program(SCALE_MASK, "f32"),
                  _program(SOFTMAX_OUT, "f32"), ("full", "strided"), 3, None)
    out = compile_kernels([ln, sm], [80, 90], cache_dir=tmp_path, jobs=2)
    meta = out[0].kernel_meta()
    assert (meta["kind"], meta["reduction"], meta["axis"], meta["n_prologue"], meta["n_extras"]) == (
        "rows", "layer_norm", 2, 2, 2)
    assert meta["input_modes"] == ["full", "full", "last", "last"] and meta["x_output"] == 1
    assert [v["requires"] for v in meta["variants"]] == [{"ptr_align": 16}, {}]
    assert [(v["cols"], v["max_cols"], v["looped"]) for v in meta["variants"]] == [(768, 768, 0), (0, 0, 1)]
    assert [(b["variant"], b["arch"], b["format"]) for b in meta["binaries"]] == [
        (0, 80, "cubin"), (0, 90, "cubin"), (0, 90, "ptx"), (1, 80, "cubin"), (1, 90, "cubin"), (1, 90, "ptx")]
    assert all(b["global_scratch_size"] == 0 for b in meta["binaries"])
    # 768 fp16 columns compiled in, aligned: vector loads along the row
    ptx = out[0].kernels()[2].decode()
    assert ".target sm_90" in ptx and "ld.global.v" in ptx
    smeta = out[1].kernel_meta()
    assert [v["max_cols"] for v in smeta["variants"]] == [128, 512, 2048, 8192, 0]
    again = compile_kernels([ln], [80, 90], cache_dir=tmp_path)
    assert again[0].cache_hits == 4 and again[0].compiled == 0
    assert json.dumps(again[0].kernel_meta()) == json.dumps(meta)


def install_index_fix() -> None:
    """Triton 3.6's interpreter turns a scalar argument into a one-element array and takes
    int() of it where a loop bound needs an index, which numpy 2 refuses: the looped kernels'
    `range(0, n_cols, BLOCK_N)` over the run-time row length. Read the element instead."""
    from triton.runtime import interpreter

    patch = interpreter._patch_lang_tensor

    def patched(tensor, scope) -> None:
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched


if __name__ == "__main__":
    if sys.argv[1:2] == ["--interpret"]:
        assert os.environ.get("TRITON_INTERPRET") == "1"
        from tests.test_codegen import _install_bf16_rounding_fix, _install_gpu_max_semantics, _install_libdevice_shims

        _install_libdevice_shims()
        _install_bf16_rounding_fix()
        _install_gpu_max_semantics()
        install_index_fix()
        run_all(Path(sys.argv[2]), "cpu")
