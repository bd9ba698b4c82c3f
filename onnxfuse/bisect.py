"""`onnxfuse bisect ORIGINAL OPTIMIZED`: name the fused nodes that make an optimized model
fail `onnxfuse bench`'s accuracy gate.

    onnxfuse bisect model.onnx model.opt.onnx --provider cuda --batch 16 --write model.fixed.onnx

Every onnxfuse node carries its original subgraph as a model-local function; unfusing a node
inlines that body with the node's tensor names (`onnxfuse.rewrite.unfuse_named`), from the
saved model alone. Inputs, reference and gate are bench's, with the same options
(`onnxfuse.tools.gate.gate_outputs`; the reference is ORIGINAL evaluated in float64 unless it
cannot be, `onnxfuse.tools.gate.untimed_references`). The steps:

1. the optimized model as it is: when it passes, say so (exit 0);
2. every fused node unfused: when that still fails, the failure is outside the fused nodes
   (in rewrites around them; exit 1);
3. culprits one at a time (`find_culprits`): a binary search for the shortest prefix of the
   remaining fused nodes (graph order) whose unfusing, together with the culprits found so
   far, passes; its last node is a culprit; repeat until unfusing the culprits alone passes;
4. each culprit's own error: the model with only that node fused, every other one unfused.

Each candidate model runs once, untimed (`onnxfuse.tools.session.evaluate_model`); progress goes to
stderr. Exit 1 with the culprits printed; ``--write FILE`` writes the optimized model with
them unfused (atomically; never over either input).
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import numpy as np
from onnx import ModelProto

from onnxfuse.bench import check_same_inputs, count_onnxfuse_nodes, settings_from_args, validate
from onnxfuse.errors import OnnxfuseError
from onnxfuse.ir import serialized_bytes
from onnxfuse.load import load_model, read_model
from onnxfuse.outputs import EXTERNAL_DATA_THRESHOLD, Outputs, save_model
from onnxfuse.rewrite import DOMAIN, unfuse_named, unique_name
from onnxfuse.text import abbreviate
from onnxfuse.tools.feeds import input_files, make_feeds
from onnxfuse.tools.gate import OutputCheck, fmt_err, gate_outputs, nan_high, untimed_references
from onnxfuse.tools.session import BenchSettings, evaluate_model, require_cuda
from onnxfuse.tools.shapes import resolve_inputs, signature

EXIT_FAILS = 1
_OVERLOAD = re.compile(r"^onnxfuse_(.+?)_[0-9a-f]{12}(_.*)?$")


@dataclass(frozen=True)
class FusedInfo:
    """One fused node of the optimized model."""

    name: str
    op_type: str
    pattern: str              # from its function overload (onnxfuse_<pattern>_<hash>), "" if unknown
    ops: tuple[str, ...]      # op types of its function body, Constants left out


@dataclass
class Culprit:
    node: FusedInfo
    alone: list[OutputCheck]  # only this node fused, every other one unfused, against the reference

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.alone)


@dataclass
class BisectResult:
    status: str                          # "passes", "culprits" or "outside" (the fused nodes are not to blame)
    reference: str                       # what the models were gated against
    nodes: list[FusedInfo]               # the candidates, in graph order
    before: list[OutputCheck]         # the optimized model as it is
    after: list[OutputCheck]          # with the culprits unfused ("outside": all of them)
    culprits: list[Culprit] = field(default_factory=list)
    search_runs: int = 0                 # candidate models run to find the culprits (steps 1-3)
    runs: int = 0                        # all candidate models run (step 4 too)
    model: ModelProto | None = None      # the optimized model with the culprits unfused (None: "outside")


def find_culprits(names: list[str], passes: Callable[[frozenset[str]], bool]) -> list[str]:
    """A small set S of `names` such that passes(S): culprits one at a time, each the last
    node of the shortest prefix of the remaining names that passes together with the culprits
    so far (binary search). Assumes passes(empty) is False and passes(all names) is True;
    the set returned (in the order of `names`) always passes: it is one seen to pass, or all
    names."""
    culprits: list[str] = []
    rest = list(names)
    hi = len(rest)  # invariant: culprits + rest[:hi] passes
    while True:
        lo = 0      # invariant: culprits + rest[:lo] fails
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if passes(frozenset(culprits + rest[:mid])):
                hi = mid
            else:
                lo = mid
        culprits.append(rest.pop(hi - 1))
        hi -= 1     # culprits + rest[:hi] is the set that passed
        if hi == 0 or passes(frozenset(culprits)):
            return [n for n in names if n in culprits]


class _Evaluator:
    """Builds the optimized model with a set of fused nodes unfused, runs it once, gates it;
    results cached by the set."""

    def __init__(self, model: ModelProto, names: list[str], feeds: dict[str, np.ndarray], settings: BenchSettings,
                 ref: dict[str, np.ndarray], ort: dict[str, np.ndarray] | None, log: TextIO, tmp: Path):
        self.base, self.names, self.feeds, self.settings = model, names, feeds, settings
        self.ref, self.ort, self.log, self.tmp = ref, ort, log, tmp
        self.cache: dict[frozenset[str], list[OutputCheck]] = {}
        self.runs = 0

    def model(self, unfused: frozenset[str]) -> ModelProto:
        m = ModelProto()
        m.CopyFrom(self.base)
        unfuse_named(m, [(name, ()) for name in self.names if name in unfused])
        return m

    def checks(self, unfused: frozenset[str]) -> list[OutputCheck]:
        if unfused in self.cache:
            return self.cache[unfused]
        m = self.model(unfused)
        library = self.settings.library and count_onnxfuse_nodes(m) > 0
        if serialized_bytes(m) < EXTERNAL_DATA_THRESHOLD:
            source: str | bytes = m.SerializeToString()
        else:
            source = str(self.tmp / "candidate.onnx")
            save_model(m, source)
        del m
        outs = evaluate_model(source, self.feeds, self.settings, library)
        checks = gate_outputs(self.ref, self.ort, outs, self.settings.rtol, self.settings.atol)
        self.runs += 1
        self.cache[unfused] = checks
        verdict = "passes" if _passed(checks) else "FAIL"
        print(f"bisect: run {self.runs}: {len(unfused)} of {len(self.names)} fused nodes unfused: {verdict} "
              f"(err vs ref {_err(checks)})", file=self.log, flush=True)
        return checks

    def passes(self, unfused: frozenset[str]) -> bool:
        return _passed(self.checks(unfused))


def _passed(checks: list[OutputCheck]) -> bool:
    return all(c.passed for c in checks)


def _err(checks: list[OutputCheck], key: str = "max_abs_err") -> str:
    return fmt_err(max((getattr(c, key) for c in checks), default=0.0, key=nan_high))


def fused_nodes(model: ModelProto) -> list[FusedInfo]:
    """The onnxfuse nodes of the main graph, in order, with what their functions say about
    them; unnamed or twice-named ones get unique names (in place)."""
    functions = {(f.domain, f.name, f.overload): f for f in model.functions}
    used = {n.name for n in model.graph.node if n.name}
    seen: set[str] = set()
    out = []
    for n in model.graph.node:
        if n.domain != DOMAIN:
            continue
        if not n.name or n.name in seen:
            n.name = unique_name(n.name or f"{n.op_type}_{len(out)}", used)
        seen.add(n.name)
        f = functions.get((n.domain, n.op_type, n.overload))
        if f is None:
            raise OnnxfuseError(f"fused node {n.name!r} ({n.op_type}) has no function body to put back")
        m = _OVERLOAD.match(n.overload)
        out.append(FusedInfo(n.name, n.op_type, m.group(1) if m else "",
                             tuple(b.op_type for b in f.node if b.op_type != "Constant")))
    return out


def bisect(original: str, optimized: str, settings: BenchSettings, log: TextIO | None = None,
           notes: TextIO | None = None) -> BisectResult:
    """Find fused nodes of `optimized` whose unfusing makes it pass the gate against
    `original` (the module docstring says how)."""
    log = log if log is not None else sys.stderr
    notes = notes if notes is not None else sys.stderr
    validate(settings)
    if settings.provider == "cuda":
        require_cuda()
    first = read_model(original)
    work = load_model(optimized)
    specs, defaulted = resolve_inputs(signature(first), settings.shapes, settings.batch, original, settings.inputs)
    check_same_inputs(optimized, signature(work), specs, original)
    nodes = fused_nodes(work)
    for text in defaulted:
        print(f"note: {text}", file=notes)
    nested = count_onnxfuse_nodes(work) - len(nodes)
    if nested:
        print(f"note: {nested} onnxfuse nodes inside subgraphs are not bisected", file=notes)
    feeds = make_feeds(specs, settings.seed, settings.inputs)
    library = settings.library and count_onnxfuse_nodes(first) > 0
    del first
    ref, ort, info = untimed_references(original, feeds, settings, library, notes)
    reference = info["description"]
    names = [n.name for n in nodes]
    with tempfile.TemporaryDirectory(prefix="onnxfuse-bisect-") as tmp:
        ev = _Evaluator(work, names, feeds, settings, ref, ort, log, Path(tmp))
        before = ev.checks(frozenset())
        result = BisectResult("passes", reference, nodes, before, before)
        if _passed(before):
            result.model, result.search_runs, result.runs = work, ev.runs, ev.runs
            return result
        everything = frozenset(names)
        result.after = ev.checks(everything)
        if not _passed(result.after):
            result.status, result.search_runs, result.runs = "outside", ev.runs, ev.runs
            return result
        found = find_culprits(names, ev.passes)
        result.search_runs = ev.runs
        by_name = {n.name: n for n in nodes}
        result.culprits = [Culprit(by_name[c], ev.checks(everything - {c})) for c in found]
        result.status, result.runs = "culprits", ev.runs
        result.after = ev.checks(frozenset(found))
        result.model = ev.model(frozenset(found))
    return result


# ---------------------------------------------------------------------------------------
# Command line (the arguments: onnxfuse.cli)
# ---------------------------------------------------------------------------------------

def run_cli(args: argparse.Namespace) -> int:
    """The `onnxfuse bisect` command: print the culprits, write --write, return the exit status."""
    with Outputs([args.write], [args.original, args.optimized, *input_files(args.input)]) as out:
        settings = settings_from_args(args)
        r = bisect(args.original, args.optimized, settings)
        if args.write and r.model is not None:
            out.model(args.write, r.model)
        out.commit()  # before printing: a reader that stops early (| head) loses no file
    print(f"reference: {r.reference}")
    n = len(r.nodes)
    if r.status == "passes":
        print(f"{args.optimized} passes the gate (err vs ref {_err(r.before)}, ORT's own "
              f"{_err(r.before, 'ort_max_abs_err')}); nothing to bisect")
    else:
        print(f"{args.optimized} fails the gate:")
        for c in r.before:
            if not c.passed:
                print(f"  output {c.name!r}: {c.failure()}")
    if r.status == "outside":
        what = "it has no fused nodes" if n == 0 else f"with all {n} fused nodes unfused it still fails"
        print(f"the failure is outside the fused nodes: {what} (err vs ref {_err(r.after)}); look at the "
              f"rewrites around them")
        return EXIT_FAILS
    if r.status == "culprits":
        print(f"{len(r.culprits)} of {n} fused nodes to blame, found in {r.search_runs} runs "
              f"(+{r.runs - r.search_runs} for their own errors):")
        width = max(len(c.node.name) for c in r.culprits)
        for c in r.culprits:
            what = c.node.op_type + (f", pattern {c.node.pattern}" if c.node.pattern else "")
            ops = abbreviate(c.node.ops, " ")
            print(f"  {c.node.name:<{width}}  {what} ({ops}): alone err vs ref {_err(c.alone)} "
                  f"(ORT's own {_err(c.alone, 'ort_max_abs_err')}): {'passes' if c.passed else 'FAIL'}")
        print(f"with those unfused it passes (err vs ref {_err(r.after)})")
    if args.write and r.model is not None:
        print(f"wrote {args.write}")
    return 0 if r.status == "passes" else EXIT_FAILS
