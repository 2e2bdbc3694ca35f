"""concat-into-elementwise: a Concat of FusedElementwise results becomes one FusedConcat node.

Values are checked twice: the rewritten model evaluated by onnx's reference evaluator with FusedElementwise
and FusedConcat implemented here from the op's contract (``custom_ops.CONCAT_OP_TYPE``) on
``expr.evaluate``, so these tests need no library; and, once the library has a FusedConcat kernel, the
rewritten model run by ONNX Runtime's CPU provider (``test_the_library_kernel_computes_the_original``,
skipped while the library does not register the op). Both against ONNX Runtime on the original model."""

from __future__ import annotations

import json
import re

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper
from onnx.reference import ReferenceEvaluator
from onnx.reference.op_run import OpRun
from test_fuse_elementwise import assert_same, feeds_for, needs_library, run

from helpers import ROOT, optimize
from onnxfuse.custom_ops import (
    CONCAT_AXIS_ATTR, CONCAT_OP_TYPE, DOMAIN, FUSED_VALUES_KEY, MAX_RANK, OP_TYPE, LibraryNotFoundError,
    concat_program_attr, expr, library_path,
)

RULE = "concat-into-elementwise"
RNG = np.random.default_rng(7)


def _init(name, shape, dtype=np.float32):
    return numpy_helper.from_array(RNG.standard_normal(shape).astype(dtype), name)


W = _init("W", (4, 4, 1, 1))  # 1x1 Convs, NCHW
W8 = _init("W8", (4, 8, 1, 1))  # the 1x1 Conv after a concatenation of 8 channels
W12 = _init("W12", (4, 12, 1, 1))
M8 = _init("M8", (8, 4))  # the channels-last "1x1 conv" (a MatMul over the last axis)
S4 = _init("S4", (4,))  # a per-channel scale, channels last


# ---- helpers ------------------------------------------------------------------------------------


def parse(text: str, inits=(), opset: int = 17) -> onnx.ModelProto:
    """A model from ONNX's text format, its shapes inferred (as the pipeline does before the rules)."""
    m = onnx.parser.parse_model(f'<ir_version: 8, opset_import: ["" : {opset}]>\n' + text)
    m.graph.initializer.extend(inits)
    return onnx.shape_inference.infer_shapes(m)


def rewrite(model, only=f"fuse-elementwise,{RULE}"):
    out, report = optimize(model, only=only)
    onnx.checker.check_model(out, full_check=False)  # also: nodes in topological order
    return out, report


def reasons(report):
    return [r.reason for r in report.refusals if r.rule == RULE]


def details(report):
    return [d for d in report.details if d["rule"] == RULE]


def nodes(model, op_type):
    return [n for n in model.graph.node if n.op_type == op_type]


def the_fused_concat(model):
    (node,) = nodes(model, CONCAT_OP_TYPE)
    assert node.domain == DOMAIN
    assert not nodes(model, "Concat")
    return node


def attrs_of(node) -> dict:
    return {a.name: h.get_attribute_value(a) for a in node.attribute}


def programs_of(node) -> list:
    """The segments' programs, parsed, in order; checks there is nothing but ``axis`` and ``program_k``."""
    attrs = attrs_of(node)
    progs = []
    while concat_program_attr(len(progs)) in attrs:
        progs.append(expr.parse(attrs[concat_program_attr(len(progs))].decode()))
    assert set(attrs) == {CONCAT_AXIS_ATTR} | {concat_program_attr(k) for k in range(len(progs))}
    assert sum(len(p.inputs) for p in progs) == len(node.input)
    assert 1 + sum(len(p.outputs) - 1 for p in progs) == len(node.output)
    return progs


def axis_of(node) -> int:
    return attrs_of(node)[CONCAT_AXIS_ATTR]


def op_types_of(program, value) -> list[str]:
    """The ops ``value`` is computed by in ``program`` (its producer's, transitively), in program order."""
    needed, found = {value}, []
    for op in reversed(program.ops):
        if op.name in needed:
            needed.update(op.args)
            found.append(op.op_type)
    return found[::-1]


# The two ops as their contract describes them, for onnx's reference evaluator (the class name is the op type).
class FusedElementwise(OpRun):
    op_domain = DOMAIN

    def _run(self, *inputs, **_):
        program = expr.parse(attrs_of(self.onnx_node)["program"].decode())
        return tuple(expr.evaluate(program, list(inputs)))


class FusedConcat(OpRun):
    op_domain = DOMAIN

    def _run(self, *inputs, **_):
        attrs = attrs_of(self.onnx_node)
        axis = attrs[CONCAT_AXIS_ATTR]
        assert axis >= 0
        slices, extras, at, k = [], [], 0, 0
        while concat_program_attr(k) in attrs:
            program = expr.parse(attrs[concat_program_attr(k)].decode())
            outs = expr.evaluate(program, list(inputs[at:at + len(program.inputs)]))
            at += len(program.inputs)
            slices.append(outs[0])
            extras.extend(outs[1:])
            k += 1
        assert at == len(inputs)
        return (np.concatenate(slices, axis=axis), *extras)


def reference_run(model, feeds) -> dict:
    sess = ReferenceEvaluator(model, new_ops=[FusedElementwise, FusedConcat])
    names = [o.name for o in model.graph.output]
    return dict(zip(names, sess.run(None, feeds)))


def assert_values(original, optimized, rtol=1e-5, atol=1e-5, seed=0):
    """The rewritten model, evaluated by the reference above, computes what ONNX Runtime computes for the
    original (every graph output, same dtype and shape)."""
    feeds = feeds_for(original, seed)
    want, got = run(original, feeds), reference_run(optimized, feeds)
    assert sorted(want) == sorted(got)
    for k in want:
        assert want[k].shape == got[k].shape and want[k].dtype == got[k].dtype, k
        np.testing.assert_allclose(got[k].astype(np.float64), want[k].astype(np.float64), rtol=rtol, atol=atol,
                                   err_msg=k)


def _fused_concat_reason() -> str | None:
    """Why ONNX Runtime cannot run a FusedConcat node with the library here (None: it can)."""
    try:
        library_path()
    except LibraryNotFoundError:
        return "the custom-op library is not built"
    prog = "onnxfuse.elementwise 1\ninput x0: float32\nt0: float32 = Identity(x0)\noutput t0\n"
    node = h.make_node(CONCAT_OP_TYPE, ["a", "b"], ["y"], domain=DOMAIN,
                       **{CONCAT_AXIS_ATTR: 0, concat_program_attr(0): prog, concat_program_attr(1): prog})
    g = h.make_graph([node], "g", [h.make_tensor_value_info(n, T.FLOAT, [2]) for n in "ab"],
                     [h.make_tensor_value_info("y", T.FLOAT, [4])])
    m = h.make_model(g, opset_imports=[h.make_opsetid("", 17), h.make_opsetid(DOMAIN, 1)])
    m.ir_version = 8
    try:
        run(m, {"a": np.zeros(2, np.float32), "b": np.ones(2, np.float32)})
    except Exception as exc:  # only "not registered" skips: any other error is the kernel's, and fails below
        if "is not a registered function/op" in str(exc) or "No Op registered" in str(exc):
            return f"the library has no {CONCAT_OP_TYPE} kernel yet ({str(exc).splitlines()[0][:120]})"
    return None


_NO_FUSED_CONCAT = _fused_concat_reason()
needs_fused_concat = pytest.mark.skipif(_NO_FUSED_CONCAT is not None, reason=_NO_FUSED_CONCAT or "")


# ---- the cases --------------------------------------------------------------------------------------
# Each builds an original model; the values of each rewritten model are checked by the reference evaluator
# in its own test and by the library's kernel in test_the_library_kernel_computes_the_original.

def nchw():
    """A C2f-style block: two SiLU branches concatenated on channels, then a 1x1 Conv."""
    return parse("""
        g (float[2,4,8,8] x) => (float[2,4,8,8] y) {
            a = Conv(x, W)
            sa = Sigmoid(a)
            ya = Mul(a, sa)
            b = Relu(x)
            yb = Add(b, x)
            cat = Concat <axis = 1> (ya, yb)
            y = Conv(cat, W8)
        }
    """, [W, W8])


def channels_last(axis):
    return parse(f"""
        g (float[2,8,8,4] x) => (float[2,8,8,4] y) {{
            a = Mul(x, S4)
            sa = Sigmoid(a)
            ya = Mul(a, sa)
            b = Tanh(x)
            yb = Add(b, x)
            cat = Concat <axis = {axis}> (ya, yb)
            y = MatMul(cat, M8)
        }}
    """, [S4, M8])


def also_read_elsewhere():
    # The pool is listed before the Concat: it reads ya, which the new node writes where the Concat was.
    return parse("""
        g (float[2,4,8,8] x) => (float[2,4,8,8] y, float[2,4,1,1] p) {
            a = Conv(x, W)
            sa = Sigmoid(a)
            ya = Mul(a, sa)
            p = GlobalAveragePool(ya)
            b = Relu(x)
            yb = Add(b, x)
            cat = Concat <axis = 1> (ya, yb)
            y = Conv(cat, W8)
        }
    """, [W, W8])


def graph_output():
    return parse("""
        g (float[2,4,8,8] x) => (float[2,4,8,8] ya, float[2,4,8,8] y) {
            a = Conv(x, W)
            sa = Sigmoid(a)
            ya = Mul(a, sa)
            b = Relu(x)
            yb = Add(b, x)
            cat = Concat <axis = 1> (yb, ya)
            y = Conv(cat, W8)
        }
    """, [W, W8])


def copies():
    """A graph input and a MaxPool's output beside one FusedElementwise result."""
    return parse("""
        g (float[2,4,8,8] x) => (float[2,4,8,8] y) {
            a = Conv(x, W)
            sa = Sigmoid(a)
            ya = Mul(a, sa)
            m = MaxPool <kernel_shape = [3, 3], pads = [1, 1, 1, 1], strides = [1, 1]> (x)
            cat = Concat <axis = 1> (x, ya, m)
            y = Conv(cat, W12)
        }
    """, [W, W12])


def float16():
    return parse("""
        g (float16[2,4,8,8] x) => (float16[2,8,8,8] cat) {
            sa = Sigmoid(x)
            ya = Mul(x, sa)
            b = Relu(x)
            yb = Sub(b, x)
            cat = Concat <axis = 1> (ya, yb)
        }
    """)


def two_outputs():
    """One region, two outputs: the gate goes to a pool, the SiLU to the Concat."""
    return parse("""
        g (float[2,4,8,8] x) => (float[2,4,8,8] y, float[2,4,1,1] p) {
            a = Conv(x, W)
            sa = Sigmoid(a)
            ya = Mul(a, sa)
            p = GlobalAveragePool(sa)
            cat = Concat <axis = 1> (x, ya)
            y = Conv(cat, W8)
        }
    """, [W, W8])


def same_tensor_twice():
    return parse("""
        g (float[2,4,8,8] x) => (float[2,4,8,8] y) {
            a = Conv(x, W)
            sa = Sigmoid(a)
            ya = Mul(a, sa)
            b = Relu(x)
            yb = Add(b, x)
            cat = Concat <axis = 1> (ya, yb, ya)
            y = Conv(cat, W12)
        }
    """, [W, W12])


def both_outputs_concatenated():
    """Two outputs of one FusedElementwise node, both in the Concat (the second is a repeat segment)."""
    return parse("""
        g (float[2,4,8,8] x) => (float[2,4,8,8] y, float[2,4,1,1] p) {
            a = Conv(x, W)
            sa = Sigmoid(a)
            ya = Mul(a, sa)
            p = GlobalAveragePool(sa)
            cat = Concat <axis = 1> (ya, sa)
            y = Conv(cat, W8)
        }
    """, [W, W8])


def chain():
    """A C2f bottleneck chain: the first SiLU feeds the next Conv and the Concat, so only the last region
    can be absorbed; the first stays (a copy segment)."""
    return parse("""
        g (float[2,4,8,8] x) => (float[2,4,8,8] y) {
            a = Conv(x, W)
            sa = Sigmoid(a)
            ya = Mul(a, sa)
            c = Conv(ya, W)
            sc = Sigmoid(c)
            yc = Mul(c, sc)
            cat = Concat <axis = 1> (ya, yc)
            y = Conv(cat, W8)
        }
    """, [W, W8])


def two_concats():
    """One FusedElementwise result in two Concats: the first absorbs it, the second copies it."""
    return parse("""
        g (float[2,4,8,8] x) => (float[2,8,8,8] c1, float[2,8,8,8] c2) {
            sa = Sigmoid(x)
            ya = Mul(x, sa)
            b = Relu(x)
            yb = Add(b, x)
            c1 = Concat <axis = 1> (ya, yb)
            c2 = Concat <axis = 1> (x, ya)
        }
    """)


def sppf():
    """An SPPF block: the MaxPools read the SiLU result the Concat also reads: absorbing it would be a cycle."""
    return parse("""
        g (float[2,4,8,8] x) => (float[2,4,8,8] y) {
            a = Conv(x, W)
            sa = Sigmoid(a)
            ya = Mul(a, sa)
            m1 = MaxPool <kernel_shape = [3, 3], pads = [1, 1, 1, 1], strides = [1, 1]> (ya)
            m2 = MaxPool <kernel_shape = [3, 3], pads = [1, 1, 1, 1], strides = [1, 1]> (m1)
            cat = Concat <axis = 1> (ya, m1, m2)
            y = Conv(cat, W12)
        }
    """, [W, W12])


def if_branch():
    """The Concat and the region inside an If branch (fuse-elementwise fuses bodies on their own)."""
    return parse("""
        g (float[2,4,8,8] x, bool c) => (float[2,8,8,8] y) {
            y = If (c) <
                then_branch = t () => (float[2,8,8,8] ty) {
                    sa = Sigmoid(x)
                    ya = Mul(x, sa)
                    b = Relu(x)
                    yb = Add(b, x)
                    ty = Concat <axis = 1> (ya, yb)
                },
                else_branch = e () => (float[2,8,8,8] ey) {
                    ey = Concat <axis = 1> (x, x)
                }
            >
        }
    """)


CASES = {
    "nchw": nchw, "channels_last": lambda: channels_last(3), "negative_axis": lambda: channels_last(-1),
    "also_read_elsewhere": also_read_elsewhere, "graph_output": graph_output, "copies": copies,
    "float16": float16, "two_outputs": two_outputs, "same_tensor_twice": same_tensor_twice,
    "both_outputs_concatenated": both_outputs_concatenated, "chain": chain, "two_concats": two_concats,
    "if_branch": if_branch,
}
TOLERANCE = {"float16": {"rtol": 2e-3, "atol": 2e-3}}


# ---- structure and values -----------------------------------------------------------------------------


def test_nchw_channel_concat_of_two_regions():
    m = nchw()
    out, report = rewrite(m)
    assert report.counts[RULE] == 1 and reasons(report) == []
    node = the_fused_concat(out)
    assert not nodes(out, OP_TYPE)  # both regions absorbed
    assert axis_of(node) == 1
    assert list(node.input) == ["a", "x"] and list(node.output) == ["cat"]
    p0, p1 = programs_of(node)
    assert op_types_of(p0, p0.outputs[0]) == ["Sigmoid", "Mul"] and op_types_of(p1, p1.outputs[0]) == ["Relu", "Add"]
    (d,) = details(report)
    assert (d["concat"], d["segments"], d["copies"], d["repeats"]) == ("cat", 2, 0, 0)
    assert len(d["absorbed_nodes"]) == 2
    assert [n.op_type for n in out.graph.node] == ["Conv", CONCAT_OP_TYPE, "Conv"]
    assert_values(m, out)


@pytest.mark.parametrize("axis", [3, -1])
def test_channels_last_axis_is_made_non_negative(axis):
    m = channels_last(axis)
    out, report = rewrite(m)
    assert report.counts[RULE] == 1
    node = the_fused_concat(out)
    assert axis_of(node) == 3
    assert [len(p.inputs) for p in programs_of(node)] == [2, 1]  # x and the per-channel scale; x
    assert_values(m, out)


def test_output_also_read_elsewhere_is_kept_as_an_extra_output():
    m = also_read_elsewhere()
    out, report = rewrite(m)
    node = the_fused_concat(out)
    assert list(node.output) == ["cat", "ya"]
    p0, p1 = programs_of(node)
    assert len(p0.outputs) == 2 and p0.outputs[0] == p0.outputs[1]  # listed twice: its slice, its own tensor
    assert len(p1.outputs) == 1
    # The pool, listed before the Concat, now follows the node that writes ya.
    order = [n.op_type for n in out.graph.node]
    assert order.index("GlobalAveragePool") > order.index(CONCAT_OP_TYPE)
    assert_values(m, out)


def test_the_rewrite_itself_keeps_the_graph_sorted():
    """Before any cleanup (which sorts too): the pool that read ya before the Concat follows the new node."""
    from onnxfuse.model_io import to_graph
    from onnxfuse.rewrites import load_rule

    fused, _ = rewrite(also_read_elsewhere(), only="fuse-elementwise")
    g = to_graph(fused)
    rule = load_rule(f"elementwise/{RULE}")
    (match,) = rule.match(g)
    rule.rewrite(g, rule.check(g, match))
    written = {id(t) for t in g.inputs} | {id(t) for t in g.tensors().values() if not t.inputs}
    for node in g.nodes:
        assert all(id(t) in written for t in node.inputs), node.name
        written.update(id(t) for t in node.outputs)


def test_graph_output_stays_written():
    m = graph_output()
    out, report = rewrite(m)
    node = the_fused_concat(out)
    assert list(node.output) == ["cat", "ya"] and "ya" in [o.name for o in out.graph.output]
    p0, p1 = programs_of(node)
    assert op_types_of(p0, p0.outputs[0]) == ["Relu", "Add"]  # the Concat's order: yb first
    assert p1.outputs[0] == p1.outputs[1] and op_types_of(p1, p1.outputs[0]) == ["Sigmoid", "Mul"]
    assert_values(m, out)


def test_graph_input_and_maxpool_output_are_copy_segments():
    m = copies()
    out, report = rewrite(m)
    node = the_fused_concat(out)
    progs = programs_of(node)
    assert list(node.input) == ["x", "a", "m"]
    for k in (0, 2):
        assert [(o.op_type, o.dtype) for o in progs[k].ops] == [("Identity", "float32")]
        assert progs[k].input_names == list(progs[k].ops[0].args) and progs[k].outputs == (progs[k].ops[0].name,)
    (d,) = details(report)
    assert (d["segments"], d["copies"]) == (3, 2)
    assert_values(m, out)


def test_float16_programs():
    m = float16()
    out, report = rewrite(m)
    node = the_fused_concat(out)
    for p in programs_of(node):
        assert {dt for _, dt in p.inputs} == {"float16"} and set(p.output_dtypes()) == {"float16"}
    assert_values(m, out, **TOLERANCE["float16"])


def test_a_region_with_two_outputs_puts_the_concatenated_one_first():
    m = two_outputs()
    out, report = rewrite(m)
    node = the_fused_concat(out)
    assert list(node.output) == ["cat", "sa"]
    copy, p = programs_of(node)
    assert [o.op_type for o in copy.ops] == ["Identity"]
    assert op_types_of(p, p.outputs[0]) == ["Sigmoid", "Mul"] and op_types_of(p, p.outputs[1]) == ["Sigmoid"]
    # fuse-elementwise wrote the gate first (program order); the rule reordered the outputs.
    alone, _ = rewrite(m, only="fuse-elementwise")
    (f,) = nodes(alone, OP_TYPE)
    assert list(f.output) == ["sa", "ya"]
    assert_values(m, out)


def test_the_same_tensor_twice_repeats_the_program():
    m = same_tensor_twice()
    out, report = rewrite(m)
    node = the_fused_concat(out)
    p0, p1, p2 = programs_of(node)
    assert p2 == p0  # the second ya: the same program again over the same input
    assert list(node.input) == ["a", "x", "a"] and list(node.output) == ["cat"]
    (d,) = details(report)
    assert (d["segments"], d["copies"], d["repeats"]) == (3, 0, 1)
    assert_values(m, out)


def test_two_outputs_of_one_region_both_concatenated():
    m = both_outputs_concatenated()
    out, report = rewrite(m)
    node = the_fused_concat(out)
    p0, p1 = programs_of(node)
    assert list(node.output) == ["cat", "sa"]  # sa: read by the pool too
    assert op_types_of(p0, p0.outputs[0]) == ["Sigmoid", "Mul"]
    assert [o.op_type for o in p1.ops] == ["Sigmoid"] and len(p1.outputs) == 1  # the Mul is not computed again
    assert_values(m, out)


def test_a_bottleneck_chain_absorbs_the_last_region_and_copies_the_first():
    m = chain()
    out, report = rewrite(m)
    node = the_fused_concat(out)
    (kept,) = nodes(out, OP_TYPE)
    assert list(kept.output) == ["ya"]
    copy, p = programs_of(node)
    assert [o.op_type for o in copy.ops] == ["Identity"]
    (d,) = details(report)
    assert d["copies"] == 1 and "reach the Concat again through Conv" in d["kept"][0]["reason"]
    assert_values(m, out)


def test_a_result_in_two_concats():
    m = two_concats()
    out, report = rewrite(m)
    assert report.counts[RULE] == 1
    (node,) = nodes(out, CONCAT_OP_TYPE)
    assert list(node.output) == ["c1", "ya"]  # ya kept for the second Concat
    (second,) = nodes(out, "Concat")
    assert list(second.input) == ["x", "ya"]
    assert reasons(report) == ["no input is a FusedElementwise output of this graph"]
    assert_values(m, out)


def test_if_branch_is_rewritten_inside():
    m = if_branch()
    out, report = rewrite(m)
    assert report.counts[RULE] == 1
    (if_node,) = nodes(out, "If")
    then = next(a.g for a in if_node.attribute if a.name == "then_branch")
    assert [n.op_type for n in then.node] == [CONCAT_OP_TYPE]
    feeds = feeds_for(m)
    for c in (True, False):
        feeds["c"] = np.array(c)
        want, got = run(m, feeds), reference_run(out, feeds)
        np.testing.assert_allclose(got["y"], want["y"], rtol=1e-6, atol=1e-6)


def test_sppf_is_refused_as_a_cycle():
    m = sppf()
    out, report = rewrite(m)
    assert report.counts[RULE] == 0 and nodes(out, "Concat")
    (reason,) = reasons(report)
    assert reason.startswith("no FusedElementwise can be absorbed: the outputs of FusedElementwise")
    assert "reach the Concat again through MaxPool" in reason and "cycle" in reason


def test_the_whole_rule_list():
    m = nchw()
    out, report = optimize(m)
    onnx.checker.check_model(out)
    assert report.counts[RULE] == 1 and report.counts["conv-bias-into-elementwise"] == 0
    the_fused_concat(out)
    assert_values(m, out)
    again, report2 = optimize(out)  # idempotent
    assert report2.total == 0 and [n.op_type for n in again.graph.node] == [n.op_type for n in out.graph.node]


def test_the_node_is_named_after_the_concat():
    m = nchw()
    next(n for n in m.graph.node if n.op_type == "Concat").name = "model/cat"
    out, _ = rewrite(m)
    assert the_fused_concat(out).name == f"model/cat/{CONCAT_OP_TYPE}"


@pytest.mark.parametrize("case", sorted(CASES))
def test_reference_values_of_every_case_differ_when_a_program_changes(case):
    """The value checks above can fail: the same rewritten model with one program's output 0 replaced by
    its Neg (or one constant changed) no longer matches."""
    m = CASES[case]()
    out, _ = rewrite(m)
    graphs = [out.graph] + [a.g for n in out.graph.node for a in n.attribute if a.type == onnx.AttributeProto.GRAPH]
    node = next(n for g in graphs for n in g.node if n.op_type == CONCAT_OP_TYPE)
    attr = next(a for a in node.attribute if a.name == concat_program_attr(len(programs_of(node)) - 1))
    p = expr.parse(attr.s.decode())
    b = expr.ProgramBuilder()
    names = [b.input(dt) for _, dt in p.inputs]
    env = dict(zip(p.input_names, names))
    for c in p.consts:
        env[c.name] = b.const(c.value, c.dtype)
    for o in p.ops:
        env[o.name] = b.op(o.op_type, [env[a] for a in o.args], **dict(o.attrs))
    b.output(b.op("Add", [env[p.outputs[0]], 1.0]))
    for v in p.outputs[1:]:
        b.output(env[v])
    attr.s = b.build().to_text().encode()
    feeds = feeds_for(m)
    if case == "if_branch":
        feeds["c"] = np.array(True)
    want, got = run(m, feeds), reference_run(out, feeds)
    assert any(not np.allclose(got[k].astype(np.float64), want[k].astype(np.float64), rtol=1e-3, atol=1e-3)
               for k in want)


# ---- the library's kernel -----------------------------------------------------------------------------


@needs_library
@needs_fused_concat
@pytest.mark.parametrize("case", sorted(CASES))
def test_the_library_kernel_computes_the_original(case):
    m = CASES[case]()
    out, report = rewrite(m)
    assert report.counts[RULE] >= 1
    tol = TOLERANCE.get(case, {"rtol": 1e-5, "atol": 1e-5})
    if case == "if_branch":
        for c in (True, False):
            feeds = feeds_for(m)
            feeds["c"] = np.array(c)
            want, got = run(m, feeds), run(out, feeds)
            np.testing.assert_allclose(got["y"], want["y"], **tol)
        return
    assert_same(m, out, **tol)


# ---- refusals -------------------------------------------------------------------------------------------


def _program(n_inputs: int, n_outputs: int = 1, dtype: str = "float32") -> str:
    """A program adding its inputs (a Relu of the input when there is one), the sum output n_outputs times."""
    b = expr.ProgramBuilder()
    xs = [b.input(dtype) for _ in range(n_inputs)]
    acc = b.op("Relu", [xs[0]]) if n_inputs == 1 else xs[0]
    for x in xs[1:]:
        acc = b.op("Add", [acc, x])
    for _ in range(n_outputs):
        b.output(acc)
    return b.build().to_text()


def fused_model(fused_inputs, concat_inputs, *, value_info=(), graph_inputs, outputs=("f",), extra_outputs=(),
                axis=1, extra_nodes=(), program=None, cat_shape=None):
    """A model written with a FusedElementwise node already in it (as fuse-elementwise writes them), no shape
    inference: ``value_info`` says what is known."""
    f = h.make_node(OP_TYPE, list(fused_inputs), list(outputs), name="F", domain=DOMAIN,
                    program=program or _program(len(fused_inputs), len(outputs)))
    cat = h.make_node("Concat", list(concat_inputs), ["cat"], name="cat", axis=axis)
    g = h.make_graph([f, *extra_nodes, cat], "g", list(graph_inputs),
                     [h.make_tensor_value_info("cat", T.FLOAT, cat_shape), *extra_outputs], value_info=list(value_info))
    m = h.make_model(g, opset_imports=[h.make_opsetid("", 17), h.make_opsetid(DOMAIN, 1)])
    m.ir_version = 8
    return m


def _vi(name, shape, elem=T.FLOAT):
    return h.make_tensor_value_info(name, elem, shape)


def refused(model) -> str:
    out, report = optimize(model, only=RULE)
    assert report.counts[RULE] == 0 and not nodes(out, CONCAT_OP_TYPE)
    (reason,) = reasons(report)
    return reason


def test_refused_when_a_fused_output_shape_is_unknown():
    m = fused_model(["x"], ["f", "x"], graph_inputs=[_vi("x", [2, 4])])
    assert refused(m) == "the shape of 'f', an output of FusedElementwise 'F', is not known"


def test_refused_when_an_input_rank_is_unknown():
    m = fused_model(["x"], ["f", "u"], graph_inputs=[_vi("x", [2, 4]), _vi("u", None)], value_info=[_vi("f", [2, 4])])
    assert refused(m) == "the rank of input 'u' is not known"


def test_refused_when_ranks_differ():
    m = fused_model(["x"], ["f", "u"], graph_inputs=[_vi("x", [2, 4]), _vi("u", [2, 4, 1])],
                    value_info=[_vi("f", [2, 4])])
    assert refused(m) == "the inputs' ranks differ (2, 3)"


def test_refused_when_the_axis_is_out_of_range():
    m = fused_model(["x"], ["f", "x"], graph_inputs=[_vi("x", [2, 4])], value_info=[_vi("f", [2, 4])], axis=2)
    assert refused(m) == "axis 2 is out of range for rank 2"


def test_refused_when_dtypes_differ():
    m = fused_model(["x"], ["f", "u"], graph_inputs=[_vi("x", [2, 4]), _vi("u", [2, 4], T.INT64)],
                    value_info=[_vi("f", [2, 4])])
    assert refused(m) == "the dtypes differ (float32, int64)"


def test_refused_when_a_dtype_is_not_in_the_language():
    m = fused_model(["x"], ["f", "u"], graph_inputs=[_vi("x", [2, 4]), _vi("u", [2, 4], T.UINT8)],
                    value_info=[_vi("f", [2, 4])])
    assert refused(m) == "input 'u' has dtype uint8, which the program language does not have"


def test_refused_above_the_rank_limit():
    shape = [1] * (MAX_RANK + 1)
    m = fused_model(["x"], ["f", "x"], graph_inputs=[_vi("x", shape)], value_info=[_vi("f", shape)])
    assert refused(m) == f"rank {MAX_RANK + 1} exceeds the library's limit of {MAX_RANK}"


def test_refused_when_a_program_has_too_many_inputs():
    from onnxfuse.rewrites.elementwise.concat_into_elementwise import MAX_PROGRAM_INPUTS

    names = [f"x{i}" for i in range(MAX_PROGRAM_INPUTS + 1)]
    m = fused_model(names, ["f", "x0"], graph_inputs=[_vi(n, [2, 4]) for n in names], value_info=[_vi("f", [2, 4])])
    assert refused(m) == (f"segment 0's program would have {MAX_PROGRAM_INPUTS + 1} inputs and 1 outputs; "
                          "one CUDA kernel takes at most 48 and 64")
    fits = fused_model(names[:-1], ["f", "x0"], graph_inputs=[_vi(n, [2, 4]) for n in names[:-1]],
                       value_info=[_vi("f", [2, 4])])
    assert optimize(fits, only=RULE)[1].counts[RULE] == 1


def test_refused_when_a_program_has_too_many_outputs():
    from onnxfuse.rewrites.elementwise.concat_into_elementwise import MAX_PROGRAM_OUTPUTS

    # 64 outputs, every one a graph output too: the one concatenated is written twice, 65 in all.
    outs = ["f"] + [f"o{i}" for i in range(MAX_PROGRAM_OUTPUTS - 1)]
    m = fused_model(["x"], ["f", "x"], graph_inputs=[_vi("x", [2, 4])], outputs=outs,
                    value_info=[_vi("f", [2, 4])], extra_outputs=[_vi(o, [2, 4]) for o in outs])
    assert refused(m).endswith(f"1 inputs and {MAX_PROGRAM_OUTPUTS + 1} outputs; one CUDA kernel takes at most 48 and 64")


def test_refused_when_a_copy_comes_from_a_loop_output():
    body = h.make_graph([h.make_node("Identity", ["c_in"], ["c_out"]), h.make_node("Identity", ["v_in"], ["v_out"])],
                        "body", [_vi("i", [], T.INT64), _vi("c_in", [], T.BOOL), _vi("v_in", [2, 4])],
                        [_vi("c_out", [], T.BOOL), _vi("v_out", [2, 4])])
    loop = h.make_node("Loop", ["n", "", "x"], ["l"], body=body)
    relu = h.make_node("Relu", ["l"], ["r"])
    m = fused_model(["x"], ["f", "r"], graph_inputs=[_vi("x", [2, 4]), _vi("n", [], T.INT64)],
                    value_info=[_vi("f", [2, 4]), _vi("l", [2, 4]), _vi("r", [2, 4])], extra_nodes=[loop, relu])
    assert refused(m) == "input 'r' is computed from a Loop, Scan or If output, whose shape ONNX Runtime may not know"


def test_refused_without_an_absorbable_fused_node():
    m = sppf()
    out, report = rewrite(m)
    assert report.counts[RULE] == 0 and len(nodes(out, OP_TYPE)) == 1


def test_the_rules_checks_that_the_engine_never_shows_it():
    """A one-input Concat (cleanup makes it an Identity first) and a cycle through the Concat's own output
    (no valid model has one): the rule's own check refuses them."""
    import onnx_graphsurgeon as gs

    from onnxfuse.rewrites import load_rule

    rule = load_rule(f"elementwise/{RULE}")
    x = gs.Variable("x", np.float32, [2, 4])
    f_out = gs.Variable("f", np.float32, [2, 4])
    cat_out = gs.Variable("cat", np.float32, [2, 4])
    f = gs.Node(OP_TYPE, "F", {"program": _program(1)}, inputs=[x], outputs=[f_out], domain=DOMAIN)
    cat = gs.Node("Concat", "cat", {"axis": 1}, inputs=[f_out], outputs=[cat_out])
    g = gs.Graph(nodes=[f, cat], inputs=[x], outputs=[cat_out], opset=17)
    assert rule.check(g, (cat, g)).reason == "the Concat has a single input: nothing to save"

    y = gs.Variable("y", np.float32, [2, 4])
    f2 = gs.Node(OP_TYPE, "F2", {"program": _program(2)}, inputs=[x, cat_out], outputs=[y], domain=DOMAIN)
    cat.inputs.append(y)
    g.nodes.append(f2)
    assert rule.check(g, (cat, g)).reason == "FusedElementwise 'F2' reads the Concat's own output (a cycle)"


def test_no_refusal_for_a_concat_without_fused_inputs():
    m = parse("""
        g (float[2,4] x, float[2,4] z) => (float[2,8] y) {
            y = Concat <axis = 1> (x, z)
        }
    """)
    out, report = rewrite(m)
    assert report.counts[RULE] == 0 and reasons(report) == []


# ---- around the rule --------------------------------------------------------------------------------------


def test_limits_agree_with_the_cuda_kernel():
    from onnxfuse.rewrites.elementwise import concat_into_elementwise as rule

    header = (ROOT / "onnxfuse" / "custom_ops" / "csrc" / "cuda_codegen.h").read_text()
    found = re.search(r"kCudaMaxInputs = (\d+), kCudaMaxOutputs = (\d+);", header)
    assert found and (int(found[1]), int(found[2])) == (rule.MAX_PROGRAM_INPUTS, rule.MAX_PROGRAM_OUTPUTS)
    assert int(re.search(r"kCudaParamBytes = (\d+);", header)[1]) == rule.KERNEL_PARAM_BYTES
    slots = re.search(r"kPlacedParamSlots = (\d+);", header)
    assert slots and int(slots[1]) == rule.PLACED_PARAM_SLOTS
    assert "(8L * (nin + 1))" in header and "8L * (nin + nout) + 24" in header  # cuda_max_dims, mirrored
    assert [rule.placed_kernel_dims(n, 1) for n in (1, 28, 29, 48)] == [16, 16, 15, 9]


def test_refused_when_the_rank_is_more_than_one_placed_launch_takes():
    names = [f"x{i}" for i in range(40)]  # 40 inputs: 11 dimensions per launch
    for rank, ok in ((12, False), (11, True)):
        shape = [2] + [1] * (rank - 1)
        m = fused_model(names, ["f", "x0"], graph_inputs=[_vi(n, shape) for n in names], value_info=[_vi("f", shape)],
                        axis=0)
        if ok:
            assert optimize(m, only=RULE)[1].counts[RULE] == 1
        else:
            assert refused(m) == ("segment 0's program (40 inputs, 1 outputs) takes at most 11 dimensions in one "
                                  "CUDA launch; the rank is 12")


def test_registered_right_after_fuse_elementwise():
    from onnxfuse.rewrites import ORDER, rule_names, select_rules

    assert ORDER[ORDER.index("elementwise/fuse-elementwise") + 1] == f"elementwise/{RULE}"
    assert RULE in rule_names()
    assert RULE in [r.name for r in select_rules("cuda")]
    assert RULE not in [r.name for r in select_rules("contrib")] + [r.name for r in select_rules("onnx")]


def test_fused_values_do_not_name_absorbed_nodes():
    import onnxfuse

    m = also_read_elsewhere()
    result = onnxfuse.optimize(m, validate=False)
    assert nodes(result.model, CONCAT_OP_TYPE)
    meta = next((p.value for p in result.model.metadata_props if p.key == FUSED_VALUES_KEY), None)
    absorbed = [n for d in result.applied.details if d["rule"] == RULE for n in d["absorbed_nodes"]]
    assert absorbed
    names = {n.name for n in result.model.graph.node}
    assert meta is None or set(json.loads(meta)) <= names - set(absorbed)
    # A region that stays keeps its entry.
    kept = onnxfuse.optimize(chain(), validate=False).model
    meta = json.loads(next(p.value for p in kept.metadata_props if p.key == FUSED_VALUES_KEY))
    (f,) = nodes(kept, OP_TYPE)
    assert set(meta) == {f.name} and set(meta[f.name]) == {"sa"}


def test_the_docs_list_the_rule():
    for doc in ("docs/architecture.md", "docs/static-choices.md"):
        assert RULE in (ROOT / doc).read_text(), doc
