"""The `onnxfuse` command line."""

# Every subcommand and its arguments are registered here; the commands' bodies live with
# their tools: onnxfuse.pipeline.optimize, bench, bisect, analyze, profile, calibrate.

from __future__ import annotations

import argparse
import atexit
import os
import sys
import warnings
from pathlib import Path

from onnxfuse import analyze, bench, bisect, calibrate, profile
from onnxfuse.errors import OnnxfuseError, OnnxfuseWarning
from onnxfuse.files import check_paths
from onnxfuse.pattern import load_patterns
from onnxfuse.pipeline import Options, build_options, optimize
from onnxfuse.tools.gate import REFERENCES
from onnxfuse.tools.session import OPT_LEVELS
from onnxfuse.tools.shapes import parse_shapes

EXIT_BAD_INPUT = 2
EXIT_BROKEN_PIPE = 128 + 13  # 141: what shells report for a process killed by SIGPIPE


def _cmd_optimize(args: argparse.Namespace) -> int:
    src, dst = Path(args.input), Path(args.output)
    check_paths([src], [dst, args.json])  # before the work (optimize checks them again)
    options = options_from_args(args)
    with warnings.catch_warnings():  # the report carries them; printed below
        warnings.simplefilter("ignore", OnnxfuseWarning)
        report = optimize(src, dst, json_path=args.json, options=options)
    for w in report.warnings:
        print(f"onnxfuse: warning: {w}", file=sys.stderr)
    print(report.summary())
    print(f"wrote {dst}" + (f" and {args.json}" if args.json else ""))
    return 0


def options_from_args(args: argparse.Namespace) -> Options:
    """The Options of `onnxfuse optimize`'s flags (`onnxfuse.pipeline.build_options`, which
    `onnxfuse.optimize` calls with the same defaults)."""
    if args.tune and args.no_tune:
        raise OnnxfuseError("--tune and --no-tune contradict each other")
    return build_options(args.target, args.layout, args.conv_precision,
                         "off" if args.no_tune else "configs" if args.tune else "auto",
                         parse_shapes(args.shape), args.batch, args.tune_budget, args.jobs,
                         args.patterns or (), args.exclude_pattern or (), args.leave_to_ort, args.cuda_graph)


def _cmd_patterns(args: argparse.Namespace) -> int:
    patterns = load_patterns(args.patterns or ())
    width = max(len(p.name) for p in patterns)
    for p in patterns:
        print(f"{p.name:<{width}}  {p.description}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="onnxfuse", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("optimize", help="fuse a model: onnxfuse optimize in.onnx out.onnx")
    p.add_argument("input")
    p.add_argument("output")
    p.add_argument("--patterns", action="append", metavar="DIR", help="also load pattern files from DIR")
    p.add_argument("--json", metavar="FILE", help="write the report as JSON")
    p.add_argument("--target", default="auto",
                   help="GPU architectures to compile kernels for, e.g. sm_90,sm_80; 'auto' (the local "
                        "GPU, else the default set) or 'none' to embed no kernels")
    p.add_argument("--jobs", type=int, default=None, help="parallel kernel compilations")
    p.add_argument("--conv-precision", choices=["tf32", "tf32x3", "ieee"], default="tf32",
                   help="how fused float32 convolutions multiply: tf32 (default) on tensor cores with the "
                        "operands rounded to TF32 as cuDNN/cuBLAS round them (the accuracy of ONNX Runtime's "
                        "CUDA EP defaults); tf32x3 about fp32 accuracy at about 3x the tensor-core math; ieee "
                        "fp32 FMA on CUDA cores, slowest. tf32x3 and ieee also keep GlobalAveragePools off "
                        "TF32 MatMuls. Measured on the H200: BENCHMARKS.md, Conv precision")
    p.add_argument("--exclude-pattern", action="append", metavar="NAME",
                   help="do not apply this pattern (repeatable; names from `onnxfuse patterns`)")
    p.add_argument("--leave-to-ort", action=argparse.BooleanOptionalAction, default=True,
                   help="pointwise chains take no node that ONNX Runtime's own fusions (BiasGelu, Gelu, FastGelu, "
                        "(Skip)LayerNormalization, Attention, FusedMatMul, MatMul + Add into Gemm) would take; the "
                        "report names the fusion (default on; --no-leave-to-ort fuses them anyway)")
    p.add_argument("--layout", choices=["auto", "nchw", "nhwc"], default="auto",
                   help="nhwc: convolutions run channels-last ([K,R,S,C] weights, Transposes only where a "
                        "run of fused convs meets other ops); nchw: as the model is; auto (default): nhwc "
                        "when kernels are compiled for a GPU, nchw with --target none")
    p.add_argument("--tune", action="store_true",
                   help="on a GPU, also search each fused kernel's configurations (tile sizes) while tuning; "
                        "an error where tuning cannot run")
    p.add_argument("--no-tune", action="store_true",
                   help="do not measure: the heuristics alone decide (tuning is on by default when this machine "
                        "has an NVIDIA GPU and onnxruntime-gpu)")
    p.add_argument("--tune-budget", type=float, metavar="SECONDS",
                   help="per-node timing stops after this long (default 60); the whole-model check always runs")
    p.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=None,
                   help="how the written model will run: --cuda-graph under ONNX Runtime's CUDA graphs "
                        "(enable_cuda_graph), --no-cuda-graph without; tuning compares whole models in that mode "
                        "alone (default: a candidate is kept only where it is slower in neither mode)")
    p.add_argument("--shape", action="append", metavar="NAME=DIMS",
                   help="the input shape the model will run at, of an input (x=32,3,224,224) or a named dim "
                        "(seq=128): tuning measures there, and when --shape/--batch give every symbolic dim the "
                        "written model takes that shape only, its shape arithmetic folded into constants (every "
                        "node on the GPU, CUDA graphs possible)")
    p.add_argument("--batch", type=int, default=None,
                   help="size of symbolic leading dims (tuning: default 1); with the other dims fixed or given, "
                        "makes the written model static as --shape does")
    p.set_defaults(func=_cmd_optimize)

    p = sub.add_parser("patterns", help="list the loaded fusion patterns")
    p.add_argument("--patterns", action="append", metavar="DIR", help="also load pattern files from DIR")
    p.set_defaults(func=_cmd_patterns)

    p = sub.add_parser("bench", help="time models on the same inputs and gate their outputs against the first "
                                     "model in float64",
                       description="Time models in ONNX Runtime on the same seeded inputs and gate every later "
                                   "model's outputs against the first's, evaluated in float64.",
                       epilog=bench.GATE_HELP)
    _bench_arguments(p)
    p.set_defaults(func=bench.run_cli)

    p = sub.add_parser("bisect", help="name the fused nodes that make an optimized model fail bench's gate",
                       description="Put fused nodes of OPTIMIZED back to their function bodies until it passes "
                                   "bench's gate against ORIGINAL; print the nodes responsible. Exit 0 when it "
                                   "already passes, 1 when it fails (culprits printed), 2 on bad input.",
                       epilog=bench.GATE_HELP)
    _bisect_arguments(p)
    p.set_defaults(func=bisect.run_cli)

    p = sub.add_parser("analyze", help="per-node FLOPs, bytes, arithmetic intensity and the roofline")
    p.add_argument("model")
    _add_device_args(p)
    _add_shape_args(p)
    p.add_argument("--threshold", type=float, default=analyze.DEFAULT_THRESHOLD,
                   help="fusion candidates: nodes below this intensity in FLOP/B "
                        f"(default {analyze.DEFAULT_THRESHOLD:g})")
    p.add_argument("--json", metavar="FILE", help="write the analysis as JSON")
    p.add_argument("--plot", metavar="FILE", help="write the roofline plot (.png or .svg; needs matplotlib)")
    p.add_argument("--top", type=int, default=50, help="rows of the table to print (0: all; default 50)")
    p.add_argument("--patterns", action="append", metavar="DIR", help="also load pattern files from DIR")
    p.add_argument("--no-fuse", action="store_true", help="do not run the optimizer to show what it would fuse")
    p.set_defaults(func=analyze.cmd_analyze)

    p = sub.add_parser("profile", help="run in ONNX Runtime's profiler: measured time per node against the roofline")
    p.add_argument("model")
    p.add_argument("--provider", choices=("cpu", "cuda"), default="cpu", help="execution provider (default cpu)")
    _add_device_args(p, default=None)
    _add_shape_args(p)
    p.add_argument("--iters", type=int, default=10, help="measured runs (default 10)")
    p.add_argument("--warmup", type=int, default=3, help="runs before measuring (default 3)")
    p.add_argument("--ort-level", choices=("disable", "basic", "extended", "all"), default="all",
                   help="ONNX Runtime graph optimization level (default all, what sessions use)")
    p.add_argument("--json", metavar="FILE", help="write the results as JSON")
    p.add_argument("--plot", metavar="FILE", help="write measured points on the roofline (.png or .svg)")
    p.add_argument("--top", type=int, default=30, help="rows of the table to print (0: all; default 30)")
    p.add_argument("--keep-trace", metavar="FILE", help="also keep ONNX Runtime's profile JSON here")
    p.add_argument("--kernels", action="store_true",
                   help="under each node, the CUDA kernels it ran, longest first (CUPTI; --provider cuda), and "
                        "how much kernel time was in TF32 tensor-core kernels (by name): which cuDNN / cuBLAS / "
                        "CUTLASS algorithm ran, TF32 tensor cores or full fp32 (the --json has every kernel)")
    p.set_defaults(func=profile.cmd_profile)

    p = sub.add_parser("calibrate", help="measure this machine's GPU (copy bandwidth, matmul/conv throughput)")
    p.add_argument("--out", default="device.json", help="device profile to write (default device.json)")
    p.add_argument("--size-mb", type=int, default=1024, help="bytes per copy buffer, in MB (default 1024)")
    p.add_argument("--iters", type=int, default=20, help="timed repetitions per measurement (default 20)")
    p.set_defaults(func=calibrate.cmd_calibrate)
    return parser




# ---------------------------------------------------------------------------------------
# Arguments shared by several commands
# ---------------------------------------------------------------------------------------

def _bench_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("models", nargs="+", metavar="MODEL", help="ONNX models; the first is the original (baseline)")
    _run_arguments(p)
    p.add_argument("--warmup", type=int, default=10, help="untimed runs after the first (default 10)")
    p.add_argument("--iters", type=int, default=100, help="timed runs (default 100)")
    p.add_argument("--cuda-graph", action="store_true",
                   help="run with ONNX Runtime's CUDA graphs (a model they cannot capture runs without, "
                        "marked \"(no graph)\")")
    p.add_argument("--json", metavar="FILE", help="write the results as JSON (schema onnxfuse.bench/1.4)")
    p.add_argument("--markdown", nargs="?", const="-", metavar="FILE",
                   help="print the table as Markdown (or write it to FILE)")


def _run_arguments(p: argparse.ArgumentParser) -> None:
    """The options bench and bisect share: provider, inputs, the gate, the session."""
    p.add_argument("--provider", choices=["cuda", "cpu"], default=None,
                   help="execution provider (default: cuda when this onnxruntime has it, else cpu)")
    p.add_argument("--shape", action="append", metavar="NAME=DIMS",
                   help="an input's shape (x=1x3x224x224) or a named dimension's size (seq=128); repeatable")
    p.add_argument("--input", action="append", metavar="NAME=VALUE",
                   help="an input's value: a .npy file or a number filling its shape (sr=16000); repeatable")
    p.add_argument("--batch", type=int, help="size of dynamic leading dimensions (default 1)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    p.add_argument("--reference", choices=REFERENCES, default="float64",
                   help="what outputs are judged against: float64 (the default), the first model evaluated in float64 "
                        "on the CPU; fp32, its float32 run (TF32 off on CUDA, its own run on the CPU)")
    p.add_argument("--tf32", action="store_true", default=True,
                   help="CUDA: run the models under ORT's defaults, TF32 allowed (the default; kept for "
                        "compatibility); with --reference fp32 they are gated against a TF32-off run of the first")
    p.add_argument("--no-tf32", dest="tf32", action="store_false",
                   help="CUDA: run every model with TF32 off; with --reference fp32 the reference is then the first "
                        "model's run (ort_err 0)")
    p.add_argument("--atol", type=float, help="absolute tolerance floor for every output (default per dtype, "
                                              "times max|reference|)")
    p.add_argument("--rtol", type=float, help="relative tolerance floor for every output (default per dtype)")
    p.add_argument("--threads", type=int, help="ONNX Runtime intra-op threads (default: ORT's)")
    p.add_argument("--opt-level", choices=OPT_LEVELS, default="all", help="ONNX Runtime graph optimizations")
    p.add_argument("--no-library", action="store_true",
                   help="do not register the onnxfuse library (fused nodes run their function bodies)")



def _bisect_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("original", metavar="ORIGINAL", help="the model before optimizing: the reference")
    p.add_argument("optimized", metavar="OPTIMIZED", help="the optimized model (onnxfuse nodes)")
    _run_arguments(p)
    p.add_argument("--write", metavar="FILE", help="write OPTIMIZED with the culprits unfused")



def _add_shape_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shape", action="append", metavar="NAME=DIMS",
                   help="concrete shape of a graph input, e.g. x=8,3,224,224 (repeatable)")
    p.add_argument("--batch", type=int, help="the first dimension of every input whose first dimension is dynamic")


def _add_device_args(p: argparse.ArgumentParser, default: str | None = "h200") -> None:
    p.add_argument("--device", default=default,
                   help=f"device preset ({', '.join(analyze.DEVICES)}) or a device profile JSON from "
                        "`onnxfuse calibrate`" + (f" (default {default})" if default else ""))
    p.add_argument("--profile-file", metavar="FILE", help="device profile JSON from `onnxfuse calibrate` "
                   "(same as --device FILE)")
    p.add_argument("--peak-tflops", type=float, help="compute roof in TFLOP/s (overrides the device)")
    p.add_argument("--bandwidth-tbps", type=float, help="DRAM bandwidth in TB/s (overrides the device)")
    p.add_argument("--dtype-peak", choices=(*analyze.DTYPE_PEAKS, "auto"), default="auto",
                   help="which peak matmul-class nodes use: fp32, tf32 or fp16 tensor cores; auto: fp16 for "
                        "fp16/bf16 models, else fp32 (profile --provider cuda: tf32, as ONNX Runtime runs them)")


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        try:
            code = args.func(args)
        except OnnxfuseError as e:
            print(f"onnxfuse: error: {e}", file=sys.stderr)
            code = EXIT_BAD_INPUT
        except KeyboardInterrupt:
            print("onnxfuse: interrupted", file=sys.stderr)
            code = 130
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        # The reader went away (`onnxfuse analyze m.onnx | head -1`): stop without a
        # traceback, with the status of a Unix tool killed by SIGPIPE. Files a command writes
        # are committed before it prints.
        _silence_broken_streams()
        return EXIT_BROKEN_PIPE


def _silence_broken_streams() -> None:
    """Point stdout (and stderr, if its reader went away too) at /dev/null, so that Python's
    flush at exit does not fail again."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BrokenPipeError:
            pass
        else:
            continue
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, stream.fileno())
            os.close(devnull)
        except (OSError, ValueError):
            pass


def end_process(code: int) -> None:
    """Exit with `code` after Python's own clean-up (stdout and stderr flushed, every atexit
    handler run: temporary folders, logging, caches), but without the native libraries'
    teardown. ONNX Runtime's CUDA EP and torch (its profiler times tuning's nodes) in one
    process abort at that teardown now and then, after every file is written: glibc's
    "free(): invalid pointer" or "double free or corruption", SIGABRT, exit status 134 (3 of
    5 tuned `onnxfuse optimize` runs of a BERT-style encoder on the H200, nineteenth session;
    not inside Python's atexit handlers or a garbage collection, which ran clean before the
    same exit; 0 of 5 ending here). A deployment pipeline reads that status, so the console
    script ends here."""
    _flush_streams()
    atexit._run_exitfuncs()
    _flush_streams()  # (what the handlers printed)
    os._exit(code)


def _flush_streams() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


def entry() -> None:
    """The `onnxfuse` console script and `python -m onnxfuse.cli`: main(), then end_process."""
    end_process(main())


if __name__ == "__main__":
    entry()
