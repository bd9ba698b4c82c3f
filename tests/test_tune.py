"""`optimize --tune`: the candidate configurations, fixing the input shapes, and the clear
errors where it cannot run. The timing itself needs a GPU: tests/test_gpu_conv.py."""

from __future__ import annotations

import onnx
import pytest

from models.build import conv_relu_maxpool
from onnxfuse.cli import main
from onnxfuse.codegen_conv import ConvSpec, MaxPoolSpec
from onnxfuse.compile import KernelSpec, local_gpu_archs
from onnxfuse.errors import OnnxfuseError
from onnxfuse.expr import HEADER, parse
from onnxfuse.layers import ConvAttrs, PoolAttrs
from onnxfuse.tune import candidates, fix_shapes

RELU = parse(HEADER + "\ninput %0 f32\n%1 = max %0 0.0\noutput %1 f32\n")


def test_conv_candidates_are_distinct_and_hold_whole_windows():
    pool = PoolAttrs((4, 4), (4, 4))  # a 16-row window
    spec = ConvSpec("k", RELU, 64, 64, ConvAttrs((3, 3), pads=(1, 1, 1, 1)), pool)
    cands = candidates(spec)
    configs = [v for _, (v,) in cands]
    assert len(cands) >= 4 and len({(v.block_m, v.block_n, v.block_k, v.num_warps, v.num_stages)
                                    for v in configs}) == len(cands)
    assert all(v.block_m % 16 == 0 for v in configs)
    assert cands[0][0].startswith("tile 64x64x32")  # the heuristic default comes first


@pytest.mark.parametrize("channels,x_layout,w_layout,first,flat", [
    (64, "nhwc", "krsc", "tile 128x64x32, 4 warps, 3 stages", False),
    (3, "nchw", "krsc", "tile 128x64x32, 4 warps, 2 stages, flat", True),
])
def test_channels_last_and_flat_candidates(channels, x_layout, w_layout, first, flat):
    """The heuristic's config first, then the runners-up of the H200 sweeps, all distinct and
    of the same kernel kind (flat or not)."""
    spec = ConvSpec("k", RELU, channels, 64, ConvAttrs((3, 3), pads=(1, 1, 1, 1)), x_layout=x_layout,
                    w_layout=w_layout)
    cands = candidates(spec)
    configs = [vs[0] for _, vs in cands]
    assert cands[0][0] == first and len(cands) >= 4
    # each candidate ships with its split-K variant where its reduction splits (64 channels
    # 3x3: 18 steps of 32 channels or 9 of 64); the flat kernel's 1 step does not
    splits = [vs[1:] for _, vs in cands]
    assert all(len(s) <= 1 for s in splits) and (any(splits) != flat)
    for (_, vs), s in zip(cands, splits, strict=True):
        for sv in s:
            assert (sv.index, sv.block_n, sv.block_k, sv.num_warps) == (1, vs[0].block_n, vs[0].block_k,
                                                                          vs[0].num_warps)
            assert sv.split > 1 and sv.block_m == min(vs[0].block_m, 64)
    assert len({(v.block_m, v.block_n, v.block_k, v.num_warps, v.num_stages) for v in configs}) == len(cands)
    assert all(v.flat == flat for v in configs)
    assert flat or all(v.num_warps >= 4 for v in configs)  # wgmma needs a warp group


@pytest.mark.parametrize("channels,pool", [(72, None), (576, None), (16, PoolAttrs((3, 3), (3, 3)))])
def test_grouped_candidates(channels, pool):
    """Depthwise convs: the direct loop's tiles, the heuristic's first, all distinct, whole
    (padded) windows per program."""
    spec = ConvSpec("k", RELU, channels, channels, ConvAttrs((3, 3), pads=(1, 1, 1, 1), group=channels), pool,
                    x_layout="nhwc", y_layout="nhwc", w_layout="krsc")
    cands = candidates(spec)
    configs = [v for _, (v,) in cands]
    assert len(cands) >= 4 and cands[0][0].endswith("direct")
    assert len({(v.block_m, v.block_n, v.num_warps) for v in configs}) == len(cands)
    assert all(v.block_m % (16 if pool else 1) == 0 and not v.flat for v in configs)
    assert (configs[0].block_m, configs[0].block_n) == ((128, 16) if channels <= 16 else (16, 64))


@pytest.mark.parametrize("pool,x_layout,first,tile", [
    (PoolAttrs((2, 2), (2, 2)), "nchw", "tile 4x64, 4 warps, rows", "rows"),
    (PoolAttrs((3, 3), (2, 2), (1, 1, 1, 1)), "nchw", "block 256", "flat"),
    (PoolAttrs((5, 5), (1, 1), (2, 2, 2, 2)), "nhwc", "tile 4x64, 1 warps, nhwc", "nhwc"),
])
def test_pool_candidates_are_of_the_heuristics_kernel(pool, x_layout, first, tile):
    """The pool kernel the heuristic picks (channels-last X: nhwc; tiling windows: rows;
    else flat), its tile first, then its sweep's runners-up; every candidate generates."""
    from onnxfuse.codegen_conv import generate_maxpool

    spec = MaxPoolSpec("k", RELU, pool, x_layout=x_layout, y_layout=x_layout)
    cands = candidates(spec)
    assert cands[0][0] == first and len(cands) >= 3 and len({label for label, _ in cands}) == len(cands)
    for _, variants in cands:
        assert {v.tile for v in variants} == {tile}
        assert [v.index for v in variants] == list(range(len(variants)))
        for v in variants:
            generate_maxpool(spec, v)
    if tile != "flat":  # as pool_variants ships them: C (nhwc) or W (rows) % 16 == 0 first, then any
        key = "c_multiple" if tile == "nhwc" else "w_multiple"
        assert all([getattr(v, key) for v in variants] == [16, 0] for _, variants in cands)


def test_pointwise_candidates():
    (label, variants), = candidates(KernelSpec(RELU, "k", 1, ("full",)))
    assert label == "default" and len(variants) >= 2


def test_fix_shapes():
    m = conv_relu_maxpool(channels=8, size=16)
    assert fix_shapes(m, {}, 4) == {"x": (4, 8, 16, 16)}
    assert fix_shapes(m, {"x": (2, 8, 10, 10)}, None) == {"x": (2, 8, 10, 10)}
    with pytest.raises(OnnxfuseError, match="--shape x="):
        fix_shapes(m, {}, None)


@pytest.mark.skipif(bool(local_gpu_archs()), reason="checks the error on a machine without a GPU")
def test_tune_without_gpu_is_a_clear_error(tmp_path, capsys):
    src, dst = tmp_path / "m.onnx", tmp_path / "o.onnx"
    onnx.save(conv_relu_maxpool(channels=8, size=16), str(src))
    assert main(["optimize", str(src), str(dst), "--tune", "--batch", "2", "--target", "sm_90"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--tune needs an NVIDIA GPU" in err[0]
    assert not dst.exists()


def test_tune_with_target_none_is_a_clear_error(tmp_path, capsys):
    src, dst = tmp_path / "m.onnx", tmp_path / "o.onnx"
    onnx.save(conv_relu_maxpool(channels=8, size=16), str(src))
    assert main(["optimize", str(src), str(dst), "--tune", "--target", "none"]) == 2
    assert "--target none" in capsys.readouterr().err
    assert not dst.exists()
