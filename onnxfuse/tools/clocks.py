"""What the GPU's clocks did while something was timed: NVML through ctypes (no pynvml).

A timing under a millisecond depends on the clock the GPU happens to run at, and that
differs between runs on one machine (the thirty-ninth session saw the same models differ by
up to 39% between calls of one lease). `ClockWatch` samples the SM and memory clocks and
the reasons NVML gives for holding them down, on a thread, while a block runs:

    with ClockWatch() as watch:
        ...timed runs...
    watch.result    # Clocks, or None without NVML or a device

so a benchmark can print the clocks beside its times and a reader can tell a slow run from
a slow model. It reads only; it never sets a clock.
"""

from __future__ import annotations

import ctypes
import os
import statistics
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass

from onnxfuse.tools.cuda import pci_bus_id

# nvmlClockType_t
_SM, _MEM = 1, 2
# nvmlClocksEventReasons bits (the names NVML's header gives them), idle and the
# setting-of-applications bits left out: they say nothing about a slow run
REASONS = {0x4: "sw_power_cap", 0x8: "hw_slowdown", 0x20: "sw_thermal", 0x40: "hw_thermal",
           0x80: "hw_power_brake"}


@dataclass(frozen=True)
class Sample:
    sm_mhz: int
    mem_mhz: int
    reasons: int          # NVML's bitmask of why the clocks are held down


@dataclass(frozen=True)
class Clocks:
    """The samples of one watched block, summarized."""
    samples: int
    sm_median_mhz: float
    sm_min_mhz: int
    sm_max_mhz: int       # the highest the device allows (NVML's max clock), 0 when unknown
    mem_median_mhz: float
    reasons: tuple[str, ...]  # every throttling reason seen in any sample

    @staticmethod
    def of(samples: list[Sample], sm_max_mhz: int) -> Clocks | None:
        if not samples:
            return None
        seen = 0
        for s in samples:
            seen |= s.reasons
        return Clocks(len(samples), statistics.median(s.sm_mhz for s in samples), min(s.sm_mhz for s in samples),
                      sm_max_mhz, statistics.median(s.mem_mhz for s in samples),
                      tuple(name for bit, name in REASONS.items() if seen & bit))

    def held_down(self) -> bool:
        """True when the median SM clock was under 90% of the device's maximum: the block's
        times are not the device's best. (A reason alone is not enough: a heavy product
        touches the power cap for a moment at full clock.)"""
        return self.sm_max_mhz > 0 and self.sm_median_mhz < 0.9 * self.sm_max_mhz

    def text(self) -> str:
        top = f" of {self.sm_max_mhz}" if self.sm_max_mhz else ""
        why = f", throttle reasons seen: {', '.join(self.reasons)}" if self.reasons else ""
        return (f"SM {self.sm_median_mhz:.0f} MHz median (min {self.sm_min_mhz}){top}, "
                f"memory {self.mem_median_mhz:.0f} MHz, {self.samples} samples{why}")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["reasons"] = list(self.reasons)
        return d


class Nvml:
    """One device's clocks through NVML; `ok` is False without libnvidia-ml or a device."""

    def __init__(self, device_id: int = 0):
        self.ok = False
        try:
            self.lib = ctypes.CDLL("libnvidia-ml.so.1")
            if self.lib.nvmlInit_v2() != 0:
                return
            self.dev = ctypes.c_void_p()
            bus = pci_bus_id(device_id)
            if bus is None or self.lib.nvmlDeviceGetHandleByPciBusId_v2(bus, ctypes.byref(self.dev)) != 0:
                if self.lib.nvmlDeviceGetHandleByIndex_v2(_visible_index(device_id), ctypes.byref(self.dev)) != 0:
                    return
            self.ok = True
        except (OSError, AttributeError):
            pass

    def _read(self, fn: str, *args) -> int | None:
        """One NVML query's value, None where it fails or this NVML lacks the function."""
        f = getattr(self.lib, fn, None)
        out = ctypes.c_ulonglong() if fn.endswith("Reasons") else ctypes.c_uint()
        return out.value if f is not None and f(self.dev, *args, ctypes.byref(out)) == 0 else None

    def max_sm_mhz(self) -> int:
        return self._read("nvmlDeviceGetMaxClockInfo", _SM) or 0

    def sample(self) -> Sample | None:
        sm, mem = self._read("nvmlDeviceGetClockInfo", _SM), self._read("nvmlDeviceGetClockInfo", _MEM)
        if sm is None or mem is None:
            return None
        return Sample(sm, mem, self._read("nvmlDeviceGetCurrentClocksThrottleReasons") or 0)

    def close(self) -> None:
        if self.ok:
            self.lib.nvmlShutdown()
            self.ok = False


def _visible_index(device_id: int) -> int:
    """The NVML index of CUDA device `device_id` when CUDA_VISIBLE_DEVICES lists indices."""
    visible = [v for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if device_id < len(visible) and visible[device_id].strip().isdigit():
        return int(visible[device_id])
    return device_id


class ClockWatch:
    """Samples the clocks every `period_s` on a thread while its block runs; `result` is the
    summary afterwards (None without NVML). `reader` stands in for NVML in tests: a callable
    returning a Sample, and `sm_max_mhz` the maximum it reports."""

    def __init__(self, period_s: float = 0.02, device_id: int = 0,
                 reader: Callable[[], Sample | None] | None = None, sm_max_mhz: int = 0):
        self.period_s = period_s
        self.result: Clocks | None = None
        self._nvml = None
        self._read, self._max = reader, sm_max_mhz
        if reader is None:
            nvml = Nvml(device_id)
            if nvml.ok:
                self._nvml, self._read, self._max = nvml, nvml.sample, nvml.max_sm_mhz()
        self._samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _run(self) -> None:
        while True:
            s = self._read()
            if s is not None:
                self._samples.append(s)
            if self._stop.wait(self.period_s):
                return

    def __enter__(self) -> ClockWatch:
        if self._read is not None:
            self._thread = threading.Thread(target=self._run, name="onnxfuse-clocks", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
        self.result = Clocks.of(self._samples, self._max)
        if self._nvml is not None:
            self._nvml.close()
