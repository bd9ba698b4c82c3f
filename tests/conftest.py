"""The `gpu` marker's skip: a test that needs an NVIDIA GPU is skipped where there is none.

    @pytest.mark.gpu                           # onnxruntime's CUDA EP and a CUDA device
    @pytest.mark.gpu(torch=True)               # those, and torch with CUDA
    @pytest.mark.gpu(ort=False, torch=True)    # torch with CUDA only (kernels launched without ORT)

Run them on the device machine with ``pytest -m gpu``.
"""

from __future__ import annotations

import functools

import pytest

from onnxfuse.tools.cuda import local_gpu_archs


@functools.cache
def cuda_provider() -> bool:
    """Whether onnxruntime has the CUDA execution provider."""
    try:
        import onnxruntime as ort
    except ImportError:
        return False
    return "CUDAExecutionProvider" in ort.get_available_providers()


@functools.cache
def cuda_device() -> bool:
    """Whether the CUDA driver sees a device."""
    return bool(local_gpu_archs())


@functools.cache
def torch_cuda() -> bool:
    """Whether torch is installed with CUDA and sees a device."""
    try:
        import torch
    except ImportError:
        return False
    try:
        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001 - a broken CUDA install is "no GPU" here
        return False


def gpu_skip_reason(ort: bool = True, torch: bool = False) -> str | None:
    """Why a test with these needs cannot run here, or None when it can."""
    if ort and not cuda_provider():
        return "onnxruntime without the CUDA execution provider"
    if ort and not cuda_device():
        return "no CUDA device"
    if torch and not torch_cuda():
        return "needs torch with a CUDA GPU"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        marker = item.get_closest_marker("gpu")
        if marker is None:
            continue
        reason = gpu_skip_reason(**marker.kwargs)
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))
