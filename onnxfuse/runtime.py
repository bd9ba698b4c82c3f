"""Run optimized models: ONNX Runtime sessions with the onnxfuse custom-op library.

    import onnxfuse
    sess = onnxfuse.InferenceSession("out.onnx")            # CUDA if available, else CPU
    sess.run(None, {"x": x})

The library (``libonnxfuse_ops.so``, see `onnxfuse.build`) implements the fused nodes
(``onnxfuse::PointwiseChain``, ``FusedConv``, ``FusedMaxPool``) for the CPU and CUDA execution
providers. A wheel ships it prebuilt (``onnxfuse/lib/``); a source install builds it on
first use and caches it; ``ONNXFUSE_LIBRARY`` points at another one instead.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

from onnxfuse import build as _build
from onnxfuse.errors import OnnxfuseError

_lock = threading.Lock()
_cached: str | None = None


def library_path(build: bool = True) -> str:
    """Path of the custom-op library for the current sources, building it if needed.

    In order: ``ONNXFUSE_LIBRARY``; the library a wheel ships (``onnxfuse/lib/``) when it was
    built from the package's sources as they are now; the one built on first use into the
    cache. With ``build=False`` an existing library is returned or OnnxfuseError is raised.
    """
    global _cached
    env = os.environ.get("ONNXFUSE_LIBRARY")
    if env:
        if not Path(env).is_file():
            raise OnnxfuseError(f"ONNXFUSE_LIBRARY={env} does not exist")
        return env
    with _lock:
        if _cached is not None and Path(_cached).is_file():
            return _cached
        path = _build.prebuilt_path()  # a wheel's, built from these sources
        if path is None and build:
            path = _build.build()
        elif path is None:
            path = _build.expected_path()
            if path is None or not path.is_file():
                raise OnnxfuseError("the onnxfuse custom-op library is not built: run `python -m onnxfuse.build`")
        _cached = str(path)
        return _cached


def session_options(sess_options: Any = None) -> Any:
    """SessionOptions with the onnxfuse library registered (a new one, or the one given)."""
    import onnxruntime as ort

    so = sess_options if sess_options is not None else ort.SessionOptions()
    so.register_custom_ops_library(library_path())
    return so


def default_providers() -> list[str]:
    """CUDA then CPU when this onnxruntime has the CUDA execution provider, else CPU."""
    import onnxruntime as ort

    available = ort.get_available_providers()
    if "CUDAExecutionProvider" in available:
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


def InferenceSession(path_or_bytes: Any, providers: Any = None, sess_options: Any = None, **kw: Any) -> Any:
    """onnxruntime.InferenceSession with the onnxfuse library registered.

    ``sess_options``, if given, gets the library registered into it (register a given
    SessionOptions object only once). ``providers`` defaults to `default_providers()`.
    Other keyword arguments go to onnxruntime.InferenceSession as they are.
    """
    import onnxruntime as ort

    if isinstance(path_or_bytes, os.PathLike):
        path_or_bytes = os.fspath(path_or_bytes)
    so = sess_options if sess_options is not None else ort.SessionOptions()
    try:
        so.register_custom_ops_library(library_path())
    except OnnxfuseError as e:
        _warn_no_library(str(e))
    return ort.InferenceSession(path_or_bytes, sess_options=so,
                                providers=providers if providers is not None else default_providers(), **kw)


_warned = False


def _warn_no_library(reason: str) -> None:
    """Once per process: the session runs without the library, so fused nodes run their
    ONNX function bodies (the original subgraphs): correct, but unfused and slower."""
    global _warned
    if not _warned:
        _warned = True
        import warnings

        warnings.warn(f"onnxfuse: custom-op library not available ({reason}); fused nodes run their ONNX "
                      "function bodies instead of the fused kernels", RuntimeWarning, stacklevel=3)
