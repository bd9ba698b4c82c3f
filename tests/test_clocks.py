"""ClockWatch: the GPU's clocks sampled while a block runs (NVML stood in for by a reader),
and compare.py's spread of interleaved rounds."""

from __future__ import annotations

import itertools
import sys
import threading
from pathlib import Path

import pytest

from onnxfuse.tools.clocks import Clocks, ClockWatch, Nvml, Sample

ROOT = Path(__file__).resolve().parents[1]


def test_a_watch_summarizes_the_samples_taken_while_its_block_ran():
    samples = itertools.cycle([Sample(1980, 2619, 0), Sample(1410, 2619, 0x4), Sample(1980, 2619, 0x1)])
    lock = threading.Lock()
    taken = []

    def read():
        with lock:
            s = next(samples)
            taken.append(s)
            return s

    with ClockWatch(period_s=0.001, reader=read, sm_max_mhz=1980) as watch:
        while len(taken) < 6:
            pass
    n = len(taken)
    c = watch.result
    assert c.samples == n >= 6
    assert c.sm_min_mhz == 1410 and c.sm_max_mhz == 1980 and c.mem_median_mhz == 2619
    # the power cap was seen; idle (0x1) is not a reason a run was slow
    assert c.reasons == ("sw_power_cap",)
    assert c.to_dict()["reasons"] == ["sw_power_cap"]
    assert "min 1410" in c.text() and "sw_power_cap" in c.text()
    # no sample after the block: the thread is gone
    assert len(taken) == n and not any(t.name == "onnxfuse-clocks" for t in threading.enumerate())


def test_held_down_means_a_median_clock_under_90_percent_of_the_maximum():
    def clocks(*sm: int, top: int = 1980) -> Clocks:
        return Clocks.of([Sample(s, 2619, 0) for s in sm], top)

    assert not clocks(1980, 1980, 1755).held_down()
    assert clocks(1980, 345, 345).held_down()
    assert not clocks(345, top=0).held_down()  # the maximum unknown: nothing to say
    assert Clocks.of([], 1980) is None


def test_a_reader_that_gives_nothing_leaves_no_result():
    with ClockWatch(period_s=0.001, reader=lambda: None) as watch:
        pass
    assert watch.result is None


def test_nvml_says_so_when_there_is_none(monkeypatch):
    import ctypes

    def no_library(name, *a, **kw):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(ctypes, "CDLL", no_library)
    assert not Nvml().ok
    with ClockWatch() as watch:
        pass
    assert watch.result is None


def test_round_spread_is_the_distance_between_the_rounds_medians():
    sys.path.insert(0, str(ROOT))
    from benchmarks.compare import round_spread

    # five rounds of two runs: medians 1.0, 1.0, 1.1, 1.0, 0.9; the median of all 1.0
    times = [1.0, 1.0, 1.0, 1.0, 1.1, 1.1, 1.0, 1.0, 0.9, 0.9]
    assert round_spread(times, 5) == pytest.approx(20.0)
    assert round_spread([1.0, 2.0], 5) is None   # fewer runs than rounds


def test_the_table_names_the_cases_timed_at_a_held_down_clock():
    sys.path.insert(0, str(ROOT))
    from benchmarks.compare import _clocks_lines

    def case(model: str, sm: int) -> dict:
        return {"model": model, "clocks": Clocks.of([Sample(sm, 2619, 0)], 1980).to_dict()}

    (_, line) = _clocks_lines([case("a", 1980), case("b", 1410), {"model": "c"}])
    assert line == "SM clock while timed (NVML, 2 cases): median 1410 to 1980 MHz of 1980; held down in b (1410 MHz)"
    assert _clocks_lines([{"model": "c"}]) == []


def test_an_nvml_without_a_function_answers_none():
    """A query this NVML does not have (an older or newer library) gives None, not an error
    in the sampling thread."""
    class Lib:
        def nvmlDeviceGetClockInfo(self, dev, kind, out):  # noqa: N802 (NVML's name)
            out._obj.value = {1: 1980, 2: 2619}[kind]
            return 0

    nvml = Nvml.__new__(Nvml)
    nvml.lib, nvml.dev, nvml.ok = Lib(), None, True
    assert nvml.sample() == Sample(1980, 2619, 0)     # no throttle-reasons function: reasons 0
    assert nvml.max_sm_mhz() == 0                      # no max-clock function: unknown
