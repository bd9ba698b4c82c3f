"""optimize(): the flat list of stages from an input model to a fused one, plus a report."""

from __future__ import annotations

import os
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import onnx
from onnx import ModelProto

from onnxfuse.errors import OnnxfuseError
from onnxfuse.graph import GraphView
from onnxfuse.load import canonicalize, infer_shapes, load_model
from onnxfuse.match import find_matches
from onnxfuse.pattern import Pattern, load_patterns
from onnxfuse.rewrite import FusedNode, rewrite

# Protobuf cannot serialize a message of 2 GiB or more: larger models go to external data.
EXTERNAL_DATA_THRESHOLD = 2**31 - 2**24


@dataclass
class FusionRecord:
    node: str
    pattern: str
    kernel: str
    replaces: list[str]
    inputs: int
    outputs: int


@dataclass
class Report:
    """What optimize did; printed by the CLI and written as JSON with --json."""

    nodes_before: int = 0
    nodes_after: int = 0
    patterns_applied: dict[str, int] = field(default_factory=dict)
    fused: list[FusionRecord] = field(default_factory=list)
    not_fused: dict[str, int] = field(default_factory=dict)  # reason -> nodes
    compile: dict | None = None
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        lines = [f"nodes: {self.nodes_before} -> {self.nodes_after}"]
        if self.patterns_applied:
            for name, count in sorted(self.patterns_applied.items()):
                lines.append(f"{name}: {count} fused")
        else:
            lines.append("nothing fused")
        for rec in self.fused[:20]:
            lines.append(f"  {rec.node}: {' -> '.join(op.split(' ')[0] for op in rec.replaces)}")
        if len(self.fused) > 20:
            lines.append(f"  ... and {len(self.fused) - 20} more")
        if self.not_fused:
            lines.append("not fused:")
            for reason, n in sorted(self.not_fused.items(), key=lambda kv: (-kv[1], kv[0])):
                lines.append(f"  {n} node{'s' if n != 1 else ''}: {reason}")
        if self.compile is not None:
            c = self.compile
            lines.append(c["summary"] if "summary" in c else f"compile: {c}")
        lines.append(f"time: {self.seconds:.2f} s")
        return "\n".join(lines)


@dataclass
class Result:
    model: ModelProto
    report: Report
    fused: list[FusedNode]


def optimize_model(model: ModelProto, patterns: list[Pattern] | None = None) -> Result:
    """Fuse a model in memory. The input model is not modified."""
    t0 = time.perf_counter()
    patterns = load_patterns() if patterns is None else patterns
    canonical = canonicalize(model)                       # exporters' habits undone
    inferred = infer_shapes(canonical)                    # types and shapes for matching
    view = GraphView.build(canonical, inferred)           # producers, consumers, constants
    found = find_matches(view, patterns)                  # groups each pattern fuses
    fused_model, fused = rewrite(canonical, view, found.matches)  # custom nodes + functions
    report = Report(
        nodes_before=len(model.graph.node),
        nodes_after=len(fused_model.graph.node),
        patterns_applied=dict(Counter(f.pattern for f in fused)),
        fused=[FusionRecord(f.node_name, f.pattern, f.kernel_name, list(f.source_nodes),
                            len(f.inputs), len(f.outputs)) for f in fused],
        not_fused=dict(found.rejected),
    )
    report.seconds = time.perf_counter() - t0
    return Result(fused_model, report, fused)


def optimize(input_path: str | os.PathLike, output_path: str | os.PathLike,
             pattern_dirs: list[str] | tuple = (), compile_hook=None) -> Report:
    """Read, fuse and atomically write a model file. compile_hook(result) may attach kernels."""
    t0 = time.perf_counter()
    patterns = load_patterns(pattern_dirs)
    model = load_model(input_path)
    result = optimize_model(model, patterns)
    if compile_hook is not None:
        result.report.compile = compile_hook(result)
    save_model(result.model, output_path)
    result.report.seconds = time.perf_counter() - t0
    return result.report


def save_model(model: ModelProto, path: str | os.PathLike) -> None:
    """Write atomically: to a temporary file in the same folder, then rename. Models too big
    for one protobuf go to external data beside it (<name>.data)."""
    path = Path(path)
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise OnnxfuseError(f"{path}: folder {folder} does not exist")
    big = model.ByteSize() > EXTERNAL_DATA_THRESHOLD
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
    os.close(fd)
    data_name = path.name + ".data"
    tmp_data = folder / f".{data_name}.tmp"
    try:
        if big:
            m = ModelProto()
            m.CopyFrom(model)
            onnx.save_model(m, tmp, save_as_external_data=True, all_tensors_to_one_file=True,
                            location=tmp_data.name, size_threshold=1024)
            # Point the tensors at the final data file name, then move both into place.
            m2 = onnx.load(tmp, load_external_data=False)
            for t in _external_tensors(m2):
                for kv in t.external_data:
                    if kv.key == "location":
                        kv.value = data_name
            onnx.save_model(m2, tmp)
            os.replace(tmp_data, folder / data_name)
        else:
            with open(tmp, "wb") as f:
                f.write(model.SerializeToString(deterministic=True))
        os.replace(tmp, path)
    except OSError as e:
        raise OnnxfuseError(f"{path}: cannot write ({e.strerror or e})") from None
    finally:
        for p in (tmp, tmp_data):
            if os.path.exists(p):
                os.unlink(p)


def _external_tensors(model: ModelProto):
    from onnx.external_data_helper import _get_all_tensors

    return [t for t in _get_all_tensors(model) if t.data_location == onnx.TensorProto.EXTERNAL]
