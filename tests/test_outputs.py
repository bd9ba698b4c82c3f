"""What the commands write, and where: nothing lost, nothing hidden.

- A symbolic link as output is written through (its target replaced, the link kept); a
  FIFO, a device or a socket is refused (exit 2), never replaced by a regular file.
- No output may be an input of the command or another output: same file by device and
  inode (hard and symbolic links too), or the same path for files not there yet.
- Files are written with the mode `open()` gives (umask); a replaced file keeps its mode.
- A command that fails leaves none of its outputs, and files already there untouched.
- A model whose external data lies outside its folder: one line, exit 2.
- A reader that goes away (`| head`): no traceback, exit 141, files written all the same;
  long fused chains are shortened in the printed text, not in the JSON."""

from __future__ import annotations

import errno
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from onnxfuse import cli, outputs
from onnxfuse.errors import OnnxfuseError
from onnxfuse.outputs import Outputs
from onnxfuse.pipeline import optimize_model
from tests.util import model

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "models" / "example.onnx"
NONE = ["--target", "none"]


def one_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith("onnxfuse: error: ") and len(err.strip().splitlines()) == 1, err
    return err


def names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


@pytest.fixture
def src(tmp_path) -> Path:
    p = tmp_path / "m.onnx"
    p.write_bytes(EXAMPLE.read_bytes())
    return p


# ---------------------------------------------------------------------------------------
# 1. non-regular files and symbolic links
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("option", ["output", "--json"])
def test_fifo_is_refused_and_stays_a_fifo(tmp_path, src, capsys, option):
    """Nothing opens the FIFO (that would block): the command refuses before any work."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    argv = (["optimize", str(src), str(fifo), *NONE] if option == "output"
            else ["optimize", str(src), str(tmp_path / "o.onnx"), *NONE, "--json", str(fifo)])
    assert cli.main(argv) == 2
    assert "pipe: is a FIFO, not a regular file" in one_line(capsys)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert names(tmp_path) == ["m.onnx", "pipe"]


def test_link_to_a_character_device_is_refused(tmp_path, src, capsys):
    """A link to /dev/null (a link: the code before this check replaced what it was given,
    here the link, never /dev/null itself)."""
    link = tmp_path / "null.onnx"
    link.symlink_to(os.devnull)
    assert cli.main(["optimize", str(src), str(link), *NONE]) == 2
    assert "is a character device" in one_line(capsys)
    assert link.is_symlink() and os.readlink(link) == os.devnull
    assert stat.S_ISCHR(os.stat(os.devnull).st_mode)


@pytest.mark.parametrize("stdout", ["pipe", "file"])
def test_dev_stdout_is_refused(tmp_path, src, stdout):
    """/dev/stdout is a link to what stdout is: a pipe (refused as a FIFO) or a regular file
    the shell opened (`> log.txt`): renamed over, the command's own output would go to an
    unlinked file."""
    log = tmp_path / "log.txt"
    with open(log, "w") as f:
        r = subprocess.run([sys.executable, "-m", "onnxfuse.cli", "analyze", str(src), "--json", "/dev/stdout"],
                           stdout=subprocess.PIPE if stdout == "pipe" else f, stderr=subprocess.PIPE, text=True,
                           cwd=ROOT, timeout=300, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert ("is a FIFO" if stdout == "pipe" else "is this command's standard output") in r.stderr
    assert names(tmp_path) == ["log.txt", "m.onnx"]


@pytest.mark.parametrize("writer", ["save_model", "write_text", "cli"])
def test_symlink_is_written_through(tmp_path, src, writer):
    real = tmp_path / "real" / "model.onnx"
    real.parent.mkdir()
    real.write_bytes(b"old")
    link = tmp_path / "link.onnx"
    link.symlink_to(Path("real") / "model.onnx")
    if writer == "save_model":
        outputs.save_model(onnx.load(str(src)), link)
    elif writer == "write_text":
        outputs.write_text(link, "new\n")
    else:
        assert cli.main(["optimize", str(src), str(tmp_path / "o.onnx"), *NONE, "--json", str(link)]) == 0
    assert link.is_symlink() and os.readlink(link) == str(Path("real") / "model.onnx")
    assert real.read_bytes() != b"old"
    if writer == "save_model":
        onnx.checker.check_model(onnx.load(str(real)))
    elif writer == "cli":
        assert json.loads(real.read_text())["nodes_after"] == 10
    assert names(real.parent) == ["model.onnx"]


def test_dangling_symlink_creates_its_target(tmp_path, src):
    link = tmp_path / "link.onnx"
    link.symlink_to("target.onnx")
    assert cli.main(["optimize", str(src), str(link), *NONE]) == 0
    assert link.is_symlink() and (tmp_path / "target.onnx").is_file()
    onnx.checker.check_model(onnx.load(str(link)))


def test_symlink_loop_is_a_one_line_error(tmp_path, src, capsys):
    (tmp_path / "a").symlink_to("b")
    (tmp_path / "b").symlink_to("a")
    assert cli.main(["optimize", str(src), str(tmp_path / "a"), *NONE]) == 2
    assert "a: cannot write" in one_line(capsys)


# ---------------------------------------------------------------------------------------
# 2. outputs that are inputs or other outputs
# ---------------------------------------------------------------------------------------

def _alias(tmp_path: Path, of: Path, how: str) -> Path:
    if how == "same":
        return of
    p = tmp_path / f"{how}-{of.name}"
    if how == "hardlink":
        os.link(of, p)
    else:
        p.symlink_to(of)
    return p


@pytest.mark.parametrize("how", ["same", "hardlink", "symlink"])
@pytest.mark.parametrize("case", [
    "optimize --json IN", "optimize OUT=IN", "bench --json IN", "bench --markdown IN", "analyze --json IN",
    "analyze --plot", "profile --json IN", "profile --keep-trace IN", "bisect --write IN",
])
def test_output_that_is_an_input_is_refused(tmp_path, src, capsys, case, how):
    command = case.split()[0]
    if case == "analyze --plot":
        pytest.importorskip("matplotlib")
        src = tmp_path / "m.png"  # a model named like a plot: the plot must not overwrite it
        src.write_bytes(EXAMPLE.read_bytes())
    alias = str(_alias(tmp_path, src, how))
    before = src.read_bytes()
    argv = {
        "optimize --json IN": ["optimize", str(src), str(tmp_path / "o.onnx"), *NONE, "--json", alias],
        "optimize OUT=IN": ["optimize", str(src), alias, *NONE],
        "bench --json IN": ["bench", str(src), "--provider", "cpu", "--iters", "1", "--json", alias],
        "bench --markdown IN": ["bench", str(src), "--provider", "cpu", "--iters", "1", "--markdown", alias],
        "analyze --json IN": ["analyze", str(src), "--json", alias],
        "analyze --plot": ["analyze", str(src), "--plot", alias],
        "profile --json IN": ["profile", str(src), "--iters", "1", "--json", alias],
        "profile --keep-trace IN": ["profile", str(src), "--iters", "1", "--keep-trace", alias],
        "bisect --write IN": ["bisect", str(src), str(src), "--provider", "cpu", "--write", alias],
    }[case]
    assert cli.main(argv) == 2, command
    assert f"would overwrite the input {src}" in one_line(capsys)
    assert src.read_bytes() == before
    assert not (tmp_path / "o.onnx").exists()


@pytest.mark.parametrize("how", ["same", "hardlink", "symlink", "not yet there"])
def test_two_outputs_that_are_one_file_are_refused(tmp_path, src, capsys, how):
    out = tmp_path / "o.onnx"
    if how == "not yet there":  # the same path once links are resolved
        (tmp_path / "here").symlink_to(tmp_path)
        other = tmp_path / "here" / "o.onnx"
    else:
        out.write_bytes(b"previous")
        other = _alias(tmp_path, out, how)
    assert cli.main(["optimize", str(src), str(out), *NONE, "--json", str(other)]) == 2
    assert f"is the same file as the output {out}" in one_line(capsys)
    if how == "not yet there":
        assert not out.exists()
    else:
        assert out.read_bytes() == b"previous"


def test_analyze_json_and_plot_on_one_file_are_refused(tmp_path, src, capsys):
    pytest.importorskip("matplotlib")
    assert cli.main(["analyze", str(src), "--json", str(tmp_path / "r.png"), "--plot", str(tmp_path / "r.png")]) == 2
    assert "is the same file as the output" in one_line(capsys)
    assert names(tmp_path) == ["m.onnx"]


def _with_external_data(folder: Path) -> Path:
    m = onnx.load(str(EXAMPLE))
    p = folder / "ext.onnx"
    onnx.save_model(m, str(p), save_as_external_data=True, location="weights.bin", size_threshold=0)
    return p


def test_external_data_of_the_input_is_an_input(tmp_path, capsys):
    """The input's external data file is known once the model is read: checked before
    anything is written."""
    p = _with_external_data(tmp_path)
    data = (tmp_path / "weights.bin").read_bytes()
    assert cli.main(["optimize", str(p), str(tmp_path / "o.onnx"), *NONE, "--json", str(tmp_path / "weights.bin")]) == 2
    assert "weights.bin: would overwrite the input" in one_line(capsys)
    assert (tmp_path / "weights.bin").read_bytes() == data
    assert names(tmp_path) == ["ext.onnx", "weights.bin"]


def test_pattern_file_and_device_profile_are_inputs(tmp_path, src, capsys):
    patterns = tmp_path / "patterns"
    patterns.mkdir()
    (patterns / "mine.yaml").write_text((ROOT / "patterns" / "pointwise_chain.yaml").read_text().replace(
        "name: pointwise_chain", "name: mine"))
    before = (patterns / "mine.yaml").read_text()
    assert cli.main(["optimize", str(src), str(tmp_path / "o.onnx"), *NONE, "--patterns", str(patterns),
                     "--json", str(patterns / "mine.yaml")]) == 2
    assert "would overwrite the input" in one_line(capsys)
    assert (patterns / "mine.yaml").read_text() == before and not (tmp_path / "o.onnx").exists()
    device = tmp_path / "dev.json"
    device.write_text(json.dumps({"bandwidth_tbps": 1.0, "peak_tflops": {"fp32": 10.0}}))
    assert cli.main(["analyze", str(src), "--device", str(device), "--json", str(device)]) == 2
    assert "would overwrite the input" in one_line(capsys)


def test_bench_input_array_is_an_input(tmp_path, capsys):
    pytest.importorskip("onnxruntime")
    x = tmp_path / "x.npy"
    m = model([helper.make_node("Relu", ["x"], ["y"])], {"x": ("float32", [2, 3])}, {"y": ("float32", [2, 3])})
    p = tmp_path / "relu.onnx"
    p.write_bytes(m.SerializeToString())
    np.save(x, np.ones((2, 3), np.float32))
    before = x.read_bytes()
    assert cli.main(["bench", str(p), "--provider", "cpu", "--iters", "1", "--input", f"x={x}",
                     "--json", str(x)]) == 2
    assert "would overwrite the input" in one_line(capsys)
    assert x.read_bytes() == before


def test_same_model_twice_as_input_is_fine(tmp_path, src):
    """Inputs may repeat (bench a model against itself); only outputs must be distinct."""
    pytest.importorskip("onnxruntime")
    js = tmp_path / "b.json"
    assert cli.main(["bench", str(src), str(src), "--provider", "cpu", "--iters", "1", "--json", str(js)]) == 0
    assert json.loads(js.read_text())["models"]


# ---------------------------------------------------------------------------------------
# 3. modes
# ---------------------------------------------------------------------------------------

@pytest.fixture
def umask():
    old = os.umask(0o022)

    def set_umask(mask: int) -> None:
        os.umask(mask)

    yield set_umask
    os.umask(old)


def mode(p: Path) -> int:
    return stat.S_IMODE(os.stat(p).st_mode)


@pytest.mark.parametrize("mask", [0o022, 0o077, 0o002])
def test_new_files_get_the_mode_open_gives(tmp_path, src, umask, mask):
    umask(mask)
    out, js = tmp_path / "o.onnx", tmp_path / "r.json"
    assert cli.main(["optimize", str(src), str(out), *NONE, "--json", str(js)]) == 0
    assert mode(out) == mode(js) == 0o666 & ~mask


@pytest.mark.parametrize("old_mode", [0o644, 0o640, 0o444, 0o666])
def test_replaced_files_keep_their_mode(tmp_path, src, umask, old_mode):
    umask(0o077)
    out, js = tmp_path / "o.onnx", tmp_path / "r.json"
    for p in (out, js):
        p.write_bytes(b"previous")
        os.chmod(p, old_mode)
    assert cli.main(["optimize", str(src), str(out), *NONE, "--json", str(js)]) == 0
    assert mode(out) == mode(js) == old_mode
    assert out.read_bytes() != b"previous"


def test_a_model_is_written_weight_by_weight_as_protobuf_serializes_it():
    """`serialized_parts` (each weight serialized on its own) joins into exactly the bytes of
    `SerializeToString(deterministic=True)`: models with functions, subgraphs, metadata, unused
    initializers and external tensors, an empty one; fields this onnx does not know (here one of
    number 100 on the model) go through the whole serialization, kept."""
    from tests.test_ir import _rich_model

    rich = _rich_model()
    rich.graph.initializer.append(numpy_helper.from_array(np.arange(5000, dtype=np.float32), "big"))
    ext = onnx.ModelProto()
    ext.CopyFrom(rich)
    ext.graph.initializer[0].data_location = onnx.TensorProto.EXTERNAL
    ext.graph.initializer[0].external_data.add(key="location", value="w.bin")
    unknown = onnx.ModelProto()
    unknown.ParseFromString(rich.SerializeToString() + b"\xa2\x06\x03abc")  # field 100, 3 bytes
    for m in (rich, ext, optimize_model(model([helper.make_node("Relu", ["x"], ["y"])], {"x": ("float32", [4])},
                                               {"y": ("float32", [4])})).model, onnx.ModelProto(), unknown):
        parts = list(outputs.serialized_parts(m))
        assert b"".join(parts) == m.SerializeToString(deterministic=True)
        assert len(parts) == (1 if m is unknown else 2 + (3 + 2 * len(m.graph.initializer)) * m.HasField("graph"))


def test_external_weights_are_written_once_each_page_aligned(tmp_path, monkeypatch):
    """The >2 GB path: each main-graph tensor over 1 KiB (raw or in typed fields) in the data
    file at a page-aligned offset, the small ones and strings inline; reloaded, every value as
    it was."""
    monkeypatch.setattr(outputs, "EXTERNAL_DATA_THRESHOLD", 1000)
    tp = onnx.TensorProto
    weights = [numpy_helper.from_array(np.arange(3000, dtype=np.float32).reshape(30, 100), "raw"),
               helper.make_tensor("typed", tp.FLOAT, [600], np.linspace(0, 1, 600).tolist()),
               numpy_helper.from_array(np.arange(900, dtype=np.float16), "half"),
               numpy_helper.from_array(np.ones(4, np.float32), "small"),
               helper.make_tensor("names", tp.STRING, [2], [b"a", b"b"])]
    g = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", tp.FLOAT, [2])],
                          [helper.make_tensor_value_info("y", tp.FLOAT, [2])], weights)
    m = helper.make_model(g)
    before = m.SerializeToString()
    outputs.save_model(m, tmp_path / "m.onnx")
    assert m.SerializeToString() == before  # the model written is not changed
    light = onnx.load(str(tmp_path / "m.onnx"), load_external_data=False)
    ext = {t.name: {kv.key: kv.value for kv in t.external_data} for t in light.graph.initializer
           if t.data_location == tp.EXTERNAL}
    assert sorted(ext) == ["half", "raw", "typed"]
    assert all(e["location"] == "m.onnx.data" and int(e["offset"]) % 4096 == 0 for e in ext.values())
    full = {t.name: t for t in onnx.load(str(tmp_path / "m.onnx")).graph.initializer}
    for t in weights:
        np.testing.assert_array_equal(numpy_helper.to_array(full[t.name]), numpy_helper.to_array(t))


def test_external_data_file_gets_the_mode_too(tmp_path, src, umask, monkeypatch):
    monkeypatch.setattr(outputs, "EXTERNAL_DATA_THRESHOLD", 1000)
    umask(0o022)
    out = tmp_path / "big.onnx"
    (tmp_path / "big.onnx.data").write_bytes(b"previous")
    os.chmod(tmp_path / "big.onnx.data", 0o640)
    outputs.save_model(onnx.load(str(src)), out)
    assert mode(out) == 0o644 and mode(tmp_path / "big.onnx.data") == 0o640
    onnx.checker.check_model(onnx.load(str(out)))


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="only root may give files away")
def test_replaced_file_keeps_its_owner_when_root_writes_it(tmp_path, src):
    """A model served by another user, optimized again by root (a deployment job)."""
    out = tmp_path / "o.onnx"
    out.write_bytes(b"previous")
    os.chown(out, 65534, 65534)
    os.chmod(out, 0o640)
    assert cli.main(["optimize", str(src), str(out), *NONE]) == 0
    st = os.stat(out)
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (65534, 65534, 0o640)


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root to set up the group")
def test_replaced_file_keeps_its_group_when_the_owner_cannot_be_kept(tmp_path, src, monkeypatch):
    """A user of the file's group replaces it (simulated: chown of the owner refused)."""
    out = tmp_path / "o.onnx"
    out.write_bytes(b"previous")
    os.chown(out, 65534, 4)
    real = os.chown

    def chown(path, uid, gid):
        if uid != -1:
            raise PermissionError(errno.EPERM, os.strerror(errno.EPERM))
        real(path, uid, gid)

    monkeypatch.setattr(os, "chown", chown)
    outputs.save_model(onnx.load(str(src)), out)
    assert (os.stat(out).st_uid, os.stat(out).st_gid) == (os.geteuid(), 4)


def test_symlink_target_keeps_its_mode(tmp_path, src, umask):
    real = tmp_path / "real.onnx"
    real.write_bytes(b"previous")
    os.chmod(real, 0o664)
    (tmp_path / "link.onnx").symlink_to("real.onnx")
    assert cli.main(["optimize", str(src), str(tmp_path / "link.onnx"), *NONE]) == 0
    assert mode(real) == 0o664 and (tmp_path / "link.onnx").is_symlink()


# ---------------------------------------------------------------------------------------
# 4. a failed command leaves none of its outputs
# ---------------------------------------------------------------------------------------

def test_missing_report_folder_fails_before_the_model_is_written(tmp_path, src, capsys):
    assert cli.main(["optimize", str(src), str(tmp_path / "o.onnx"), *NONE,
                     "--json", str(tmp_path / "nodir" / "r.json")]) == 2
    assert "nodir/r.json: folder" in one_line(capsys)
    assert names(tmp_path) == ["m.onnx"]


def _fail_writing(monkeypatch, suffix: str) -> None:
    real = outputs._write_file

    def write(path, data):
        if Path(path).name.rsplit(".", 2)[0].endswith(suffix):  # the temporary file .<name>.<random>.tmp
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(path, data)

    monkeypatch.setattr(outputs, "_write_file", write)


def test_report_that_cannot_be_written_leaves_no_model(tmp_path, src, capsys, monkeypatch):
    out, js = tmp_path / "o.onnx", tmp_path / "r.json"
    out.write_bytes(b"previous model")
    _fail_writing(monkeypatch, ".json")
    assert cli.main(["optimize", str(src), str(out), *NONE, "--json", str(js)]) == 2
    assert "r.json: cannot write (No space left on device)" in one_line(capsys)
    assert out.read_bytes() == b"previous model"
    assert names(tmp_path) == ["m.onnx", "o.onnx"]


def test_analyze_plot_that_cannot_be_written_leaves_no_json(tmp_path, src, capsys, monkeypatch):
    pytest.importorskip("matplotlib")
    _fail_writing(monkeypatch, ".png")
    assert cli.main(["analyze", str(src), "--json", str(tmp_path / "a.json"), "--plot", str(tmp_path / "r.png")]) == 2
    assert "r.png: cannot write" in one_line(capsys)
    assert names(tmp_path) == ["m.onnx"]


def test_failed_rename_puts_the_previous_files_back(tmp_path, monkeypatch):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text("old a")
    b.write_text("old b")
    real = os.replace

    def replace(src, dst):
        if Path(dst).name == "b.json":
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        real(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OnnxfuseError, match="b.json: cannot write"), Outputs([a, b]) as out:
        out.text(a, "new a")
        out.text(b, "new b")
        out.commit()
    assert (a.read_text(), b.read_text()) == ("old a", "old b")
    assert names(tmp_path) == ["a.json", "b.json"]


def test_leaving_without_commit_writes_nothing(tmp_path):
    with Outputs([tmp_path / "a.txt"]) as out:
        out.text(tmp_path / "a.txt", "never")
    assert names(tmp_path) == []


# ---------------------------------------------------------------------------------------
# 6. external data outside the model's folder
# ---------------------------------------------------------------------------------------

@pytest.fixture
def outside(tmp_path) -> Path:
    """A model in sub/ whose external data is ../w.bin."""
    w = numpy_helper.from_array(np.ones(4, np.float32), "w")
    m = model([helper.make_node("Add", ["x", "w"], ["y"])], {"x": ("float32", [4])}, {"y": ("float32", [4])},
              {"w": np.ones(4, np.float32)})
    (tmp_path / "w.bin").write_bytes(w.raw_data)
    t = m.graph.initializer[0]
    t.ClearField("raw_data")
    t.data_location = onnx.TensorProto.EXTERNAL
    for k, v in (("location", "../w.bin"), ("offset", "0"), ("length", "16")):
        t.external_data.add(key=k, value=v)
    (tmp_path / "sub").mkdir()
    p = tmp_path / "sub" / "m.onnx"
    p.write_bytes(m.SerializeToString())
    return p


@pytest.mark.parametrize("command", ["optimize", "analyze", "profile"])
def test_external_data_outside_the_folder_is_a_one_line_error(tmp_path, outside, capsys, command):
    if command == "profile":
        pytest.importorskip("onnxruntime")
    argv = [command, str(outside)] + ([str(tmp_path / "o.onnx"), *NONE] if command == "optimize" else [])
    assert cli.main(argv) == 2
    assert "cannot read external data" in one_line(capsys)
    assert not (tmp_path / "o.onnx").exists()


# ---------------------------------------------------------------------------------------
# 9. closed pipes, long chains, --patterns FILE
# ---------------------------------------------------------------------------------------

def _closed_stdout(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """Run the CLI with stdout a pipe whose reader is gone (as after `| head -1`)."""
    r, w = os.pipe()
    os.close(r)
    try:
        return subprocess.run([sys.executable, "-m", "onnxfuse.cli", *argv], stdout=w, stderr=subprocess.PIPE,
                              text=True, cwd=cwd, timeout=300, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    finally:
        os.close(w)


@pytest.mark.parametrize("command", ["analyze", "optimize"])
def test_closed_stdout_exits_141_quietly_and_keeps_the_files(tmp_path, src, command):
    js = tmp_path / "r.json"
    argv = ([command, str(src), "--json", str(js)] if command == "analyze"
            else [command, str(src), str(tmp_path / "o.onnx"), *NONE, "--json", str(js)])
    r = _closed_stdout(argv, ROOT)
    assert r.returncode == cli.EXIT_BROKEN_PIPE == 141, r.stderr
    assert r.stderr == ""
    assert json.loads(js.read_text())
    if command == "optimize":
        onnx.checker.check_model(onnx.load(str(tmp_path / "o.onnx")))


def _long_chain(n: int) -> onnx.ModelProto:
    nodes = [helper.make_node("Neg" if i % 2 else "Abs", [f"t{i}" if i else "x"], [f"t{i + 1}" if i < n - 1 else "y"],
                              name=f"n{i}") for i in range(n)]
    return model(nodes, {"x": ("float32", [4, 8])}, {"y": ("float32", [4, 8])})


def test_long_fused_chain_is_shortened_in_text_not_in_json(tmp_path, capsys):
    n = 400
    p = tmp_path / "chain.onnx"
    p.write_bytes(_long_chain(n).SerializeToString())
    js = tmp_path / "r.json"
    assert cli.main(["optimize", str(p), str(tmp_path / "o.onnx"), *NONE, "--json", str(js)]) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) < 200, out
    assert f"({n - 12:,} more)" in out
    (fused,) = json.loads(js.read_text())["fused"]
    assert len(fused["replaces"]) == n
    assert cli.main(["analyze", str(p)]) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) < 250, max(out.splitlines(), key=len)


def test_report_summary_of_a_huge_chain_is_short():
    r = optimize_model(_long_chain(30)).report
    r.fused[0].replaces = r.fused[0].replaces * 10_000  # 300,000 nodes
    assert max(len(line) for line in r.summary().splitlines()) < 200


def test_patterns_option_given_a_file_says_so(tmp_path, src, capsys):
    assert cli.main(["optimize", str(src), str(tmp_path / "o.onnx"), *NONE, "--patterns", str(src)]) == 2
    err = one_line(capsys)
    assert "not a folder" in err and "does not exist" not in err
