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
