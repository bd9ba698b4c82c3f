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
