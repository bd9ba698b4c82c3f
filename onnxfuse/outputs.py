"""Writing a command's files: all of them or none, each atomically (`Outputs`).

The rules of what may be written and which file a write replaces are `onnxfuse.files`';
`save_model`, `write_text` and `write_bytes` write one file the same way.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from pathlib import Path

import onnx
from onnx import ModelProto

from onnxfuse import files
from onnxfuse.errors import OnnxfuseError
from onnxfuse.files import check_output, check_paths
from onnxfuse.ir import copy_field, copy_fields, serialized_bytes

# Protobuf cannot serialize a message of 2 GiB or more: larger models go to external data.
EXTERNAL_DATA_THRESHOLD = 2**31 - 2**24


class Outputs:
    """The files one command writes, all of them or none.

    Made with the command's output and input paths before any work, it checks them
    (`onnxfuse.files.check_paths`: writable as regular files, none the same file as an input
    or another output). Used as a context manager it records the files read meanwhile
    (models, external data, pattern files...). `model`, `text` and `data` write each output
    to a temporary file beside the file it replaces (a symbolic link's target); `commit`
    checks the paths again against everything read, then renames the temporary files into
    place. Leaving the `with` block without committing (an error, Ctrl-C) removes the
    temporary files: no output is written and files already there are untouched.

    Permissions: a new file gets what `open()` gives it (0666 less the umask, or the
    folder's default ACL); a file replaced keeps its permission bits, its owner where the
    writing user may set it (root) and its group where the user belongs to it."""

    def __init__(self, outputs=(), inputs=()):
        self.outputs = [Path(p) for p in outputs if p is not None]
        self.inputs = [Path(p) for p in inputs if p is not None]
        check_paths(self.inputs, self.outputs)
        self._staged: list[tuple[str, Path, Path]] = []  # (temporary file, file it replaces, path as given)
        self._temps: list[str] = []
        self._token = None

    def __enter__(self) -> Outputs:
        self._token = files.start_recording(self.inputs)
        return self

    def __exit__(self, *exc) -> None:
        if self._token is not None:
            files.stop_recording(self._token)
            self._token = None
        self.discard()

    def discard(self) -> None:
        """Remove the temporary files not yet committed."""
        for p in self._temps:
            _unlink(p)
        self._temps.clear()
        self._staged.clear()

    def model(self, path: str | os.PathLike, model: ModelProto) -> None:
        """Stage an ONNX model. Models too big for one protobuf go to external data beside
        it (<name>.data, a second output)."""
        path = Path(path)
        final = self._check(path)
        sizes = [t.ByteSize() for t in model.graph.initializer]  # (each tensor encoded once to be measured)
        big = serialized_bytes(model, sizes) > EXTERNAL_DATA_THRESHOLD
        data_name = final.name + ".data"
        try:
            tmp = self._temp_for(final)
            release_freed_memory()  # serializing takes one more copy of the weights
            if big:
                data_final = final.parent / data_name
                check_output(data_final)
                tmp_data = self._temp_for(data_final)
                # The tensors point at the final data file name; both are renamed into place.
                light = _with_external_weights(model, tmp_data, data_name)
                _write_file(tmp, light.SerializeToString(deterministic=True))
                _keep_permissions(tmp_data, data_final)
                self._staged.append((tmp_data, data_final, path.parent / (path.name + ".data")))
            else:
                _write_file(tmp, serialized_parts(model, sizes))
            _keep_permissions(tmp, final)
        except OSError as e:
            raise OnnxfuseError(f"{path}: cannot write ({e.strerror or e})") from None
        self._staged.append((tmp, final, path))  # after its data file: renamed last

    def text(self, path: str | os.PathLike, text: str) -> None:
        """Stage a text file (UTF-8)."""
        self.data(path, text.encode())

    def data(self, path: str | os.PathLike, data: bytes) -> None:
        """Stage a file with these bytes."""
        path = Path(path)
        final = self._check(path)
        try:
            tmp = self._temp_for(final)
            _write_file(tmp, data)
            _keep_permissions(tmp, final)
        except OSError as e:
            raise OnnxfuseError(f"{path}: cannot write ({e.strerror or e})") from None
        self._staged.append((tmp, final, path))

    def commit(self) -> None:
        """Rename every staged file into place, after checking the paths again against the
        files read since. When a rename fails, those already renamed are put back (the
        previous files from hard-linked copies, where the file system has hard links)."""
        check_paths(self.inputs, [final for _, final, _ in self._staged])
        done: list[tuple[Path, str | None, bool]] = []  # (file, backup of the previous one, it existed)
        try:
            for tmp, final, shown in self._staged:
                existed = final.exists()
                backup = _backup(final, tmp) if existed else None
                try:
                    os.replace(tmp, final)
                except OSError as e:
                    if backup is not None:
                        _unlink(backup)
                    raise OnnxfuseError(f"{shown}: cannot write ({e.strerror or e})") from None
                self._temps.remove(tmp)
                done.append((final, backup, existed))
        except BaseException:
            for final, backup, existed in reversed(done):
                try:
                    if backup is not None:
                        os.replace(backup, final)
                    elif not existed:
                        _unlink(final)
                except OSError:
                    pass
            raise
        finally:
            for _, backup, _ in done:
                if backup is not None:
                    _unlink(backup)
        self._staged.clear()

    def _check(self, path: Path) -> Path:
        check_output(path)
        return files.target(path)

    def _temp_for(self, final: Path) -> str:
        return _temp_file(final.parent if str(final.parent) else Path("."), final.name, self._temps)


def save_model(model: ModelProto, path: str | os.PathLike) -> None:
    """Write atomically: to a temporary file in the same folder, then rename. Models too big
    for one protobuf go to external data beside it (<name>.data). After any failure (full
    disk, no permission, Ctrl-C) no partial or temporary file is left and a file already at
    `path` is untouched; OSError becomes a one-line OnnxfuseError. The rules of `Outputs`
    apply: a symbolic link is written through, other files than regular ones are refused,
    permissions are those `open()` would give."""
    with Outputs([path]) as out:
        out.model(path, model)
        out.commit()


def write_text(path: str | os.PathLike, text: str) -> None:
    """Write a small text file (the JSON report) atomically, like `save_model`."""
    write_bytes(path, text.encode())


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write a file atomically, like `save_model`."""
    with Outputs([path]) as out:
        out.data(path, data)
        out.commit()


def _temp_file(folder: Path, name: str, temps: list[str]) -> str:
    """Create an empty temporary file in `folder` as `open()` creates files (mode 0666 less
    the umask, or the folder's default ACL), and note it in `temps`."""
    for _ in range(100):
        tmp = str(folder / f".{name}.{secrets.token_hex(4)}.tmp")
        try:
            fd = _create(tmp)
        except FileExistsError:
            continue
        temps.append(tmp)
        os.close(fd)
        return tmp
    raise FileExistsError(errno.EEXIST, f"no free temporary file name in {folder}")


def _create(path: str) -> int:
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)


def _keep_permissions(tmp: str, final: Path) -> None:
    """Give the temporary file the permission bits of the file it replaces, and its owner
    and group where allowed (root; other users the group when they belong to it), so a
    replaced file keeps them (a model served by a group goes on being readable by it)."""
    try:
        st = os.stat(final)
    except FileNotFoundError:
        return
    if hasattr(os, "chown"):
        mine = os.stat(tmp)
        if (mine.st_uid, mine.st_gid) != (st.st_uid, st.st_gid):
            try:
                os.chown(tmp, st.st_uid, st.st_gid)
            except PermissionError:  # not root: the group at least, where the user belongs to it
                if mine.st_gid != st.st_gid:
                    try:
                        os.chown(tmp, -1, st.st_gid)
                    except PermissionError:
                        pass
    os.chmod(tmp, stat.S_IMODE(st.st_mode) & 0o777)


def _backup(final: Path, tmp: str) -> str | None:
    """A hard link to the file about to be replaced (to put it back), or None where the file
    system has none."""
    name = tmp + ".old"
    try:
        os.link(final, name)
    except OSError:
        return None
    return name


EXTERNAL_MIN_BYTES = 1024  # a tensor of more bytes than this goes to the data file
EXTERNAL_ALIGNMENT = 4096  # each at a page-aligned offset (as ONNX Runtime maps them)


def _with_external_weights(model: ModelProto, data_path: str, location: str) -> ModelProto:
    """The main graph's initializers of more than EXTERNAL_MIN_BYTES written to `data_path`
    one after the other (page-aligned), and `model` with them as external tensors at
    `location`: built field by field, so that no copy of the weights is made but the one
    tensor being written. Strings, tensors already external and tensors elsewhere (subgraphs,
    attributes) stay as they are."""
    light = ModelProto()
    copy_fields(model, light, skip="graph")
    copy_fields(model.graph, light.graph, skip="initializer")
    offset = 0
    with open(data_path, "wb") as f:
        for t in model.graph.initializer:
            if t.data_location == onnx.TensorProto.EXTERNAL or t.data_type == onnx.TensorProto.STRING:
                light.graph.initializer.add().CopyFrom(t)
                continue
            data = t.raw_data if t.HasField("raw_data") else onnx.numpy_helper.to_array(t).tobytes()
            if len(data) <= EXTERNAL_MIN_BYTES:
                light.graph.initializer.add().CopyFrom(t)
                continue
            pad = -offset % EXTERNAL_ALIGNMENT
            f.write(b"\0" * pad)
            f.write(data)
            offset += pad
            out = light.graph.initializer.add(name=t.name, data_type=t.data_type, doc_string=t.doc_string)
            out.dims.extend(t.dims)
            if hasattr(t, "metadata_props"):  # (onnx >= 1.17)
                out.metadata_props.extend(t.metadata_props)
            out.data_location = onnx.TensorProto.EXTERNAL
            for k, v in (("location", location), ("offset", str(offset)), ("length", str(len(data)))):
                kv = out.external_data.add()
                kv.key, kv.value = k, v
            offset += len(data)
        f.flush()
        os.fsync(f.fileno())
    return light


def serialized_parts(model: ModelProto, sizes: list[int] | None = None):
    """`model.SerializeToString(deterministic=True)` in pieces whose concatenation is those bytes,
    each weight serialized on its own: the model's fields before its graph, the graph's before
    its initializers, each initializer, the rest of the graph, the rest of the model (protobuf
    writes a message's fields in field-number order; a field of a message is its tag, its
    length, its bytes). Writing them in turn holds one weight's bytes at a time, not a second
    copy of the model. The whole serialization where the model or its graph carries fields
    this onnx does not know (their place in the bytes is not theirs to split). `sizes`: the
    initializers' ByteSize() where the caller has them."""
    try:
        from google.protobuf.unknown_fields import UnknownFieldSet
    except ImportError:  # an older protobuf
        yield model.SerializeToString(deterministic=True)
        return
    if len(UnknownFieldSet(model)) or len(UnknownFieldSet(model.graph)):
        yield model.SerializeToString(deterministic=True)
        return
    graph_no = ModelProto.DESCRIPTOR.fields_by_name["graph"].number
    init_no = onnx.GraphProto.DESCRIPTOR.fields_by_name["initializer"].number
    head, tail, g_head, g_tail = ModelProto(), ModelProto(), onnx.GraphProto(), onnx.GraphProto()
    for src, skip, number, before, after in ((model, "graph", graph_no, head, tail),
                                             (model.graph, "initializer", init_no, g_head, g_tail)):
        for fd, value in src.ListFields():
            if fd.name != skip:
                copy_field(before if fd.number < number else after, fd, value)
    sizes = [t.ByteSize() for t in model.graph.initializer] if sizes is None else sizes
    parts = [g_head.SerializeToString(deterministic=True), g_tail.SerializeToString(deterministic=True)]
    graph_len = sum(len(p) for p in parts) + sum(len(_field_key(init_no, n)) + n for n in sizes)
    yield head.SerializeToString(deterministic=True)
    if model.HasField("graph"):
        yield _field_key(graph_no, graph_len)
        yield parts[0]
        for t, n in zip(model.graph.initializer, sizes, strict=True):
            yield _field_key(init_no, n)
            yield t.SerializeToString(deterministic=True)
        yield parts[1]
    yield tail.SerializeToString(deterministic=True)


def _field_key(number: int, length: int) -> bytes:
    """A length-delimited field's tag and length, as protobuf writes them (varints)."""
    out = bytearray()
    for n in ((number << 3) | 2, length):
        while n > 0x7F:
            out.append((n & 0x7F) | 0x80)
            n >>= 7
        out.append(n)
    return bytes(out)


def release_freed_memory() -> None:
    """Give the memory freed so far back to the system (glibc's malloc keeps much of what a
    dropped model held, so that serializing the output would stack its copy on top); nothing
    where the C library has no malloc_trim."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _write_file(path: str, data) -> None:
    """Write `data` (bytes, or pieces of bytes written in turn) and flush to disk (a full disk
    shows up here, not after the rename)."""
    with open(path, "wb") as f:
        for part in [data] if isinstance(data, bytes) else data:
            f.write(part)
        f.flush()
        os.fsync(f.fileno())


def _unlink(path: str | os.PathLike) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass

