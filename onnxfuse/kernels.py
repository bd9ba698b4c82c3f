"""Optimize-time kernel step: generate, compile and embed a Triton kernel per fused node."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

from onnx import numpy_helper

from onnxfuse import compile as aot
from onnxfuse import rounding
from onnxfuse import tune as tuning
from onnxfuse.codegen_conv import ConvSpec, prerounds_weights, round_array_to_tf32
from onnxfuse.errors import OnnxfuseError
from onnxfuse.layout import apply_layouts
from onnxfuse.rewrite import unfuse
from onnxfuse.specs import kernel_spec


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


TUNE_MODES = ("auto", "off", "configs")


def configure(target: str = "auto", layout: str = "auto", conv_precision: str = "tf32", tune: str = "auto",
              shapes: dict | None = None, batch: int | None = None, tune_budget: float | None = None,
              jobs: int | None = None) -> tuple[Callable | None, str]:
    """The compile hook and layout `onnxfuse optimize` uses, from its options; the command
    line and `onnxfuse.optimize` both call this, so they have the same defaults.

    target: "auto" (the local GPU, else the default set), "none" (no kernels: the function
    bodies and the CPU library run the fused nodes) or a list like "sm_90,sm_80". layout:
    "auto" is "nhwc" when kernels are compiled and Triton is installed, else "nchw". tune:
    "auto" (measure when this machine has an NVIDIA GPU and onnxruntime-gpu and kernels are
    compiled), "off", or "configs" (also search kernel configurations; an error where it
    cannot run). shapes / batch: where tuning measures (as --shape / --batch).
    Returns (hook or None, layout)."""
    if layout not in ("auto", "nchw", "nhwc"):
        raise OnnxfuseError(f"--layout {layout}: choose auto, nchw or nhwc")
    if tune not in TUNE_MODES:
        raise OnnxfuseError(f"tune={tune!r}: choose one of {', '.join(TUNE_MODES)}")
    if tune_budget is not None and not tune_budget > 0:
        raise OnnxfuseError("--tune-budget must be a positive number of seconds")
    if batch is not None and batch < 1:
        raise OnnxfuseError("--batch must be at least 1")
    if layout == "nhwc" and target == "none":
        raise OnnxfuseError("--layout nhwc is for the GPU kernels: it cannot be combined with --target none")
    if layout == "nhwc" and not triton_available():
        raise OnnxfuseError("--layout nhwc runs with the compiled GPU kernels and needs Triton: "
                            "pip install 'onnxfuse[compile]'")
    # auto: nhwc when kernels are compiled (the NHWC pass runs with them); without Triton the
    # compile step does nothing
    if layout == "auto":
        layout = "nhwc" if target != "none" and triton_available() else "nchw"
    settings = None
    if tune == "configs":
        if target == "none":
            raise OnnxfuseError("--tune times compiled kernels: it cannot be combined with --target none")
        if not tuning.available():
            raise OnnxfuseError("--tune needs an NVIDIA GPU and onnxruntime-gpu (CUDA execution provider)")
    if tune == "configs" or (tune == "auto" and target != "none" and tuning.available()):
        settings = tuning.TuneSettings(shapes=dict(shapes or {}), batch=batch, configs=tune == "configs",
                                       explicit=tune == "configs", budget_s=tune_budget or tuning.BUDGET_S)
    if target == "none":
        return None, layout
    return compile_hook(target, jobs=jobs, conv_precision=conv_precision, tune=settings, layout=layout), layout


def compile_hook(target: str, jobs: int | None = None, conv_precision: str = "tf32",
                 tune=None, layout: str = "nchw") -> Callable:
    """A pipeline hook that compiles every fused node's kernel for `target` and attaches it.

    target: "auto" (the local GPU, else the default set; skipped with a note when Triton is
    not installed) or a list like "sm_90,sm_80" (an error when Triton is missing).
    tune: an `onnxfuse.tune.TuneSettings` to measure on the local GPU which fused nodes to
    keep and whether the optimized model beats the original (`onnxfuse.tune`), or None.
    A tuning that cannot run (no GPU, a model that does not run at the shapes) is an error
    when the settings are `explicit` (--tune), else a warning and the heuristics decide.
    """
    if target != "auto" and not triton_available():
        raise OnnxfuseError("--target needs Triton: pip install 'onnxfuse[compile]' (or use --target none)")

    def hook(result) -> dict:
        if not result.fused:
            return {"summary": "kernels: nothing to compile", "kernels": 0}
        if not triton_available():
            return {"summary": "kernels: not compiled (Triton is not installed); fused nodes run through "
                               "their function bodies or the CPU library", "kernels": 0}
        targets = aot.default_targets() if target == "auto" else aot.parse_targets(target)

        # with --tune (configs) the measurements decide which convs cuDNN keeps
        decline = tune is None or not tune.configs

        def build(res) -> dict:
            return _compile(res, targets, jobs, conv_precision, layout, decline_slow_convs=decline)

        if tune is None:
            return build(result)

        def build_precise(res) -> dict:  # tried when the tf32 convs fail the accuracy gate
            return _compile(res, targets, jobs, tuning.PRECISE, layout, decline_slow_convs=decline)

        before = tuning.snapshot(result)
        info = build(result)
        try:
            return tuning.tune(result, before, info, build, tune, targets, conv_precision=conv_precision, jobs=jobs,
                               recompile_precise=build_precise if conv_precision == "tf32" else None)
        except Exception as e:  # measuring must not lose the optimized model: the heuristics decide
            why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            if not isinstance(e, OnnxfuseError):
                why = f"{type(e).__name__}: {why}"
            if tune.explicit:
                raise OnnxfuseError(f"--tune: {why}") from None
            result.warn(f"not tuned: {why}")
            return info

    hook.layout = layout  # `onnxfuse.optimize` picks its patterns for the same layout
    return hook


def _compile(result, targets: list[int], jobs: int | None, conv_precision: str, layout: str,
             decline_slow_convs: bool) -> dict:
    """Compile (and lay out) the fused nodes of a pipeline Result; its report follows."""
    info = compile_fused(result.model, result.fused, targets, jobs=jobs, conv_precision=conv_precision,
                         tensors=result.tensors, decline_slow_convs=decline_slow_convs, layout=layout)
    kernels = {f.node_name: f.kernel_name for f in result.fused}
    for rec in result.report.fused:  # the NHWC pass renames kernels
        rec.kernel = kernels.get(rec.node, rec.kernel)
    result.report.nodes_after = len(result.model.graph.node)  # and adds boundary Transposes
    for reason in dict.fromkeys(d["reason"] for d in info["declined"]):
        result.drop_fused({d["node"] for d in info["declined"] if d["reason"] == reason}, reason)
    if info["failed"]:
        result.drop_fused({f["node"] for f in info["failed"]}, FAILED_REASON)
        for f in info["failed"]:
            result.warn(failure_warning(f))
    return info


def _plan_rounding(model, fused: list, specs: list, caller: list, conv_precision: str, weight_dims: dict):
    """TF32 rounding at the producer (`onnxfuse.rounding`): the fused convs whose readers all
    round their activations store Y rounded, and those that read only such tensors skip their
    own rounding. Renames their kernels; the FusedNode values in `caller` follow."""
    convs = [(f, s) for f, s in zip(fused, specs, strict=True) if isinstance(s, ConvSpec)]
    # the shipped kernels (weights rounded when packed, activations in the kernel); the
    # benchmarks' other modes of codegen_conv._ROUND_TF32 keep their kernels as they are
    rounds = {f.node_name for f, s in convs if prerounds_weights(s)}
    may_store = {f.node_name for f, s in convs if s.dtype == "f32" and s.precision == "tf32"
                 and s.program.outputs[0][1] == "f32"}
    if not rounds and not any(f.x_rounded or f.round_y for f in fused):
        return fused, specs
    new = rounding.apply(model, fused, rounding.plan(model, rounds, may_store))
    changed = {f.node_name: f for f, g in zip(new, fused, strict=True) if f is not g}
    if not changed:
        return fused, specs
    caller[:] = [changed.get(f.node_name, f) for f in caller]
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
                  tensors: dict | None = None) -> dict:
    """Compile the kernel of every fused node of `model` for `targets` and attach it to the
    node; returns the compile part of the report.

    A fused node whose kernel fails to compile for any target is turned back into its
    original nodes (`onnxfuse.rewrite.unfuse`): a node without kernels would fail on CUDA at
    run time. It is listed under "failed" (node, kernel, targets, error, nodes); the
    caller updates its report (see `compile_hook`).

    With decline_slow_convs, conv nodes the heuristic of `onnxfuse.compile.conv_decline_reason`
    expects to be slower than cuDNN are unfused too, listed under "declined" with the reason:
    grouped convs with wide groups, and on layout "nchw" deep convs. With layout "nhwc" the
    NHWC pass (`onnxfuse.layout`) runs next (its channels-last kernels were as fast as
    cuDNN's channels-last convs or faster on every layer measured, BENCHMARKS.md), at
    conv_precision (with ieee or tf32x3 it keeps GlobalAveragePools, whose channels-last
    MatMul ONNX Runtime would run in TF32); the
    FusedNode values in `fused` whose kernel names, inputs and layouts it changes are
    replaced in place; `tensors` (`Result.tensors`) gives it the shapes inferred while
    optimizing."""
    if layout not in ("nchw", "nhwc"):
        raise OnnxfuseError(f"--layout {layout}: choose nchw or nhwc")
    caller = fused
    weight_dims = {t.name: tuple(t.dims) for t in model.graph.initializer}
    declined = []
    if decline_slow_convs:
        keep = []
        for f in fused:
            reason = None
            if f.kind == "conv":
                reason = aot.conv_decline_reason(kernel_spec(model, f, conv_precision, weight_dims), layout)
            if reason:
                unfuse(model, f)
                declined.append({"node": f.node_name, "kernel": f.kernel_name, "nodes": len(f.source_nodes),
                                 "reason": reason})
            else:
                keep.append(f)
        fused = keep
    if layout == "nhwc":
        fused = apply_layouts(model, fused, tensors, conv_precision)
        changed = {f.node_name: f for f in fused}
        caller[:] = [changed.get(f.node_name, f) for f in caller]
        weight_dims = {t.name: tuple(t.dims) for t in model.graph.initializer}  # repacked weights
    specs = [kernel_spec(model, f, conv_precision, weight_dims) for f in fused]
    fused, specs = _plan_rounding(model, fused, specs, caller, conv_precision, weight_dims)
    results = aot.compile_kernels(specs, targets, jobs=jobs, errors="collect")
    failed = []
    while bad := {i for i, ck in enumerate(results) if isinstance(ck, aot.CompileFailure)}:
        for i in sorted(bad):
            f, ck = fused[i], results[i]
            unfuse(model, f)
            failed.append({"node": f.node_name, "kernel": f.kernel_name, "targets": list(ck.targets),
                           "error": ck.message, "nodes": len(f.source_nodes)})
        keep = [i for i in range(len(fused)) if i not in bad]
        fused, specs, results = [fused[i] for i in keep], [specs[i] for i in keep], [results[i] for i in keep]
        # a conv that went back to ONNX Runtime no longer stores rounded values (nor rounds what
        # it reads): plan again and compile the kernels whose flags change
        new, specs = _plan_rounding(model, fused, specs, caller, conv_precision, weight_dims)
        redo = [i for i, (a, b) in enumerate(zip(new, fused, strict=True)) if a is not b]
        fused = new
        for i, ck in zip(redo, aot.compile_kernels([specs[i] for i in redo], targets, jobs=jobs, errors="collect")
                         if redo else [], strict=True):
            results[i] = ck
    nodes = {n.name: n for n in model.graph.node}  # after unfuse, which rebuilds the node list
    compiled = list(results)
    rounded: set[str] = set()
    for f, spec, ck in zip(fused, specs, results, strict=True):
        aot.attach(nodes[f.node_name], ck)
        if isinstance(spec, aot.ConvSpec) and prerounds_weights(spec):
            rounded.add(f.inputs[1])
    _round_weights(model, rounded)
    seconds = sum(c.compile_seconds for c in compiled)
    hits = sum(c.cache_hits for c in compiled)
    built = sum(c.compiled for c in compiled)
    names = ",".join(f"sm_{t}" for t in targets)
    summary = f"kernels: {len(compiled)} for {names}: {built} compiled in {seconds:.1f} s, {hits} cache hits"
    if failed:
        summary += f", {len(failed)} failed (left unfused)"
    if declined:
        summary += f"; {len(declined)} convs left to cuDNN (" + "; ".join(
            f"{sum(d['reason'] == r for d in declined)}: {r.split(':')[0]}"
            for r in dict.fromkeys(d["reason"] for d in declined)) + ")"
    return {
        "summary": summary, "kernels": len(compiled), "targets": list(targets), "compile_seconds": seconds,
        "cache_hits": hits, "compiled": built, "failed": failed, "declined": declined,
    }
