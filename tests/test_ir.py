"""onnxfuse.ir: the onnx-graphsurgeon graph the rewriting passes work on keeps what our models
carry (functions and their overloads, opset imports, node overloads, doc strings,
metadata_props, value_info, binary string attributes, external data, overridable
initializers, subgraphs), and the optimizer's output is byte-deterministic across processes."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnxfuse import ir, optimize_model
from onnxfuse.rewrite import DOMAIN

ROOT = Path(__file__).resolve().parents[1]
N = helper.make_node


def _rich_model() -> onnx.ModelProto:
    """A model with every feature the IR must carry through an import and an export."""
    call = N("F", ["x"], ["f"], name="call", domain="custom", alpha=0.5)
    call.overload = "v2"
    call.doc_string = "calls F"
    call.metadata_props.add(key="k", value="v")
    kernel = N("Relu", ["f"], ["r"], name="relu", blob=b"\xff\xfe\x00cubin")  # not UTF-8
    branch = helper.make_graph([N("Neg", ["r"], ["o"])], "then", [],
                               [helper.make_tensor_value_info("o", TensorProto.FLOAT, [4])])
    cond = N("If", ["c"], ["z"], name="if", then_branch=branch, else_branch=branch)
    mul = N("Mul", ["z", "w"], ["y"], name="mul")
    g = helper.make_graph(
        [call, kernel, cond, mul], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4]),
         helper.make_tensor_value_info("w", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
        [numpy_helper.from_array(np.ones(4, np.float32), "w"),   # an overridable default
         numpy_helper.from_array(np.array(True), "c"),
         numpy_helper.from_array(np.zeros(3, np.float32), "unused")],
        value_info=[helper.make_tensor_value_info("r", TensorProto.FLOAT, [4])])
    g.doc_string = "graph doc"
    leaky = N("LeakyRelu", ["a"], ["b"])
    leaky.attribute.append(onnx.AttributeProto(name="alpha", ref_attr_name="alpha", type=onnx.AttributeProto.FLOAT))
    f = helper.make_function("custom", "F", ["a"], ["b"], [leaky], [helper.make_opsetid("", 17)], ["alpha"])
    f.overload = "v2"
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("custom", 1),
                                            helper.make_opsetid(DOMAIN, 1)], functions=[f])
    m.ir_version = 10
    m.doc_string = "model doc"
    m.producer_name = "test"
    m.model_version = 3
    m.metadata_props.add(key="author", value="me")
    return m


def test_round_trip_keeps_everything_the_models_carry():
    m = _rich_model()
    out = ir.export_model(ir.import_model(m))
    assert out.SerializeToString(deterministic=True) == m.SerializeToString(deterministic=True)


def test_round_trip_keeps_external_data(tmp_path):
    m = _rich_model()
    onnx.save_model(m, str(tmp_path / "m.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="m.bin", size_threshold=0)
    ext = onnx.load(str(tmp_path / "m.onnx"), load_external_data=False)
    assert any(t.data_location == TensorProto.EXTERNAL for t in ext.graph.initializer)
    out = ir.export_model(ir.import_model(ext))
    assert out.SerializeToString(deterministic=True) == ext.SerializeToString(deterministic=True)


def test_import_reads_the_weights_in_place_and_export_leaves_them_unchanged():
    """The gs Constants are the source's own TensorProtos (no copy of the weights for each pass
    that imports a model); a pass that renames one changes the export, not the source."""
    m = _rich_model()
    before = m.SerializeToString(deterministic=True)
    mi = ir.import_model(m)
    w = mi.tensors()["c"]
    assert isinstance(w, ir.gs.Constant) and ir.tensor_proto(w) is m.graph.initializer[1]
    w.name = "c_renamed"
    out = ir.export_model(mi)
    assert m.SerializeToString(deterministic=True) == before
    assert [t.name for t in out.graph.initializer] == ["w", "unused", "c_renamed"]


def test_serialized_bytes_bounds_the_size_without_serializing_the_model():
    m = _rich_model()
    for k in range(3):
        m.graph.initializer.append(numpy_helper.from_array(np.arange(300 * (k + 1), dtype=np.float32), f"big{k}"))
    size = ir.serialized_bytes(m)
    assert m.ByteSize() <= size <= m.ByteSize() + 10 + 11 * len(m.graph.initializer)


def test_cleanup_drops_detached_nodes_and_keeps_the_rest():
    m = _rich_model()
    model = ir.import_model(m)
    relu = next(n for n in model.graph.nodes if n.name == "relu")
    tensors = model.tensors()
    relu.outputs.clear()  # replaced by a node reading f directly
    model.graph.nodes.append(ir.make_node("Abs", "abs", "", {}, [tensors["f"]], [tensors["r"]], overload=""))
    ir.cleanup(model)
    out = ir.export_model(model)
    assert [n.name for n in out.graph.node] == ["call", "abs", "if", "mul"]
    assert out.graph.node[0].overload == "v2" and out.graph.node[0].metadata_props[0].value == "v"
    assert [t.name for t in out.graph.initializer] == ["w", "c", "unused"]  # the source order
    assert [i.name for i in out.graph.input] == ["x", "w"]


def _digest_in_fresh_process() -> str:
    code = ("import hashlib, sys; from models import build as mb; from onnxfuse import optimize_model; "
            "m = mb.vgg_stack(blocks=2, channels=8, size=16); "
            "r = optimize_model(m); "
            "sys.stdout.write(hashlib.sha256(r.model.SerializeToString()).hexdigest())")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "PYTHONHASHSEED": "random"})
    return out.stdout.strip()


def test_output_is_byte_deterministic_across_processes():
    from models import build as mb

    first, second = _digest_in_fresh_process(), _digest_in_fresh_process()
    here = hashlib.sha256(optimize_model(mb.vgg_stack(blocks=2, channels=8, size=16)).model.SerializeToString())
    assert first == second == here.hexdigest()


def test_unproduced_reads_sees_a_branchs_outer_reads():
    """A name an If's branch reads from the graph around it counts only where a node before the
    If, an input or an initializer gives it; a name the branch gives itself is its own."""
    branch = helper.make_graph([helper.make_node("Add", ["x", "y"], ["t"]), helper.make_node("Neg", ["t"], ["u"])],
                               "b", [], [helper.make_tensor_value_info("u", TensorProto.FLOAT, [1])])

    def graph(order):
        nodes = {"if": helper.make_node("If", ["c"], ["z"], then_branch=branch, else_branch=branch),
                 "y": helper.make_node("Relu", ["x"], ["y"])}
        return helper.make_graph([nodes[k] for k in order], "g",
                                 [helper.make_tensor_value_info("c", TensorProto.BOOL, []),
                                  helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                                 [helper.make_tensor_value_info("z", TensorProto.FLOAT, [1])])

    assert ir.unproduced_reads(graph(["y", "if"])) == []
    assert ir.unproduced_reads(graph(["if", "y"])) == ["y"]
    assert ir.unproduced_reads(graph(["if"])) == ["y"]
    assert ir.graph_reads(graph(["y", "if"])) == {"c", "x", "y", "t", "z"}
