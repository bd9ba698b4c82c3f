"""Packaging: a wheel carries the compiled custom-op library, installs where there is no
compiler and runs the README's first command with that library; an editable install
compiles nothing.

The end-to-end test runs the README's wheel line: its `pip wheel` here (with g++), then, in a
fresh venv (no system site-packages) whose PATH holds only the venv's bin and an empty folder
and whose ONNXFUSE_CXX names no compiler, its `pip install` and the set-up command's
`onnxfuse optimize ... && onnxfuse bench ...`, asserting that bench registered the library
shipped in the wheel and that the (empty) onnxfuse cache got no build. It needs the package
index (the wheel build installs setuptools and nvidia-cuda-runtime-cu12 into its isolated
environment; `pip wheel` collects the dependencies' wheels) and is skipped only when the
index cannot be reached at all. About 20-40 s with a warm pip cache.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import sysconfig
import urllib.parse
import urllib.request
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
COMMANDS = [line.strip() for b in re.findall(r"```bash\n(.*?)```", README, re.S) for line in b.splitlines()
            if line.strip()]
(WHEEL_LINE,) = [c for c in COMMANDS if c.startswith("pip wheel ")]
(SETUP_LINE,) = [c for c in COMMANDS if c.startswith("pip install -e") and "onnxfuse optimize" in c]
LIB = "libonnxfuse_ops.so"
COMPILERS = ("g++", "c++", "gcc", "cc", "clang", "clang++")


def copy_repo(dst: Path) -> Path:
    shutil.copytree(ROOT, dst, ignore=shutil.ignore_patterns(
        ".git", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", ".ruff_cache", "out", "benchmarks"))
    return dst


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV") and not k.startswith("ONNXFUSE_")}
    env.update(extra)
    return env


def backend(src: Path, call: str, **env: str) -> subprocess.CompletedProcess:
    """Call the project's PEP 517 backend (as pip would, without isolation) in `src`."""
    code = ("import json, sys; sys.path.insert(0, 'build_backend'); import onnxfuse_backend as b; "
            f"print(json.dumps({call}))")
    return subprocess.run([sys.executable, "-c", code], cwd=src, capture_output=True, text=True,
                          env=clean_env(**env), timeout=600)


def build(tmp_path: Path, hook: str, **env: str) -> tuple[subprocess.CompletedProcess, Path]:
    """The backend's `hook` (build_wheel, build_editable) on a copy of the repository, writing
    into tmp_path/out: the process and that folder."""
    src = copy_repo(tmp_path / "src")
    out = tmp_path / "out"
    out.mkdir()
    return backend(src, f"b.{hook}({str(out)!r})", **env), out


def wheel_files(path: Path) -> tuple[list[str], str]:
    with zipfile.ZipFile(path) as z:
        names = z.namelist()
        wheel = z.read(next(n for n in names if n.endswith(".dist-info/WHEEL"))).decode()
    return names, wheel


# ---------------------------------------------------------------------------------------
# The build backend and setup.py (no network: the hooks are called directly)
# ---------------------------------------------------------------------------------------

def test_readme_wheel_line_builds_then_installs_without_an_index():
    build_cmd, install_cmd = (p.strip() for p in WHEEL_LINE.split("&&"))
    assert build_cmd.startswith("pip wheel ") and " -w dist" in build_cmd
    assert install_cmd.startswith("pip install --no-index --find-links dist ")


def test_backend_asks_for_cuda_headers_for_wheels_only(tmp_path):
    src = copy_repo(tmp_path / "src")
    r = backend(src, "[b.get_requires_for_build_wheel(), b.get_requires_for_build_editable(), "
                     "b.get_requires_for_build_sdist()]")
    assert r.returncode == 0, r.stderr
    wheel, editable, sdist = json.loads(r.stdout.splitlines()[-1])
    assert any(x.startswith("nvidia-cuda-runtime-cu12") for x in wheel)
    assert not any("nvidia" in x for x in editable + sdist)
    r = backend(src, "b.get_requires_for_build_wheel()", ONNXFUSE_WHEEL_LIBRARY="cpu")
    assert r.returncode == 0, r.stderr
    assert not any("nvidia" in x for x in json.loads(r.stdout.splitlines()[-1]))


def test_editable_install_compiles_nothing(tmp_path):
    r, out = build(tmp_path, "build_editable", ONNXFUSE_CXX=str(tmp_path / "no" / "g++"),
                   ONNXFUSE_CACHE=str(tmp_path / "cache"))
    assert r.returncode == 0, r.stderr[-2000:]
    name = json.loads(r.stdout.splitlines()[-1])
    assert name.endswith("-py3-none-any.whl"), name
    names, wheel = wheel_files(out / name)
    assert not any(LIB in n for n in names) and "Root-Is-Purelib: true" in wheel
    assert not (tmp_path / "src" / "build" / "lib" / "onnxfuse" / "lib").exists()
    assert not (tmp_path / "cache").exists()


def test_wheel_carries_the_library_at_its_root(tmp_path):
    if shutil.which("g++") is None:
        pytest.skip("no g++")
    r, out = build(tmp_path, "build_wheel")
    assert r.returncode == 0, r.stderr[-2000:]
    name = json.loads(r.stdout.splitlines()[-1])
    plat = sysconfig.get_platform().replace("-", "_").replace(".", "_")
    assert name == f"onnxfuse-0.1.0-py3-none-{plat}.whl"
    names, wheel = wheel_files(out / name)
    assert f"onnxfuse/lib/{LIB}" in names and "onnxfuse/lib/libonnxfuse_ops.json" in names
    assert "onnxfuse/csrc/register.cc" in names and "onnxfuse/build.py" in names
    # the kinds, Python and C++ (docs/kinds.md)
    assert {"onnxfuse/kinds/conv.py", "onnxfuse/csrc/kinds/conv_cpu.cc",
            "onnxfuse/csrc/kinds/conv_cuda.cc"} <= set(names)
    assert "Root-Is-Purelib: false" in wheel and not any(".data/" in n for n in names)
    with zipfile.ZipFile(out / name) as z:
        stamp = json.loads(z.read("onnxfuse/lib/libonnxfuse_ops.json"))
    assert stamp["cuda"] is True and stamp["ort_api"] == 21 and len(stamp["source_hash"]) == 16


def test_wheel_without_the_library_when_asked(tmp_path):
    r, out = build(tmp_path, "build_wheel", ONNXFUSE_WHEEL_LIBRARY="none",
                   ONNXFUSE_CXX=str(tmp_path / "no" / "g++"))
    assert r.returncode == 0, r.stderr[-2000:]
    name = json.loads(r.stdout.splitlines()[-1])
    assert name.endswith("-py3-none-any.whl")
    assert not any(LIB in n for n in wheel_files(out / name)[0])


def test_wheel_build_without_a_compiler_fails_and_says_why(tmp_path):
    r, out = build(tmp_path, "build_wheel", ONNXFUSE_WHEEL_LIBRARY="cpu",
                   ONNXFUSE_CXX=str(tmp_path / "no" / "g++"))
    assert r.returncode != 0
    assert "building the custom-op library for the wheel failed: C++ compiler" in r.stderr
    assert "ONNXFUSE_WHEEL_LIBRARY=none" in r.stderr
    assert not list(out.iterdir())


# ---------------------------------------------------------------------------------------
# End to end: pip wheel, then a fresh venv without a compiler
# ---------------------------------------------------------------------------------------

def _index_url() -> str:
    url = os.environ.get("PIP_INDEX_URL")
    if not url:
        r = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True)
        for line in r.stdout.splitlines():
            key, _, value = line.partition("=")
            if key.endswith(".index-url"):
                url = value.strip().strip("'\"")
    return url or "https://pypi.org/simple"


def no_network() -> str | None:
    """Why the package index cannot be reached (None when it can, or is local)."""
    url = urllib.parse.urlparse(_index_url())
    if url.scheme not in ("http", "https"):
        return None
    proxy = urllib.request.getproxies().get(url.scheme)
    target = urllib.parse.urlparse(proxy) if proxy else url
    host, port = target.hostname, target.port or (443 if target.scheme == "https" else 80)
    try:
        socket.create_connection((host, port), timeout=10).close()
    except OSError as e:
        return f"no network: the package index {host}:{port} cannot be reached ({e})"
    return None


def run(cmd: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    r = subprocess.run(["/bin/bash", "-c", cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (cmd, r.stdout[-3000:], r.stderr[-3000:])
    return r


def test_wheel_installs_and_runs_without_a_compiler(tmp_path):
    reason = no_network()
    if reason:
        pytest.skip(reason)
    src = copy_repo(tmp_path / "src")
    build_cmd, install_cmd = (p.strip() for p in WHEEL_LINE.split("&&"))

    # 1. the wheel, where the compiler is (this Python's pip, the cache of its first-use builds)
    run(f"{sys.executable} -m {build_cmd}", src, clean_env())
    (wheel,) = (src / "dist").glob("onnxfuse-*.whl")
    assert "-py3-none-" in wheel.name and not wheel.name.endswith("-any.whl"), wheel.name

    # 2. a fresh venv, no compiler on PATH, ONNXFUSE_CXX pointing at none, an empty cache
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, env=clean_env(), timeout=300)
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    cache = tmp_path / "onnxfuse-cache"
    cache.mkdir()
    path = f"{venv / 'bin'}{os.pathsep}{empty}"
    assert not [c for c in COMPILERS if shutil.which(c, path=path)]
    env = clean_env(PATH=path, ONNXFUSE_CXX=str(tmp_path / "no-compiler" / "g++"), ONNXFUSE_CACHE=str(cache))
    run(install_cmd, src, env)

    # 3. the README's first command, after its install
    work = tmp_path / "work"
    (work / "models").mkdir(parents=True)
    shutil.copy(ROOT / "models" / "activation_block.onnx", work / "models" / "activation_block.onnx")
    commands = [p.strip() for p in SETUP_LINE.split("&&") if p.strip().startswith("onnxfuse ")]
    assert [c.split()[1] for c in commands] == ["analyze", "optimize", "bench"]
    out = [run(c, work, env).stdout for c in commands]
    assert "pointwise_chain: 1 fused" in out[1]
    # bench registered the library for the fused model (a library that failed to load is an error)
    assert re.search(r"block\.opt\.onnx\s+1 \(lib\)", out[2]), out[2]
    site = run("python -c 'import onnxfuse, onnxfuse.runtime as r; print(onnxfuse.__file__); "
               "print(r.library_path(build=False))'", work, env).stdout.split()
    pkg = Path(site[0]).parent
    assert pkg.is_relative_to(venv) and Path(site[1]) == pkg / "lib" / LIB
    assert list(cache.iterdir()) == [], "something was built or downloaded at run time"
