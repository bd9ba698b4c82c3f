"""The one libcuda wrapper: the CUDA driver API through ctypes (no torch, no CUDA toolkit).

`CudaDriver` names a device and reads the memory in use in its primary context, the one
ONNX Runtime uses; `local_gpu_archs` lists the compute capabilities of the visible devices;
`pci_bus_id` gives a device's PCI bus id (the key NVML shares: `onnxfuse.tools.clocks`).
All answer "nothing" (None, []) on a machine without libcuda or a device.
"""

from __future__ import annotations

import ctypes

# CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR / _MINOR
_CC_MAJOR, _CC_MINOR = 75, 76


def _libcuda() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


class CudaDriver:
    """Device name and memory in use (cuMemGetInfo) in the device's primary context, the one
    ONNX Runtime uses. Every method returns None when libcuda is unavailable."""

    def __init__(self, device_id: int = 0):
        self.ok = False
        try:
            lib = _libcuda()
            if lib is None:
                return
            self.lib = lib
            self.dev = ctypes.c_int()
            self.ctx = ctypes.c_void_p()
            self._check(self.lib.cuInit(0))
            self._check(self.lib.cuDeviceGet(ctypes.byref(self.dev), device_id))
            self._check(self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(self.ctx), self.dev))
            self.ok = True
        except (OSError, AttributeError, RuntimeError):
            pass

    @staticmethod
    def _check(status: int) -> None:
        if status != 0:
            raise RuntimeError(f"CUDA driver error {status}")

    def name(self) -> str | None:
        if not self.ok:
            return None
        buf = ctypes.create_string_buffer(256)
        if self.lib.cuDeviceGetName(buf, 256, self.dev) != 0:
            return None
        return buf.value.decode(errors="replace")

    def used_bytes(self) -> int | None:
        if not self.ok:
            return None
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        old = ctypes.c_void_p()
        if self.lib.cuCtxPushCurrent_v2(self.ctx) != 0:
            return None
        try:
            if self.lib.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)) != 0:
                return None
        finally:
            self.lib.cuCtxPopCurrent_v2(ctypes.byref(old))
        return total.value - free.value

    def close(self) -> None:
        if self.ok:
            self.lib.cuDevicePrimaryCtxRelease_v2(self.dev)
            self.ok = False


def local_gpu_archs() -> list[int]:
    """Compute capabilities (major*10+minor) of the visible CUDA devices; [] without any."""
    cuda = _libcuda()
    if cuda is None:
        return []
    count, major, minor = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return []
    archs = set()
    for dev in range(count.value):
        if (cuda.cuDeviceGetAttribute(ctypes.byref(major), _CC_MAJOR, dev) == 0
                and cuda.cuDeviceGetAttribute(ctypes.byref(minor), _CC_MINOR, dev) == 0):
            archs.add(major.value * 10 + minor.value)
    return sorted(archs)


def pci_bus_id(device_id: int) -> bytes | None:
    """CUDA device `device_id`'s PCI bus id, the key NVML and CUDA share; None without one."""
    cuda = _libcuda()
    if cuda is None:
        return None
    try:
        dev, buf = ctypes.c_int(), ctypes.create_string_buffer(32)
        if (cuda.cuInit(0) != 0 or cuda.cuDeviceGet(ctypes.byref(dev), device_id) != 0
                or cuda.cuDeviceGetPCIBusId(buf, 32, dev) != 0):
            return None
        return buf.value
    except AttributeError:
        return None
