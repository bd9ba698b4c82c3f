"""Pattern files: loading, validation errors that name file and field, examples, user folders."""

from __future__ import annotations

import textwrap
from collections import Counter
from pathlib import Path

import pytest

from onnxfuse import PatternError, load_patterns
from onnxfuse.pattern import BUILTIN_DIR, example_model, load_pattern_file
from tests.util import check_fusion

BUILTIN = load_patterns()
VALID = textwrap.dedent("""\
    name: activations_only
    description: Only activation functions.
    priority: 1
    match:
      kind: elementwise_group
      ops: [Relu, Sigmoid, Tanh]
    replace:
      op_type: PointwiseChain
      kernel: pointwise
    example:
      inputs: {x: [float32, [4]]}
      nodes:
        - [Sigmoid, [x], [s]]
        - [Tanh, [s], [y]]
      outputs: [y]
      expect: {PointwiseChain: 1}
    """)


def test_builtin_patterns_load():
    names = [p.name for p in BUILTIN]
    assert "pointwise_chain" in names
    assert all(p.description and p.source.startswith(str(BUILTIN_DIR)) for p in BUILTIN)


@pytest.mark.parametrize("pattern", [p for p in BUILTIN if p.example], ids=lambda p: p.name)
def test_pattern_example_fuses_as_declared(pattern, monkeypatch):
    from onnxfuse.pipeline import NHWC_ONLY_PATTERNS

    m = example_model(pattern)
    # a kind fused only where tuning measures it (the gemm kind): matched as if tuned
    monkeypatch.setattr(type(pattern.kind), "untuned_reason", lambda self: None)
    r = check_fusion(m, layout="nhwc" if pattern.name in NHWC_ONLY_PATTERNS else "nchw")
    counts = Counter(n.op_type for n in r.model.graph.node)
    for op, n in pattern.example.expect.items():
        assert counts[op] == n, r.report.summary()


def write(tmp_path: Path, text: str, name: str = "p.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_user_folder_adds_patterns(tmp_path):
    write(tmp_path, VALID)
    names = [p.name for p in load_patterns([tmp_path])]
    assert names[0] == "activations_only"  # priority 1 runs first
    assert "pointwise_chain" in names


def test_user_pattern_example_runs(tmp_path):
    p = load_pattern_file(write(tmp_path, VALID))
    r = check_fusion(example_model(p), expect_fused=1)
    assert r.fused[0].pattern == "pointwise_chain"  # the built-ins only: p was not passed


@pytest.mark.parametrize("edit,field", [
    (("kind: elementwise_group", "kind: tree"), "match.kind"),
    (("ops: [Relu, Sigmoid, Tanh]", "ops: [Relu, Conv]"), "match.ops"),
    (("ops: [Relu, Sigmoid, Tanh]", "ops: Relu"), "match.ops"),
    (("kernel: pointwise", "kernel: cutlass"), "replace.kernel"),
    (("name: activations_only", "name: 'bad name'"), "name"),
    (("priority: 1\n", "priority: high\n"), "priority"),
    (("description: Only activation functions.\n", ""), "description"),
    (("  op_type: PointwiseChain\n", "  op_type: PointwiseChain\n  extra: 1\n"), "replace.extra"),
    (("inputs: {x: [float32, [4]]}", "inputs: {x: float32}"), "example.inputs.x"),
])
def test_bad_pattern_names_file_and_field(tmp_path, edit, field):
    old, new = edit
    assert old in VALID
    path = write(tmp_path, VALID.replace(old, new))
    with pytest.raises(PatternError) as e:
        load_pattern_file(path)
    assert str(e.value).startswith(f"{path}: {field}:"), str(e.value)


NEW_FORM = textwrap.dedent("""\
    name: activations_only
    description: Only activation functions.
    priority: 10
    kind: pointwise
    match:
      ops: [Relu, Sigmoid, Tanh]
    """)


def test_a_pattern_names_its_kind_and_the_kind_owns_op_type_and_kernel(tmp_path):
    """The top-level `kind` form and the older `match.kind` + `replace` form load the same
    pattern; the built-in files use the first."""
    new = load_pattern_file(write(tmp_path, NEW_FORM, "new.yaml"))
    old = load_pattern_file(write(tmp_path, VALID, "old.yaml"))
    assert (new.kind, new.match) == (old.kind, old.match)
    assert (new.kind.name, new.kind.op_type) == ("pointwise", "PointwiseChain")
    for p in BUILTIN:
        text = Path(p.source).read_text()
        assert f"\nkind: {p.kind.name}\n" in text and "replace:" not in text, p.source


@pytest.mark.parametrize("text,field", [
    (NEW_FORM.replace("kind: pointwise", "kind: tree"), "kind"),
    (NEW_FORM.replace("kind: pointwise\n", ""), "kind"),
    (NEW_FORM.replace("match:\n", "match:\n  kind: elementwise_group\n"), "match.kind"),
    (NEW_FORM.replace("kind: pointwise", "kind: conv"), "match.dtypes"),  # bfloat16 by default
    (VALID.replace("op_type: PointwiseChain", "op_type: FusedConv"), "replace.op_type"),
    (VALID.replace("kernel: pointwise", "kernel: conv"), "replace.kernel"),
])
def test_kind_errors_name_file_and_field(tmp_path, text, field):
    path = write(tmp_path, text)
    with pytest.raises(PatternError) as e:
        load_pattern_file(path)
    assert str(e.value).startswith(f"{path}: {field}:"), str(e.value)


def test_invalid_yaml_names_file_and_line(tmp_path):
    path = write(tmp_path, "name: [unclosed\n")
    with pytest.raises(PatternError, match=rf"^{path}: line \d+: not valid YAML"):
        load_pattern_file(path)


def test_duplicate_builtin_name_in_user_folder_replaces_it(tmp_path):
    write(tmp_path, VALID.replace("name: activations_only", "name: pointwise_chain"))
    (p,) = [p for p in load_patterns([tmp_path]) if p.name == "pointwise_chain"]
    assert p.source.startswith(str(tmp_path))


def test_missing_folder(tmp_path):
    with pytest.raises(PatternError, match="does not exist"):
        load_patterns([tmp_path / "nope"])


def test_nhwc_only_patterns_apply_only_for_the_nhwc_layout():
    from onnxfuse.pipeline import optimize_model

    m = example_model(next(p for p in BUILTIN if p.name == "conv_alone"))
    assert [n.op_type for n in optimize_model(m).model.graph.node] == ["Conv", "Concat"]
    assert [n.op_type for n in optimize_model(m, layout="nhwc").model.graph.node] == ["FusedConv", "Concat"]
    m = example_model(next(p for p in BUILTIN if p.name == "maxpool"))
    assert [n.op_type for n in optimize_model(m).model.graph.node] == ["MaxPool"]
    assert [n.op_type for n in optimize_model(m, layout="nhwc").model.graph.node] == ["FusedMaxPool"]
