"""Build the onnxfuse custom-op library (``libonnxfuse_ops.so``) from ``csrc/``.

The library is compiled with the system ``g++`` against the ONNX Runtime C API headers
(ORT 1.21, API 21: a library built against it loads in any ORT >= 1.21). The headers are
not in the onnxruntime wheels, so they are taken from Debian's ``libonnxruntime-dev``
package (trixie), downloaded with ``apt-get download`` under a throw-away apt
configuration and unpacked with ``dpkg -x`` into the cache; nothing is installed
system-wide. The CUDA driver API header comes from the installed ``triton`` wheel and is
used for types only: the library opens ``libcuda.so.1`` with dlopen when a CUDA kernel
first runs, so it builds and loads on machines without CUDA (without triton installed the
CUDA kernel is left out).

Everything lands under the cache directory (``$ONNXFUSE_CACHE``, default
``~/.cache/onnxfuse``): ``ort-headers/<version>/`` and ``lib/<hash>/libonnxfuse_ops.so``,
the hash covering the sources, the flags, the compiler and the headers, so a changed
source rebuilds and an unchanged one is reused.

The Debian archive is the one this machine's apt already uses (the first ``.../debian``
entry of /etc/apt/sources.list{,.d}, with its Signed-By keyring), asked for the trixie suite.

Environment: ``ONNXFUSE_ORT_INCLUDE`` (a folder holding ``onnxruntime_c_api.h``, skips the
download), ``ONNXFUSE_DEBIAN_MIRROR`` (archive URI to use instead of the system's),
``ONNXFUSE_CXX`` (compiler, default ``g++``).

``python -m onnxfuse.build`` builds (if needed) and prints the library's path.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from onnxfuse.errors import OnnxfuseError

LIB_NAME = "libonnxfuse_ops.so"
ORT_DEB = "libonnxruntime-dev"
ORT_HEADERS_VERSION = "1.21"  # API 21; the suite below carries 1.21.x
DEBIAN_SUITE = "trixie"
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
    return sorted(p for p in src.iterdir() if p.suffix in (".cc", ".h") and p.is_file())


# ---------------------------------------------------------------------------------------
# ONNX Runtime headers
# ---------------------------------------------------------------------------------------

def ort_include_dir() -> Path:
    """A folder with onnxruntime_c_api.h (API >= 21), downloading it once if needed."""
    env = os.environ.get("ONNXFUSE_ORT_INCLUDE")
    if env:
        if not (Path(env) / "onnxruntime_c_api.h").is_file():
            raise OnnxfuseError(f"ONNXFUSE_ORT_INCLUDE={env} has no onnxruntime_c_api.h")
        return Path(env)
    root = cache_dir() / "ort-headers" / ORT_HEADERS_VERSION
    inc = root / "usr" / "include" / "onnxruntime"
    if (inc / "onnxruntime_c_api.h").is_file():
        return inc
    _fetch_ort_headers(root)
    if not (inc / "onnxruntime_c_api.h").is_file():
        raise OnnxfuseError(f"{ORT_DEB} unpacked into {root} but has no onnxruntime_c_api.h")
    return inc


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
        raise OnnxfuseError(
            "cannot fetch the ONNX Runtime C API headers: no Debian archive in /etc/apt sources "
            "(set ONNXFUSE_DEBIAN_MIRROR to one, or ONNXFUSE_ORT_INCLUDE to a folder with onnxruntime_c_api.h)")
    opt = f"[signed-by={signed}] " if signed and Path(signed).is_file() else ""
    return f"deb {opt}{mirror} {DEBIAN_SUITE} main"


def _fetch_ort_headers(root: Path) -> None:
    for tool in ("apt-get", "dpkg"):
        if shutil.which(tool) is None:
            raise OnnxfuseError(
                f"cannot fetch the ONNX Runtime C API headers: {tool} not found (needs a Debian-like "
                "system, or set ONNXFUSE_ORT_INCLUDE to a folder with onnxruntime_c_api.h)")
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
            try:
                staging.rename(root)
            except OSError:
                if not root.is_dir():  # another process won the race otherwise
                    raise
        finally:
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)


def cuda_include_dir() -> Path | None:
    """triton's copy of the CUDA headers (cuda.h), or None without triton."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("triton")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        inc = Path(loc) / "backends" / "nvidia" / "include"
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


def _digest(cxx: str, ort_inc: Path, cuda_inc: Path | None) -> str:
    h = hashlib.sha256()
    for p in _sources(source_dir()):
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    h.update(" ".join(CXXFLAGS + LDFLAGS + VECTOR_MATH).encode() + VERSION_SCRIPT.encode())
    h.update(_compiler_id(cxx).encode())
    h.update((ort_inc / "onnxruntime_c_api.h").read_bytes())
    h.update(b"cuda" if cuda_inc else b"nocuda")
    return h.hexdigest()[:16]


def expected_path() -> Path | None:
    """The cached library for the current sources, without building (None if unknown yet)."""
    try:
        cxx = _compiler()
    except OnnxfuseError:
        return None
    ort_inc = os.environ.get("ONNXFUSE_ORT_INCLUDE") or (
        cache_dir() / "ort-headers" / ORT_HEADERS_VERSION / "usr" / "include" / "onnxruntime")
    ort_inc = Path(ort_inc)
    if not (ort_inc / "onnxruntime_c_api.h").is_file():
        return None
    return cache_dir() / "lib" / _digest(cxx, ort_inc, cuda_include_dir()) / LIB_NAME


def build(force: bool = False, verbose: bool = False) -> Path:
    """Build the library if it is not in the cache; return its path."""
    cxx = _compiler()
    ort_inc = ort_include_dir()
    cuda_inc = cuda_include_dir()
    src = source_dir()
    out_dir = cache_dir() / "lib" / _digest(cxx, ort_inc, cuda_inc)
    out = out_dir / LIB_NAME
    if out.is_file() and not force:
        return out
    out_dir.mkdir(parents=True, exist_ok=True)
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
