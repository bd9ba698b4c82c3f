"""`onnxfuse optimize --tune`: measured fusion decisions, on a machine with a GPU.

For every fused node, at the model's shapes (graph inputs fixed by --shape / --batch):
1. a one-node model holding the fused node and its function, and the same model with the
   node turned back into its original subgraph (`onnxfuse.rewrite.unfuse`);
2. each candidate kernel configuration (`candidates`: tile sizes for conv kernels, block
   sizes for max-pool kernels, the default launch for pointwise kernels) is compiled for
   the local GPU, attached, and timed in ONNX Runtime's CUDA execution provider (IO
   binding, median of `iters` runs, `onnxfuse.bench.run_model`); so is the original;
3. the fastest candidate's kernel is kept; when the original subgraph is faster than every
   candidate, the node is unfused.

The report lists every time (`Report.compile["tune"]`). With `--layout nhwc` a node's
original subgraph includes the Transposes of its function body, which favours the fused
kernel; tune NCHW models for a fair comparison. Without a GPU (or without
onnxruntime-gpu) --tune is an error; the default configurations then come from the
heuristics in `onnxfuse.compile.conv_variants` / `pool_variants` / `choose_variants`.
"""

from __future__ import annotations

import dataclasses
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import ModelProto, helper

from onnxfuse.errors import OnnxfuseError

ITERS, WARMUP = 30, 5
REASON = "the original subgraph was faster on this GPU (--tune)"


@dataclass
class TuneRecord:
    node: str
    kind: str
    original_ms: float
    candidates: list[dict] = field(default_factory=list)  # {"config": str, "ms": float} or {"error"}
    chosen: str = ""  # the chosen config, or "original"


def candidates(spec) -> list[tuple[str, tuple]]:
    """(label, variants) per candidate configuration of a kernel spec."""
    from onnxfuse import compile as aot
    from onnxfuse.codegen_conv import ConvVariant

    if isinstance(spec, aot.ConvSpec):
        base = aot.conv_variants(spec)[0]
        if spec.conv.group != 1:  # the direct loop: the runners-up of conv_kernels_depthwise.json
            tiles = [base] + [dataclasses.replace(base, block_m=bm, block_n=bn, num_warps=w)
                              for bm, bn, w in ((128, 16, 4), (16, 64, 2), (64, 32, 4), (32, 128, 4), (128, 32, 8))]
        elif base.flat:  # the runners-up of the flat-reduction sweep (conv_kernels_flat_*.json)
            tiles = [base, dataclasses.replace(base, block_m=256, num_warps=8),
                     dataclasses.replace(base, block_k=16, num_stages=3),
                     dataclasses.replace(base, block_m=64, num_warps=2, num_stages=3)]
        elif base.num_warps >= 4:  # channels-last wgmma tiles: that sweep's runners-up
            tiles = [base, dataclasses.replace(base, num_stages=4),
                     dataclasses.replace(base, block_m=64 if base.block_m == 128 else 128,
                                         block_n=128 if base.block_n == 64 else 64),
                     dataclasses.replace(base, block_m=128, block_n=128),
                     dataclasses.replace(base, block_m=64, block_n=64, block_k=64)]
        else:
            tiles = [base, dataclasses.replace(base, block_m=128, num_warps=4),
                     dataclasses.replace(base, block_m=32, num_stages=4),
                     dataclasses.replace(base, block_k=16, num_stages=4),
                     dataclasses.replace(base, block_n=128 if base.block_n == 64 else 64, num_warps=4)]
        out, seen = [], set()
        win = 1 << (spec.pool.kernel[0] * spec.pool.kernel[1] - 1).bit_length() if spec.pool else 1
        for v in tiles:
            v = ConvVariant(0, max(v.block_m, win), v.block_n, v.block_k, v.num_warps, v.num_stages, v.flat)
            key = (v.block_m, v.block_n, v.block_k, v.num_warps, v.num_stages)
            if key not in seen:
                seen.add(key)
                label = ("tile {}x{}x{}, {} warps, {} stages".format(*key) + (", flat" if v.flat else "")
                         if spec.conv.group == 1 else f"tile {v.block_m}x{v.block_n}, {v.num_warps} warps, direct")
                # with the candidate's split-K variant, which the launcher takes for small outputs
                split = aot.split_variant(spec, v)
                out.append((label, (v,) if split is None else (v, split)))
        return out
    if isinstance(spec, aot.MaxPoolSpec):  # the kernel kind the heuristic picks, its sweep's runners-up
        base = aot.pool_variants(spec)[-1]  # the heuristic's tile for any size
        if base.tile == "nhwc":  # pool_nhwc_aot.json
            tiles = [dataclasses.replace(base, block_p=p, block_c=c, num_warps=w)
                     for p, c, w in ((4, 64, 1), (2, 64, 1), (8, 64, 1), (2, 128, 1), (4, 128, 2), (32, 64, 4))]
            label = "tile {0.block_p}x{0.block_c}, {0.num_warps} warps, nhwc"
        elif base.tile == "rows":  # relu_maxpool_tiles.json
            tiles = [dataclasses.replace(base, block_oh=h, block_ow=w, num_warps=nw)
                     for h, w, nw in ((4, 64, 4), (8, 64, 4), (8, 32, 4), (16, 64, 8))]
            label = "tile {0.block_oh}x{0.block_ow}, {0.num_warps} warps, rows"
        else:
            tiles = [dataclasses.replace(base, block=b, num_warps=4) for b in (256, 512, 1024)]
            label = "block {0.block}"
        tiles = [base] + [t for t in tiles if t != base]
        return [(label.format(t), aot.with_size_variants(spec, t)) for t in tiles]  # each as it ships
    return [("default", aot.choose_variants(spec))]


def fix_shapes(model: ModelProto, shapes: dict[str, tuple[int, ...]], batch: int | None) -> dict[str, tuple]:
    """Concrete dims for every graph input: `shapes` by input name, else `batch` for a
    symbolic first dim. Raises OnnxfuseError naming what is missing."""
    out = {}
    inits = {t.name for t in model.graph.initializer}
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        if vi.name in shapes:
            out[vi.name] = tuple(shapes[vi.name])
            continue
        dims = []
        for k, d in enumerate(vi.type.tensor_type.shape.dim):
            if d.HasField("dim_value"):
                dims.append(d.dim_value)
            elif k == 0 and batch is not None:
                dims.append(batch)
            else:
                raise OnnxfuseError(f"--tune needs the shape of input {vi.name!r}: give --shape {vi.name}=D0,D1,... "
                                    "or --batch N")
        out[vi.name] = tuple(dims)
    return out


def _inferred(model: ModelProto, dims: dict[str, tuple]) -> dict[str, onnx.ValueInfoProto]:
    m = ModelProto()
    m.CopyFrom(model)
    for vi in m.graph.input:
        if vi.name in dims:
            shape = vi.type.tensor_type.shape
            del shape.dim[:]
            for d in dims[vi.name]:
                shape.dim.add().dim_value = d
    del m.graph.value_info[:]
    inf = onnx.shape_inference.infer_shapes(m, strict_mode=False)
    return {v.name: v for v in list(inf.graph.input) + list(inf.graph.value_info) + list(inf.graph.output)}


def _one_node_model(model: ModelProto, node: onnx.NodeProto, infos: dict) -> ModelProto:
    inits = {t.name: t for t in model.graph.initializer}
    key = (node.domain, node.op_type, node.overload)
    fn = [f for f in model.functions if (f.domain, f.name, f.overload) == key]
    inputs, consts = [], []
    for name in dict.fromkeys(x for x in node.input if x):
        if name in inits:
            consts.append(inits[name])
        elif name in infos and _static(infos[name]):
            inputs.append(infos[name])
        else:
            raise OnnxfuseError(f"--tune: no static shape for {name!r} (input of {node.name})")
    outputs = []
    for name in node.output:
        if name not in infos:
            raise OnnxfuseError(f"--tune: no type for {name!r} (output of {node.name})")
        outputs.append(infos[name])
    g = helper.make_graph([node], "tune_" + node.name, inputs, outputs, consts)
    m = helper.make_model(g, opset_imports=list(model.opset_import), functions=fn)
    m.ir_version = model.ir_version
    return m


def _static(vi: onnx.ValueInfoProto) -> bool:
    t = vi.type.tensor_type
    return t.HasField("shape") and all(d.HasField("dim_value") for d in t.shape.dim)


def _feeds(m: ModelProto, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    feeds = {}
    for vi in m.graph.input:
        t = vi.type.tensor_type
        dt = onnx.helper.tensor_dtype_to_np_dtype(t.elem_type)
        shape = [d.dim_value for d in t.shape.dim]
        feeds[vi.name] = (rng.random(shape) < 0.5) if dt == np.bool_ else rng.standard_normal(shape).astype(dt)
    return feeds


def _time(m: ModelProto, feeds, folder: Path, tag: str, library: bool) -> float:
    from onnxfuse.bench import BenchSettings, run_model

    path = folder / f"{tag}.onnx"
    onnx.save(m, str(path))
    run = run_model(str(path), feeds, BenchSettings(provider="cuda", warmup=WARMUP, iters=ITERS, tf32=True),
                    library=library)
    return float(np.median(run.times_ms))


def tune(result, targets: list[int], dims: dict[str, tuple], conv_precision: str = "tf32",
         jobs: int | None = None) -> list[TuneRecord]:
    """Time every fused node of `result` (an `onnxfuse.pipeline.Result` whose kernels are
    compiled) against its original subgraph and its candidate configurations; keep the
    fastest. Mutates result.model / result.fused; returns one record per node."""
    import onnxruntime as ort

    from onnxfuse import compile as aot
    from onnxfuse.kernels import kernel_spec
    from onnxfuse.rewrite import unfuse

    if "CUDAExecutionProvider" not in ort.get_available_providers() or not aot.local_gpu_archs():
        raise OnnxfuseError("--tune needs an NVIDIA GPU and onnxruntime-gpu (CUDA execution provider)")
    infos = _inferred(result.model, dims)
    records: list[TuneRecord] = []
    slower: set[str] = set()
    with tempfile.TemporaryDirectory(prefix="onnxfuse-tune-") as tmp:
        folder = Path(tmp)
        for f in list(result.fused):
            nodes = {n.name: n for n in result.model.graph.node}
            node = nodes[f.node_name]
            mini = _one_node_model(result.model, node, infos)
            feeds = _feeds(mini, 0)
            original = ModelProto()
            original.CopyFrom(mini)
            unfuse(original, f)
            rec = TuneRecord(f.node_name, f.kind, _time(original, feeds, folder, "original", library=False))
            spec = kernel_spec(result.model, f, conv_precision)
            best = None
            for label, variants in candidates(spec):
                try:
                    (ck,) = aot.compile_kernels([spec], targets, jobs=jobs, variant_override=variants)
                    trial = ModelProto()
                    trial.CopyFrom(mini)
                    aot.attach(trial.graph.node[0], ck)
                    ms = _time(trial, feeds, folder, "fused", library=True)
                    rec.candidates.append({"config": label, "ms": ms})
                    if best is None or ms < best[0]:
                        best = (ms, label, ck)
                except Exception as e:  # a configuration that does not compile or run is skipped
                    rec.candidates.append({"config": label, "error": str(e).splitlines()[0][:200]})
            if best is None or best[0] >= rec.original_ms:
                rec.chosen = "original"
                unfuse(result.model, f)
                slower.add(f.node_name)
            else:
                rec.chosen = best[1]
                aot.attach({n.name: n for n in result.model.graph.node}[f.node_name], best[2])
            records.append(rec)
    if slower:
        result.drop_fused(slower, REASON)
    return records


def summary(records: list[TuneRecord]) -> str:
    lines = ["tune (median ms, original subgraph vs the fused kernel's configurations):"]
    for r in records:
        times = ", ".join(f"{c['config']}: {c['ms']:.4f}" if "ms" in c else f"{c['config']}: failed"
                          for c in r.candidates)
        lines.append(f"  {r.node}: original {r.original_ms:.4f}; {times} -> {r.chosen}")
    return "\n".join(lines)
