"""Failure paths: kernels that do not compile, full disks, unwritable outputs, Ctrl-C,
opsets newer than the tool knows, corrupt pattern files.

The rule: the optimizer either writes a correct model (possibly with fewer fusions, and a
warning saying why) or fails with a one-line error (exit 2; 130 for Ctrl-C); it never leaves
a partial output or temporary files behind, and a file already at the output path is
untouched when it fails."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper

import onnxfuse
from onnxfuse import cli, optimize_model, outputs, pipeline
from onnxfuse import compile as aot
from onnxfuse.codegen import KernelSpec
from onnxfuse.errors import OnnxfuseError, OnnxfuseWarning
from onnxfuse.kernels import FAILED_REASON
from onnxfuse.kinds import pointwise
from onnxfuse.pipeline import compile_pass
from onnxfuse.rewrite import DOMAIN, unfuse
from tests.util import kernel_options, model, op_types, random_feeds, run

N = helper.make_node
REPO = Path(__file__).resolve().parent.parent
X = {"x": ("float32", [4, 8])}


def two_groups() -> onnx.ModelProto:
    """Two fused groups (split by a ReduceMax) with different programs."""
    return model([N("Mul", ["x", "x"], ["a"], name="sq"), N("Exp", ["a"], ["b"], name="exp"),
                  N("ReduceMax", ["b"], ["r"], keepdims=1, name="max"), N("Sub", ["b", "r"], ["c"], name="sub"),
                  N("Sigmoid", ["c"], ["y"], name="sig")], X, {"y": ("float32", [4, 8])}, opset=17)


def lib_run(m: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    return onnxfuse.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"],
                                     sess_options=so).run(None, feeds)


def same_results(a: onnx.ModelProto, b: onnx.ModelProto) -> None:
    feeds = random_feeds(a)
    for e, got in zip(run(a, feeds), run(b, feeds), strict=True):
        np.testing.assert_allclose(got, e, rtol=1e-6)
    for e, got in zip(run(a, feeds), lib_run(b, feeds), strict=True):
        np.testing.assert_allclose(got, e, rtol=1e-5, atol=1e-6)


def leftovers(folder: Path, keep: set[str]) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name not in keep)


# ---------------------------------------------------------------------------------------
# kernels that do not compile
# ---------------------------------------------------------------------------------------

def _fake_compile(fail: set[tuple[str, int]]):
    """A stand-in for compile._compile_job: writes a dummy cache entry, or raises for the
    (kernel name prefix, arch) pairs in `fail`."""

    def job(j: aot._Job) -> tuple[str, float]:
        for prefix, arch in fail:
            if j.kernel.name.startswith(prefix) and j.arch == arch:
                raise RuntimeError(f"PTXAS error: simulated failure for sm_{arch}\nsecond line")
        meta = {"entry": j.kernel.name, "num_warps": 4, "shared": 0, "global_scratch_size": 0,
                "global_scratch_align": 1, "profile_scratch_size": 0, "profile_scratch_align": 1}
        aot._cache_put(Path(j.root), j.key, meta, b"\x7fELF-fake", f"//\n.target sm_{j.arch}\n")
        return j.key, 0.01

    return job


def test_kernel_failing_for_one_target_leaves_that_group_unfused(tmp_path, monkeypatch):
    monkeypatch.setenv("ONNXFUSE_CACHE", str(tmp_path / "cache"))
    m = two_groups()
    first = optimize_model(m).fused[0].kernel_name
    monkeypatch.setattr(aot, "_compile_job", _fake_compile({(first, 90)}))
    src, out = tmp_path / "m.onnx", tmp_path / "out.onnx"
    src.write_bytes(m.SerializeToString())
    with pytest.warns(OnnxfuseWarning, match="failed to compile for sm_90"):
        report = pipeline.optimize(src, out, target="sm_80,sm_90", layout="nchw", tune="off", jobs=1)
    o = onnx.load(str(out))
    onnx.checker.check_model(o, full_check=True)
    # the failed group is back as its original nodes (names kept); the other one has its kernels
    assert op_types(o) == ["Mul", "Exp", "ReduceMax", "PointwiseChain"]
    assert [n.name for n in o.graph.node[:2]] == ["sq", "exp"]
    fused = [n for n in o.graph.node if n.domain == DOMAIN]
    assert {a.name for a in fused[0].attribute} >= {"program", "kernel_meta", "kernel_0"}
    assert [(f.domain, f.overload) for f in o.functions] == [(DOMAIN, fused[0].overload)]
    assert report.nodes_after == 4 and len(report.fused) == 1 and report.patterns_applied == {"pointwise_chain": 1}
    assert report.not_fused[FAILED_REASON] == 2
    (failure,) = report.compile["failed"]
    assert failure["targets"] == [90] and "simulated failure" in failure["error"]
    assert any("pointwise_chain_sq" in w and "2 original nodes are kept" in w for w in report.warnings)
    assert "1 failed (left unfused)" in report.summary()
    same_results(m, o)


def test_every_kernel_failing_leaves_the_model_unfused_and_valid(tmp_path, monkeypatch):
    monkeypatch.setenv("ONNXFUSE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(aot, "_compile_job", _fake_compile({("onnxfuse_", 80)}))
    m = two_groups()
    r = optimize_model(m)
    with pytest.warns(OnnxfuseWarning):
        info = compile_pass(r, kernel_options("sm_80", jobs=1)).report.compile
    assert len(info["failed"]) == 2 and info["kernels"] == 0
    assert op_types(r.model) == op_types(m) and not r.model.functions and not r.fused
    assert DOMAIN not in {i.domain for i in r.model.opset_import}
    onnx.checker.check_model(r.model, full_check=True)
    same_results(m, r.model)


def test_unfuse_restores_the_original_subgraph():
    m = model([N("Mul", ["x", "two"], ["a"], name="m"), N("Erf", ["a"], ["b"], name="e"),
               N("Add", ["b", "x"], ["y"], name="t0")], X, {"y": ("float32", [4, 8]), "b": ("float32", [4, 8])},
              {"two": np.array(2.0, np.float32)})
    r = optimize_model(m)
    (f,) = r.fused
    unfuse(r.model, f)
    assert op_types(r.model) == ["Constant", "Mul", "Erf", "Add"]
    assert [n.name for n in r.model.graph.node[1:]] == ["m", "e", "t0"]
    onnx.checker.check_model(r.model, full_check=True)
    same_results(m, r.model)


def _broken_generate(bad_name: str, body: str):
    """codegen.generate as the pointwise kind calls it, except that kernel `bad_name`'s module
    source gets `body` appended."""
    real = pointwise.generate

    def generate(program, name, *args, **kw):
        k = real(program, name, *args, **kw)
        return dataclasses.replace(k, source=k.source + body) if name == bad_name else k

    return generate


@pytest.mark.parametrize("how", ["syntax error", "compiler process dies"])
def test_kernel_failing_in_a_worker_process(tmp_path, monkeypatch, how):
    """Real Triton compilation in two worker processes; one kernel's generated source is
    broken (a SyntaxError, or a module that kills its process): that fusion is dropped,
    the other one compiles."""
    monkeypatch.setenv("ONNXFUSE_CACHE", str(tmp_path / "cache"))
    m = two_groups()
    r = optimize_model(m)
    bad = r.fused[1].kernel_name
    body = "\n)(\n" if how == "syntax error" else "\nimport os\nos._exit(3)\n"
    monkeypatch.setattr(pointwise, "generate", _broken_generate(bad, body))
    with pytest.warns(OnnxfuseWarning, match=f"{r.fused[1].node_name} failed to compile for sm_80"):
        info = compile_pass(r, kernel_options("sm_80", jobs=2)).report.compile
    assert [f["kernel"] for f in info["failed"]] == [bad]
    expected = "SyntaxError" if how == "syntax error" else "exited with code 3"
    assert expected in info["failed"][0]["error"]
    assert info["kernels"] == 1 and info["compiled"] == 2  # two variants of the good kernel
    assert op_types(r.model) == ["PointwiseChain", "ReduceMax", "Sub", "Sigmoid"]
    onnx.checker.check_model(r.model, full_check=True)
    same_results(m, r.model)


def test_compile_errors_still_raise_by_default(tmp_path, monkeypatch):
    monkeypatch.setattr(aot, "_compile_job", _fake_compile({("onnxfuse_", 80)}))
    spec = KernelSpec(optimize_model(two_groups()).fused[0].program, "onnxfuse_k_0123", 2, ("full",))
    with pytest.raises(OnnxfuseError, match="kernel compilation failed .*sm_80"):
        aot.compile_kernels([spec], [80], cache_dir=tmp_path, jobs=1)


def test_interrupted_compile_kills_its_workers(tmp_path, monkeypatch):
    """Ctrl-C while waiting for the compiler processes: they are killed, their folder removed."""
    started, interrupted = [], []
    real_popen = subprocess.Popen

    class Popen(real_popen):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            started.append(self)

        def wait(self, timeout=None):
            if self.poll() is None and not interrupted:
                interrupted.append(self)
                raise KeyboardInterrupt
            return super().wait(timeout)

    folders = []
    real_tmp = aot.tempfile.TemporaryDirectory

    def temporary_directory(*a, **kw):
        d = real_tmp(*a, **kw)
        folders.append(Path(d.name))
        return d

    monkeypatch.setattr(subprocess, "Popen", Popen)
    monkeypatch.setattr(aot.tempfile, "TemporaryDirectory", temporary_directory)
    r = optimize_model(two_groups())
    specs = [KernelSpec(f.program, f.kernel_name, f.rank, f.input_modes) for f in r.fused]
    with pytest.raises(KeyboardInterrupt):
        aot.compile_kernels(specs, [80], cache_dir=tmp_path / "cache", jobs=2)
    assert len(started) == 2
    assert all(p.poll() is not None for p in started)
    assert folders and not any(f.exists() for f in folders)


# ---------------------------------------------------------------------------------------
# writing the output
# ---------------------------------------------------------------------------------------

EXAMPLE = REPO / "models" / "example.onnx"


def _full_disk(after: int = 100):
    """A _write_file that writes `after` bytes, then fails like a full disk."""

    def write(path, data):
        data = data if isinstance(data, bytes) else b"".join(data)  # (a model comes in pieces)
        with open(path, "wb") as f:
            f.write(data[:after])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    return write


def test_full_disk_leaves_no_partial_file_and_keeps_the_old_output(tmp_path, monkeypatch, capsys):
    out = tmp_path / "out.onnx"
    out.write_bytes(b"previous output")
    monkeypatch.setattr(outputs, "_write_file", _full_disk())
    code = cli.main(["optimize", str(EXAMPLE), str(out), "--target", "none"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.strip() == f"onnxfuse: error: {out}: cannot write (No space left on device)"
    assert out.read_bytes() == b"previous output"
    assert leftovers(tmp_path, {"out.onnx"}) == []


def test_full_disk_with_external_data(tmp_path, monkeypatch):
    """The >2 GB path (external data): a failure while writing the data leaves nothing."""
    monkeypatch.setattr(outputs, "EXTERNAL_DATA_THRESHOLD", 1000)
    real_write = outputs._with_external_weights

    def write(model, data_path, location):  # the data file written, then the disk is full
        real_write(model, data_path, location)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(outputs, "_with_external_weights", write)
    with pytest.raises(OnnxfuseError, match="No space left on device"):
        pipeline.optimize(EXAMPLE, tmp_path / "big.onnx", target="none")
    assert leftovers(tmp_path, set()) == []


def test_failing_rename_after_the_data_file_removes_it(tmp_path, monkeypatch):
    monkeypatch.setattr(outputs, "EXTERNAL_DATA_THRESHOLD", 1000)
    real_replace = os.replace

    def replace(src, dst):
        if str(dst).endswith("big.onnx"):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OnnxfuseError, match="Input/output error"):
        pipeline.optimize(EXAMPLE, tmp_path / "big.onnx", target="none")
    assert leftovers(tmp_path, set()) == []


def test_unwritable_output_folder(tmp_path, monkeypatch, capsys):
    """No permission to create a file there (simulated: the tests may run as root)."""
    def create(path):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)

    monkeypatch.setattr(outputs, "_create", create)
    code = cli.main(["optimize", str(EXAMPLE), str(tmp_path / "out.onnx"), "--target", "none"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("onnxfuse: error: ") and "Permission denied" in err
    assert len(err.strip().splitlines()) == 1 and leftovers(tmp_path, set()) == []


def test_output_path_is_a_directory(tmp_path, capsys):
    (tmp_path / "out.onnx").mkdir()
    code = cli.main(["optimize", str(EXAMPLE), str(tmp_path / "out.onnx"), "--target", "none"])
    assert code == 2 and "is a directory" in capsys.readouterr().err


def test_unwritable_json_report_is_a_one_line_error(tmp_path, capsys):
    code = cli.main(["optimize", str(EXAMPLE), str(tmp_path / "out.onnx"), "--target", "none",
                     "--json", str(tmp_path / "no" / "such" / "report.json")])
    err = capsys.readouterr().err
    assert code == 2 and "report.json: folder" in err and len(err.strip().splitlines()) == 1
    assert leftovers(tmp_path, set()) == []  # nor the model: a failed command writes none of its outputs


# ---------------------------------------------------------------------------------------
# Ctrl-C
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("stage", ["find_matches", "rewrite", "write"])
def test_interrupt_in_a_stage_exits_130_and_leaves_nothing(tmp_path, monkeypatch, capsys, stage):
    def interrupt(*a, **kw):
        if stage == "write":
            with open(a[0], "wb") as f:
                f.write(b"partial")
        raise KeyboardInterrupt

    if stage == "write":
        monkeypatch.setattr(outputs, "_write_file", interrupt)
    else:
        monkeypatch.setattr(pipeline, stage, interrupt)
    code = cli.main(["optimize", str(EXAMPLE), str(tmp_path / "out.onnx"), "--target", "none"])
    assert code == 130
    assert capsys.readouterr().err.strip() == "onnxfuse: interrupted"
    assert leftovers(tmp_path, set()) == []


@pytest.mark.parametrize("parent", ["default", "ignored"])
def test_real_sigint_while_writing(tmp_path, parent):
    """SIGINT to a running `onnxfuse optimize` blocked in the middle of writing its output.

    A process started with SIGINT ignored keeps ignoring it (Python installs its handler
    only where SIGINT has its default action): so does a test suite run as a background job
    of a shell, and its children. `parent="ignored"` starts the child so; the child sets
    Python's handler itself, as an interactive `onnxfuse` has it."""
    script = textwrap.dedent(f"""
        import signal, sys, time
        signal.signal(signal.SIGINT, signal.default_int_handler)  # whatever the parent ignores
        from onnxfuse import cli, outputs
        def slow(path, data):
            with open(path, "wb") as f:
                f.write(next(iter([data] if isinstance(data, bytes) else data))[:10])
                f.flush()
            print("writing", flush=True)
            for _ in range(600):  # (short sleeps: a SIGINT that lands on another thread, ONNX
                time.sleep(0.1)   # Runtime's, is still seen within 0.1 s by the main thread)
        outputs._write_file = slow
        sys.exit(cli.main(["optimize", {str(EXAMPLE)!r}, {str(tmp_path / "out.onnx")!r}, "--target", "none"]))
    """)
    disposition = signal.SIG_IGN if parent == "ignored" else signal.SIG_DFL
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)),
                            preexec_fn=lambda: signal.signal(signal.SIGINT, disposition))
    try:
        assert proc.stdout.readline().strip() == "writing"
        assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")], "no temporary file while writing"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert err.strip() == "onnxfuse: interrupted"
    assert leftovers(tmp_path, set()) == []


# ---------------------------------------------------------------------------------------
# opsets, pattern files
# ---------------------------------------------------------------------------------------

def test_newer_opset_leaves_the_model_unchanged_with_a_warning():
    m = model([N("Mul", ["x", "x"], ["a"]), N("Exp", ["a"], ["y"])], X, {"y": ("float32", [4, 8])})
    m.opset_import[0].version = onnx.defs.onnx_opset_version() + 1
    before = m.SerializeToString()
    with pytest.warns(OnnxfuseWarning, match="newer than this onnxfuse knows.*left unchanged"):
        r = optimize_model(m)
    assert m.SerializeToString() == before
    assert r.model.SerializeToString() == before and not r.fused
    assert r.report.nodes_after == r.report.nodes_before == 2
    assert list(r.report.not_fused.values()) == [2]
    assert "warning: opset" in r.report.summary()


def test_unknown_version_of_another_domain_does_not_stop_fusion():
    """Only default-domain ops are fused; another domain's opset version does not matter."""
    m = model([N("Mul", ["x", "x"], ["a"]), N("Exp", ["a"], ["y"])], X, {"y": ("float32", [4, 8])})
    m.opset_import.extend([helper.make_opsetid("ai.onnx.ml", 99), helper.make_opsetid("com.example", 7)])
    r = optimize_model(m)
    assert op_types(r.model) == ["PointwiseChain"] and not r.report.warnings
    onnx.checker.check_model(r.model, full_check=True)


@pytest.mark.parametrize("content,message", [
    (b"\xff\xfe\x00binary", "(file): not UTF-8 text"),
    (b"name: x\ndescription: [unclosed\n", "line 3: not valid YAML"),
    (b"name: x\ndescription: d\nmatch: {kind: elementwise_group, ops: [Conv]}\n"
     b"replace: {op_type: PointwiseChain, kernel: pointwise}\n", "match.ops: 'Conv' is not an elementwise op"),
])
def test_corrupt_pattern_file_names_the_file_and_field(tmp_path, capsys, content, message):
    (tmp_path / "bad.yaml").write_bytes(content)
    code = cli.main(["optimize", str(EXAMPLE), str(tmp_path / "out.onnx"), "--target", "none",
                     "--patterns", str(tmp_path)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith(f"onnxfuse: error: {tmp_path / 'bad.yaml'}: ") and message in err
    assert not (tmp_path / "out.onnx").exists()


def test_json_report_lists_warnings(tmp_path, monkeypatch):
    monkeypatch.setenv("ONNXFUSE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(aot, "_compile_job", _fake_compile({("onnxfuse_", 80)}))
    m = two_groups()
    src = tmp_path / "m.onnx"
    src.write_bytes(m.SerializeToString())
    code = cli.main(["optimize", str(src), str(tmp_path / "o.onnx"), "--target", "sm_80", "--jobs", "1",
                     "--json", str(tmp_path / "r.json")])
    assert code == 0
    report = json.loads((tmp_path / "r.json").read_text())
    assert len(report["warnings"]) == 2 and report["not_fused"][FAILED_REASON] == 4
