"""benchmarks/gpu_session.sh: its two-call GPU test modes (gpu-tests-a, gpu-tests-b) name every
test file that holds a GPU-marked test, so that running both runs them all."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _mode_block(text: str, label: str) -> str:
    start = text.index(f"  {label})")
    return text[start:text.index("\n    ;;", start)]


def test_the_two_gpu_test_calls_cover_every_gpu_test_file():
    script = (ROOT / "benchmarks" / "gpu_session.sh").read_text()
    named = set(re.findall(r"tests/(test_\w+\.py)", _mode_block(script, "gpu-tests-a|gpu-tests-b")))
    used = re.compile(r"^\s*(@pytest\.mark\.gpu|pytestmark\s*=.*pytest\.mark\.gpu)", re.M)
    marked = {p.name for p in (ROOT / "tests").glob("test_*.py") if used.search(p.read_text())}
    assert marked, "no GPU-marked test found: the marker's spelling changed?"
    assert marked <= named, f"not run by gpu-tests-a/b: {sorted(marked - named)}"
    assert named <= {p.name for p in (ROOT / "tests").glob("test_*.py")}, "a named file does not exist"


def test_cache_save_and_load_carry_the_caches_to_a_fresh_machine(tmp_path):
    """cache-save packs the tuning cache and the kernels into $OUT; cache-load unpacks them
    under another machine's cache root, file for file."""
    import subprocess

    src, dst, out = tmp_path / "src", tmp_path / "dst", tmp_path / "out"
    (src / "tune").mkdir(parents=True)
    (src / "kernels" / "ab").mkdir(parents=True)
    (src / "tune" / "H200.json").write_text('{"k": {"ms": 0.01}}')
    (src / "kernels" / "ab" / "k.cubin").write_bytes(b"\x7fELF" + bytes(64))
    (src / "lib").mkdir()  # the built library stays behind: it is the machine's own
    (src / "lib" / "libonnxfuse_ops.so").write_bytes(b"x")
    script = str(ROOT / "benchmarks" / "gpu_session.sh")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "OUT": str(out)}
    subprocess.run(["bash", script, "cache-save"], env={**env, "ONNXFUSE_CACHE": str(src)}, check=True,
                   capture_output=True, cwd=ROOT)
    assert (out / "onnxfuse_cache.tgz").is_file()
    subprocess.run(["bash", script, "cache-load", str(out / "onnxfuse_cache.tgz")],
                   env={**env, "ONNXFUSE_CACHE": str(dst), "OUT": str(tmp_path / "out2")}, check=True,
                   capture_output=True, cwd=ROOT)
    assert (dst / "tune" / "H200.json").read_text() == '{"k": {"ms": 0.01}}'
    assert (dst / "kernels" / "ab" / "k.cubin").read_bytes() == b"\x7fELF" + bytes(64)
    assert not (dst / "lib").exists()


def test_kernels_too_large_for_one_file_travel_in_parts(tmp_path):
    """Past the tool's per-file limit (CACHE_PART_BYTES here, 15 MB in use) cache-save writes the
    tuning cache alone and the kernels in numbered parts; cache-load joins them again. Past
    CACHE_MAX_PARTS the kernels are left out and the tuning cache still travels."""
    import os
    import subprocess

    src, out = tmp_path / "src", tmp_path / "out"
    (src / "tune").mkdir(parents=True)
    (src / "kernels").mkdir()
    (src / "tune" / "H200.json").write_text("{}")
    blob = os.urandom(9000)  # incompressible: 3 parts of 4000 bytes
    (src / "kernels" / "k.cubin").write_bytes(blob)
    script = str(ROOT / "benchmarks" / "gpu_session.sh")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "CACHE_PART_BYTES": "4000"}
    subprocess.run(["bash", script, "cache-save"], env={**env, "ONNXFUSE_CACHE": str(src), "OUT": str(out)},
                   check=True, capture_output=True, cwd=ROOT)
    assert sorted(p.name for p in out.iterdir()) == ["onnxfuse_cache.tgz", "onnxfuse_kernels.tgz.00",
                                                    "onnxfuse_kernels.tgz.01", "onnxfuse_kernels.tgz.02"]
    dst = tmp_path / "dst"
    subprocess.run(["bash", script, "cache-load", str(out / "onnxfuse_cache.tgz")],
                   env={**env, "ONNXFUSE_CACHE": str(dst), "OUT": str(tmp_path / "o2")}, check=True,
                   capture_output=True, cwd=ROOT)
    assert (dst / "kernels" / "k.cubin").read_bytes() == blob and (dst / "tune" / "H200.json").exists()
    few = tmp_path / "few"
    r = subprocess.run(["bash", script, "cache-save"], env={**env, "ONNXFUSE_CACHE": str(src), "OUT": str(few),
                                                            "CACHE_MAX_PARTS": "2"},
                       check=True, capture_output=True, text=True, cwd=ROOT)
    assert "kernels left out (3 parts)" in r.stdout and [p.name for p in few.iterdir()] == ["onnxfuse_cache.tgz"]


def _fake_python(tmp_path: Path, body: str = 'echo "| asked | $* |"') -> tuple[Path, dict[str, str]]:
    """A python3 first on PATH that stands in for compare.py (a bash script: `body`, by default
    saying what it was asked); the OUT folder and the environment to run gpu_session.sh in."""
    bin_dir, out = tmp_path / "bin", tmp_path / "out"
    bin_dir.mkdir()
    fake = bin_dir / "python3"
    fake.write_text(f"#!/bin/bash\n{body}\n")
    fake.chmod(0o755)
    return out, {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path), "OUT": str(out)}


def test_suite_shapes_times_the_rows_four_ways_in_one_call(tmp_path):
    """suite-shapes: the variant set (all six, or the three graph variants) crossed with the runs
    per variant (60, 150), each pass its own JSON, the caller's compare.py arguments passed to
    every pass; without .devlib it stops before running anything."""
    import subprocess

    out, env = _fake_python(tmp_path)
    script = str(ROOT / "benchmarks" / "gpu_session.sh")
    args = ["bash", script, "suite-shapes", "100", "--models", "bert_base", "--batches", "1"]
    r = subprocess.run(args, env={**env, "ONNXFUSE_LIBRARY": "lib.so"}, capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    asked = {p.stem.removeprefix("suite_shapes_"): p.read_text() for p in out.glob("suite_shapes_*.log")}
    assert sorted(asked) == ["six150", "six60", "three150", "three60"]
    for tag, text in asked.items():
        variants = "ort_graph,ort_tfopt_graph,onnxfuse_graph" if tag.startswith("three") else \
            "ort,ort_graph,ort_tfopt,ort_tfopt_graph,onnxfuse,onnxfuse_graph"
        assert f"--variants {variants} --iters {tag.removeprefix('six').removeprefix('three')} " in text
        assert f"--json {out}/suite_shapes_{tag}.json --models bert_base --batches 1 |" in text
    assert r.stdout.count("| asked |") == 4
    env.pop("OUT")
    r = subprocess.run(args, env={**env, "OUT": str(tmp_path / "o2")}, capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 2 and "no .devlib" in r.stderr and not any((tmp_path / "o2").glob("suite_shapes_*"))


def test_suite_resume_goes_on_where_the_last_call_stopped(tmp_path):
    """suite-resume: the first call skips nothing; its JSON is kept (numbered in call order) and
    the next call passes it to --skip-done; each call ends with the merged table of all."""
    import subprocess

    done = tmp_path / "done"
    # says what it was asked, writes its --json
    out, env = _fake_python(tmp_path, 'echo "| asked | $* |"\nprev=""\nfor a in "$@"; do\n'
                                      '  [ "$prev" = "--json" ] && echo \'{"cases": []}\' > "$a"\n  prev="$a"\ndone')
    script = str(ROOT / "benchmarks" / "gpu_session.sh")
    env.update(RESUME_DIR=str(done), ONNXFUSE_LIBRARY="lib.so")
    runs = []
    for tag in ("a", "b"):
        r = subprocess.run(["bash", script, "suite-resume", tag, "100", "--models", "bert_base"], env=env,
                           capture_output=True, text=True, cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        runs.append([ln for ln in r.stdout.splitlines() if ln.startswith("| asked |")])
    first, second = runs
    assert "--skip-done" not in first[0] and f"--json {out}/suite_a.json --models bert_base |" in first[0]
    assert f"--skip-done {done}/00_suite_a.json --models bert_base |" in second[0]
    assert sorted(p.name for p in done.iterdir()) == ["00_suite_a.json", "01_suite_b.json"]
    assert f"--from-json {done}/00_suite_a.json {done}/01_suite_b.json --markdown {out}/suite_b_merged.md" in second[1]


def test_suite_prep_runs_one_process_per_model(tmp_path):
    """suite-prep with --models: one compare.py --prepare per model, at once, each given the
    other arguments, their logs in suite_prep.log in the order of the models; without
    --models, one process for the whole suite."""
    import subprocess

    out, env = _fake_python(tmp_path, 'echo "| asked | $* | OMP_NUM_THREADS=${OMP_NUM_THREADS:-unset} |"')
    script = str(ROOT / "benchmarks" / "gpu_session.sh")
    args = ["bash", script, "suite-prep", "100", "--models", "bert_base,vit_s16_dynamo", "--dtypes", "fp16"]
    r = subprocess.run(args, env=env, capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    asked = [ln for ln in (out / "suite_prep.log").read_text().splitlines() if ln.startswith("| asked |")]
    assert len(asked) == 2
    for line, name in zip(asked, ("bert_base", "vit_s16_dynamo"), strict=True):
        assert f"--prepare --model-cache /tmp/suite-models --models {name} --dtypes fp16 |" in line
        assert "OMP_NUM_THREADS=unset" not in line
    r = subprocess.run(["bash", script, "suite-prep", "100", "--dtypes", "fp32"], env=env, capture_output=True,
                       text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    (line,) = [ln for ln in r.stdout.splitlines() if ln.startswith("| asked |")]
    assert "--prepare --model-cache /tmp/suite-models --dtypes fp32 |" in line and "--models" not in line
