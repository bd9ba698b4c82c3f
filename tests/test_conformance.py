"""The ONNX backend conformance cases as a regression suite for the optimizer.

For each case of a set (the in-memory `node` tests and the `pytorch-converted`,
`pytorch-operator` and `simple` models shipped in the onnx wheel):

1. run the original model in onnxruntime (CPU) on the case's inputs and compare with the
   expected outputs by the ONNX backend runner's own rule (`Runner.assert_similar_outputs`,
   the case's rtol/atol: 1e-3 / 1e-7 by default). A case whose original model does not load
   or does not pass is skipped -- decided here, at test time, not from a hand-kept list;
2. optimize it with `onnxfuse.optimize_model`; an exception there is a failure;
3. if the original passes `onnx.checker.check_model(full_check=True)`, the optimized model
   must pass it too;
4. run the optimized model and require the same comparison to pass (same output names).

One test function per set runs every case of the set, prints
`conformance[<set>]: N passed, N failed, N skipped (N with something fused)` and asserts
that nothing failed, listing each failure with its name and the first line of its error.
Run `python tests/test_conformance.py [set ...]` for the same report without pytest.
"""

from __future__ import annotations

import glob
import os
import sys
import time
import traceback
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper
from onnx.backend.test.loader import DATA_DIR, load_model_tests
from onnx.backend.test.runner import Runner

from onnxfuse import optimize_model
from onnxfuse.rewrite import DOMAIN

SETS = ("node", "pytorch-converted", "pytorch-operator", "simple")


@dataclass
class Case:
    name: str
    model: onnx.ModelProto
    data_sets: list[tuple[list, list]]
    rtol: float
    atol: float


@dataclass
class Outcome:
    passed: list[str] = field(default_factory=list)
    failed: list[tuple[str, str]] = field(default_factory=list)  # (name, first line of the error)
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (name, why the original fails)
    fused: list[str] = field(default_factory=list)  # passed or failed cases that had something fused
    seconds: float = 0.0

    def counts(self) -> str:
        return (f"{len(self.passed)} passed, {len(self.failed)} failed, {len(self.skipped)} skipped "
                f"({len(self.fused)} with something fused)")


# -- loading cases ---------------------------------------------------------------------------

def _normalize(x):
    """TestCase data may hold TensorProto/SequenceProto/OptionalProto objects; make them numpy."""
    if isinstance(x, onnx.TensorProto):
        return numpy_helper.to_array(x)
    if isinstance(x, onnx.SequenceProto):
        return numpy_helper.to_list(x)
    if isinstance(x, onnx.OptionalProto):
        return numpy_helper.to_optional(x)
    return x


def _load_pb(path: str, type_proto: onnx.TypeProto):
    """Like the backend runner's _load_proto: parse by the model's declared type."""
    with open(path, "rb") as f:
        content = f.read()
    if type_proto.HasField("sequence_type"):
        seq = onnx.SequenceProto()
        seq.ParseFromString(content)
        return numpy_helper.to_list(seq)
    if type_proto.HasField("optional_type"):
        opt = onnx.OptionalProto()
        opt.ParseFromString(content)
        return numpy_helper.to_optional(opt)
    t = onnx.TensorProto()
    t.ParseFromString(content)
    return numpy_helper.to_array(t)


def _disk_data_sets(model: onnx.ModelProto, model_dir: str) -> list[tuple[list, list]]:
    sets = []
    for d in sorted(glob.glob(os.path.join(model_dir, "test_data_set*"))):
        n_in = len(glob.glob(os.path.join(d, "input_*.pb")))
        n_out = len(glob.glob(os.path.join(d, "output_*.pb")))
        inputs = [_load_pb(os.path.join(d, f"input_{i}.pb"), model.graph.input[i].type) for i in range(n_in)]
        outputs = [_load_pb(os.path.join(d, f"output_{i}.pb"), model.graph.output[i].type) for i in range(n_out)]
        sets.append((inputs, outputs))
    return sets


def load_cases(kind: str) -> Iterator[Case | tuple[str, str]]:
    """The cases of one set; a (name, reason) pair for a case whose data cannot be read."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the node-test generators warn about overflow etc.
        tests = load_model_tests(kind=kind)
    for t in sorted(tests, key=lambda t: t.name):
        try:
            if t.model is not None:  # node tests: built in memory
                data = [([_normalize(x) for x in ins], [_normalize(x) for x in outs]) for ins, outs in t.data_sets]
                yield Case(t.name, t.model, data, t.rtol, t.atol)
            elif t.model_dir is not None:  # on disk in the onnx wheel
                model = onnx.load(os.path.join(t.model_dir, "model.onnx"))
                yield Case(t.name, model, _disk_data_sets(model, t.model_dir), t.rtol, t.atol)
            else:
                yield t.name, "needs a download"
        except Exception as e:  # noqa: BLE001 - unreadable data: the original cannot be run either
            yield t.name, f"cannot load data: {_first_line(e)}"


# -- running ---------------------------------------------------------------------------------

def _session_options() -> ort.SessionOptions:
    so = ort.SessionOptions()  # graph optimizations at the default level
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    so.log_severity_level = 4  # quiet: skipped originals fail loudly otherwise
    return so


_SO = _session_options()


def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    return ort.InferenceSession(model.SerializeToString(), _SO, providers=["CPUExecutionProvider"])


def _feeds(sess: ort.InferenceSession, inputs: list) -> dict:
    """Inputs by position over the session's inputs, as onnxruntime's backend does."""
    feeds = {}
    for i, inp in enumerate(sess.get_inputs()):
        v = inputs[i]
        feeds[inp.name] = np.asarray(v) if isinstance(v, np.generic) else v
    return feeds


def _check_outputs(sess: ort.InferenceSession, case: Case, feeds_per_set: list[dict],
                   output_names: list[str]) -> None:
    for feeds, (_, expected) in zip(feeds_per_set, case.data_sets, strict=True):
        got = sess.run(output_names, feeds)
        Runner.assert_similar_outputs(expected, got, rtol=case.rtol, atol=case.atol)


def _first_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    # numpy's assert_allclose puts the useful part ("Mismatched elements ...") after a blank header.
    text = next((ln for ln in lines if "Mismatch" in ln), lines[0] if lines else "")
    return (f"{type(e).__name__}: {text}" if text else type(e).__name__)[:300]


def _full_check(model: onnx.ModelProto) -> str | None:
    try:
        onnx.checker.check_model(model, full_check=True)
    except Exception as e:  # noqa: BLE001 - checker raises several error types
        return _first_line(e)
    return None


def run_case(case: Case) -> tuple[str, str, bool]:
    """('pass' | 'fail' | 'skip', detail, fused)."""
    # 1. The original, as the conformance suite runs it.
    try:
        sess = _session(case.model)
        feeds = [_feeds(sess, ins) for ins, _ in case.data_sets]
        output_names = [o.name for o in sess.get_outputs()]
        _check_outputs(sess, case, feeds, output_names)
    except Exception as e:  # noqa: BLE001
        return "skip", f"original: {_first_line(e)}", False
    del sess
    # 2. Optimize (it promises not to modify its input).
    before = case.model.SerializeToString(deterministic=True)
    try:
        result = optimize_model(case.model)
    except Exception as e:  # noqa: BLE001
        where = traceback.extract_tb(e.__traceback__)[-1]
        return "fail", f"optimize_model raised {_first_line(e)} at {os.path.basename(where.filename)}:" \
                       f"{where.lineno}", False
    if case.model.SerializeToString(deterministic=True) != before:
        return "fail", "optimize_model modified its input model", False
    optimized = result.model
    fused = bool(result.fused) or any(n.domain == DOMAIN for n in optimized.graph.node)
    # 3. The checker, when the original passes it.
    if _full_check(case.model) is None:
        err = _full_check(optimized)
        if err is not None:
            return "fail", f"check_model(full_check=True): {err}", fused
    # 4. The optimized model, same inputs, same outputs.
    try:
        sess = _session(optimized)
    except Exception as e:  # noqa: BLE001
        return "fail", f"onnxruntime cannot load the optimized model: {_first_line(e)}", fused
    names = [i.name for i in sess.get_inputs()]
    want = list(feeds[0]) if feeds else names
    if sorted(names) != sorted(want):
        return "fail", f"graph inputs changed: {want} -> {names}", fused
    try:
        _check_outputs(sess, case, feeds, output_names)
    except Exception as e:  # noqa: BLE001
        return "fail", f"optimized model: {_first_line(e)}", fused
    return "pass", "", fused


def run_set(kind: str) -> Outcome:
    out = Outcome()
    t0 = time.perf_counter()
    for case in load_cases(kind):
        if isinstance(case, tuple):
            out.skipped.append(case)
            continue
        status, detail, fused = run_case(case)
        if fused:
            out.fused.append(case.name)
        if status == "pass":
            out.passed.append(case.name)
        elif status == "fail":
            out.failed.append((case.name, detail))
        else:
            out.skipped.append((case.name, detail))
    out.seconds = time.perf_counter() - t0
    return out


def report(kind: str, out: Outcome, verbose: bool = False) -> str:
    lines = [f"conformance[{kind}]: {out.counts()} in {out.seconds:.1f} s"]
    lines += [f"  FAIL {name}: {detail}" for name, detail in out.failed]
    if verbose:
        lines += [f"  skip {name}: {detail}" for name, detail in out.skipped]
    return "\n".join(lines)


# -- pytest ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def totals(request):
    """Sums the sets run in this session; prints the overall line when the module is done."""
    total = Outcome()
    yield total
    if total.passed or total.failed or total.skipped:
        capture = request.config.pluginmanager.getplugin("capturemanager")
        with capture.global_and_fixture_disabled():
            print(f"\nconformance: {total.counts()} in {total.seconds:.1f} s")


@pytest.mark.parametrize("kind", SETS)
def test_conformance(kind: str, totals: Outcome, capsys) -> None:
    if kind != "node" and not os.path.isdir(os.path.join(DATA_DIR, kind)):
        pytest.skip(f"this onnx wheel has no {kind} test data")
    out = run_set(kind)
    for attr in ("passed", "failed", "skipped", "fused"):
        getattr(totals, attr).extend(getattr(out, attr))
    totals.seconds += out.seconds
    with capsys.disabled():
        print("\n" + report(kind, out))
    assert out.passed, f"no {kind} case passed at all: is onnxruntime working?"
    if out.failed:
        pytest.fail(f"{len(out.failed)} {kind} case(s) fail after optimization:\n" + "\n".join(
            f"  {name}: {detail}" for name, detail in out.failed), pytrace=False)


def test_model_without_default_opset_import() -> None:
    """Regression (test_ai_onnx_ml_*): a model whose only opset import is ai.onnx.ml is valid
    ONNX, but optimize_model raised StopIteration from load.default_opset (called by rewrite)."""
    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [3])
    y = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [3])
    node = onnx.helper.make_node("Binarizer", ["x"], ["y"], domain="ai.onnx.ml", threshold=0.5)
    model = onnx.helper.make_model(onnx.helper.make_graph([node], "ml_only", [x], [y]),
                                   opset_imports=[onnx.helper.make_opsetid("ai.onnx.ml", 3)])
    onnx.checker.check_model(model, full_check=True)
    result = optimize_model(model)
    assert [n.op_type for n in result.model.graph.node] == ["Binarizer"]
    assert not result.fused
    onnx.checker.check_model(result.model, full_check=True)


if __name__ == "__main__":
    kinds = [a for a in sys.argv[1:] if not a.startswith("-")] or list(SETS)
    total = Outcome()
    for k in kinds:
        o = run_set(k)
        print(report(k, o, verbose="-v" in sys.argv), flush=True)
        for attr in ("passed", "failed", "skipped", "fused"):
            getattr(total, attr).extend(getattr(o, attr))
        total.seconds += o.seconds
    print(f"conformance: {total.counts()} in {total.seconds:.1f} s")
    sys.exit(1 if total.failed else 0)
