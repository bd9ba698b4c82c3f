"""The README's commands: the set-up commands match .ci/run, and every CLI example runs."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"```bash\n(.*?)```", README, re.S)
COMMANDS = [line.strip() for b in BLOCKS for line in b.splitlines() if line.strip()]
TEST_COMMAND = "pip install torch==2.13.0 && pip install -e \".[test]\" && python -m pytest"


def test_ci_runs_the_readme_test_command():
    assert TEST_COMMAND in COMMANDS
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    ci = [line for line in lines if line and not line.startswith(("#", "set ", "cd ", "export "))]
    assert ci == [TEST_COMMAND]


def test_setup_command_installs_then_optimizes_the_bundled_example():
    (setup,) = [c for c in COMMANDS if c.startswith("pip install -e") and "onnxfuse optimize" in c]
    assert "onnxfuse analyze models/activation_block.onnx" in setup
    assert "onnxfuse optimize models/activation_block.onnx" in setup and "onnxfuse bench" in setup


# what `optimize` fuses in each bundled model the README's commands use
FUSED = {"models/example.onnx": "layer_norm: 1 fused", "models/activation_block.onnx": "pointwise_chain: 1 fused"}


# Each line's onnxfuse commands, in order (a set-up line chains pip install && onnxfuse ...).
CLI_COMMANDS = [[part.strip() for part in c.split("&&") if part.strip().startswith("onnxfuse ")]
                for c in COMMANDS if "onnxfuse " in c]


@pytest.mark.parametrize("commands", CLI_COMMANDS, ids=lambda cs: " && ".join(cs)[:60])
def test_readme_cli_command_runs(tmp_path, commands):
    (tmp_path / "models").mkdir()
    for name in FUSED:
        shutil.copy(ROOT / name, tmp_path / name)
    for command in commands:
        argv = command.split()
        r = subprocess.run([sys.executable, "-m", "onnxfuse.cli", *argv[1:]], cwd=tmp_path, capture_output=True,
                           text=True, timeout=600)
        assert r.returncode == 0, (command, r.stdout, r.stderr)
        if argv[1] == "optimize":
            assert FUSED[argv[2]] in r.stdout
            assert (tmp_path / argv[3]).exists()


PYTHON_BLOCKS = re.findall(r"```python\n(.*?)```", README, re.S)


@pytest.mark.parametrize("code", PYTHON_BLOCKS, ids=[f"python{i}" for i in range(len(PYTHON_BLOCKS))])
def test_readme_python_example_runs(tmp_path, code):
    # the examples use the optimized bundled example (on this machine's providers: CPU here)
    r = subprocess.run([sys.executable, "-m", "onnxfuse.cli", "optimize", str(ROOT / "models" / "example.onnx"),
                        "example.opt.onnx", "--target", "none"], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
