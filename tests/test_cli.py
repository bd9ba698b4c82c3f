"""The command line: optimize and patterns, bad input, atomic output, the input left alone."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from models.build import example
from tests.util import random_feeds, run

EXAMPLE = Path(__file__).resolve().parent.parent / "models" / "example.onnx"


def cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "onnxfuse.cli", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=300)


def sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def test_bundled_example_is_current():
    assert EXAMPLE.read_bytes() == example().SerializeToString(deterministic=True)


def test_optimize_example(tmp_path):
    out, js = tmp_path / "out.onnx", tmp_path / "report.json"
    before = sha(EXAMPLE)
    r = cli("optimize", str(EXAMPLE), str(out), "--target", "none", "--json", str(js))
    assert r.returncode == 0, r.stderr
    assert "layer_norm: 1 fused" in r.stdout and "pointwise_chain: 1 fused" in r.stdout
    assert "nodes: 19 -> 10" in r.stdout
    assert "6 nodes: left to ONNX Runtime's BiasGelu fusion" in r.stdout
    assert sha(EXAMPLE) == before
    report = json.loads(js.read_text())
    assert report["patterns_applied"] == {"layer_norm": 1, "pointwise_chain": 1}
    assert report["nodes_before"] == 19 and report["nodes_after"] == 10
    assert report["not_fused"]["left to ONNX Runtime's BiasGelu fusion"] == 6
    assert {"node", "pattern", "kernel", "replaces"} <= set(report["fused"][0])
    m, o = onnx.load(str(EXAMPLE)), onnx.load(str(out))
    onnx.checker.check_model(o, full_check=True)
    feeds = random_feeds(m, {"N": 5})
    for a, b in zip(run(m, feeds), run(o, feeds), strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-6)
    # byte-identical on a second run, and a fixed point when run on its own output
    out2, out3 = tmp_path / "out2.onnx", tmp_path / "out3.onnx"
    assert cli("optimize", str(EXAMPLE), str(out2), "--target", "none").returncode == 0
    assert cli("optimize", str(out), str(out3), "--target", "none").returncode == 0
    assert out2.read_bytes() == out.read_bytes() == out3.read_bytes()


def test_patterns_command(tmp_path):
    r = cli("patterns")
    assert r.returncode == 0
    names = [line.split()[0] for line in r.stdout.splitlines()]
    assert names == ["squeeze_excite", "conv_relu_maxpool", "conv_relu", "conv_grouped", "relu_maxpool",  # by
                     "maxpool", "conv_alone", "attention", "layer_norm", "rms_norm", "softmax",  # priority
                     "group_norm", "gemm_epilogue", "gemm_library", "pointwise_chain"]


def bad(tmp_path: Path, *args: str) -> str:
    out = tmp_path / "out.onnx"
    r = cli("optimize", *args, str(out), "--target", "none")
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.onnx")], "temporary file left behind"
    return r.stderr


def test_the_console_script_runs_atexit_handlers_and_keeps_the_status(tmp_path):
    """entry() ends the process with os._exit (the native libraries' teardown aborts now and
    then with ONNX Runtime's CUDA EP and torch in one process) after Python's own clean-up:
    the streams flushed, every atexit handler run, the command's exit status kept."""
    code = ("import atexit, sys; from onnxfuse import cli; "
            "atexit.register(lambda: print('atexit handler ran')); cli.entry(); print('not reached')")
    ok = subprocess.run([sys.executable, "-c", code, "analyze", str(EXAMPLE)], capture_output=True, text=True,
                        timeout=300)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.rstrip().endswith("atexit handler ran") and "not reached" not in ok.stdout
    assert "FLOP" in ok.stdout
    missing = subprocess.run([sys.executable, "-c", code, "optimize", str(tmp_path / "nope.onnx"),
                              str(tmp_path / "out.onnx")], capture_output=True, text=True, timeout=300)
    assert missing.returncode == 2 and "no such file" in missing.stderr and "Traceback" not in missing.stderr
    assert missing.stdout.strip() == "atexit handler ran"


def test_missing_file(tmp_path):
    assert "no such file" in bad(tmp_path, str(tmp_path / "nope.onnx"))


def test_not_onnx(tmp_path):
    p = tmp_path / "text.onnx"
    p.write_text("hello, I am not a model\n" * 10)
    assert "not a valid ONNX model" in bad(tmp_path, str(p))


def test_truncated(tmp_path):
    p = tmp_path / "trunc.onnx"
    p.write_bytes(EXAMPLE.read_bytes()[: 5000])
    assert "not a valid ONNX model" in bad(tmp_path, str(p))


def test_opset_newer_than_known_leaves_the_model_unchanged(tmp_path):
    """Any op may mean something else in an opset onnx does not know yet: the model is written
    unchanged, with a warning, and the command succeeds."""
    m = onnx.load(str(EXAMPLE))
    m.opset_import[0].version = 99
    p, out, js = tmp_path / "future.onnx", tmp_path / "out.onnx", tmp_path / "r.json"
    p.write_bytes(m.SerializeToString())
    r = cli("optimize", str(p), str(out), "--target", "none", "--json", str(js))
    assert r.returncode == 0, r.stderr
    assert r.stderr.startswith("onnxfuse: warning: opset 99 is newer than this onnxfuse knows"), r.stderr
    assert "left unchanged" in r.stderr and "Traceback" not in r.stderr
    assert onnx.load(str(out)).graph == m.graph
    report = json.loads(js.read_text())
    assert report["nodes_after"] == report["nodes_before"] == len(m.graph.node)
    assert report["warnings"] and not report["fused"]


def test_unsupported_old_opset(tmp_path):
    m = onnx.load(str(EXAMPLE))
    m.opset_import[0].version = 5
    p = tmp_path / "old.onnx"
    p.write_bytes(m.SerializeToString())
    assert "opset 5 is older than supported" in bad(tmp_path, str(p))


def test_missing_external_data(tmp_path):
    m = onnx.load(str(EXAMPLE))
    p = tmp_path / "ext.onnx"
    onnx.save_model(m, str(p), save_as_external_data=True, location="ext.onnx.data", size_threshold=0)
    os.unlink(tmp_path / "ext.onnx.data")
    assert "missing external data" in bad(tmp_path, str(p))


def test_output_folder_missing(tmp_path):
    r = cli("optimize", str(EXAMPLE), str(tmp_path / "no" / "out.onnx"), "--target", "none")
    assert r.returncode == 2 and "does not exist" in r.stderr and "Traceback" not in r.stderr


def test_refuses_to_overwrite_input(tmp_path):
    p = tmp_path / "m.onnx"
    p.write_bytes(EXAMPLE.read_bytes())
    r = cli("optimize", str(p), str(p), "--target", "none")
    assert r.returncode == 2 and "overwrite the input" in r.stderr
    assert p.read_bytes() == EXAMPLE.read_bytes()


def test_bad_pattern_folder_is_a_one_line_error(tmp_path):
    (tmp_path / "broken.yaml").write_text("name: x\n")
    r = cli("patterns", "--patterns", str(tmp_path))
    assert r.returncode == 2
    assert r.stderr.strip() == f"onnxfuse: error: {tmp_path / 'broken.yaml'}: description: is required"


def test_external_data_model_round_trips(tmp_path):
    m = onnx.load(str(EXAMPLE))
    src = tmp_path / "ext.onnx"
    onnx.save_model(m, str(src), save_as_external_data=True, location="ext.onnx.data", size_threshold=0)
    out = tmp_path / "out.onnx"
    r = cli("optimize", str(src), str(out), "--target", "none")
    assert r.returncode == 0, r.stderr
    ref = onnx.load(str(EXAMPLE))  # save_model moved m's weights out
    feeds = random_feeds(ref)
    np.testing.assert_allclose(run(onnx.load(str(out)), feeds)[0], run(ref, feeds)[0], rtol=1e-6)


@pytest.mark.parametrize("module", ["models.build"])
def test_model_scripts_run(tmp_path, module):
    r = subprocess.run([sys.executable, "-m", module, "--out", str(tmp_path)], capture_output=True, text=True,
                       cwd=Path(__file__).resolve().parent.parent, timeout=300)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "example.onnx").exists()


def test_big_models_are_written_with_external_data(tmp_path, monkeypatch):
    # Stand-in for a model over 2 GB: lower the threshold instead of allocating gigabytes.
    from onnxfuse import outputs, pipeline

    monkeypatch.setattr(outputs, "EXTERNAL_DATA_THRESHOLD", 1000)
    out = tmp_path / "big.onnx"
    pipeline.optimize(EXAMPLE, out, target="none")
    assert (tmp_path / "big.onnx.data").stat().st_size > 100_000
    assert out.stat().st_size < 50_000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.onnx", "big.onnx.data"]
    ref = onnx.load(str(EXAMPLE))
    feeds = random_feeds(ref)
    np.testing.assert_allclose(run(onnx.load(str(out)), feeds)[0], run(ref, feeds)[0], rtol=1e-6)


def test_exclude_pattern(tmp_path, capsys):
    import onnx

    from models.build import vgg_stack
    from onnxfuse.cli import main

    src, dst = tmp_path / "m.onnx", tmp_path / "o.onnx"
    onnx.save(vgg_stack(blocks=2, channels=8, size=16), str(src))
    args = ["optimize", str(src), str(dst), "--target", "none"]
    assert main([*args, "--exclude-pattern", "conv_relu_maxpool", "--exclude-pattern", "conv_relu"]) == 0
    ops = [n.op_type for n in onnx.load(str(dst)).graph.node]
    assert ops == ["Conv", "FusedMaxPool"] * 2  # Relu + MaxPool still fuse
    capsys.readouterr()
    dst.unlink()
    assert main([*args, "--exclude-pattern", "no_such_pattern"]) == 2
    err = capsys.readouterr().err
    assert "no_such_pattern: no such pattern" in err and "conv_relu" in err and not dst.exists()


def _conv_model(tmp_path) -> Path:
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.ones((16, 16, 3, 3), np.float32), "w")
    g = helper.make_graph([helper.make_node("Conv", ["x", "w"], ["y"], kernel_shape=[3, 3], pads=[1] * 4)], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 16, 8, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 16, 8, 8])], [w])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 9
    src = tmp_path / "conv.onnx"
    src.write_bytes(m.SerializeToString())
    return src


@pytest.mark.parametrize("flags, kwargs", [
    ([], {}),
    (["--target", "none"], {"target": "none"}),
    (["--target", "none", "--layout", "nchw", "--conv-precision", "ieee", "--no-tune", "--shape", "x=2,16,8,8",
      "--batch", "2", "--tune-budget", "5", "--jobs", "3", "--exclude-pattern", "conv_relu",
      "--patterns", "{patterns}"],
     {"target": "none", "layout": "nchw", "conv_precision": "ieee", "tune": "off", "shapes": {"x": (2, 16, 8, 8)},
      "batch": 2, "tune_budget": 5.0, "jobs": 3, "exclude": ["conv_relu"],
      "pattern_dirs": ["{patterns}"]}),
])
def test_the_cli_and_the_python_api_build_equal_options(tmp_path, monkeypatch, flags, kwargs):
    """`onnxfuse optimize` and `onnxfuse.optimize` hand the passes equal Options for equal
    inputs, and the same defaults (`onnxfuse.pipeline.build_options`, issue 16)."""
    from onnxfuse import optimize, pipeline
    from onnxfuse.cli import main

    seen = []
    real = pipeline.optimize_model

    def spy(model, *args, options=None, **kw):
        seen.append(options)
        return real(model, *args, options=dataclasses.replace(options, target="none", tune=None), **kw)

    monkeypatch.setattr(pipeline, "optimize_model", spy)
    monkeypatch.setenv("ONNXFUSE_CACHE", str(tmp_path / "cache"))
    src = _conv_model(tmp_path)
    (tmp_path / "patterns").mkdir()  # a pattern folder of no patterns: a str for the CLI, a Path from Python
    flags = [str(tmp_path / "patterns") if f == "{patterns}" else f for f in flags]
    if "pattern_dirs" in kwargs:
        kwargs = {**kwargs, "pattern_dirs": [tmp_path / "patterns"]}
    assert main(["optimize", str(src), str(tmp_path / "cli.onnx"), *flags]) == 0
    optimize(src, tmp_path / "api.onnx", **kwargs)
    cli, api = seen
    assert isinstance(cli, pipeline.Options) and cli == api
    assert cli == pipeline.build_options(**kwargs)
    assert cli.layout in ("nchw", "nhwc")  # "auto" is decided when the options are built
    with pytest.raises(dataclasses.FrozenInstanceError):
        cli.layout = "nchw"


def test_the_layout_picks_the_patterns(tmp_path, monkeypatch):
    """The choose-layout pass: a lone Conv fuses only with the NHWC patterns, that is when
    kernels are compiled (`--layout auto`), not with `--target none`."""
    pytest.importorskip("triton")
    from onnxfuse import optimize

    monkeypatch.setenv("ONNXFUSE_CACHE", str(tmp_path / "cache"))
    src = _conv_model(tmp_path)
    assert optimize(src, tmp_path / "a.onnx", target="sm_90", tune="off").patterns_applied == {"conv_alone": 1}
    assert optimize(src, tmp_path / "b.onnx", target="none").patterns_applied == {}  # nchw: a lone conv stays


def test_the_pass_list_is_the_documented_one():
    """PASSES, in order, is the list README.md gives (Development)."""
    from onnxfuse.pipeline import PASSES

    names = [p.__name__.removesuffix("_pass").replace("_", " ") for p in PASSES]
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    head = "Passes (`onnxfuse.pipeline.PASSES`):"
    (line,) = [ln.strip() for ln in readme.splitlines() if ln.strip().startswith(head)]
    assert line.split(":", 1)[1].strip().rstrip(".").split(" → ") == names
    assert names == ["canonicalize", "fold", "infer shapes", "choose layout", "pack", "head bias", "align", "bias",
                     "match", "rewrite", "kmajor", "compile", "tune"]


def test_python_optimize_has_the_command_lines_defaults(tmp_path, monkeypatch):
    """`onnxfuse.optimize(IN, OUT)` writes what `onnxfuse optimize IN OUT` writes: the same
    targets, layout, precision and tuning decisions (issue 15, item 12), byte for byte."""
    pytest.importorskip("triton")
    from onnx import TensorProto, helper

    from onnxfuse import optimize
    from onnxfuse.cli import main

    monkeypatch.setenv("ONNXFUSE_CACHE", str(tmp_path / "cache"))
    g = helper.make_graph([helper.make_node("Sigmoid", ["x"], ["s"]), helper.make_node("Mul", ["x", "s"], ["y"])],
                          "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 64])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 64])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 10
    src = tmp_path / "m.onnx"
    src.write_bytes(m.SerializeToString())
    report = optimize(src, tmp_path / "api.onnx")
    assert main(["optimize", str(src), str(tmp_path / "cli.onnx")]) == 0
    assert report.compile is not None and report.compile["kernels"] == 1  # compiled, as the CLI does
    assert (tmp_path / "api.onnx").read_bytes() == (tmp_path / "cli.onnx").read_bytes()
    assert optimize(src, tmp_path / "none.onnx", target="none").compile is None


def test_target_none_compiles_no_kernels(tmp_path, monkeypatch):
    """`--target none` embeds no kernels (before the Options, the command line passed no hook
    for it and `onnxfuse.optimize` then compiled for the default targets)."""
    from onnxfuse.cli import main

    monkeypatch.setenv("ONNXFUSE_CACHE", str(tmp_path / "cache"))
    dst, js = tmp_path / "o.onnx", tmp_path / "r.json"
    assert main(["optimize", str(EXAMPLE), str(dst), "--target", "none", "--json", str(js)]) == 0
    assert json.loads(js.read_text())["compile"] is None
    fused = [n for n in onnx.load(str(dst)).graph.node if n.domain == "onnxfuse"]
    assert fused and not any(a.name.startswith("kernel") for n in fused for a in n.attribute)
