"""The `onnxfuse` command line."""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path

from onnxfuse.errors import OnnxfuseError, OnnxfuseWarning

EXIT_BAD_INPUT = 2
EXIT_BROKEN_PIPE = 128 + 13  # 141: what shells report for a process killed by SIGPIPE


def _cmd_optimize(args: argparse.Namespace) -> int:
    from onnxfuse.files import check_paths
    from onnxfuse.pipeline import optimize

    src, dst = Path(args.input), Path(args.output)
    check_paths([src], [dst, args.json])  # before the work (optimize checks them again)
    if args.tune and args.no_tune:
        raise OnnxfuseError("--tune and --no-tune contradict each other")
    from onnxfuse.kernels import configure

    shapes = _shapes(args)
    hook, layout = configure(args.target, args.layout, args.conv_precision,
                             "off" if args.no_tune else "configs" if args.tune else "auto",
                             shapes, args.batch, args.tune_budget, args.jobs)
    with warnings.catch_warnings():  # the report carries them; printed below
        warnings.simplefilter("ignore", OnnxfuseWarning)
        report = optimize(src, dst, args.patterns or (), compile_hook=hook, exclude=args.exclude_pattern or (),
                          layout=layout, json_path=args.json, shapes=shapes, batch=args.batch)
    for w in report.warnings:
        print(f"onnxfuse: warning: {w}", file=sys.stderr)
    print(report.summary())
    print(f"wrote {dst}" + (f" and {args.json}" if args.json else ""))
    return 0


def _shapes(args: argparse.Namespace) -> dict[str, tuple[int, ...]]:
    from onnxfuse.bench import parse_assignments, parse_dims

    return {k: parse_dims(v) for k, v in parse_assignments(args.shape, "--shape").items()}


def _cmd_patterns(args: argparse.Namespace) -> int:
    from onnxfuse.pattern import load_patterns

    patterns = load_patterns(args.patterns or ())
    width = max(len(p.name) for p in patterns)
    for p in patterns:
        print(f"{p.name:<{width}}  {p.description}")
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from onnxfuse.bench import run_cli

    return run_cli(args)


def _cmd_bisect(args: argparse.Namespace) -> int:
    from onnxfuse.bisect import run_cli

    return run_cli(args)


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

    from onnxfuse.bench import GATE_HELP
    from onnxfuse.bench import add_arguments as bench_arguments

    p = sub.add_parser("bench", help="time models on the same inputs and gate their outputs against the first "
                                     "model in float64",
                       description="Time models in ONNX Runtime on the same seeded inputs and gate every later "
                                   "model's outputs against the first's, evaluated in float64.", epilog=GATE_HELP)
    bench_arguments(p)
    p.set_defaults(func=_cmd_bench)

    from onnxfuse.bisect import add_arguments as bisect_arguments

    p = sub.add_parser("bisect", help="name the fused nodes that make an optimized model fail bench's gate",
                       description="Put fused nodes of OPTIMIZED back to their function bodies until it passes "
                                   "bench's gate against ORIGINAL; print the nodes responsible. Exit 0 when it "
                                   "already passes, 1 when it fails (culprits printed), 2 on bad input.",
                       epilog=GATE_HELP)
    bisect_arguments(p)
    p.set_defaults(func=_cmd_bisect)

    from onnxfuse.analyze import add_commands as analysis_commands

    analysis_commands(sub)  # analyze, profile, calibrate
    return parser


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


if __name__ == "__main__":
    sys.exit(main())
