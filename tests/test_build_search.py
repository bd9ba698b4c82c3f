"""Where the library and its headers come from (onnxfuse.build, onnxfuse.runtime), without a
compiler or a network: the header search order, the release fallback (a local tarball through
a file:// URL), the one-line error, and the choice between a wheel's prebuilt library and
building on first use."""

from __future__ import annotations

import io
import json
import shutil
import tarfile
from pathlib import Path

import pytest

from onnxfuse import build, runtime
from onnxfuse.errors import OnnxfuseError

REAL_RELEASE = getattr(build, "_fetch_ort_release", None)


def headers(folder: Path, api: int = 21) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "onnxruntime_c_api.h").write_text(f"#pragma once\n#define ORT_API_VERSION {api}\n")
    return folder


def no_fetch(root: Path) -> None:
    raise AssertionError(f"nothing should be downloaded (into {root})")


@pytest.fixture
def env(tmp_path, monkeypatch):
    """An empty cache and system, no env settings, no installed runtime to match, no downloads."""
    monkeypatch.setenv("ONNXFUSE_CACHE", str(tmp_path / "cache"))
    for var in ("ONNXFUSE_ORT_INCLUDE", "CONDA_PREFIX", "ONNXFUSE_ORT_RELEASE_URL", "ONNXFUSE_LIBRARY",
                "ONNXFUSE_CUDA_INCLUDE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(build, "SYSTEM_INCLUDE_ROOTS", (str(tmp_path / "usr/include"),
                                                        str(tmp_path / "usr/local/include")))
    monkeypatch.setattr(build, "installed_ort_api", lambda: None)
    monkeypatch.setattr(build, "_fetch_ort_headers", no_fetch)
    monkeypatch.setattr(build, "_fetch_ort_release", no_fetch)
    return tmp_path


def release_tarball(path: Path, api: int = 21, top: str = "onnxruntime-linux-x64-1.21.0") -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, text in ((f"{top}/include/onnxruntime_c_api.h", f"#define ORT_API_VERSION {api}\n"),
                           (f"{top}/include/onnxruntime_cxx_api.h", "// C++\n"),
                           (f"{top}/lib/libonnxruntime.so", "ELF"),
                           (f"{top}/include/../../evil.h", "outside\n")):
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


# ---------------------------------------------------------------------------------------
# ONNX Runtime headers
# ---------------------------------------------------------------------------------------

def test_env_var_comes_first_and_must_hold_the_header(env, monkeypatch):
    headers(env / "usr/include/onnxruntime")
    mine = headers(env / "mine")
    monkeypatch.setenv("ONNXFUSE_ORT_INCLUDE", str(mine))
    assert build.ort_include_dir() == mine
    monkeypatch.setenv("ONNXFUSE_ORT_INCLUDE", str(env / "nowhere"))
    with pytest.raises(OnnxfuseError, match="ONNXFUSE_ORT_INCLUDE=.*nowhere: no onnxruntime_c_api.h"):
        build.ort_include_dir()


def test_system_include_dirs_before_any_download(env):
    local = headers(env / "usr/local/include/onnxruntime/core/session")  # an older install layout
    assert build.ort_include_dir() == local
    usr = headers(env / "usr/include/onnxruntime")
    assert build.ort_include_dir() == usr


def test_conda_prefix_include_dir(env, monkeypatch):
    monkeypatch.setenv("CONDA_PREFIX", str(env / "conda"))
    conda = headers(env / "conda/include/onnxruntime")
    assert build.ort_include_dir() == conda
    assert build.ort_include_dir(fetch=False) == conda


def test_headers_of_the_wrong_api_are_passed_over(env, monkeypatch):
    headers(env / "usr/include/onnxruntime", api=20)  # too old for the library
    headers(env / "usr/local/include/onnxruntime", api=25)  # newer than the runtime below
    monkeypatch.setenv("CONDA_PREFIX", str(env / "conda"))
    conda = headers(env / "conda/include/onnxruntime", api=23)
    monkeypatch.setattr(build, "installed_ort_api", lambda: 23)
    assert build.ort_include_dir() == conda
    # a wheel's library: API 21 exactly, whatever runtime the build machine has
    assert build.ort_include_dir(fetch=False, max_api=21) is None
    monkeypatch.setattr(build, "installed_ort_api", lambda: None)
    assert build.ort_include_dir() == env / "usr/local/include/onnxruntime"


def test_installed_runtime_api_is_its_minor_version(monkeypatch):
    from importlib import metadata

    versions = {"onnxruntime-gpu": "1.22.1"}

    def version(dist):
        if dist not in versions:
            raise metadata.PackageNotFoundError(dist)
        return versions[dist]

    monkeypatch.setattr(metadata, "version", version)
    assert build.installed_ort_api() == 22
    versions.clear()
    assert build.installed_ort_api() is None


def test_cached_downloads_before_fetching(env):
    deb = headers(env / "cache/ort-headers/1.21/usr/include/onnxruntime")
    assert build.ort_include_dir() == deb
    shutil.rmtree(env / "cache/ort-headers/1.21")
    rel = headers(env / "cache/ort-headers/release-1.21.0/include")
    assert build.ort_include_dir() == rel


def test_debian_archive_then_the_release_tarball(env, monkeypatch):
    calls = []

    def debian(root):
        calls.append("debian")
        raise OnnxfuseError("apt-get not found (not a Debian-like system)")

    monkeypatch.setattr(build, "_fetch_ort_headers", debian)
    monkeypatch.setattr(build, "_fetch_ort_release", REAL_RELEASE)
    url = release_tarball(env / "onnxruntime-linux-x64-1.21.0.tgz").as_uri()
    monkeypatch.setenv("ONNXFUSE_ORT_RELEASE_URL", url)
    inc = build.ort_include_dir()
    assert calls == ["debian"]
    assert inc == env / "cache/ort-headers/release-1.21.0/include"
    assert sorted(p.name for p in inc.iterdir()) == ["onnxruntime_c_api.h", "onnxruntime_cxx_api.h"]
    assert (inc.parent / "SOURCE").read_text().strip() == url
    assert not (env / "evil.h").exists() and not (env / "cache/evil.h").exists()
    # next time from the cache, with no download
    monkeypatch.setattr(build, "_fetch_ort_headers", no_fetch)
    monkeypatch.setattr(build, "_fetch_ort_release", no_fetch)
    assert build.ort_include_dir() == inc



def test_release_download_failures_are_one_line(env, monkeypatch):
    monkeypatch.setattr(build, "_fetch_ort_release", REAL_RELEASE)
    monkeypatch.setenv("ONNXFUSE_ORT_RELEASE_URL", (env / "missing.tgz").as_uri())
    with pytest.raises(OnnxfuseError, match="downloading file://.*missing.tgz failed"):
        REAL_RELEASE(env / "cache/ort-headers/release-1.21.0")
    (env / "bad.tgz").write_text("not a tarball")
    monkeypatch.setenv("ONNXFUSE_ORT_RELEASE_URL", (env / "bad.tgz").as_uri())
    with pytest.raises(OnnxfuseError, match="not a readable .tgz"):
        REAL_RELEASE(env / "cache/ort-headers/release-1.21.0")
    assert not (env / "cache/ort-headers/release-1.21.0").exists()


def test_release_url_is_the_version_debian_carries(monkeypatch):
    monkeypatch.delenv("ONNXFUSE_ORT_RELEASE_URL", raising=False)
    assert build.ORT_RELEASE_VERSION.startswith(build.ORT_HEADERS_VERSION + ".")
    monkeypatch.setattr(build.sys, "platform", "linux")
    monkeypatch.setattr(build.platform, "machine", lambda: "x86_64")
    assert build.release_url() == ("https://github.com/microsoft/onnxruntime/releases/download/v1.21.0/"
                                   "onnxruntime-linux-x64-1.21.0.tgz")
    monkeypatch.setattr(build.platform, "machine", lambda: "aarch64")
    assert build.release_url().endswith("/v1.21.0/onnxruntime-linux-aarch64-1.21.0.tgz")
    monkeypatch.setattr(build.sys, "platform", "darwin")
    assert build.release_url().endswith("/v1.21.0/onnxruntime-osx-universal2-1.21.0.tgz")


def test_nothing_found_is_one_error_naming_every_place(env, monkeypatch):
    headers(env / "usr/include/onnxruntime", api=19)

    def debian(root):
        raise OnnxfuseError("apt-get not found (not a Debian-like system)")

    def release(root):
        raise OnnxfuseError("downloading https://example/ort.tgz failed: <urlopen error no network>")

    monkeypatch.setattr(build, "_fetch_ort_headers", debian)
    monkeypatch.setattr(build, "_fetch_ort_release", release)
    monkeypatch.setenv("CONDA_PREFIX", str(env / "conda"))
    with pytest.raises(OnnxfuseError) as e:
        build.ort_include_dir()
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("ONNX Runtime C API headers not found")
    for place in ("ONNXFUSE_ORT_INCLUDE (not set)",
                  f"{env}/usr/include/onnxruntime (API 19, older than the 21 the library needs)",
                  f"{env}/usr/local/include/onnxruntime (no onnxruntime_c_api.h)",
                  f"{env}/usr/local/include/onnxruntime/core/session (no onnxruntime_c_api.h)",
                  f"{env}/conda/include/onnxruntime (no onnxruntime_c_api.h)",
                  f"{env}/cache/ort-headers/1.21/usr/include/onnxruntime (no onnxruntime_c_api.h)",
                  f"{env}/cache/ort-headers/release-1.21.0/include (no onnxruntime_c_api.h)",
                  "Debian's libonnxruntime-dev (trixie): apt-get not found",
                  "ONNX Runtime 1.21.0 release: downloading https://example/ort.tgz failed"):
        assert place in msg, place
    assert msg.index("Debian's") < msg.index("ONNX Runtime 1.21.0 release")
    # without downloads: None, for expected_path
    assert build.ort_include_dir(fetch=False) is None


def test_expected_path_follows_the_search(env, monkeypatch):
    if shutil.which("g++") is None:
        pytest.skip("no g++")
    monkeypatch.delenv("ONNXFUSE_CXX", raising=False)
    assert build.expected_path() is None
    headers(env / "usr/include/onnxruntime")
    path = build.expected_path()
    assert path is not None and path.parent.parent == env / "cache/lib"


# ---------------------------------------------------------------------------------------
# cuda.h
# ---------------------------------------------------------------------------------------

def test_cuda_header_from_env_triton_or_the_nvidia_wheel(tmp_path, monkeypatch):
    import importlib.machinery
    import importlib.util

    monkeypatch.delenv("ONNXFUSE_CUDA_INCLUDE", raising=False)
    site = tmp_path / "site"
    nv = site / "nvidia" / "cuda_runtime" / "include"
    nv.mkdir(parents=True)
    (nv / "cuda.h").write_text("// cuda\n")
    real = importlib.util.find_spec

    def find_spec(name, *a):
        if name == "triton":  # not installed
            return None
        if name == "nvidia":  # the namespace package nvidia-cuda-runtime-cu12 installs into
            spec = importlib.machinery.ModuleSpec("nvidia", None, is_package=True)
            spec.submodule_search_locations = [str(site / "nvidia")]
            return spec
        return real(name, *a)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    assert build.cuda_include_dir() == nv
    own = tmp_path / "cuda"
    own.mkdir()
    (own / "cuda.h").write_text("// mine\n")
    monkeypatch.setenv("ONNXFUSE_CUDA_INCLUDE", str(own))
    assert build.cuda_include_dir() == own
    monkeypatch.setenv("ONNXFUSE_CUDA_INCLUDE", str(tmp_path))
    with pytest.raises(OnnxfuseError, match="ONNXFUSE_CUDA_INCLUDE=.* has no cuda.h"):
        build.cuda_include_dir()


# ---------------------------------------------------------------------------------------
# Prebuilt library (a wheel's) or build on first use
# ---------------------------------------------------------------------------------------

@pytest.fixture
def package_lib(tmp_path, monkeypatch):
    """A fake onnxfuse/lib/ with a library stamped for the current sources."""
    d = tmp_path / "pkg-lib"
    d.mkdir()
    (d / build.LIB_NAME).write_bytes(b"\x7fELF prebuilt")
    (d / build.STAMP_NAME).write_text(json.dumps({"source_hash": build.source_hash(),
                                                  "platform": build._platform_id(), "cuda": True}))
    monkeypatch.setattr(build, "prebuilt_dir", lambda: d)
    monkeypatch.setattr(runtime, "_cached", None)
    monkeypatch.delenv("ONNXFUSE_LIBRARY", raising=False)
    built = tmp_path / "cache-built.so"
    built.write_bytes(b"\x7fELF built")
    calls = []

    def fake_build(*a, **kw):
        calls.append("build")
        return built

    monkeypatch.setattr(build, "build", fake_build)
    monkeypatch.setattr(build, "expected_path", lambda: built)
    return d, built, calls


def test_runtime_takes_the_shipped_library_without_building(package_lib, monkeypatch, tmp_path):
    d, built, calls = package_lib
    assert runtime.library_path() == str(d / build.LIB_NAME)
    monkeypatch.setattr(runtime, "_cached", None)
    assert runtime.library_path(build=False) == str(d / build.LIB_NAME)
    assert calls == []
    # ONNXFUSE_LIBRARY still comes first
    other = tmp_path / "other.so"
    other.write_bytes(b"x")
    monkeypatch.setenv("ONNXFUSE_LIBRARY", str(other))
    assert runtime.library_path() == str(other)


@pytest.mark.parametrize("stale", ["sources changed", "other platform", "no stamp", "bad stamp"])
def test_a_stale_shipped_library_is_not_used(package_lib, monkeypatch, tmp_path, stale):
    d, built, calls = package_lib
    stamp = d / build.STAMP_NAME
    if stale == "sources changed":  # an editable checkout whose csrc/ was edited since
        src = tmp_path / "csrc"
        shutil.copytree(build.source_dir(), src)
        monkeypatch.setattr(build, "source_dir", lambda: src)
        assert build.prebuilt_path() == d / build.LIB_NAME
        (src / "program.cc").write_text((src / "program.cc").read_text() + "\n// edited\n")
    elif stale == "other platform":
        stamp.write_text(json.dumps({**json.loads(stamp.read_text()), "platform": "linux-riscv64"}))
    elif stale == "no stamp":
        stamp.unlink()
    else:
        stamp.write_text("{not json")
    assert build.prebuilt_path() is None
    assert runtime.library_path() == str(built)
    assert calls == ["build"]


def test_a_source_checkout_has_no_shipped_library():
    assert not (Path(build.__file__).parent / "lib" / build.LIB_NAME).exists()
    assert build.prebuilt_path() is None


def test_write_prebuilt_stamps_what_it_built(tmp_path, monkeypatch):
    """The wheel's library: the cached build, copied with a stamp that prebuilt_path accepts."""
    if shutil.which("g++") is None:
        pytest.skip("no g++")
    monkeypatch.delenv("ONNXFUSE_CXX", raising=False)
    monkeypatch.setattr(build, "cuda_include_dir", lambda: None)
    with pytest.raises(OnnxfuseError, match="no cuda.h for the library's CUDA kernels"):
        build.write_prebuilt(tmp_path / "lib")
    monkeypatch.undo()
    monkeypatch.delenv("ONNXFUSE_CXX", raising=False)
    dest = tmp_path / "lib"
    cuda = build.cuda_include_dir() is not None
    lib = build.write_prebuilt(dest, require_cuda=False)
    assert lib == dest / build.LIB_NAME and lib.stat().st_size > 100_000
    meta = json.loads((dest / build.STAMP_NAME).read_text())
    assert meta["source_hash"] == build.source_hash() and meta["platform"] == build._platform_id()
    assert meta["cuda"] is cuda and meta["ort_api"] == 21
    monkeypatch.setattr(build, "prebuilt_dir", lambda: dest)
    assert build.prebuilt_path() == lib


def test_a_build_says_so_on_stderr_once(env, tmp_path, monkeypatch, capsys):
    """The first run builds the library (about 20 s on 2 cores): a line on stderr says so, so
    the wait is not silent; a cached library is returned without a word."""
    import subprocess

    monkeypatch.setenv("ONNXFUSE_ORT_INCLUDE", str(headers(tmp_path / "inc")))
    monkeypatch.setattr(build, "_compiler", lambda: "c++")
    calls = []

    def fake_run(cmd, **kw):  # the compile writes its -o file; other calls (--version) answer
        if "-o" in cmd:
            calls.append(cmd)
            Path(cmd[cmd.index("-o") + 1]).write_bytes(b"\x7fELF")
        return subprocess.CompletedProcess(cmd, 0, "c++ (fake) 1.0\n", "")

    monkeypatch.setattr(build.subprocess, "run", fake_run)
    path = build.build()
    err = capsys.readouterr().err
    assert "onnxfuse: building the custom-op library (once, cached in" in err and len(calls) == 1
    assert build.build() == path and capsys.readouterr().err == "" and len(calls) == 1
