"""The paths a command reads and writes: which file a write replaces, what may be written,
and that no output is one of the command's inputs or another of its outputs.

Rules (README, Reliability):
- An output that is a symbolic link is written through: the file it points to is replaced
  (as `open(path, "w")` would write it), the link stays.
- An output that exists and is not a regular file (after following links: a FIFO, a socket,
  a device such as /dev/null) is refused; so is a folder.
- No output may be the same file (device and inode; for files that do not exist yet, the
  same path once links are resolved) as an input of the command or as another output.

The files a command reads while it works (models, their external data, pattern files,
device profiles, `--input` arrays) are recorded by `record_read` while `recording` is
active, so that the check before the outputs are renamed into place covers them too
(`onnxfuse.outputs.Outputs`)."""

from __future__ import annotations

import os
import stat
from contextvars import ContextVar
from pathlib import Path

from onnxfuse.errors import OnnxfuseError

_reads: ContextVar[list | None] = ContextVar("onnxfuse_reads", default=None)


def record_read(path: str | os.PathLike) -> None:
    """Note that the current command read `path` (a no-op outside `recording`)."""
    into = _reads.get()
    if into is not None:
        into.append(Path(path))


def start_recording(into: list):
    """Append every path given to `record_read` to `into` until `stop_recording(token)`."""
    return _reads.set(into)


def stop_recording(token) -> None:
    _reads.reset(token)


def target(path: str | os.PathLike) -> Path:
    """The file a write to `path` replaces: a symbolic link's target (resolved to the end,
    also when it does not exist yet), else `path` itself."""
    p = Path(path)
    return Path(os.path.realpath(p)) if p.is_symlink() else p


_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"))


def check_output(path: str | os.PathLike) -> os.stat_result | None:
    """Raise a one-line OnnxfuseError unless `path` can be written as a regular file: its
    folder exists and it is a regular file or does not exist (after following links).
    Returns the existing file's stat, or None."""
    p = Path(path)
    try:
        st = os.stat(p)  # follows links, also /dev/stdout's to an open pipe
    except FileNotFoundError:
        real = target(p)
        folder = real.parent if str(real.parent) else Path(".")
        if not folder.is_dir():
            raise OnnxfuseError(f"{p}: folder {folder} does not exist") from None
        return None
    except OSError as e:
        raise OnnxfuseError(f"{p}: cannot write ({e.strerror or e})") from None
    if stat.S_ISDIR(st.st_mode):
        raise OnnxfuseError(f"{p}: is a directory")
    if not stat.S_ISREG(st.st_mode):
        kind = next((name for test, name in _KINDS if test(st.st_mode)), "not a regular file")
        raise OnnxfuseError(f"{p}: is {kind}, not a regular file; onnxfuse writes regular files only")
    for fd, name in _STREAMS:
        try:
            s = os.fstat(fd)
        except OSError:
            continue
        if (s.st_dev, s.st_ino) == (st.st_dev, st.st_ino):
            raise OnnxfuseError(f"{p}: is this command's {name}; choose another path")
    return st


# A regular file the command reads as stdin or writes as stdout or stderr (a shell's
# `> log.txt`, also named as /dev/stdout) is not replaced.
_STREAMS = ((0, "standard input"), (1, "standard output"), (2, "standard error"))


def _identity(path: Path) -> tuple | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return ("inode", st.st_dev, st.st_ino)


def check_paths(inputs, outputs) -> None:
    """Raise a one-line OnnxfuseError when an output cannot be written (`check_output`), is
    the same file as an input (device and inode, so also through hard and symbolic links) or
    as another output (also for files that do not exist yet: the same path once links are
    resolved). None entries are skipped; inputs that do not exist are not compared."""
    seen_in = []
    for p in inputs:
        if p is not None and (ident := _identity(Path(p))) is not None:
            seen_in.append((ident, Path(p)))
    seen_out: list[tuple[tuple, Path]] = []
    for p in outputs:
        if p is None:
            continue
        p = Path(p)
        st = check_output(p)
        ident = ("inode", st.st_dev, st.st_ino) if st is not None else ("path", os.path.realpath(p))
        for other, q in seen_in:
            if other == ident:
                raise OnnxfuseError(f"{p}: would overwrite the input {q}; choose another path")
        for other, q in seen_out:
            if other == ident:
                raise OnnxfuseError(f"{p}: is the same file as the output {q}; choose another path")
        seen_out.append((ident, p))
