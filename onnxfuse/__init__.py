"""onnxfuse: fuse memory-bound ONNX subgraphs into Triton kernels run by ONNX Runtime."""

from onnxfuse.errors import OnnxfuseError, PatternError
from onnxfuse.pattern import Pattern, load_patterns
from onnxfuse.pipeline import Report, Result, optimize, optimize_model
from onnxfuse.version import __version__

__all__ = [
    "OnnxfuseError", "PatternError", "Pattern", "Report", "Result", "load_patterns", "optimize",
    "optimize_model", "InferenceSession", "library_path", "__version__",
]


def __getattr__(name: str):
    # The runtime pulls in onnxruntime; import it only when asked for.
    if name in ("InferenceSession", "library_path", "session_options"):
        from onnxfuse import runtime

        return getattr(runtime, name)
    raise AttributeError(f"module 'onnxfuse' has no attribute {name!r}")
