"""A worker process: functions run by name in a Python process of onnxfuse's own.

Tuning times its bundles of one-node models under torch's profiler (`onnxfuse.bundle`), and
CUPTI stays attached to a process after the profiler stops: every later kernel launch in it
pays. On an H100, ONNX Runtime's BERT-base fp16 batch-1 run took 19% longer without CUDA
graphs and 7.5% longer with them after one profiled step (forty-first session,
`benchmarks/cupti_probe.py`), which slowed tuning's own whole-model timings and, for a caller
of the Python API, every run after `optimize`. Kineto's ``TEARDOWN_CUPTI=1`` would detach it,
but CUPTI's re-initialization after a teardown has crashed under CUDA graphs (torch's own
compiler turns teardown off where graphs are used), and tuning profiles again and again among
graph sessions. So the profiling runs here instead, and CUPTI never attaches to the caller.

`Worker.call(module, function, *args)` imports `module` in the worker and returns
`function(*args)`: arguments and result go by pickle over the worker's stdin and stdout (the
worker's own prints go to its stderr, kept in a temporary file for the error message). The
worker starts on the first call (``python -m onnxfuse.tools.worker``: no re-import of the
caller's ``__main__``, so a script without a main guard is safe), with the caller's
``sys.path`` and environment; the caller's ``ONNXFUSE_*`` variables go with every call. An
`OnnxfuseError` the function raises comes back as one; any other exception as an
`OnnxfuseError` with its type and first line. A worker that dies or does not answer within
the timeout raises `WorkerError` and is started afresh on the next call. `shared()` is the
process's one worker, closed at exit.
"""

from __future__ import annotations

import atexit
import importlib
import os
import pickle
import select
import subprocess
import sys
import tempfile
import threading
from typing import Any, BinaryIO

from onnxfuse.errors import OnnxfuseError

TIMEOUT_S = 600.0  # one call at most: a bundle of the largest models ran 8.4 s on the H200
ENV_PREFIX = "ONNXFUSE_"
LOG_TAIL_BYTES = 65536  # of the worker's stderr, read for a death's last line


def child_pythonpath() -> str:
    """This process's ``sys.path`` as a PYTHONPATH for a Python child (absolute: the child
    imports what this process imports, whatever its working directory)."""
    return os.pathsep.join(os.path.abspath(p) if p else os.getcwd() for p in sys.path)


class WorkerError(OnnxfuseError):
    """The worker process died, or did not answer in time."""


class Worker:
    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._log: Any = None
        self._lock = threading.Lock()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    def _start(self) -> None:
        env = dict(os.environ, PYTHONPATH=child_pythonpath())
        self._log = tempfile.TemporaryFile()
        self._proc = subprocess.Popen([sys.executable, "-m", "onnxfuse.tools.worker"], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=self._log, env=env)

    def call(self, module: str, function: str, *args: Any, timeout: float = TIMEOUT_S) -> Any:
        """`module`.`function`(*args) in the worker (see the module docstring)."""
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self.close()
                self._start()
            proc = self._proc
            assert proc is not None and proc.stdin is not None and proc.stdout is not None
            env = {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIX)}
            try:
                pickle.dump((module, function, args, env), proc.stdin, protocol=pickle.HIGHEST_PROTOCOL)
                proc.stdin.flush()
                ready, _, _ = select.select([proc.stdout], [], [], timeout)
                if not ready:
                    self.close()
                    raise WorkerError(f"the worker process did not answer {module}.{function} in {timeout:.0f} s")
                status, value = pickle.load(proc.stdout)
            except (EOFError, OSError, pickle.UnpicklingError) as e:
                why = self._last_error_line() or type(e).__name__
                self.close()
                raise WorkerError(f"the worker process stopped during {module}.{function} ({why})") from None
        if status == "error":
            raise OnnxfuseError(value)
        return value

    def _last_error_line(self) -> str:
        if self._log is None:
            return ""
        try:  # the file holds every print of a long-lived worker: its tail has the last line
            self._log.seek(max(0, self._log.seek(0, os.SEEK_END) - LOG_TAIL_BYTES))
            lines = [ln for ln in self._log.read().decode(errors="replace").splitlines() if ln.strip()]
        except (OSError, ValueError):
            return ""
        return lines[-1].strip()[:300] if lines else ""

    def close(self) -> None:
        """Ends the worker (EOF on its stdin, then a kill after 5 s)."""
        proc, self._proc = self._proc, None
        if proc is not None:
            try:
                if proc.stdin is not None:
                    proc.stdin.close()
                proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
        if self._log is not None:
            self._log.close()
            self._log = None


_SHARED: Worker | None = None


def shared() -> Worker:
    """The process's one worker (started on its first call, closed at exit)."""
    global _SHARED
    if _SHARED is None:
        _SHARED = Worker()
        atexit.register(_SHARED.close)
    return _SHARED


def _apply_env(env: dict[str, str]) -> None:
    for k in [k for k in os.environ if k.startswith(ENV_PREFIX) and k not in env]:
        del os.environ[k]
    os.environ.update(env)


def serve(inp: BinaryIO, out: BinaryIO) -> None:
    """The worker's loop: one pickled call in, one pickled ("ok", value) or ("error", text)
    out, until EOF."""
    while True:
        try:
            module, function, args, env = pickle.load(inp)
        except EOFError:
            return
        _apply_env(env)
        try:
            reply: tuple[str, Any] = ("ok", getattr(importlib.import_module(module), function)(*args))
        except OnnxfuseError as e:
            reply = ("error", str(e))
        except Exception as e:  # noqa: BLE001  anything the function raises goes back as its first line
            text = str(e).strip().splitlines()
            reply = ("error", f"{type(e).__name__}: {text[0][:300] if text else ''}")
        try:
            data = pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:  # noqa: BLE001  a result pickle cannot take
            data = pickle.dumps(("error", f"{module}.{function}'s result cannot be sent back: {e}"))
        out.write(data)
        out.flush()


if __name__ == "__main__":
    _out = os.fdopen(os.dup(1), "wb")  # the replies' stream; anything printed goes to stderr
    os.dup2(2, 1)
    serve(sys.stdin.buffer, _out)
