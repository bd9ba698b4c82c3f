"""Golden kernel sources: every generated Triton kernel and its kernel_meta stay byte-identical.

For a set of models that exercises every fusion kind and kernel shape (pointwise chains with
full / scalar / strided inputs in f32, f16 and bf16, short and long programs; convs plain,
flat (image input), split-K, grouped (direct loop and block-diagonal GEMM), depthwise,
NCHW and NHWC, with a pooled epilogue, at the three conv precisions, with TF32 rounding at
the producer; max pools flat, rows and nhwc), the compile pass runs as `optimize` runs it
(`--target sm_80,sm_90`, no tuning), but nothing is compiled: the kernel cache is faked, so
every (kernel, variant, target) is a "hit" whose source is recorded. Each kernel's record is
the sha256 of every variant's source with its compile arguments, of its kernel_meta (binaries
included: the fake cache gives them fixed metadata), and of the sources of the candidate
configurations `--tune` would time.

tests/data/kernel_sources.json holds the hashes. A change that alters a generated kernel
on purpose regenerates it: ``ONNXFUSE_UPDATE_GOLDEN=1 python -m pytest tests/test_kernel_sources.py``
(and says so in its commit message). The pretrained models are used when they are in the
models cache (`python -m models.pretrained`); without them their cases skip.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from models import build
from onnxfuse import compile as aot
from onnxfuse import tune
from onnxfuse.pattern import example_model, load_patterns
from onnxfuse.pipeline import NHWC_ONLY_PATTERNS, build_options, optimize_model
from tests import test_layout as lay

pytest.importorskip("triton")

GOLDEN = Path(__file__).parent / "data" / "kernel_sources.json"
UPDATE = os.environ.get("ONNXFUSE_UPDATE_GOLDEN") == "1"
TARGETS = "sm_80,sm_90"
N = helper.make_node


def _sha(data: str | bytes) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


def _kernel_text(k) -> str:
    """A generated kernel as `triton.compile` gets it: source and every compile argument."""
    return json.dumps({"name": k.name, "source": k.source, "params": k.params, "constexprs": k.constexprs,
                       "divisible": k.divisible, "num_warps": k.num_warps, "num_stages": k.num_stages}, sort_keys=True)


class FakeCache:
    """Stands in for the kernel cache: every key is a hit with fixed metadata; records the
    kernel source behind each key."""

    def __init__(self):
        self.kernels: dict[str, object] = {}

    def key(self, kernel, arch: int) -> str:
        key = _sha(f"{arch}\n{_kernel_text(kernel)}")
        self.kernels[key] = kernel
        return key

    def get(self, root, key: str) -> dict:
        k = self.kernels[key]
        return {"entry": k.name, "num_warps": k.num_warps, "shared": 0, "global_scratch_size": 0,
                "global_scratch_align": 1, "profile_scratch_size": 0, "profile_scratch_align": 1,
                "cubin": b"cubin", "ptx": ".target sm_90a\n"}


def kernel_records(model: onnx.ModelProto, monkeypatch, layout: str, precision: str = "tf32",
                   patterns: list | None = None, leave_to_ort: bool = True) -> dict[str, dict]:
    """kernel name -> {"variants": [sha per variant], "meta": sha, "candidates": sha} of every
    kernel the compile pass of `model` writes."""
    cache = FakeCache()
    monkeypatch.setattr(aot, "_cache_key", cache.key)
    monkeypatch.setattr(aot, "_cache_get", cache.get)
    specs: dict[str, object] = {}
    real = aot.compile_kernels

    def recording(spec_list, *args, **kwargs):
        if kwargs.get("variant_override") is None:
            specs.update((s.name, s) for s in spec_list)
        return real(spec_list, *args, **kwargs)

    monkeypatch.setattr(aot, "compile_kernels", recording)
    options = build_options(target=TARGETS, layout=layout, conv_precision=precision, tune="off",
                            leave_to_ort=leave_to_ort)
    r = optimize_model(model, patterns, options=options)
    info = r.report.compile or {}
    assert not info.get("failed"), info.get("failed")
    metas = {}
    for n in r.model.graph.node:
        meta = next((a.s for a in n.attribute if a.name == "kernel_meta"), None)
        if meta is not None:
            metas[json.loads(meta)["name"]] = meta
    out = {}
    for name in sorted(metas):
        spec = specs[name]
        (ck,) = real([spec], aot.parse_targets(TARGETS))
        variants = {}
        for k in cache.kernels.values():
            if k.name == name:
                variants[k.variant.index] = _sha(_kernel_text(k))
        assert ck.kernel_meta_json().encode() == metas[name]
        cands = []
        for label, vs in tune.candidates(spec):
            before = set(cache.kernels)
            (c,) = real([spec], [90], variant_override=vs)
            new = sorted(_kernel_text(cache.kernels[k]) for k in cache.kernels if k not in before) or [
                c.kernel_meta_json()]
            cands.append(label + "\n" + "\n".join(new) + "\n" + c.kernel_meta_json())
        out[name] = {"variants": [variants[i] for i in sorted(variants)], "meta": _sha(metas[name]),
                     "candidates": _sha("\n\n".join(cands))}
    return out


# ---------------------------------------------------------------------------------------
# models
# ---------------------------------------------------------------------------------------

def _pointwise_dtypes(dtype: int) -> onnx.ModelProto:
    """A chain over x [N, 8, 33] with a full input, a broadcast (strided) row, a scalar, and
    two outputs; in `dtype`."""
    nodes = [N("Mul", ["x", "row"], ["a"]), N("Sigmoid", ["a"], ["s"]), N("Add", ["s", "z"], ["b"]),
             N("Mul", ["b", "k"], ["y"]), N("Tanh", ["a"], ["t"])]
    inputs = [helper.make_tensor_value_info("x", dtype, ["N", 8, 33]),
              helper.make_tensor_value_info("row", dtype, [1, 33]),
              helper.make_tensor_value_info("z", dtype, ["N", 8, 33]),
              helper.make_tensor_value_info("k", dtype, [1])]
    outputs = [helper.make_tensor_value_info("y", dtype, ["N", 8, 33]),
               helper.make_tensor_value_info("t", dtype, ["N", 8, 33])]
    g = helper.make_graph(nodes, "pointwise_dtypes", inputs, outputs)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 10
    return m


def _grouped_gemm() -> onnx.ModelProto:
    """RegNet's grouped conv: 32 channels in groups of 8 (the block-diagonal GEMM), then a
    group-1 1x1 conv; SiLU epilogues."""
    rng = np.random.default_rng(11)
    inits = [numpy_helper.from_array((rng.standard_normal(s) / np.sqrt(np.prod(s[1:]))).astype(np.float32), n)
             for n, s in (("w0", (32, 16, 1, 1)), ("w1", (32, 8, 3, 3)), ("w2", (16, 32, 1, 1)))]
    nodes = [N("Conv", ["x", "w0"], ["c0"], kernel_shape=[1, 1], name="c0"),
             N("Relu", ["c0"], ["r0"]),
             N("Conv", ["r0", "w1"], ["c1"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], group=4, name="grouped"),
             N("Sigmoid", ["c1"], ["s1"]), N("Mul", ["c1", "s1"], ["m1"]),
             N("Conv", ["m1", "w2"], ["c2"], kernel_shape=[1, 1], name="c2"),
             N("Relu", ["c2"], ["y"])]
    return lay.image_model(nodes, "grouped_gemm", 16, 12, [("y", 16)], inits)


def _mbconv_se(c: int, e: int, size: int) -> onnx.ModelProto:
    from tests.test_conv_small_m import mbconv_se

    return mbconv_se(c, e, size)


def _group_norm(dtype: int, shape: list, groups: int, form: str) -> onnx.ModelProto:
    """A GroupNorm with a time-embedding add before it and SiLU after it: `form` "torch"
    (Reshape -> InstanceNormalization -> Reshape(Shape(x)) -> Mul -> Add, as torch exports
    nn.GroupNorm) or "op" (GroupNormalization, opset 21)."""
    c = shape[1]
    rng = np.random.default_rng(17)
    np_dt = {TensorProto.FLOAT: np.float32, TensorProto.FLOAT16: np.float16}[dtype]
    inits = [numpy_helper.from_array(rng.standard_normal(s).astype(np_dt), n)
             for n, s in (("gamma", (c, 1, 1) if form == "torch" else (c,)), ("beta", (c, 1, 1) if form == "torch"
                                                                                 else (c,)))]
    nodes = [N("Add", ["x", "t"], ["h"])]
    if form == "torch":
        inits += [numpy_helper.from_array(np.array([0, groups, -1], np.int64), "split"),
                  numpy_helper.from_array(np.ones(groups, np_dt), "ones"),
                  numpy_helper.from_array(np.zeros(groups, np_dt), "zeros")]
        nodes += [N("Reshape", ["h", "split"], ["r"]), N("InstanceNormalization", ["r", "ones", "zeros"], ["i"]),
                  N("Shape", ["h"], ["hs"]), N("Reshape", ["i", "hs"], ["n0"]), N("Mul", ["n0", "gamma"], ["n1"]),
                  N("Add", ["n1", "beta"], ["n"])]
    else:
        nodes.append(N("GroupNormalization", ["h", "gamma", "beta"], ["n"], num_groups=groups))
    nodes += [N("Sigmoid", ["n"], ["sg"]), N("Mul", ["n", "sg"], ["y"])]
    inputs = [helper.make_tensor_value_info("x", dtype, shape),
              helper.make_tensor_value_info("t", dtype, [shape[0], c, 1, 1])]
    g = helper.make_graph(nodes, f"group_norm_{form}", inputs, [helper.make_tensor_value_info("y", dtype, shape)],
                          inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21 if form == "op" else 17)])
    m.ir_version = 10
    return m


def _group_norm_between_convs() -> onnx.ModelProto:
    """conv -> Relu -> GroupNorm -> SiLU -> conv -> Relu: the NHWC pass lays the GroupNorm out
    channels-last (tests/test_rows_groupnorm.py)."""
    from tests.test_rows_groupnorm import _convs_around_group_norm

    return _convs_around_group_norm()


def _pretrained(name: str) -> Callable[[], onnx.ModelProto]:
    def load() -> onnx.ModelProto:
        from models import pretrained

        path = pretrained.cache_dir() / f"{name}.onnx"
        spec = pretrained.PRETRAINED[name]
        if not path.exists() or pretrained.sha256(path) != spec.sha256:
            pytest.skip(f"{name} is not in the models cache (python -m models.pretrained {name})")
        return onnx.load(str(path))
    return load


def _pattern_cases() -> dict[str, tuple]:
    cases = {}
    for p in load_patterns():
        if p.example is None:
            continue
        for layout in ("nchw", "nhwc"):
            if layout == "nchw" and p.name in NHWC_ONLY_PATTERNS:
                continue
            kw = {"env": GEMM_ENV} if p.kind.untuned_reason() else {}  # (matched only when tuned)
            cases[f"pattern_{p.name}_{layout}"] = (lambda p=p: example_model(p), layout, "tf32", kw)
    return cases


def _gemm_ffn(dtype: str = "float32", s: int = 128, k: int = 768, n: int = 3072) -> onnx.ModelProto:
    from tests.test_gemm_patterns import ffn1

    return ffn1(dtype, s, k, n)


def _gemm_attention() -> onnx.ModelProto:
    """Gemm transB with a bias and Relu, then a batched product with a transposed A."""
    rng = np.random.default_rng(12)
    inits = [numpy_helper.from_array(rng.standard_normal(s).astype(np.float32), n)
             for n, s in (("w", (64, 32)), ("c", (64,)), ("w2", (24, 16)))]
    nodes = [N("Gemm", ["x", "w", "c"], ["h"], transB=1), N("Relu", ["h"], ["y"]),
             N("Transpose", ["z"], ["zt"], perm=[0, 2, 1]), N("MatMul", ["zt", "w2"], ["p"]),
             N("Sigmoid", ["p"], ["q"])]
    g = helper.make_graph(nodes, "gemm_mix", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [10, 32]),
                                              helper.make_tensor_value_info("z", TensorProto.FLOAT, [3, 24, 5])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [10, 64]),
                           helper.make_tensor_value_info("q", TensorProto.FLOAT, [3, 5, 16])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 10
    return m


def _attention(form: str) -> onnx.ModelProto:
    """BERT-base's attention at batch 2 in float16 (aligned and unaligned variants, a mask);
    GPT-2's causal Where on a small float32 head (precision ieee); a packed projection read in
    place with torch's NaN guard (nan_to_zero)."""
    if form == "bert":
        from tests.test_attention_gpu import _shaped

        return _shaped("float16", 2, 128, 12, 64)
    if form == "packed":  # Q, K and V packed into one projection; torch's NaN guard after the softmax
        from onnx import helper as h

        from tests.test_pack import _bert_attention

        m = _bert_attention()
        nodes = list(m.graph.node)
        sm = next(n for n in nodes if n.op_type == "Softmax")
        pv = next(n for n in nodes if n.op_type == "MatMul" and n.input[0] == sm.output[0])
        pv.input[0] = "p_guarded"
        at = nodes.index(sm) + 1
        nodes[at:at] = [h.make_node("IsNaN", [sm.output[0]], ["p_nan"]),
                        h.make_node("Where", ["p_nan", "zero", sm.output[0]], ["p_guarded"])]
        del m.graph.node[:]
        m.graph.node.extend(nodes)
        m.graph.initializer.append(numpy_helper.from_array(np.array(0.0, np.float32), "zero"))
        return m
    from tests.test_attention_patterns import _heads

    return _heads("where")


# Cases whose kernels the optimizer writes only with $ONNXFUSE_GEMM_ALL=1 or tuning (the gemm kind)
GEMM_ENV = {"ONNXFUSE_GEMM_ALL": "1"}

# case name -> (model builder, layout, conv precision, optimize keywords)
CASES: dict[str, tuple] = {
    **_pattern_cases(),
    "example": (build.example, "nhwc", "tf32", {"leave_to_ort": False}),
    "activation_block": (build.activation_block, "nhwc", "tf32", {}),
    "mul_chain_8": (lambda: build.mul_chain(8), "nhwc", "tf32", {}),
    "mul_chain_64": (lambda: build.mul_chain(64), "nhwc", "tf32", {}),
    "mul_chain_256": (lambda: build.mul_chain(256), "nhwc", "tf32", {}),
    "gelu_erf": (build.gelu_erf, "nhwc", "tf32", {"leave_to_ort": False}),
    "pointwise_f32": (lambda: _pointwise_dtypes(TensorProto.FLOAT), "nhwc", "tf32", {}),
    "pointwise_f16": (lambda: _pointwise_dtypes(TensorProto.FLOAT16), "nhwc", "tf32", {}),
    "pointwise_bf16": (lambda: _pointwise_dtypes(TensorProto.BFLOAT16), "nhwc", "tf32", {}),
    "mlp_block": (lambda: build.mlp_block(8, 32, 64), "nhwc", "tf32", {"leave_to_ort": False}),
    "relu_maxpool_nchw": (lambda: build.relu_maxpool(8, 16), "nchw", "tf32", {}),
    "relu_maxpool_odd": (lambda: build.relu_maxpool(8, 15), "nchw", "tf32", {}),
    "conv_relu_nchw": (lambda: build.conv_relu(64, 16), "nchw", "tf32", {}),
    "conv_relu_maxpool_nchw": (lambda: build.conv_relu_maxpool(32, 16), "nchw", "tf32", {}),
    "vgg_stack_nchw": (lambda: build.vgg_stack(3, 64, 3, 32), "nchw", "tf32", {}),
    "vgg_stack_nhwc": (lambda: build.vgg_stack(3, 64, 3, 32), "nhwc", "tf32", {}),
    "vgg_stack_ieee": (lambda: build.vgg_stack(3, 64, 3, 32), "nhwc", "ieee", {}),
    "vgg_stack_tf32x3": (lambda: build.vgg_stack(3, 64, 3, 32), "nhwc", "tf32x3", {}),
    "vgg_stack_fp16": (lambda: lay.to_fp16(build.vgg_stack(3, 64, 3, 32)), "nhwc", "tf32", {}),
    "conv_relu_nchw_ieee": (lambda: build.conv_relu(128, 16), "nchw", "ieee", {}),
    "c2f": (lay.c2f, "nhwc", "tf32", {}),
    "c2f_nchw": (lay.c2f, "nchw", "tf32", {}),
    "sppf": (lay.sppf, "nhwc", "tf32", {}),
    "resnet_stem": (lay.resnet_stem, "nhwc", "tf32", {}),
    "residual": (lay.residual, "nhwc", "tf32", {}),
    "inverted_residual": (lay.inverted_residual, "nhwc", "tf32", {}),
    "inverted_residual_grouped": (lambda: lay.inverted_residual(group=3), "nhwc", "tf32", {}),
    "inverted_residual_fp16": (lambda: lay.to_fp16(lay.inverted_residual()), "nhwc", "tf32", {}),
    "squeeze_excite": (lay.squeeze_excite, "nhwc", "tf32", {}),
    "squeeze_excite_ieee": (lay.squeeze_excite, "nhwc", "ieee", {}),
    "grouped_gemm": (_grouped_gemm, "nhwc", "tf32", {}),
    "grouped_gemm_fp16": (lambda: lay.to_fp16(_grouped_gemm()), "nhwc", "tf32", {}),
    # the small-M variant and one-pixel convs at ieee (tests/test_conv_small_m.py): EfficientNet's
    # MBConv block at 14² (M = 196 at batch 1) and 7² (49), its SE FCs on one pixel
    "small_m_mbconv_14": (lambda: _mbconv_se(80, 480, 14), "nhwc", "tf32", {}),
    "small_m_mbconv_7": (lambda: _mbconv_se(32, 192, 7), "nhwc", "tf32", {}),
    "small_m_mbconv_7_ieee": (lambda: _mbconv_se(32, 192, 7), "nhwc", "ieee", {}),
    "small_m_mbconv_7_tf32x3": (lambda: _mbconv_se(32, 192, 7), "nhwc", "tf32x3", {}),
    "small_m_mbconv_7_fp16": (lambda: lay.to_fp16(_mbconv_se(32, 192, 7)), "nhwc", "tf32", {}),
    # GroupNorm (rows kind, reduction group_norm): SD-UNet's 40960-column rows (looped), fp16
    # with a dynamic batch (compiled for the row length), and a dynamic image size (the
    # single-pass variants by row length, then looped)
    "group_norm_torch_sd_looped": (lambda: _group_norm(TensorProto.FLOAT, [1, 320, 64, 64], 32, "torch"), "nchw",
                                   "tf32", {}),
    "group_norm_op_fp16": (lambda: _group_norm(TensorProto.FLOAT16, ["N", 64, 16, 16], 32, "op"), "nchw", "tf32",
                           {}),
    "group_norm_op_dynamic_size": (lambda: _group_norm(TensorProto.FLOAT, ["N", 32, "H", "W"], 8, "op"), "nhwc",
                                   "tf32", {}),
    "group_norm_between_convs_nhwc": (_group_norm_between_convs, "nhwc", "tf32", {}),
    "yolov8n_320": (_pretrained("yolov8n_320"), "nhwc", "tf32", {}),
    "ppocr_det": (_pretrained("ppocr_det"), "nhwc", "tf32", {}),
    "ppocr_det_nchw": (_pretrained("ppocr_det"), "nchw", "tf32", {}),
    "gemm_ffn_tf32": (_gemm_ffn, "nhwc", "tf32", {"env": GEMM_ENV}),
    "gemm_ffn_ieee": (_gemm_ffn, "nhwc", "ieee", {"env": GEMM_ENV}),
    "gemm_ffn_tf32x3": (_gemm_ffn, "nhwc", "tf32x3", {"env": GEMM_ENV}),
    # the Triton kernels of a 16-bit bias + GELU product (cuBLASLt's variant left out: it has no source)
    "gemm_ffn_fp16": (lambda: _gemm_ffn("float16"), "nhwc", "tf32",
                      {"env": {**GEMM_ENV, "ONNXFUSE_GEMM_LIBRARY": "0"}}),
    "gemm_small_m": (lambda: _gemm_ffn(s=4, k=256, n=64), "nhwc", "tf32", {"env": GEMM_ENV}),
    "gemm_mix": (_gemm_attention, "nhwc", "tf32", {"env": {**GEMM_ENV, "ONNXFUSE_GEMM_LIBRARY": "0"}}),
    "attention_bert_base_fp16": (lambda: _attention("bert"), "nhwc", "tf32", {}),
    "attention_gpt2_causal_ieee": (lambda: _attention("gpt2"), "nhwc", "ieee", {}),
    "attention_packed_nan_to_zero": (lambda: _attention("packed"), "nhwc", "tf32", {}),
}


def _golden() -> dict:
    return json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}


@pytest.mark.parametrize("case", list(CASES))
def test_generated_kernels_are_unchanged(case, monkeypatch, tmp_path):
    monkeypatch.setenv("ONNXFUSE_CACHE", str(tmp_path / "cache"))
    for var in ("ONNXFUSE_POINTWISE_CONFIG", "ONNXFUSE_CONV_CONFIG", "ONNXFUSE_POOL_CONFIG", "ONNXFUSE_CONV_ALL",
                "ONNXFUSE_GEMM_ALL", "ONNXFUSE_GEMM_LIBRARY"):
        monkeypatch.delenv(var, raising=False)
    builder, layout, precision, kw = CASES[case]
    kw = dict(kw)
    for var, value in kw.pop("env", {}).items():
        monkeypatch.setenv(var, value)
    got = kernel_records(builder(), monkeypatch, layout, precision, **kw)
    assert got, f"{case}: no kernels"
    if UPDATE:
        data = _golden()
        data[case] = got
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps(dict(sorted(data.items())), indent=1, sort_keys=True) + "\n")
        return
    want = _golden().get(case)
    assert want is not None, f"{case}: no golden record (ONNXFUSE_UPDATE_GOLDEN=1 writes it)"
    assert sorted(got) == sorted(want), f"{case}: the kernels written differ"
    for name in want:
        assert got[name] == want[name], f"{case}: kernel {name} changed"


def test_the_cases_cover_every_kernel_shape():
    """The golden set holds every kind and kernel shape this test is meant to pin."""
    kinds = set()
    for records in _golden().values():
        kinds.update(name.split("_")[1] for name in records)
    assert {"pointwise", "conv", "relu", "maxpool"} <= kinds, kinds
