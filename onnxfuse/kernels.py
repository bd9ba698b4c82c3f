"""The compile pass's work (`onnxfuse.pipeline.compile_pass`): generate, compile and embed a
Triton kernel per fused node."""

from __future__ import annotations

import importlib.util

from onnx import numpy_helper

from onnxfuse import compile as aot
from onnxfuse import rounding
from onnxfuse.codegen_conv import round_array_to_tf32
from onnxfuse.errors import OnnxfuseError
from onnxfuse.kinds import KINDS
from onnxfuse.layout import apply_layouts
from onnxfuse.rewrite import unfuse_all
from onnxfuse.specs import kernel_spec


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def _plan_rounding(model, fused: list, specs: list, conv_precision: str, weight_dims: dict):
    """TF32 rounding at the producer (`onnxfuse.rounding`): the fused convs whose readers all
    round their activations store Y rounded, and those that read only such tensors skip their
    own rounding. Renames their kernels: returns the FusedNode values and specs, changed
    where they were."""
    pairs = list(zip(fused, specs, strict=True))
    # the shipped kernels (weights rounded when packed, activations in the kernel); the
    # benchmarks' other modes of codegen_conv._ROUND_TF32 keep their kernels as they are
    rounds = {f.node_name for f, s in pairs if KINDS[f.kind].reads_tf32(s)}
    may_store = {f.node_name for f, s in pairs if KINDS[f.kind].may_store_tf32(s)}
    if not rounds and not any(f.x_rounded or f.round_y for f in fused):
        return fused, specs
    new = rounding.apply(model, fused, rounding.plan(model, rounds, may_store))
    changed = {f.node_name: f for f, g in zip(new, fused, strict=True) if f is not g}
    if not changed:
        return fused, specs
    specs = [kernel_spec(model, f, conv_precision, weight_dims) if f.node_name in changed else s
             for f, s in zip(new, specs, strict=True)]
    return new, specs


def _round_weights(model, names: set[str]) -> None:
    """Round the packed conv weights `names` to TF32 in place: the "tf32" kernels read them
    rounded (`onnxfuse.codegen_conv.prerounds_weights`). The node's function body reads them
    too: under ONNX Runtime's CUDA defaults (TF32) its Conv rounds them anyway, so nothing
    changes there; elsewhere it computes with weights 2**-11 (relative) from the original's
    at most (README, "Reliability")."""
    for t in model.graph.initializer:
        if t.name in names:
            t.CopyFrom(numpy_helper.from_array(round_array_to_tf32(numpy_helper.to_array(t)), t.name))


FAILED_REASON = "kernel failed to compile (left unfused)"


def failure_warning(f: dict) -> str:
    first = next((ln for ln in f["error"].splitlines() if ln.strip()), "no error message")
    archs = ",".join(f"sm_{a}" for a in f["targets"])
    return (f"the kernel of fused node {f['node']} failed to compile for {archs} ({first}); its "
            f"{f['nodes']} original nodes are kept instead")


def compile_fused(model, fused: list, targets: list[int], jobs: int | None = None,
                  conv_precision: str = "tf32", decline_slow_convs: bool = True, layout: str = "nchw",
                  tensors: dict | None = None) -> tuple[dict, list]:
    """Compile the kernel of every fused node of `model` for `targets` and attach it to the
    node; returns the compile part of the report, and `fused` with the FusedNode values that
    the NHWC pass and TF32 rounding changed (new kernel names, inputs, layouts) replaced, in
    the same order (declined and failed nodes included: the caller drops them from its list,
    `onnxfuse.pipeline.compile_result`).

    A fused node whose kernel fails to compile for any target is turned back into its
    original nodes (`onnxfuse.rewrite.unfuse_all`): a node without kernels would fail on CUDA at
    run time. It is listed under "failed" (node, kernel, targets, error, nodes); the
    caller updates its report.

    With decline_slow_convs, nodes that their kind's heuristic expects to be slower than
    ONNX Runtime (`onnxfuse.kinds.base.Kind.decline_reason`; for convs, cuDNN:
    `onnxfuse.kinds.conv.conv_decline_reason`) are unfused too, listed under "declined"
    with the reason: grouped convs with wide groups, and on layout "nchw" deep convs. With layout "nhwc" the
    NHWC pass (`onnxfuse.layout`) runs next (its channels-last kernels were as fast as
    cuDNN's channels-last convs or faster on every layer measured, BENCHMARKS.md), at
    conv_precision (with ieee or tf32x3 it keeps GlobalAveragePools, whose channels-last
    MatMul ONNX Runtime would run in TF32); `tensors` (`onnxfuse.pipeline.Result.shapes`)
    gives it the shapes inferred while optimizing."""
    if layout not in ("nchw", "nhwc"):
        raise OnnxfuseError(f"--layout {layout}: choose nchw or nhwc")
    everything = list(fused)  # what the caller gets back, changed nodes replaced
    weight_dims = {t.name: tuple(t.dims) for t in model.graph.initializer}
    declined = []
    if decline_slow_convs:
        keep, back = [], []
        for f in fused:
            reason = KINDS[f.kind].decline_reason(kernel_spec(model, f, conv_precision, weight_dims), layout)
            if reason:
                back.append(f)
                declined.append({"node": f.node_name, "kernel": f.kernel_name, "nodes": len(f.source_nodes),
                                 "reason": reason})
            else:
                keep.append(f)
        unfuse_all(model, back)
        fused = keep
    if layout == "nhwc":
        fused = apply_layouts(model, fused, tensors, conv_precision)
        everything = _replaced(everything, fused)
        weight_dims = {t.name: tuple(t.dims) for t in model.graph.initializer}  # repacked weights
    specs = [kernel_spec(model, f, conv_precision, weight_dims) for f in fused]
    fused, specs = _plan_rounding(model, fused, specs, conv_precision, weight_dims)
    everything = _replaced(everything, fused)
    results = aot.compile_kernels(specs, targets, jobs=jobs, errors="collect")
    failed = []
    while bad := {i for i, ck in enumerate(results) if isinstance(ck, aot.CompileFailure)}:
        unfuse_all(model, [fused[i] for i in sorted(bad)])
        for i in sorted(bad):
            f, ck = fused[i], results[i]
            failed.append({"node": f.node_name, "kernel": f.kernel_name, "targets": list(ck.targets),
                           "error": ck.message, "nodes": len(f.source_nodes)})
        keep = [i for i in range(len(fused)) if i not in bad]
        fused, specs, results = [fused[i] for i in keep], [specs[i] for i in keep], [results[i] for i in keep]
        # a conv that went back to ONNX Runtime no longer stores rounded values (nor rounds what
        # it reads): plan again and compile the kernels whose flags change
        new, specs = _plan_rounding(model, fused, specs, conv_precision, weight_dims)
        redo = [i for i, (a, b) in enumerate(zip(new, fused, strict=True)) if a is not b]
        fused = new
        everything = _replaced(everything, fused)
        for i, ck in zip(redo, aot.compile_kernels([specs[i] for i in redo], targets, jobs=jobs, errors="collect")
                         if redo else [], strict=True):
            results[i] = ck
    nodes = {n.name: n for n in model.graph.node}  # after unfuse, which rebuilds the node list
    compiled = list(results)
    rounded: set[str] = set()
    for f, spec, ck in zip(fused, specs, results, strict=True):
        aot.attach(nodes[f.node_name], ck)
        rounded.update(KINDS[f.kind].tf32_initializers(f, spec))
    _round_weights(model, rounded)
    seconds = sum(c.compile_seconds for c in compiled)
    hits = sum(c.cache_hits for c in compiled)
    built = sum(c.compiled for c in compiled)
    names = ",".join(f"sm_{t}" for t in targets)
    summary = f"kernels: {len(compiled)} for {names}: {built} compiled in {seconds:.1f} s, {hits} cache hits"
    # GemmEpilogue nodes whose first variant is cuBLASLt's product with its own epilogue
    library = sum(1 for c in compiled if c.variants and getattr(c.variants[0], "library", None) is not None)
    if library:
        summary += f"; {library} run cuBLASLt's product and epilogue first (Triton where it declines)"
    if failed:
        summary += f", {len(failed)} failed (left unfused)"
    if declined:
        summary += f"; {len(declined)} convs left to cuDNN (" + "; ".join(
            f"{sum(d['reason'] == r for d in declined)}: {r.split(':')[0]}"
            for r in dict.fromkeys(d["reason"] for d in declined)) + ")"
    return {
        "summary": summary, "kernels": len(compiled), "targets": list(targets), "compile_seconds": seconds,
        "cache_hits": hits, "compiled": built, "failed": failed, "declined": declined, "library": library,
    }, everything


def _replaced(everything: list, changed: list) -> list:
    """`everything` with the FusedNode values of the same node names in `changed`."""
    by_name = {f.node_name: f for f in changed}
    return [by_name.get(f.node_name, f) for f in everything]
