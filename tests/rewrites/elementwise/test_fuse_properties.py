"""Property-based tests of fuse-elementwise on random DAGs of elementwise ops.

Random graphs mix broadcasting inputs, scalar and per-channel constants, values read by several
consumers, intermediate graph outputs, and (optionally) a non-fusible ReduceMax whose smaller output
flows back into the elementwise ops (forcing cycle avoidance and region splits). Properties:

* the optimized model passes the checker and matches the original on ONNX Runtime CPU (with the
  FusedElementwise library) within fp32 1e-5;
* a purely elementwise graph whose inputs all have the full shape collapses to exactly one fused
  node per connected component of two or more ops.
"""

from __future__ import annotations

import numpy as np
import onnx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from helpers import optimize, op_types
from test_fuse_elementwise import FUSED, RULE, assert_same, needs_library

FULL = (2, 3, 4)
UNARY = ["Relu", "Sigmoid", "Tanh", "Neg", "Abs", "Softsign", "Sin", "Erf", "LeakyRelu", "HardSigmoid"]
BINARY = ["Add", "Sub", "Mul", "Max", "Min"]


@st.composite
def dags(draw, pure: bool = False):
    n_inputs = draw(st.integers(1, 3))
    inputs, inits, nodes, values = [], [], [], []
    rank: dict[str, int] = {}
    for k in range(n_inputs):
        if pure or k == 0:
            shape = list(FULL)
        else:
            r = draw(st.integers(0, 3))
            shape = [d if draw(st.booleans()) else 1 for d in FULL[3 - r:]]
        inputs.append(helper.make_tensor_value_info(f"in{k}", TensorProto.FLOAT, shape))
        values.append(f"in{k}")
        rank[f"in{k}"] = len(shape)
    consts = []
    for k in range(draw(st.integers(0, 2))):
        if draw(st.booleans()):
            arr = np.array(draw(st.floats(-2, 2, allow_nan=False, width=32)), np.float32)
        else:
            arr = np.linspace(-1, 1, 3, dtype=np.float32).reshape(3, 1) * (k + 1)
        inits.append(numpy_helper.from_array(arr, f"k{k}"))
        rank[f"k{k}"] = arr.ndim
        consts.append(f"k{k}")
    n_ops = draw(st.integers(1, 12))
    for i in range(n_ops):
        out = f"v{i}"
        ranked = [v for v in values if rank[v] >= 1]
        if not pure and ranked and draw(st.integers(0, 7)) == 0:
            src = draw(st.sampled_from(ranked))
            nodes.append(helper.make_node("ReduceMax", [src], [out], axes=[-1], keepdims=1, name=f"n{i}"))
            rank[out] = rank[src]
        elif draw(st.booleans()):
            op = draw(st.sampled_from(UNARY))
            src = draw(st.sampled_from(values))
            nodes.append(helper.make_node(op, [src], [out], name=f"n{i}"))
            rank[out] = rank[src]
        else:
            op = draw(st.sampled_from(BINARY))
            a = draw(st.sampled_from(values))
            b = draw(st.sampled_from(values + consts))
            if draw(st.booleans()):
                a, b = b, a
            nodes.append(helper.make_node(op, [a, b], [out], name=f"n{i}"))
            rank[out] = max(rank[a], rank[b])
        values.append(out)
    produced = [f"v{i}" for i in range(n_ops)]
    chosen = {produced[-1]} | set(draw(st.lists(st.sampled_from(produced), max_size=3)))
    # Values nobody reads would be dead code; make them outputs so every op matters.
    read = {t for n in nodes for t in n.input}
    chosen |= {v for v in produced if v not in read}
    outputs = [helper.make_tensor_value_info(v, TensorProto.FLOAT, None) for v in produced if v in chosen]
    graph = helper.make_graph(nodes, "random", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    return onnx.shape_inference.infer_shapes(model)


def _components_of_size_two_or_more(model):
    ops = [n for n in model.graph.node]
    parent = list(range(len(ops)))

    def find(x):
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    producer = {n.output[0]: i for i, n in enumerate(ops)}
    for j, n in enumerate(ops):
        for t in n.input:
            if t in producer:
                parent[find(producer[t])] = find(j)
    sizes = {}
    for i in range(len(ops)):
        sizes[find(i)] = sizes.get(find(i), 0) + 1
    return sum(1 for s in sizes.values() if s >= 2), sum(1 for s in sizes.values() if s == 1)


def _cleaned(model):
    """``model`` after cleanup alone (no rule)."""
    from onnxfuse.model_io import to_graph, to_model
    from onnxfuse.rewrites import apply_rules

    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    graph = to_graph(copy)
    apply_rules(graph, [])
    return to_model(graph, model)


SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@needs_library
@SETTINGS
@given(dags())
def test_random_dags_stay_exact(model):
    out, report = optimize(model, only=RULE)
    onnx.checker.check_model(out)
    assert [o.name for o in out.graph.output] == [o.name for o in model.graph.output]
    assert_same(model, out, rtol=1e-5, atol=1e-5)
    # Every elementwise op left alone says why.
    reported = {r.node for r in report.refusals if r.rule == RULE}
    for n in out.graph.node:
        if n.op_type in UNARY + BINARY:
            assert n.name in reported, n.name


@SETTINGS
@given(dags(pure=True))
def test_pure_elementwise_graph_collapses_per_component(model):
    out, report = optimize(model, only=RULE)
    onnx.checker.check_model(out)
    # Components of what cleanup leaves: it merges duplicate nodes first (two identical branches of
    # the random graph are one computation), then fuse-elementwise takes each component whole.
    multi, single = _components_of_size_two_or_more(_cleaned(model))
    assert op_types(out).count(FUSED) == multi
    assert len(out.graph.node) == multi + single
    assert all(r.reason == "single op" for r in report.refusals if r.rule == RULE)
