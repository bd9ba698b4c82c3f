"""Build the onnxfuse custom-op library (``libonnxfuse_ops.so``) from ``csrc/``.

The library is compiled with the system ``g++`` against the ONNX Runtime C API headers
(API >= 21; ORT 1.21's headers, API 21, build a library that loads in any ORT >= 1.21). The
headers are not in the onnxruntime wheels; `ort_include_dir` looks for them, in order:

1. ``ONNXFUSE_ORT_INCLUDE`` (a folder holding ``onnxruntime_c_api.h``);
2. the system's include dirs (``/usr/include/onnxruntime``, ``/usr/local/include/onnxruntime``,
   ``/opt/homebrew/include/onnxruntime``) and conda's (``$CONDA_PREFIX/include/onnxruntime``),
   each also as ``.../onnxruntime/core/session``;
3. the headers downloaded by 4 or 5 earlier, in the cache;
4. Debian's ``libonnxruntime-dev`` package (trixie: 1.21.0), downloaded with ``apt-get
   download`` under a throw-away apt configuration and unpacked with ``dpkg -x`` into the
   cache; nothing is installed system-wide. The Debian archive is the one this machine's apt
   already uses (the first ``.../debian`` entry of /etc/apt/sources.list{,.d}, with its
   Signed-By keyring), asked for the trixie suite;
5. the ONNX Runtime release of the same version, 1.21.0 (``onnxruntime-<platform>-1.21.0.tgz``
   from GitHub, its ``include/*.h``), into the cache.

Headers older than API 21, or newer than the installed onnxruntime's API, are passed over.
When all fail, one OnnxfuseError names every place tried.

The CUDA driver API header comes from ``ONNXFUSE_CUDA_INCLUDE``, the installed ``triton``
wheel or the ``nvidia-cuda-runtime-cu12`` wheel, and is used for types only: the library
opens ``libcuda.so.1`` with dlopen when a CUDA kernel first runs, so it builds and loads on
machines without CUDA (without a cuda.h the CUDA kernel is left out).

Everything lands under the cache directory (``$ONNXFUSE_CACHE``, default
``~/.cache/onnxfuse``): ``ort-headers/<version>/`` (Debian's), ``ort-headers/release-<version>/``
and ``lib/<hash>/libonnxfuse_ops.so``, the hash covering the sources, the flags, the compiler
and the headers, so a changed source rebuilds and an unchanged one is reused.

A wheel (``pip wheel .``, see setup.py) ships the library prebuilt in ``onnxfuse/lib/`` with a
stamp of the sources it was built from (`write_prebuilt`); `onnxfuse.runtime` uses it only
while the package's sources still match (`prebuilt_path`).

Environment: ``ONNXFUSE_ORT_INCLUDE``, ``ONNXFUSE_DEBIAN_MIRROR`` (archive URI to use instead
of the system's), ``ONNXFUSE_ORT_RELEASE_URL`` (the release tarball's URL, e.g. a mirror or a
file:// URL), ``ONNXFUSE_CUDA_INCLUDE`` (a folder holding cuda.h), ``ONNXFUSE_CXX`` (compiler,
default ``g++``).

``python -m onnxfuse.build`` builds (if needed) and prints the library's path.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from onnxfuse.errors import OnnxfuseError

LIB_NAME = "libonnxfuse_ops.so"
ORT_DEB = "libonnxruntime-dev"
ORT_HEADERS_VERSION = "1.21"  # API 21; the suite below carries 1.21.x
ORT_MIN_API = 21
DEBIAN_SUITE = "trixie"
# The fallback: the ONNX Runtime release of the version Debian carries (1.21.0+dfsg-1), whose
# tarball holds include/onnxruntime_c_api.h; ONNXFUSE_ORT_RELEASE_URL replaces the URL.
ORT_RELEASE_VERSION = "1.21.0"
ORT_RELEASE_URL = "https://github.com/microsoft/onnxruntime/releases/download/v{version}/onnxruntime-{platform}-{version}.tgz"
# Include dirs searched for a user's own headers (then $CONDA_PREFIX/include).
SYSTEM_INCLUDE_ROOTS = ("/usr/include", "/usr/local/include", "/opt/homebrew/include")
CXXFLAGS = [
    "-O3", "-std=c++17", "-shared", "-fPIC", "-pthread", "-fvisibility=hidden",
    "-fvisibility-inlines-hidden", "-fno-math-errno", "-Wall", "-Wextra", "-Wno-unused-parameter",
]
LDFLAGS = ["-ldl", "-Wl,--exclude-libs,ALL", "-Wl,-z,defs"]
# SIMD transcendental functions from glibc's libmvec (see csrc/program.cc); dropped when the
# C library lacks them.
VECTOR_MATH = ["-DONNXFUSE_VECTOR_MATH=1", "-lmvec", "-lm"]
# Only RegisterCustomOps is exported; everything else (including inline std:: code) is local.
VERSION_SCRIPT = "{ global: RegisterCustomOps; local: *; };\n"


def cache_dir() -> Path:
    return Path(os.environ.get("ONNXFUSE_CACHE") or Path.home() / ".cache" / "onnxfuse")


def source_dir() -> Path:
    here = Path(__file__).resolve().parent
    for cand in (here / "csrc", here.parent / "csrc"):
        if (cand / "register.cc").is_file():
            return cand
    raise OnnxfuseError(f"onnxfuse C++ sources not found (looked for csrc/ next to {here})")


def _sources(src: Path) -> list[Path]:
    """Every .cc and .h under `src`: the shared files and csrc/kinds/ (one per kind and
    execution provider)."""
    return sorted(p for p in src.rglob("*") if p.suffix in (".cc", ".h") and p.is_file())


# ---------------------------------------------------------------------------------------
# ONNX Runtime headers
# ---------------------------------------------------------------------------------------

def _api_version(header: Path) -> int | None:
    """ORT_API_VERSION as #defined in onnxruntime_c_api.h (None if absent)."""
    try:
        m = re.search(r"^\s*#\s*define\s+ORT_API_VERSION\s+(\d+)", header.read_text(errors="replace"), re.M)
    except OSError:
        return None
    return int(m.group(1)) if m else None


def installed_ort_api() -> int | None:
    """The C API version of the installed onnxruntime (its minor version: 1.21 serves API 21), None
    without one. Headers newer than it would build a library that this runtime refuses to load."""
    from importlib import metadata

    for dist in ("onnxruntime", "onnxruntime-gpu"):
        try:
            version = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
        m = re.match(r"(\d+)\.(\d+)", version)
        if m and m.group(1) == "1":
            return int(m.group(2))
    return None


def system_include_dirs() -> list[Path]:
    """Where a user's own ONNX Runtime headers would be: the system's include dirs, then
    conda's ($CONDA_PREFIX/include), each as include/onnxruntime (the layout of ORT's own
    install, Debian's and conda-forge's packages) or include/onnxruntime/core/session (older
    installs)."""
    roots = [Path(p) for p in SYSTEM_INCLUDE_ROOTS]
    conda = os.environ.get("CONDA_PREFIX")
    if conda:
        roots.append(Path(conda) / "include")
    return [d for r in roots for d in (r / "onnxruntime", r / "onnxruntime" / "core" / "session")]


def _usable(inc: Path, max_api: int | None) -> str | None:
    """Why `inc` cannot serve as the headers folder (None when it can)."""
    header = inc / "onnxruntime_c_api.h"
    if not header.is_file():
        return "no onnxruntime_c_api.h"
    api = _api_version(header)
    if api is None:
        return "no ORT_API_VERSION in onnxruntime_c_api.h"
    if api < ORT_MIN_API:
        return f"API {api}, older than the {ORT_MIN_API} the library needs"
    if max_api is not None and api > max_api:
        return f"API {api}, newer than the {max_api} of the onnxruntime it is for"
    return None


def _debian_root() -> Path:
    return cache_dir() / "ort-headers" / ORT_HEADERS_VERSION


def _debian_include(root: Path) -> Path:
    return root / "usr" / "include" / "onnxruntime"


def _release_root() -> Path:
    return cache_dir() / "ort-headers" / f"release-{ORT_RELEASE_VERSION}"


def _release_include(root: Path) -> Path:
    return root / "include"


def ort_include_dir(fetch: bool = True, max_api: int | None = None) -> Path | None:
    """A folder with onnxruntime_c_api.h of API >= ORT_MIN_API, downloading it once if needed.

    Looked for, in order: ONNXFUSE_ORT_INCLUDE (an error if it has no usable header); the
    system's include dirs and conda's (`system_include_dirs`); the headers downloaded
    earlier into the cache; Debian's libonnxruntime-dev through apt; the ONNX Runtime
    release tarball. Headers of an API newer than `max_api` (default: the installed
    onnxruntime's) are passed over. With ``fetch=False`` nothing is downloaded and None is
    returned where only a download would find them; otherwise OnnxfuseError names every
    place tried."""
    if max_api is None:
        max_api = installed_ort_api()
    if max_api is not None and max_api < ORT_MIN_API:
        max_api = None  # a runtime too old for any usable header: register.cc's load error says so
    env = os.environ.get("ONNXFUSE_ORT_INCLUDE")
    if env:
        why = _usable(Path(env), None)
        if why:
            raise OnnxfuseError(f"ONNXFUSE_ORT_INCLUDE={env}: {why}")
        return Path(env)
    tried: list[str] = []
    local = [*system_include_dirs(), _debian_include(_debian_root()), _release_include(_release_root())]
    for inc in local:
        why = _usable(inc, max_api)
        if why is None:
            return inc
        tried.append(f"{inc} ({why})")
    if not fetch:
        return None
    fetchers = ((f"Debian's {ORT_DEB} ({DEBIAN_SUITE})", _fetch_ort_headers, _debian_root, _debian_include),
                (f"ONNX Runtime {ORT_RELEASE_VERSION} release", _fetch_ort_release, _release_root, _release_include))
    for what, fetch_into, root_of, include_of in fetchers:
        root = root_of()
        try:
            fetch_into(root)
        except OnnxfuseError as e:
            tried.append(f"{what}: {e}")
            continue
        inc = include_of(root)
        why = _usable(inc, max_api)
        if why is None:
            return inc
        tried.append(f"{what} unpacked into {root}: {why}")
    raise OnnxfuseError(
        "ONNX Runtime C API headers not found (onnxruntime_c_api.h, API >= "
        f"{ORT_MIN_API}); tried: ONNXFUSE_ORT_INCLUDE (not set); " + "; ".join(tried)
        + ". Set ONNXFUSE_ORT_INCLUDE to a folder holding onnxruntime_c_api.h (`python -m onnxfuse.build "
        "--headers` on a machine that can download prints one to copy)")


def _run(cmd: list[str], what: str, **kw) -> subprocess.CompletedProcess:
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, **kw)
    except FileNotFoundError as e:
        raise OnnxfuseError(f"{what}: {cmd[0]} not found") from e
    if res.returncode != 0:
        lines = (res.stderr or res.stdout).strip().splitlines()
        detail = " | ".join(line.strip() for line in lines[-4:]) or f"exit code {res.returncode}"
        raise OnnxfuseError(f"{what} failed: {detail}")
    return res


def _apt_entries() -> list[tuple[str, str, str]]:
    """(uri, suites, signed_by) of the system's enabled Debian-style apt sources."""
    entries: list[tuple[str, str, str]] = []
    etc = Path("/etc/apt")
    files = [etc / "sources.list"] + sorted((etc / "sources.list.d").glob("*"))
    for f in files:
        if not f.is_file() or f.suffix not in (".list", ".sources"):
            continue
        try:
            text = f.read_text(errors="replace")
        except OSError:
            continue
        if f.suffix == ".list":
            for line in text.splitlines():
                tok = line.split("#", 1)[0].split()
                if len(tok) < 3 or tok[0] != "deb":
                    continue
                opts, rest = "", tok[1:]
                if rest[0].startswith("["):
                    while rest and not rest[0].endswith("]"):
                        opts += " " + rest.pop(0)
                    opts += " " + rest.pop(0)
                signed = next((o.split("=", 1)[1].rstrip("]") for o in opts.split() if o.startswith("signed-by=")), "")
                if len(rest) >= 2:
                    entries.append((rest[0], rest[1], signed))
        else:
            for stanza in text.split("\n\n"):
                fields: dict[str, str] = {}
                for line in stanza.splitlines():
                    if ":" in line and not line.startswith(("#", " ")):
                        k, v = line.split(":", 1)
                        fields[k.strip().lower()] = v.strip()
                if "deb" not in fields.get("types", "").split() or fields.get("enabled", "yes") == "no":
                    continue
                for uri in fields.get("uris", "").split():
                    entries.append((uri, fields.get("suites", ""), fields.get("signed-by", "")))
    return entries


def _debian_source_line() -> str:
    """A sources.list line for trixie main on this machine's Debian archive."""
    mirror = os.environ.get("ONNXFUSE_DEBIAN_MIRROR")
    signed = ""
    if not mirror:
        for uri, suites, key in _apt_entries():
            if uri.rstrip("/").endswith("/debian") and "security" not in suites:
                mirror, signed = uri, key
                break
    if not mirror:
        raise OnnxfuseError("no Debian archive in /etc/apt sources (ONNXFUSE_DEBIAN_MIRROR names one)")
    opt = f"[signed-by={signed}] " if signed and Path(signed).is_file() else ""
    return f"deb {opt}{mirror} {DEBIAN_SUITE} main"


def _fetch_ort_headers(root: Path) -> None:
    for tool in ("apt-get", "dpkg"):
        if shutil.which(tool) is None:
            raise OnnxfuseError(f"{tool} not found (not a Debian-like system)")
    root.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="onnxfuse-apt-") as tmp:
        t = Path(tmp)
        for d in ("lists/partial", "cache/archives/partial", "sources.list.d", "dl"):
            (t / d).mkdir(parents=True)
        (t / "sources.list").write_text(_debian_source_line() + "\n")
        opts = [
            f"-oDir::Etc::SourceList={t / 'sources.list'}",
            f"-oDir::Etc::SourceParts={t / 'sources.list.d'}",
            f"-oDir::State::Lists={t / 'lists'}",
            f"-oDir::Cache={t / 'cache'}",
            "-oDebug::NoLocking=1",
            "-oAPT::Sandbox::User=root",
            "-oAcquire::Retries=3",
            "-qq",
        ]
        source = (t / "sources.list").read_text().strip()
        upd = _run(["apt-get", *opts, "update"],
                   f"apt-get update for Debian {DEBIAN_SUITE} (is the Debian archive reachable?)")
        if not any((t / "lists").glob("*_Packages*")):
            detail = " | ".join((upd.stderr or upd.stdout).strip().splitlines()[-2:])
            raise OnnxfuseError(f"apt-get update could not reach the Debian archive ({source}): {detail}")
        _run(["apt-get", *opts, "download", ORT_DEB], f"apt-get download {ORT_DEB} from Debian {DEBIAN_SUITE}",
             cwd=t / "dl")
        debs = sorted((t / "dl").glob(f"{ORT_DEB}_*.deb"))
        if not debs:
            raise OnnxfuseError(f"apt-get download {ORT_DEB} produced no .deb file")
        staging = Path(tempfile.mkdtemp(prefix=root.name + ".", dir=root.parent))
        try:
            _run(["dpkg", "-x", str(debs[0]), str(staging)], f"dpkg -x {debs[0].name}")
            (staging / "SOURCE").write_text(debs[0].name + "\n")
            _publish(staging, root)
        finally:
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)


def _publish(staging: Path, root: Path) -> None:
    """Move a filled staging folder to `root` in one rename; when another process got there
    first (the rename fails and root exists), theirs stays."""
    try:
        staging.rename(root)
    except OSError:
        if not root.is_dir():
            raise


def release_url() -> str:
    """The ONNX Runtime release tarball for this platform (its headers are the same on all)."""
    env = os.environ.get("ONNXFUSE_ORT_RELEASE_URL")
    if env:
        return env
    machine = platform.machine().lower()
    if sys.platform == "darwin":
        plat = "osx-universal2"
    else:
        plat = "linux-aarch64" if machine in ("aarch64", "arm64") else "linux-x64"
    return ORT_RELEASE_URL.format(version=ORT_RELEASE_VERSION, platform=plat)


def _fetch_ort_release(root: Path) -> None:
    """Download the release tarball and unpack its include/*.h into root/include."""
    import tarfile
    import urllib.request

    url = release_url()
    root.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="onnxfuse-ort-release-") as tmp:
        archive = Path(tmp) / "release.tgz"
        try:
            with urllib.request.urlopen(url, timeout=60) as r, open(archive, "wb") as f:
                shutil.copyfileobj(r, f)
        except (OSError, ValueError) as e:
            raise OnnxfuseError(f"downloading {url} failed: {e}") from e
        staging = Path(tempfile.mkdtemp(prefix=root.name + ".", dir=root.parent))
        try:
            inc = staging / "include"
            inc.mkdir()
            try:
                with tarfile.open(archive) as tar:
                    for m in tar.getmembers():
                        parts = Path(m.name).parts
                        # <top>/include/<name>.h, flat: nothing is written outside include/
                        if m.isfile() and len(parts) == 3 and parts[1] == "include" and parts[2].endswith(".h"):
                            src = tar.extractfile(m)
                            if src is not None:
                                (inc / parts[2]).write_bytes(src.read())
            except (OSError, tarfile.TarError) as e:
                raise OnnxfuseError(f"{url} is not a readable .tgz: {e}") from e
            if not (inc / "onnxruntime_c_api.h").is_file():
                raise OnnxfuseError(f"{url} has no <top>/include/onnxruntime_c_api.h")
            (staging / "SOURCE").write_text(url + "\n")
            _publish(staging, root)
        finally:
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)


def cuda_include_dir() -> Path | None:
    """A folder with the CUDA driver API header (cuda.h, for types only), or None: the one
    ONNXFUSE_CUDA_INCLUDE names, triton's copy, or the nvidia-cuda-runtime-cu12 wheel's (what
    a wheel build installs for it)."""
    import importlib.util

    env = os.environ.get("ONNXFUSE_CUDA_INCLUDE")
    if env:
        if not (Path(env) / "cuda.h").is_file():
            raise OnnxfuseError(f"ONNXFUSE_CUDA_INCLUDE={env} has no cuda.h")
        return Path(env)
    for pkg, sub in (("triton", ("backends", "nvidia", "include")), ("nvidia", ("cuda_runtime", "include"))):
        try:
            spec = importlib.util.find_spec(pkg)
        except (ImportError, ValueError):
            spec = None
        for loc in (spec.submodule_search_locations or []) if spec is not None else []:
            inc = Path(loc).joinpath(*sub)
            if (inc / "cuda.h").is_file():
                return inc
    return None


# ---------------------------------------------------------------------------------------
# Compile
# ---------------------------------------------------------------------------------------

def _compiler() -> str:
    cxx = os.environ.get("ONNXFUSE_CXX", "g++")
    path = shutil.which(cxx)
    if path is None:
        raise OnnxfuseError(f"C++ compiler {cxx!r} not found: install g++ (e.g. apt-get install g++) "
                            "or set ONNXFUSE_CXX")
    return path


def _compiler_id(cxx: str) -> str:
    try:
        return subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout.splitlines()[0]
    except (OSError, IndexError):
        return cxx


def _hash_sources(h) -> None:
    src = source_dir()
    for p in _sources(src):
        h.update(p.relative_to(src).as_posix().encode() + b"\0" + p.read_bytes() + b"\0")
    h.update(" ".join(CXXFLAGS + LDFLAGS + VECTOR_MATH).encode() + VERSION_SCRIPT.encode())


def source_hash() -> str:
    """What a prebuilt library must have been built from: the sources and the flags."""
    h = hashlib.sha256()
    _hash_sources(h)
    return h.hexdigest()[:16]


def _digest(cxx: str, ort_inc: Path, cuda_inc: Path | None) -> str:
    h = hashlib.sha256()
    _hash_sources(h)
    h.update(_compiler_id(cxx).encode())
    h.update((ort_inc / "onnxruntime_c_api.h").read_bytes())
    h.update(b"cuda" if cuda_inc else b"nocuda")
    return h.hexdigest()[:16]


def expected_path() -> Path | None:
    """The cached library for the current sources, without building (None if unknown yet)."""
    try:
        cxx = _compiler()
        ort_inc = ort_include_dir(fetch=False)
        cuda_inc = cuda_include_dir()
    except OnnxfuseError:
        return None
    if ort_inc is None:
        return None
    return cache_dir() / "lib" / _digest(cxx, ort_inc, cuda_inc) / LIB_NAME


def build(force: bool = False, verbose: bool = False, max_api: int | None = None) -> Path:
    """Build the library if it is not in the cache; return its path. `max_api`: the newest
    ONNX Runtime C API whose headers may be used (default: the installed onnxruntime's)."""
    cxx = _compiler()
    ort_inc = ort_include_dir(max_api=max_api)
    cuda_inc = cuda_include_dir()
    src = source_dir()
    out_dir = cache_dir() / "lib" / _digest(cxx, ort_inc, cuda_inc)
    out = out_dir / LIB_NAME
    if out.is_file() and not force:
        return out
    out_dir.mkdir(parents=True, exist_ok=True)
    # A first run spends its time here (about 20 s on 2 cores): say so, on stderr, so the
    # wait is not silent and no command's output changes.
    print(f"onnxfuse: building the custom-op library (once, cached in {out_dir.parent}; about 20 s on a "
          "2-core machine)...", file=sys.stderr, flush=True)
    # Build into a private name, then rename: concurrent builds never see a partial file.
    fd, tmp_name = tempfile.mkstemp(prefix=LIB_NAME + ".", suffix=".tmp", dir=out_dir)
    os.close(fd)
    tmp = Path(tmp_name)
    vs = out_dir / f"exports.{os.getpid()}.map"
    vs.write_text(VERSION_SCRIPT)
    cmd = [cxx, *CXXFLAGS, f"-I{src}", f"-I{ort_inc}"]
    if cuda_inc is not None:
        cmd += [f"-I{cuda_inc}", "-DONNXFUSE_WITH_CUDA=1"]
    cmd += [str(p) for p in _sources(src) if p.suffix == ".cc"]
    cmd += ["-o", str(tmp), f"-Wl,--version-script={vs}", *LDFLAGS]
    try:
        # First with glibc's vector math (libmvec, glibc >= 2.35), else with scalar libm.
        for extra in (VECTOR_MATH, []):
            if verbose:
                print(" ".join(cmd + extra), file=sys.stderr)
            res = subprocess.run(cmd + extra, capture_output=True, text=True)
            if res.returncode == 0:
                break
        if res.returncode != 0:
            errs = [ln for ln in res.stderr.splitlines() if "error" in ln] or res.stderr.splitlines()
            raise OnnxfuseError("compiling the onnxfuse custom-op library failed: "
                                + " | ".join(ln.strip() for ln in errs[:3]))
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
        vs.unlink(missing_ok=True)
    return out


# ---------------------------------------------------------------------------------------
# The library a wheel ships (onnxfuse/lib/)
# ---------------------------------------------------------------------------------------

STAMP_NAME = "libonnxfuse_ops.json"


def prebuilt_dir() -> Path:
    return Path(__file__).resolve().parent / "lib"


def _platform_id() -> str:
    return f"{sys.platform}-{platform.machine()}"


def prebuilt_path() -> Path | None:
    """The library shipped in the package (a wheel's onnxfuse/lib/), when its stamp says it
    was built from the sources the package holds now, for this platform; else None (an
    editable checkout whose csrc/ changed since must not run an old library)."""
    d = prebuilt_dir()
    lib = d / LIB_NAME
    if not lib.is_file():
        return None
    try:
        meta = json.loads((d / STAMP_NAME).read_text())
        current = source_hash()
    except (OSError, ValueError, OnnxfuseError):
        return None
    if not isinstance(meta, dict) or meta.get("source_hash") != current or meta.get("platform") != _platform_id():
        return None
    return lib


def write_prebuilt(dest: Path, require_cuda: bool = True, verbose: bool = False) -> Path:
    """Build the library for a wheel and put it, with its stamp, into `dest`; return its path.

    The headers are of API ORT_MIN_API exactly (unless ONNXFUSE_ORT_INCLUDE names others), so
    the library loads in any ONNX Runtime >= 1.21. Without a cuda.h the CUDA kernels would be
    left out: an error unless `require_cuda` is False."""
    cuda_inc = cuda_include_dir()
    if cuda_inc is None and require_cuda:
        raise OnnxfuseError("no cuda.h for the library's CUDA kernels: install nvidia-cuda-runtime-cu12 or triton, "
                            "or set ONNXFUSE_CUDA_INCLUDE (ONNXFUSE_WHEEL_CUDA=0 builds a CPU-only library)")
    lib = build(verbose=verbose, max_api=ORT_MIN_API)
    ort_inc = ort_include_dir(fetch=False, max_api=ORT_MIN_API)
    # what the headers came from: the .deb or the tarball's URL, written next to a download
    source = next((q / "SOURCE" for q in (ort_inc.parents if ort_inc is not None else [])
                   if (q / "SOURCE").is_file()), None)
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(lib, dest / LIB_NAME)
    meta = {
        "source_hash": source_hash(),
        "platform": _platform_id(),
        "ort_api": _api_version(ort_inc / "onnxruntime_c_api.h") if ort_inc is not None else None,
        "ort_headers": source.read_text().strip() if source is not None else str(ort_inc),
        "cuda": cuda_inc is not None,
        "compiler": _compiler_id(_compiler()),
    }
    (dest / STAMP_NAME).write_text(json.dumps(meta, indent=1) + "\n")
    return dest / LIB_NAME


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m onnxfuse.build", description=__doc__.splitlines()[0])
    ap.add_argument("--force", action="store_true", help="rebuild even if the cached library is current")
    ap.add_argument("-v", "--verbose", action="store_true", help="print the compiler command")
    ap.add_argument("--headers", action="store_true",
                    help="only fetch the ONNX Runtime C API headers and print their folder (to copy to a "
                         "machine without network access, where ONNXFUSE_ORT_INCLUDE points at them)")
    args = ap.parse_args(argv)
    try:
        print(ort_include_dir() if args.headers else build(force=args.force, verbose=args.verbose))
    except OnnxfuseError as e:
        print(f"onnxfuse: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
