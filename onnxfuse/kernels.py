"""Optimize-time kernel step: generate, compile and embed a Triton kernel per fused node."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

from onnxfuse.errors import OnnxfuseError


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def compile_hook(target: str, jobs: int | None = None) -> Callable:
    """A pipeline hook that compiles every fused node's kernel for `target` and attaches it.

    target: "auto" (the local GPU, else the default set; skipped with a note when Triton is
    not installed) or a list like "sm_90,sm_80" (an error when Triton is missing).
    """
    if target != "auto" and not triton_available():
        raise OnnxfuseError("--target needs Triton: pip install 'onnxfuse[compile]' (or use --target none)")

    def hook(result) -> dict:
        if not result.fused:
            return {"summary": "kernels: nothing to compile", "kernels": 0}
        if not triton_available():
            return {"summary": "kernels: not compiled (Triton is not installed); fused nodes run through "
                               "their function bodies or the CPU library", "kernels": 0}
        from onnxfuse import compile as aot

        targets = aot.default_targets() if target == "auto" else aot.parse_targets(target)
        return aot.compile_fused(result.model, result.fused, targets, jobs=jobs)

    return hook
