"""onnxfuse.tools.worker: functions run by name in a process of their own (tuning's bundles
profile there, so that CUPTI never attaches to the caller), and bundle.run_bundle's hand-off."""

from __future__ import annotations

import os
import pickle
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from onnxfuse import bundle
from onnxfuse.errors import OnnxfuseError
from onnxfuse.tools import worker
from tests.util import model


def _fail(text: str) -> None:
    raise OnnxfuseError(text)


def _print_then(value: int) -> int:
    print("noise on stdout")
    sys.stdout.flush()
    return value * 2


def _die(code: int) -> None:
    sys.stderr.write("the last words\n")
    sys.stderr.flush()
    os._exit(code)


def _noise_then_die(n_bytes: int) -> None:
    sys.stderr.write("x" * (n_bytes - 1) + "\n" + "the last words after much noise\n")
    sys.stderr.flush()
    os._exit(4)


def _slow(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


@pytest.fixture
def w():
    one = worker.Worker()
    yield one
    one.close()


def test_a_call_runs_in_another_process_that_stays(w):
    first = w.call("os", "getpid")
    assert first != os.getpid() and w.call("os", "getpid") == first == w.pid
    assert w.call("tests.test_worker", "_print_then", 21) == 42  # prints do not reach the replies' stream


def test_the_callers_onnxfuse_environment_goes_with_every_call(w, monkeypatch):
    monkeypatch.setenv("ONNXFUSE_WORKER_TEST", "1")
    assert w.call("os", "getenv", "ONNXFUSE_WORKER_TEST") == "1"
    monkeypatch.delenv("ONNXFUSE_WORKER_TEST")
    assert w.call("os", "getenv", "ONNXFUSE_WORKER_TEST") is None


def test_errors_come_back_as_onnxfuse_errors_and_the_worker_stays(w):
    pid = w.call("os", "getpid")
    with pytest.raises(OnnxfuseError, match=r"^a reason$"):
        w.call("tests.test_worker", "_fail", "a reason")
    with pytest.raises(OnnxfuseError, match=r"^JSONDecodeError: "):
        w.call("json", "loads", "{not json")
    with pytest.raises(OnnxfuseError, match="ModuleNotFoundError"):
        w.call("no_such_module_here", "f")
    assert w.call("os", "getpid") == pid


def test_a_worker_that_dies_or_hangs_is_replaced(w):
    pid = w.call("os", "getpid")
    with pytest.raises(worker.WorkerError, match=r"stopped during tests\.test_worker\._die \(the last words\)"):
        w.call("tests.test_worker", "_die", 3)
    again = w.call("os", "getpid")
    assert again != pid
    with pytest.raises(worker.WorkerError, match="did not answer"):
        w.call("tests.test_worker", "_slow", 30.0, timeout=0.5)
    assert w.call("tests.test_worker", "_slow", 0.0) == 0.0 and w.pid not in (pid, again)


def test_a_death_after_much_printing_still_names_its_last_line(w, monkeypatch):
    """Only the tail of the worker's stderr is read: its size does not matter."""
    monkeypatch.setattr(worker, "LOG_TAIL_BYTES", 1024)
    with pytest.raises(worker.WorkerError, match=r"\(the last words after much noise\)"):
        w.call("tests.test_worker", "_noise_then_die", 10 * 1024)


def test_the_shared_worker_is_one():
    assert worker.shared() is worker.shared()


def test_run_bundle_hands_the_saved_bundle_to_the_worker(monkeypatch):
    """run_bundle saves the bundle and its feeds and has the shared worker run `run_saved` on
    them; ONNXFUSE_BUNDLE_WORKER=0 runs it in this process."""
    m = model([], {"x": ("float32", [2])}, {"x": ("float32", [2])})
    feeds = {"x": np.arange(2, dtype=np.float32)}
    seen = []

    class Fake:
        def call(self, module, function, folder, library, iters, warmup):
            with open(Path(folder) / "feeds.pkl", "rb") as f:
                got = pickle.load(f)
            seen.append((module, function, (Path(folder) / "bundle.onnx").is_file(), got, library, iters, warmup))
            return "ran"

    monkeypatch.setattr(worker, "shared", lambda: Fake())
    assert bundle.run_bundle(m, feeds, library=True, iters=3, warmup=1) == "ran"
    (module, function, saved, got, library, iters, warmup), = seen
    assert (module, function, saved, library, iters, warmup) == ("onnxfuse.bundle", "run_saved", True, True, 3, 1)
    np.testing.assert_array_equal(got["x"], feeds["x"])
    monkeypatch.setenv("ONNXFUSE_BUNDLE_WORKER", "0")
    monkeypatch.setattr(bundle, "run_saved", lambda folder, library, iters, warmup: "here")
    assert bundle.run_bundle(m, feeds, library=False) == "here" and len(seen) == 1
