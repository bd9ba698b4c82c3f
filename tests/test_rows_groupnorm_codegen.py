"""Generated GroupNorm kernels (FusedRows, reduction group_norm; onnxfuse.codegen_rows) against
the numpy reference of the node contract (onnxfuse.kinds.rows.evaluate_rows): under
``TRITON_INTERPRET=1`` in one child process (this file run as a script, as
tests/test_rows_codegen.py does), on the GPU with Triton's JIT (`gpu`), and compiled ahead
of time for sm_90 with no GPU.

The cases cover NCHW and channels-last (NHWC) x, the single-pass kernel with several rows
(image, group) per program and the looped one (forced with small chunks, and the default
for a dynamic row length), groups of a channel count that is not a power of two, every
group_norm input mode (full, scalar, channel: gamma and beta; batch_channel: a time
embedding [N, C, 1, 1] added before the norm; batch), fp16 rows of magnitude 1e4 (whose
squares overflow fp16), bf16, and an exposed x."""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from onnxfuse.codegen_rows import RowsSpec, RowsVariant, generate_rows, rows_param_names, rows_variants
from onnxfuse.expr import HEADER, parse
from onnxfuse.kinds.rows import evaluate_rows

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tests.util import interpreted_run  # noqa: E402

NP = {"f32": np.float32, "f16": np.float16, "bf16": ml_dtypes.bfloat16}

# Programs: the prologue (x from the node's first inputs), the epilogue (x, mean, var, then
# the extras), with {dt} the activations' dtype; the int: the epilogue's extras.
IDENTITY = ("input %0 {dt}\noutput %0 {dt}", 0)
TEMB = ("input %0 {dt}\ninput %1 {dt}\n%2 = add %0 %1\noutput %2 {dt}", 0)
PER_IMAGE = ("input %0 {dt}\ninput %1 f32\n%2 = mul %0 %1\noutput %2 {dt}", 0)
GN_SILU = ("input %0 f32\ninput %1 f32\ninput %2 f32\ninput %3 {dt}\ninput %4 {dt}\n%5 = sub %0 %1\n"
           "%6 = add %2 1e-05\n%7 = sqrt %6\n%8 = div 1.0 %7\n%9 = mul %5 %8\n%10 = mul %9 %3\n%11 = add %10 %4\n"
           "%12 = sigmoid %11\n%13 = mul %11 %12\noutput %13 {dt}", 2)
GN_SCALAR = ("input %0 f32\ninput %1 f32\ninput %2 f32\ninput %3 f32\ninput %4 {dt}\n%5 = sub %0 %1\n"
             "%6 = add %2 1e-06\n%7 = sqrt %6\n%8 = div %5 %7\n%9 = mul %8 %3\n%10 = add %9 %4\noutput %10 {dt}", 2)


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    shape: tuple[int, ...]  # logical [N, C, spatial...]
    groups: int
    prologue: tuple[str, int]
    epilogue: tuple[str, int]
    modes: tuple[str, ...]  # per input: the prologue's, then the extras'
    dtype: str = "f32"
    channels_last: bool = False
    x_output: bool = False
    variant: RowsVariant | None = None  # None: rows_variants(spec)[pick]
    pick: int = 0
    dynamic: bool = False  # the row length not known when compiling
    scale: float = 1.0
    mean: float = 0.0


CASES = [
    Case("nchw-temb-silu-rows-per-program", (2, 32, 6, 7), 8, TEMB, GN_SILU,
         ("full", "batch_channel", "channel", "channel")),
    Case("nchw-looped-small-chunks", (2, 12, 9, 11), 3, TEMB, GN_SILU, ("full", "full", "channel", "channel"),
         variant=RowsVariant(0, 1, 64, 4, looped=True, cols=4 * 99), scale=10.0, mean=100.0),
    Case("nchw-fp16-magnitude-1e4-x-output", (2, 16, 10, 10), 4, TEMB, GN_SILU,
         ("full", "full", "channel", "channel"), dtype="f16", scale=1e4, x_output=True),
    Case("nchw-dynamic-looped", (3, 10, 7, 5), 5, IDENTITY, GN_SILU, ("full", "channel", "channel"), dynamic=True,
         pick=4),
    Case("nchw-bf16-per-image-scalar", (2, 6, 4, 9), 2, PER_IMAGE, GN_SCALAR, ("full", "batch", "scalar", "channel"),
         dtype="bf16"),
    Case("nhwc-temb-silu-rows-per-program", (2, 32, 6, 7), 8, TEMB, GN_SILU,
         ("full", "batch_channel", "channel", "channel"), channels_last=True),
    Case("nhwc-looped-five-channel-groups", (2, 20, 5, 9), 4, TEMB, GN_SILU, ("full", "full", "channel", "channel"),
         channels_last=True, variant=RowsVariant(0, 1, 32, 2, looped=True), mean=-3.0),
    Case("nhwc-fp16-magnitude-1e4-x-output", (1, 64, 9, 9), 32, TEMB, GN_SILU,
         ("full", "batch_channel", "channel", "channel"), dtype="f16", scale=1e4, x_output=True, channels_last=True),
    Case("nchw-split-3-programs-per-row", (2, 12, 9, 11), 3, TEMB, GN_SILU,
         ("full", "batch_channel", "channel", "channel"),
         variant=RowsVariant(0, 1, 64, 4, looped=True, cols=4 * 99, split=3, max_rows=64), scale=10.0, mean=100.0),
    Case("nhwc-split-4-run-time-cols", (1, 20, 7, 9), 4, TEMB, GN_SILU, ("full", "full", "channel", "channel"),
         channels_last=True, variant=RowsVariant(0, 1, 32, 2, looped=True, split=4, max_rows=64), mean=-3.0),
    Case("nhwc-bf16-per-image-scalar", (2, 6, 4, 9), 3, PER_IMAGE, GN_SCALAR, ("full", "batch", "scalar", "channel"),
         dtype="bf16", channels_last=True),
]


def _program(text: tuple[str, int], dtype: str):
    return parse(f"{HEADER}\n{text[0].format(dt=dtype)}\n")


def spec_of(i: int, case: Case) -> tuple[RowsSpec, RowsVariant]:
    n, c = case.shape[0], case.shape[1]
    n_cols = int(np.prod(case.shape)) // (n * case.groups)
    spec = RowsSpec(f"k_gn_{i}", "group_norm", _program(case.prologue, case.dtype),
                    _program(case.epilogue, case.dtype), case.modes, 1, None if case.dynamic else n_cols,
                    case.x_output, groups=case.groups, channels=c, channels_last=case.channels_last)
    return spec, case.variant or rows_variants(spec)[case.pick]


def physical(case: Case) -> tuple[int, ...]:
    """x's shape as stored."""
    s = case.shape
    return (s[0], *s[2:], s[1]) if case.channels_last else s


def input_shape(mode: str, case: Case) -> tuple[int, ...]:
    n, c = case.shape[:2]
    ones = (1,) * (len(case.shape) - 2)
    return {"full": physical(case), "scalar": (1,), "channel": (c, *ones), "batch_channel": (n, c, *ones),
            "batch": (n, 1, *ones)}[mode]


def inputs_of(i: int, case: Case) -> list[np.ndarray]:
    spec, _ = spec_of(i, case)
    rng = np.random.default_rng(5000 + i)
    dtypes = list(spec.prologue.input_dtypes) + list(spec.program.input_dtypes[spec.n_row_values:])
    out = []
    for k, (mode, dt) in enumerate(zip(case.modes, dtypes, strict=True)):
        a = rng.standard_normal(input_shape(mode, case))
        if k == 0:
            a = a * case.scale + case.mean
        out.append(a.astype(NP[dt]))
    return out


def reference(i: int, case: Case) -> list[np.ndarray]:
    spec, _ = spec_of(i, case)
    return evaluate_rows("group_norm", spec.prologue, spec.program, inputs_of(i, case), 1, case.x_output,
                         case.groups, case.channels_last)


def launch(fn, spec: RowsSpec, variant: RowsVariant, constexprs: dict, inputs: list[np.ndarray], case: Case,
           device: str = "cpu") -> list[np.ndarray]:
    """Run a generated kernel with the parameters and grid the C++ launcher passes."""
    import torch

    def tensor(a: np.ndarray):
        if a.dtype == ml_dtypes.bfloat16:
            return torch.from_numpy(a.view(np.uint16).copy()).view(torch.bfloat16).to(device)
        return torch.from_numpy(np.ascontiguousarray(a)).to(device)

    tdt = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
    out_dts = [dt for _, dt in spec.program.outputs] + ([spec.x_dtype] if spec.x_output else [])
    outs = [torch.empty(physical(case), dtype=tdt[dt], device=device) for dt in out_dts]
    n_rows = case.shape[0] * case.groups
    n_cols = int(np.prod(case.shape)) // n_rows
    fn[variant.grid(n_rows)](*map(tensor, inputs), *outs, n_rows, n_cols, **constexprs)
    return [o.float().cpu().numpy() for o in outs]


def run_all(workdir: Path, device: str) -> None:
    from benchmarks.conv_kernels import _load

    results = {}
    for i, case in enumerate(CASES):
        try:
            spec, v = spec_of(i, case)
            ks = generate_rows(spec, v)
            fn = _load(ks.source, spec.name, workdir)
            for k, o in enumerate(launch(fn, spec, v, dict(ks.constexprs), inputs_of(i, case), case, device)):
                results[f"case{i}_{k}"] = o
        except Exception as e:  # reported by the case's test
            (workdir / f"case{i}_error.txt").write_text(f"{type(e).__name__}: {e}")
    np.savez(workdir / "out.npz", **results)


def check(workdir: Path, index: int) -> None:
    case = CASES[index]
    err = workdir / f"case{index}_error.txt"
    if err.exists():
        pytest.fail(f"kernel failed: {err.read_text()}")
    got_all = np.load(workdir / "out.npz")
    spec, _ = spec_of(index, case)
    dtypes = [dt for _, dt in spec.program.outputs] + ([spec.x_dtype] if spec.x_output else [])
    for k, want in enumerate(reference(index, case)):
        got = got_all[f"case{index}_{k}"]
        want = want.astype(np.float32)
        assert got.shape == want.shape
        assert np.isfinite(got).all(), f"output {k}: not finite (fp16 overflow?)"
        tol = {"f32": 2e-5, "f16": 2e-3, "bf16": 1.6e-2}[dtypes[k]]
        scale = float(np.abs(want).max(initial=1.0))
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol * scale, err_msg=f"output {k}")


@pytest.fixture(scope="module")
def interpreted():
    with interpreted_run(__file__, "onnxfuse-gn-interp-") as workdir:
        yield workdir


@pytest.mark.parametrize("index", range(len(CASES)), ids=[c.id for c in CASES])
def test_group_norm_kernel_matches_reference(interpreted, index):
    check(interpreted, index)


@pytest.mark.gpu(ort=False, torch=True)
def test_group_norm_kernels_on_gpu(tmp_path):
    """The same kernels with Triton's JIT on the GPU."""
    run_all(tmp_path, "cuda")
    for i in range(len(CASES)):
        check(tmp_path, i)


def test_reference_matches_torch_group_norm():
    """The contract's numpy reference (NCHW and channels-last) is torch's GroupNorm."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 12, 5, 7)).astype(np.float32) * 3 + 1
    g, b = rng.standard_normal(12).astype(np.float32), rng.standard_normal(12).astype(np.float32)
    want = torch.nn.functional.group_norm(torch.from_numpy(x), 4, torch.from_numpy(g), torch.from_numpy(b),
                                          eps=1e-5).numpy()
    epi = parse(f"{HEADER}\n" + GN_SILU[0].format(dt="f32").replace("%12 = sigmoid %11\n%13 = mul %11 %12\n"
                                                                     "output %13", "output %11") + "\n")
    pro = _program(IDENTITY, "f32")
    (got,) = evaluate_rows("group_norm", pro, epi, [x, g.reshape(12, 1, 1), b.reshape(12, 1, 1)], 1, groups=4)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    (got_cl,) = evaluate_rows("group_norm", pro, epi, [x.transpose(0, 2, 3, 1).copy(), g.reshape(12, 1, 1),
                                                       b.reshape(12, 1, 1)], 1, groups=4, channels_last=True)
    np.testing.assert_allclose(got_cl, want.transpose(0, 2, 3, 1), rtol=1e-5, atol=1e-5)


def test_parameters_and_variants():
    spec, _ = spec_of(0, CASES[0])
    assert rows_param_names(spec) == ["x0_ptr", "x1_ptr", "e0_ptr", "e1_ptr", "y0_ptr", "n_rows", "n_cols"]
    v = rows_variants(spec)  # 4 channels x 42 pixels = 168 columns: single pass, 4 rows per program, then looped
    assert [(x.block_m, x.block_n, x.looped, x.cols) for x in v] == [(4, 256, False, 168), (1, 1024, True, 0)]
    big = dataclasses.replace(spec, n_cols=10 * 64 * 64, channels=320, groups=32)  # SD-UNet: 40960 columns
    # first 4 programs per row for launches of at most 64 rows (batch 1 and 2), then one per row
    assert [(x.looped, x.cols, x.split, x.max_rows) for x in rows_variants(big)] == [
        (True, 40960, 4, 64), (True, 40960, 1, 0), (True, 0, 1, 0)]
    assert rows_variants(big)[0].meta()["split"] == 4 and "split" not in rows_variants(big)[1].meta()
    assert rows_variants(big)[0].grid(32) == (128, 1)
    assert rows_variants(dataclasses.replace(big, x_output=True))[0].split == 1  # x stored once per row
    ks = generate_rows(spec, v[0])
    assert dict(ks.constexprs)["GROUPS"] == 8 and dict(ks.constexprs)["GROUP_CHANNELS"] == 4
    assert "Group norm: 32 channels in 8 groups, x stored NCHW" in ks.source


def test_rejected_specs():
    spec, v = spec_of(0, CASES[0])
    with pytest.raises(ValueError, match="multiple of groups"):
        generate_rows(dataclasses.replace(spec, channels=30), v)
    with pytest.raises(ValueError, match="input mode 'last'"):
        generate_rows(dataclasses.replace(spec, input_modes=("full", "last", "channel", "channel")), v)
    with pytest.raises(ValueError, match="splits its rows"):
        generate_rows(spec, dataclasses.replace(v, split=2))  # a single-pass variant
    ln = dataclasses.replace(spec, reduction="layer_norm", input_modes=("full", "full", "last", "last"))
    with pytest.raises(ValueError, match="group_norm's"):
        generate_rows(ln, v)


def test_aot_compile_for_sm90(tmp_path):
    """Both layouts, single pass and looped, and the split kernel (SD-UNet's 40960-column
    rows) compile for sm_90 with no GPU."""
    pytest.importorskip("triton")
    from onnxfuse.compile import compile_kernels

    sd = dataclasses.replace(spec_of(0, CASES[0])[0], name="k_gn_sd", n_cols=10 * 64 * 64, channels=320, groups=32)
    specs = [spec_of(0, CASES[0])[0], spec_of(7, CASES[7])[0], sd]
    out = compile_kernels(specs, [90], cache_dir=tmp_path)
    metas = [ck.kernel_meta() for ck in out]
    assert [m["channels_last"] for m in metas] == [0, 1, 0]
    assert [len(m["variants"]) for m in metas] == [2, 2, 3]
    assert metas[2]["variants"][0]["split"] == 4 and metas[2]["variants"][0]["max_rows"] == 64
    for m in metas:
        assert m["reduction"] == "group_norm" and len(m["binaries"]) >= len(m["variants"])


if __name__ == "__main__":
    if sys.argv[1:2] == ["--interpret"]:
        assert os.environ.get("TRITON_INTERPRET") == "1"
        from tests.test_codegen import _install_bf16_rounding_fix, _install_gpu_max_semantics, _install_libdevice_shims
        from tests.test_rows_codegen import install_index_fix

        _install_libdevice_shims()
        _install_bf16_rounding_fix()
        _install_gpu_max_semantics()
        install_index_fix()
        run_all(Path(sys.argv[2]), "cpu")
