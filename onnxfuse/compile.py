"""Ahead-of-time compilation: generated Triton kernels become cubin/PTX per GPU target.

No GPU is needed: `triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32))`
runs Triton's whole pipeline and the bundled ``ptxas`` on the CPU. For each spec
`compile_kernels` compiles the variants its kind chooses (docs/format.md; for a pointwise
kernel, one promising 16-byte aligned pointers and ``n_elements % 16 == 0``, which reach
Triton as ``tt.divisibility`` hints so that loads and stores vectorize, then one promising
nothing).

Each variant is compiled to a cubin per requested target, and a PTX is kept too so that
GPUs newer than every cubin can JIT it: the highest target's, its ``.target`` relaxed from
``sm_XXa`` to ``sm_XX``, unless the kind picks another (`onnxfuse.kinds.base.Kind.ptx_arch`). `attach` writes the
result onto a fused node as the ``kernel_meta`` attribute and one string attribute
``kernel_<i>`` per binary.

Each kind (`onnxfuse.kinds`) says which variants a kernel ships with, generates their
sources and writes its ``kernel_meta``; this module compiles and caches them.

Targets: triton 3.6 compiles sm_70 ... sm_90 with its bundled ptxas (CUDA 12.8) and
sm_100, sm_101, sm_103, sm_120, sm_121 with its bundled ptxas-blackwell (CUDA 12.9);
sm_110 is not known to either. From sm_90 on, Triton compiles for the arch-specific
``sm_XXa`` target; such a cubin runs on exactly that compute capability.

Misses compile in parallel, in `jobs` worker processes (default: one per CPU core).

Cache: one entry per (kernel source, variant, target) under ``~/.cache/onnxfuse/kernels``
(``$ONNXFUSE_CACHE/kernels`` where it is set), keyed by a hash of the source, signature,
hints, options, target and Triton version. Generated modules are written under the same
root (``src/``), because ``@triton.jit`` reads its function's source file.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import pickle
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import onnx

from onnxfuse.codegen import KernelSource
from onnxfuse.errors import OnnxfuseError
from onnxfuse.kinds import KINDS
from onnxfuse.kinds.base import Spec
from onnxfuse.tools.cuda import local_gpu_archs
from onnxfuse.tools.worker import child_pythonpath

CACHE_FORMAT = 1  # bump when the cache entry layout or the compile options change
DEFAULT_TARGETS = (80, 90)  # A100 and H100/H200, when no local GPU reports its arch
SUPPORTED_ARCHS = (70, 72, 75, 80, 86, 87, 89, 90, 100, 101, 103, 120, 121)

# triton.compile options. enable_reflect_ftz=False keeps subnormals in libdevice math
# (the numpy reference and ONNX Runtime do not flush them).
COMPILE_OPTIONS = {"enable_reflect_ftz": False}


@dataclass(frozen=True)
class Binary:
    """One compiled binary (attribute ``kernel_<i>``) and its entry in ``kernel_meta``."""

    variant: int
    arch: int
    format: str  # "cubin" or "ptx"
    entry: str  # symbol of the kernel in the module
    num_warps: int
    shared: int
    global_scratch_size: int
    global_scratch_align: int
    profile_scratch_size: int
    profile_scratch_align: int
    data: bytes

    def meta(self) -> dict:
        return {
            "variant": self.variant, "arch": self.arch, "format": self.format, "entry": self.entry,
            "num_warps": self.num_warps, "shared": self.shared,
            "global_scratch_size": self.global_scratch_size,
            "global_scratch_align": self.global_scratch_align,
            "profile_scratch_size": self.profile_scratch_size,
            "profile_scratch_align": self.profile_scratch_align,
        }


@dataclass(frozen=True)
class CompiledKernel:
    """All binaries of one kernel, plus how they were obtained."""

    spec: Spec
    variants: tuple  # the kind's variant values
    binaries: tuple[Binary, ...]
    compile_seconds: float  # time spent compiling this kernel's misses (0.0 if all hit)
    cache_hits: int  # (variant, target) pairs found in the cache
    compiled: int  # (variant, target) pairs compiled now

    def kernel_meta(self) -> dict:
        """The ``kernel_meta`` object of docs/format.md, as the spec's kind writes it."""
        return KINDS[self.spec.kind].kernel_meta(self.spec, self.variants, [b.meta() for b in self.binaries])

    def kernel_meta_json(self) -> str:
        return json.dumps(self.kernel_meta(), separators=(",", ":"))

    def kernels(self) -> list[bytes]:
        """The code of each binary: attribute ``kernel_<i>`` holds ``kernels()[i]``."""
        return [b.data for b in self.binaries]


@dataclass(frozen=True)
class CompileFailure:
    """A kernel that did not compile (`compile_kernels(..., errors="collect")`)."""

    spec: Spec
    targets: tuple[int, ...]  # the archs it failed for
    message: str  # the first failure's error, shortened


# ---------------------------------------------------------------------------------------
# targets
# ---------------------------------------------------------------------------------------


def parse_targets(text: str) -> list[int]:
    """``"sm_90,sm_80"`` -> ``[90, 80]`` (order kept, duplicates dropped)."""
    archs: list[int] = []
    for tok in (t.strip() for t in text.split(",")):
        m = re.fullmatch(r"sm_?(\d+)a?", tok)
        if not m:
            raise OnnxfuseError(
                f"bad GPU target {tok!r}: expected names like sm_80 or sm_90, comma-separated")
        arch = int(m.group(1))
        if arch not in SUPPORTED_ARCHS:
            known = ", ".join(f"sm_{a}" for a in SUPPORTED_ARCHS)
            raise OnnxfuseError(f"GPU target {tok!r} is not supported by triton's ptxas (known: {known})")
        if arch not in archs:
            archs.append(arch)
    return archs


def targets(text: str) -> list[int]:
    """What `--target` names: "auto" the local GPUs' archs (`default_targets`), else the
    list `parse_targets` reads."""
    return default_targets() if text == "auto" else parse_targets(text)


def default_targets() -> list[int]:
    """The local GPUs' archs if the CUDA driver reports any, else `DEFAULT_TARGETS`.

    A local arch newer than every supported one maps to the newest supported arch below
    it (its PTX JITs on the newer GPU).
    """
    archs = []
    for cc in local_gpu_archs():
        usable = [a for a in SUPPORTED_ARCHS if a <= cc]
        if usable and usable[-1] not in archs:
            archs.append(usable[-1] if cc not in SUPPORTED_ARCHS else cc)
    return sorted(archs) or list(DEFAULT_TARGETS)


# ---------------------------------------------------------------------------------------
# compile
# ---------------------------------------------------------------------------------------


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """`cache_dir`, else ``kernels`` under ``$ONNXFUSE_CACHE``, else ``~/.cache/onnxfuse/kernels``:
    the same root as the tuning cache's and the library's (`onnxfuse.build.cache_dir`), which
    the GPU session's cache-save and cache-load carry as ``tune`` and ``kernels``."""
    if cache_dir is not None:
        return Path(cache_dir)
    return Path(os.environ.get("ONNXFUSE_CACHE") or Path.home() / ".cache" / "onnxfuse") / "kernels"


@dataclass(frozen=True)
class _Job:
    """One (kernel source, variant, target) to compile; picklable for the worker pool."""

    kernel: KernelSource
    arch: int
    key: str
    root: str


def compile_kernels(
    specs: list[Spec],
    targets: list[int],
    cache_dir: str | os.PathLike | None = None,
    jobs: int | None = None,
    errors: str = "raise",
    variant_override: tuple | None = None,
    variant_overrides: list[tuple] | None = None,
) -> list[CompiledKernel | CompileFailure]:
    """Compile every spec's variants for every target (cached, in parallel); same order.

    A (variant, target) that fails to compile raises OnnxfuseError, or with
    errors="collect" makes its spec's entry a CompileFailure (the others still compile).
    variant_override: the variants to compile for every spec instead of the defaults (tuning);
    variant_overrides: one such tuple per spec (a spec given once per configuration tuning
    times, all compiled in parallel)."""
    if variant_overrides is not None and len(variant_overrides) != len(specs):
        raise ValueError("variant_overrides needs one tuple of variants per spec")
    if not targets:
        raise OnnxfuseError("no GPU targets to compile for")
    for arch in targets:
        if arch not in SUPPORTED_ARCHS:
            raise OnnxfuseError(f"GPU target sm_{arch} is not supported by triton's ptxas")
    root = cache_root(cache_dir)
    archs = sorted(set(targets))
    plans = []  # per spec: (variants, [(kernel, arch, key)])
    for i, spec in enumerate(specs):
        try:
            kind = KINDS[spec.kind]
            variants = (variant_overrides[i] if variant_overrides is not None
                        else variant_override if variant_override is not None else kind.variants(spec))
            # a library variant (cuBLASLt's GEMM) has no source and no binary
            kernels = [kind.generate(spec, v) for v in variants if getattr(v, "library", None) is None]
        except ValueError as e:  # a kernel this code generator cannot write
            if errors != "collect":
                raise OnnxfuseError(f"kernel {spec.name}: {e}") from None
            plans.append(((), [], str(e)))
            continue
        plans.append((variants, [(k, a, _cache_key(k, a)) for k in kernels for a in archs], None))

    results: dict[str, dict] = {}
    misses: dict[str, _Job] = {}
    for _, entries, _ in plans:
        for kernel, arch, key in entries:
            hit = _cache_get(root, key)
            if hit is not None:
                results[key] = hit
            elif key not in misses:
                misses[key] = _Job(kernel, arch, key, str(root))
    timings, failures = _run_jobs(list(misses.values()), jobs)
    if failures and errors != "collect":
        key, message = next(iter(failures.items()))
        raise OnnxfuseError(f"kernel compilation failed ({misses[key].kernel.name}, sm_{misses[key].arch}):\n"
                            f"{message}")
    for key in misses:
        if key in failures:
            continue
        entry = _cache_get(root, key)
        if entry is None:
            failures[key] = f"compiled kernel {misses[key].kernel.name} is missing from the cache at {root}"
            if errors != "collect":
                raise OnnxfuseError(failures[key])
            continue
        results[key] = entry

    out: list[CompiledKernel | CompileFailure] = []
    for spec, (variants, entries, problem) in zip(specs, plans, strict=True):
        if problem is not None:
            out.append(CompileFailure(spec, tuple(archs), problem))
            continue
        failed = [(a, failures[key]) for _, a, key in entries if key in failures]
        if failed:
            archs = tuple(sorted({a for a, _ in failed}))
            out.append(CompileFailure(spec, archs, failed[0][1]))
            continue
        binaries: list[Binary] = []
        for v in variants:
            if getattr(v, "library", None) is not None:
                continue
            mine = [(a, results[key]) for k, a, key in entries if k.variant == v]
            binaries += [_binary(v.index, a, r, "cubin") for a, r in mine]
            binaries.append(_ptx_binary(spec, v.index, mine))
        keys = [key for _, _, key in entries]
        out.append(CompiledKernel(
            spec=spec,
            variants=variants,
            binaries=tuple(binaries),
            compile_seconds=sum(timings.get(k, 0.0) for k in set(keys)),
            cache_hits=sum(k not in misses for k in keys),
            compiled=sum(k in misses for k in keys),
        ))
    return out


def _run_jobs(todo: list[_Job], jobs: int | None) -> tuple[dict[str, float], dict[str, str]]:
    """Compile the jobs, in `jobs` worker processes when there are several. Returns seconds
    per compiled key and an error message per failed key: a job that raises fails alone;
    when a worker process dies, its unfinished jobs run again one per process, so only the
    job that kills its compiler fails.

    Workers are fresh interpreters (``python -c``) fed a pickled list of jobs, rather than
    a multiprocessing pool: "fork" would copy the caller's threads (ONNX Runtime, MLIR),
    and "spawn" re-imports the caller's main script, which breaks unguarded scripts. When
    the caller is interrupted (Ctrl-C) or fails, the workers are killed.
    """
    n = min(len(todo), jobs or os.cpu_count() or 1)
    if n <= 1:
        return _compile_all(todo)
    with tempfile.TemporaryDirectory(prefix="onnxfuse-compile-") as tmp:
        timings, failures, crashed = _run_workers([todo[w::n] for w in range(n)], n, Path(tmp), "w")
        if len(crashed) > 1:
            for j in crashed:
                failures.pop(j.key, None)
            t2, f2, _ = _run_workers([[j] for j in crashed], n, Path(tmp), "r")
            timings.update(t2)
            failures.update(f2)
        return timings, failures


def _run_workers(groups: list[list[_Job]], parallel: int, tmp: Path, tag: str):
    """Run each group of jobs in one worker process, at most `parallel` at a time. Returns
    (timings, failures, jobs of workers that died without a result)."""
    env = dict(os.environ, PYTHONPATH=child_pythonpath())
    env.pop("TRITON_INTERPRET", None)
    timings: dict[str, float] = {}
    failures: dict[str, str] = {}
    crashed: list[_Job] = []
    for first in range(0, len(groups), parallel):
        procs = []
        try:
            for w, mine in enumerate(groups[first:first + parallel], start=first):
                job_file, log_file = tmp / f"{tag}{w}.pickle", tmp / f"{tag}{w}.log"
                job_file.write_bytes(pickle.dumps(mine))
                with open(log_file, "wb") as log:
                    cmd = [sys.executable, "-c", f"import onnxfuse.compile as c; c._worker_main({str(job_file)!r})"]
                    procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                                   stdin=subprocess.DEVNULL), mine, job_file, log_file))
            for proc, mine, job_file, log_file in procs:
                code = proc.wait()
                out = job_file.with_suffix(".out")
                if code == 0 and out.exists():
                    done, failed = pickle.loads(out.read_bytes())
                    timings.update(done)
                    failures.update(failed)
                    continue
                log = log_file.read_text(errors="replace")[-4000:]
                for j in mine:
                    failures[j.key] = f"compiler process exited with code {code}:\n{log}"
                crashed += mine
        finally:
            alive = [proc for proc, *_ in procs if proc.poll() is None]
            for proc in alive:
                proc.kill()
            for proc in alive:
                proc.wait()
    return timings, failures, crashed


def _compile_all(todo: list[_Job]) -> tuple[dict[str, float], dict[str, str]]:
    timings: dict[str, float] = {}
    failures: dict[str, str] = {}
    for j in todo:
        try:
            key, seconds = _compile_job(j)
            timings[key] = seconds
        except Exception as e:  # one kernel's failure: reported, the others go on
            failures[j.key] = _error_text(e)
    return timings, failures


def _error_text(e: BaseException) -> str:
    lines = [ln for ln in f"{type(e).__name__}: {e}".strip().splitlines() if ln.strip()]
    return "\n".join(lines[:20])


def _worker_main(job_path: str) -> None:
    """Worker process: compile the pickled jobs, write ({key: seconds}, {key: error}) beside them."""
    todo = pickle.loads(Path(job_path).read_bytes())
    Path(job_path).with_suffix(".out").write_bytes(pickle.dumps(_compile_all(todo)))


def _compile_job(job: _Job) -> tuple[str, float]:
    """Compile one job with triton and store it in the cache; returns (key, seconds)."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    start = time.perf_counter()
    root = Path(job.root)
    k = job.kernel
    fn = _load_kernel(root, k)
    with tempfile.TemporaryDirectory() as triton_cache, knobs.cache.scope(), \
            knobs.compilation.scope(), knobs.runtime.scope():
        knobs.cache.dir = triton_cache  # ours is the only persistent cache
        knobs.compilation.disable_line_info = True  # else the cubin embeds the PTX text
        knobs.runtime.override_arch = None
        src = ASTSource(fn, k.signature, dict(k.constexprs), k.attrs)
        options = dict(COMPILE_OPTIONS, num_warps=k.num_warps)
        if k.num_stages is not None:
            options["num_stages"] = k.num_stages
        ck = triton.compile(src, target=GPUTarget("cuda", job.arch, 32), options=options)
    md = ck.metadata
    meta = {
        "entry": md.name,
        "num_warps": md.num_warps,
        "shared": md.shared,
        "global_scratch_size": md.global_scratch_size or 0,
        "global_scratch_align": md.global_scratch_align or 1,
        "profile_scratch_size": md.profile_scratch_size or 0,
        "profile_scratch_align": md.profile_scratch_align or 1,
        "triton_version": triton.__version__,
    }
    _cache_put(root, job.key, meta, ck.asm["cubin"], ck.asm["ptx"])
    return job.key, time.perf_counter() - start


def _load_kernel(root: Path, kernel: KernelSource):
    """Write the kernel module under ``root/src`` and import it; returns the JITFunction."""
    import triton
    from triton import knobs

    digest = hashlib.sha256(kernel.source.encode()).hexdigest()[:16]
    modname = f"_onnxfuse_kernel_{kernel.name}_{digest}"
    path = root / "src" / f"{kernel.name}_{digest}.py"
    if not path.exists() or path.read_text() != kernel.source:
        _atomic_write(path, kernel.source.encode())
    mod = sys.modules.get(modname)
    if mod is None or not isinstance(getattr(mod, kernel.name, None), triton.runtime.JITFunction):
        spec = importlib.util.spec_from_file_location(modname, path)
        mod = importlib.util.module_from_spec(spec)
        with knobs.runtime.scope():
            knobs.runtime.interpret = False  # an interpreted function cannot be compiled
            spec.loader.exec_module(mod)
        sys.modules[modname] = mod
    return getattr(mod, kernel.name)


def code_lines(source: str) -> str:
    """The source without its whole-line comments: what the binary depends on. A kernel's
    header names the ONNX nodes it replaces, so the twelve layers of an encoder differ only
    there; keyed on this, they compile once (the forty-first session's BERT-base compiled each
    layer's kernel, and each of its tuning candidates, again: 4.5 s a layer for the attention
    tiles on two cores). Line numbers do not reach the binaries (`disable_line_info`)."""
    return "\n".join(ln for ln in source.splitlines() if not ln.lstrip().startswith("#"))


def _cache_key(kernel: KernelSource, arch: int) -> str:
    import triton

    desc = {
        "format": CACHE_FORMAT,
        "triton": triton.__version__,
        "ptxas": [os.environ.get(v, "") for v in ("TRITON_PTXAS_PATH", "TRITON_PTXAS_BLACKWELL_PATH")],
        "arch": arch,
        "name": kernel.name,
        "source": code_lines(kernel.source),
        "params": kernel.params,
        "constexprs": kernel.constexprs,
        "divisible": kernel.divisible,
        "num_warps": kernel.num_warps,
        "num_stages": kernel.num_stages,
        "options": COMPILE_OPTIONS,
    }
    return hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()


def _entry_paths(root: Path, key: str) -> tuple[Path, Path, Path]:
    d = root / key[:2]
    return d / f"{key}.json", d / f"{key}.cubin", d / f"{key}.ptx"


def _cache_get(root: Path, key: str) -> dict | None:
    """The cached entry (metadata plus ``cubin`` and ``ptx``), or None."""
    meta_path, cubin_path, ptx_path = _entry_paths(root, key)
    try:
        meta = json.loads(meta_path.read_text())
        return dict(meta, cubin=cubin_path.read_bytes(), ptx=ptx_path.read_text())
    except (OSError, ValueError):
        return None


def _cache_put(root: Path, key: str, meta: dict, cubin: bytes, ptx: str) -> None:
    meta_path, cubin_path, ptx_path = _entry_paths(root, key)
    _atomic_write(cubin_path, cubin)
    _atomic_write(ptx_path, ptx.encode())
    _atomic_write(meta_path, json.dumps(meta, sort_keys=True).encode())  # last: marks complete


def _atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _binary(variant: int, arch: int, entry: dict, fmt: str, relax: bool = True) -> Binary:
    ptx = entry["ptx"]
    data = entry["cubin"] if fmt == "cubin" else (portable_ptx(ptx) if relax else ptx).encode()
    return Binary(
        variant=variant, arch=arch, format=fmt, entry=entry["entry"], num_warps=entry["num_warps"],
        shared=entry["shared"], global_scratch_size=entry["global_scratch_size"],
        global_scratch_align=entry["global_scratch_align"],
        profile_scratch_size=entry["profile_scratch_size"],
        profile_scratch_align=entry["profile_scratch_align"], data=data,
    )


def _ptx_binary(spec: Spec, variant: int, mine: list[tuple[int, dict]]) -> Binary:
    """The PTX to embed beside the cubins: the target and relaxation the spec's kind asks
    for (`onnxfuse.kinds.base.Kind.ptx_arch`; by default the highest target's, relaxed)."""
    arch, relax = KINDS[spec.kind].ptx_arch([a for a, _ in mine])
    return _binary(variant, arch, dict(mine)[arch], "ptx", relax=relax)


def portable_ptx(ptx: str) -> str:
    """Relax ``.target sm_90a`` to ``sm_90`` so newer GPUs can JIT the PTX.

    Triton targets the arch-specific ``sm_XXa`` from sm_90 on; PTX for it only loads on
    exactly that arch. Pointwise kernels use no arch-specific instructions (the tests
    assemble the relaxed PTX for a newer arch with ptxas).
    """
    return re.sub(r"^(\s*\.target\s+sm_\d+)a\b", r"\1", ptx, flags=re.MULTILINE)


# ---------------------------------------------------------------------------------------
# the fused node
# ---------------------------------------------------------------------------------------

_KERNEL_ATTR = re.compile(r"kernel_meta|kernel_\d+|kernels")  # "kernels": the format before kernel_<i>


def attach(node: onnx.NodeProto, compiled: CompiledKernel) -> None:
    """Set ``kernel_meta`` and ``kernel_0``, ``kernel_1``, ... on a fused node (docs/format.md),
    replacing any kernel attributes it had."""
    if node.overload and node.overload != compiled.spec.name:
        raise ValueError(f"node overload {node.overload!r} is not kernel {compiled.spec.name!r}")
    program = next((a.s.decode() for a in node.attribute if a.name == "program"), None)
    if program is not None and program != compiled.spec.program.to_text():
        raise ValueError(f"node {node.name!r}: its program is not the compiled kernel's")
    for attr in [a for a in node.attribute if _KERNEL_ATTR.fullmatch(a.name)]:
        node.attribute.remove(attr)
    node.attribute.append(onnx.helper.make_attribute("kernel_meta", compiled.kernel_meta_json()))
    for i, blob in enumerate(compiled.kernels()):
        node.attribute.append(onnx.helper.make_attribute(f"kernel_{i}", blob))
