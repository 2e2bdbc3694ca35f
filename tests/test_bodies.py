"""Rules inside If branches and Loop bodies (onnxfuse/bodies.py): each body rewritten as a model of its
own by the rules that write only ONNX Runtime's or standard ops, then put back reading the outer values
by name. Against the original on ONNX Runtime's CPU provider, on every branch and over several loop
iterations; the cases a body is left as it was, with the reason in the report."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxfuse
from helpers import op_types_within
from onnxfuse import bodies, model_io
from onnxfuse.custom_ops import session_options
from onnxfuse.rewrites.engine.rule import ApplyReport

E = 8
RNG = np.random.default_rng(5)
GAMMA = RNG.standard_normal(E).astype(np.float32)
BETA = RNG.standard_normal(E).astype(np.float32)


def _layernorm_nodes(x: str, out: str, p: str) -> list[onnx.NodeProto]:
    """LayerNorm over the last axis, decomposed as exporters below opset 17 write it, with the main graph's
    ``gamma`` and ``beta`` (outer initializers)."""
    return [
        helper.make_node("ReduceMean", [x], [f"{p}mean"], axes=[-1]),
        helper.make_node("Sub", [x, f"{p}mean"], [f"{p}d"]),
        helper.make_node("Mul", [f"{p}d", f"{p}d"], [f"{p}sq"]),
        helper.make_node("ReduceMean", [f"{p}sq"], [f"{p}var"], axes=[-1]),
        helper.make_node("Add", [f"{p}var", "eps"], [f"{p}ve"]),
        helper.make_node("Sqrt", [f"{p}ve"], [f"{p}sd"]),
        helper.make_node("Div", [f"{p}d", f"{p}sd"], [f"{p}n"]),
        helper.make_node("Mul", [f"{p}n", "gamma"], [f"{p}g"]),
        helper.make_node("Add", [f"{p}g", "beta"], [out]),
    ]


def _weights() -> list[onnx.TensorProto]:
    return [numpy_helper.from_array(GAMMA, "gamma"), numpy_helper.from_array(BETA, "beta"),
            numpy_helper.from_array(np.array(1e-5, np.float32), "eps")]


def _if_model(opset: int, batchnorm: bool = False) -> onnx.ModelProto:
    """``y = LayerNorm(x) if c else -x`` (with ``batchnorm``: x through a BatchNormalization first)."""
    x = "xb" if batchnorm else "x"
    then = helper.make_graph(_layernorm_nodes(x, "then_y", "t/"), "then", [],
                             [helper.make_tensor_value_info("then_y", TensorProto.FLOAT, None)])
    other = helper.make_graph([helper.make_node("Neg", [x], ["else_y"])], "else", [],
                              [helper.make_tensor_value_info("else_y", TensorProto.FLOAT, None)])
    nodes = [helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other)]
    inits = _weights()
    if batchnorm:
        nodes.insert(0, helper.make_node("BatchNormalization", ["x", "bn_s", "bn_b", "bn_m", "bn_v"], ["xb"]))
        inits += [numpy_helper.from_array(RNG.standard_normal(3).astype(np.float32), n) for n in ("bn_s", "bn_b", "bn_m")]
        inits.append(numpy_helper.from_array(np.ones(3, np.float32), "bn_v"))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, E]),
                                           helper.make_tensor_value_info("c", TensorProto.BOOL, [])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3, E])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _loop_model() -> onnx.ModelProto:
    """Three iterations of ``h = LayerNorm(h) + h``: the LayerNorm inside the Loop body."""
    body = helper.make_graph(
        [*_layernorm_nodes("h_in", "ln", "b/"), helper.make_node("Add", ["ln", "h_in"], ["h_out"]),
         helper.make_node("Identity", ["cond_in"], ["cond_out"])], "body",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []),
         helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
         helper.make_tensor_value_info("h_in", TensorProto.FLOAT, [2, E])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("h_out", TensorProto.FLOAT, [2, E])])
    inits = [*_weights(), numpy_helper.from_array(np.array(3, np.int64), "trips"),
             numpy_helper.from_array(np.array(True), "go")]
    graph = helper.make_graph([helper.make_node("Loop", ["trips", "go", "x"], ["y"], body=body)], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, E])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, E])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _branch(node, name: str) -> onnx.GraphProto:
    (attr,) = [a for a in node.attribute if a.name == name]
    return attr.g


def _run(model, feeds):
    session = ort.InferenceSession(model.SerializeToString(), session_options(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)[0]


def _body_ops(model, attribute: str) -> Counter:
    (node,) = [n for n in model.graph.node if n.op_type in ("If", "Loop")]
    (attr,) = [a for a in node.attribute if a.name == attribute]
    return Counter(n.op_type for n in attr.g.node)


def test_a_branch_takes_the_rules_and_both_branches_stay_equal():
    model = _if_model(opset=17)
    result = onnxfuse.optimize(model, bench=False)
    assert result.validation.passed
    assert _body_ops(result.model, "then_branch") == Counter({"LayerNormalization": 1}), _body_ops(result.model, "then_branch")
    assert result.applied.counts["contrib-layernorm"] == 1
    assert result.applied.bodies == [{"node": "<If → y>", "attribute": "then_branch", "rewrites": 1}]  # unnamed: op and output
    assert {i.name for i in result.model.graph.initializer} >= {"gamma", "beta"}  # read from outside, not copied in
    x = RNG.standard_normal((2, 3, E)).astype(np.float32)
    for c in (True, False):
        feeds = {"x": x, "c": np.array(c)}
        np.testing.assert_allclose(_run(result.model, feeds), _run(model, feeds), rtol=1e-5, atol=1e-5)


def test_a_loop_body_takes_the_rules_and_iterates_the_same():
    model = _loop_model()
    result = onnxfuse.optimize(model, bench=False)
    assert result.validation.passed
    assert _body_ops(result.model, "body")["LayerNormalization"] == 1 and not _body_ops(result.model, "body")["Sqrt"]
    x = RNG.standard_normal((2, E)).astype(np.float32)
    h = x.astype(np.float64)
    for _ in range(3):  # the loop in float64, as an independent reference
        mean = h.mean(-1, keepdims=True)
        var = ((h - mean) ** 2).mean(-1, keepdims=True)
        h = (h - mean) / np.sqrt(var + 1e-5) * GAMMA + BETA + h
    np.testing.assert_allclose(_run(result.model, {"x": x}), h, rtol=1e-4, atol=1e-4)


def test_a_body_raises_the_opset_only_where_the_whole_model_can_follow():
    """At opset 14, LayerNormalization needs 17: the raise is taken for the whole model, unless another
    node would change meaning (BatchNormalization-15), and then the branch is left, with the reason."""
    raised = onnxfuse.optimize(_if_model(opset=14), bench=False)
    assert raised.validation.passed and _body_ops(raised.model, "then_branch")["LayerNormalization"] == 1
    assert [o.version for o in raised.model.opset_import if o.domain in ("", "ai.onnx")] == [17]
    blocked = onnxfuse.optimize(_if_model(opset=14, batchnorm=True), bench=False)
    assert blocked.validation.passed and not _body_ops(blocked.model, "then_branch")["LayerNormalization"]
    (left,) = blocked.applied.bodies
    assert left["attribute"] == "then_branch" and "BatchNormalization" in left["left"], left
    assert any(n.startswith("rules did not run inside <If → y> then_branch: its rewrite needs opset 17")
               for n in blocked.validation.notes), blocked.validation.notes


def test_a_body_reading_a_value_of_unknown_type_is_left():
    model = _if_model(opset=17)
    model.graph.node.insert(0, helper.make_node("Mystery", ["x"], ["x2"], domain="test.unknown"))
    _branch(model.graph.node[1], "then_branch").node[0].input[0] = "x2"  # its first ReduceMean
    model.opset_import.append(helper.make_opsetid("test.unknown", 1))
    calls = []
    out, done, left = bodies.rewrite_bodies(model, lambda m: calls.append(m) or (m, ApplyReport()))
    assert not calls and not done and out is model
    assert len(left) == 1 and "'x2'" in left[0].reason and "type" in left[0].reason


def test_names_a_body_rewrite_creates_that_the_outer_graph_defines_are_renamed():
    """ONNX scopes: a body must not define a name an enclosing graph defines. A rewrite that named a new
    tensor after one of the main graph's (here ``y``, the If's own output) has it renamed in the body,
    readers included."""
    model = _if_model(opset=17)
    then = _branch(model.graph.node[0], "then_branch")
    rewritten = onnx.GraphProto()
    rewritten.CopyFrom(then)
    for node in rewritten.node:  # as if a rule had called its intermediate "y"
        node.input[:] = ["y" if n == "t/n" else n for n in node.input]
        node.output[:] = ["y" if n == "t/n" else n for n in node.output]
    body = bodies._put_back(rewritten, set(), {}, model_io.defined_names(model.graph), then)
    written = [o for n in body.node for o in n.output]
    assert "y" not in written and "y__body1" in written
    assert any("y__body1" in n.input for n in body.node if n.op_type == "Mul")


def test_merged_decoders_attention_is_fused_in_both_branches():
    """optimum's merged T5 decoder: both decoders' self- and cross-attention (2 layers) fused inside the
    If, as the decoders exported apart are."""
    from helpers import load_testdata

    result = onnxfuse.optimize(load_testdata("optimum_t5_decoder_merged"), bench=False)
    assert result.validation.passed
    for branch in ("then_branch", "else_branch"):
        ops = _body_ops(result.model, branch)
        assert ops["MultiHeadAttention"] == 4 and ops["Softmax"] == 0, (branch, ops)
    assert Counter(op_types_within(result.model))["MultiHeadAttention"] == 8


def test_the_report_of_bodies_follows_the_schema():
    """``rewrites.bodies`` in the JSON report, for a body the rules ran in and one they were kept out of."""
    import jsonschema

    from onnxfuse.reports import load_schema

    for model in (_if_model(opset=17), _if_model(opset=14, batchnorm=True)):
        doc = onnxfuse.optimize(model, bench=False).to_json()
        jsonschema.validate(doc, load_schema(), cls=jsonschema.Draft202012Validator)
        (entry,) = doc["result"]["rewrites"]["bodies"]
        assert entry["attribute"] == "then_branch" and ("rewrites" in entry) != ("left" in entry)
    del entry["attribute"]  # the schema holds the entries to their fields
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(doc, load_schema(), cls=jsonschema.Draft202012Validator)


def test_a_lazily_loaded_model_whose_weights_only_branches_read(tmp_path, monkeypatch):
    """A model large enough to load lazily (its weights stay references into the file) whose weights only
    If branches read, as a merged decoder's are: the rules read them inside the branches
    (model_io._adopt_lazy maps those too), pack-sibling-matmuls makes new weights in each branch under the
    same name with other contents (so they stay in the branches, read in: model_io.inline_lazy), and the
    written model runs equal to the original on both branches. Before: an internal error (exit 5) on
    t5-small- and bart-base-sized merged decoders."""
    from onnxfuse import lazy_weights as lw

    monkeypatch.setattr(lw, "LAZY_MODEL_BYTES", 1 << 20)
    rng = np.random.default_rng(9)
    width, out = 512, 640  # 1.25 MiB per weight: over LAZY_MIN_TENSOR, so each is a reference
    weights = {f"w{i}": (rng.standard_normal((width, out)) / 16).astype(np.float32) for i in range(6)}

    def branch(name, first, second, third):  # three MatMuls of x (q, k, v-like), then an elementwise tail:
        return helper.make_graph(  # the same node names in both branches, as a merged decoder's
            [helper.make_node("MatMul", ["x", first], [f"{name}_a"], name="mm_a"),
             helper.make_node("MatMul", ["x", second], [f"{name}_b"], name="mm_b"),
             helper.make_node("MatMul", ["x", third], [f"{name}_c"], name="mm_c"),
             helper.make_node("Relu", [f"{name}_a"], [f"{name}_r"], name="relu"),
             helper.make_node("Mul", [f"{name}_r", f"{name}_b"], [f"{name}_m"], name="mul"),
             helper.make_node("Add", [f"{name}_m", f"{name}_c"], [f"{name}_y"], name="add")],
            name, [], [helper.make_tensor_value_info(f"{name}_y", TensorProto.FLOAT, [4, out])])

    graph = helper.make_graph(
        [helper.make_node("If", ["c"], ["y"], then_branch=branch("then", "w0", "w1", "w2"),
                          else_branch=branch("else", "w3", "w4", "w5"))],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, width]),
              helper.make_tensor_value_info("c", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, out])],
        [numpy_helper.from_array(w, n) for n, w in weights.items()])
    src = tmp_path / "merged.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), src)
    result = onnxfuse.optimize(str(src), tmp_path / "out.onnx", bench=False)
    assert result.validation.passed and result.applied.counts["pack-sibling-matmuls"] == 2
    written = onnx.load(str(tmp_path / "out.onnx"))
    assert all(not lw.is_external(t) for g in model_io.proto_graphs(written.graph) for t in g.initializer)
    assert all(len(a.g.initializer) == 1 for a in written.graph.node[0].attribute)  # each its own packed weight
    x = rng.standard_normal((4, width)).astype(np.float32)
    for c in (True, False):
        w = [weights[f"w{i + (0 if c else 3)}"] for i in range(3)]
        want = np.maximum(x @ w[0], 0) * (x @ w[1]) + x @ w[2]
        np.testing.assert_allclose(_run(written, {"x": x, "c": np.array(c)}), want, rtol=1e-4, atol=1e-4)


def test_the_report_counts_the_ops_inside_bodies_apart_from_the_main_graph():
    """``ops_before``/``ops_after`` count the main graph (their sum is its node count); ``ops_in_bodies`` the
    nodes of If branches and Loop/Scan bodies, so the merged T5 decoder's attentions, all inside its If,
    show in the report (8 MultiHeadAttention after, 8 Softmax before, none after), and the JSON follows
    the schema."""
    import jsonschema

    from helpers import load_testdata
    from onnxfuse.reports import load_schema

    model = load_testdata("optimum_t5_decoder_merged")
    result = onnxfuse.optimize(model, bench=False)
    assert sum(result.ops_after.values()) == len(result.model.graph.node) and "MultiHeadAttention" not in result.ops_after
    within = Counter(op_types_within(result.model))
    assert result.body_ops_after["com.microsoft::MultiHeadAttention"] == within["MultiHeadAttention"] == 8
    assert result.body_ops_before["Softmax"] == Counter(op_types_within(model))["Softmax"] == 8
    assert "Softmax" not in result.body_ops_after
    doc = result.to_json()
    jsonschema.validate(doc, load_schema(), cls=jsonschema.Draft202012Validator)
    assert doc["result"]["ops_in_bodies"]["after"]["com.microsoft::MultiHeadAttention"] == 8
