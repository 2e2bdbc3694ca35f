"""constant-reshape-target: computed Reshape targets become constants with 0 (copy) and -1 (infer).

Each rewrite is checked against ONNX Runtime on the original at several sizes of the dynamic
dimensions (a wrong 0 or -1 would give another shape or fail), and the refusals keep the graph.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
from contrib_testlib import fuse, parse, refusals, same_at

from onnxfuse.rewrites.fold.constant_reshape_target import ConstantReshapeTarget

RULE = ConstantReshapeTarget()


def _ops(model) -> Counter:
    return Counter(n.op_type for n in model.graph.node)


def _target(model) -> list[int]:
    node = next(n for n in model.graph.node if n.op_type == "Reshape")
    init = {i.name: i for i in model.graph.initializer}
    return onnx.numpy_helper.to_array(init[node.input[1]]).tolist()


def _scaled_batch(factor: int, rest: str, out: str):
    """Reshape(x, Concat(batch · factor, rest)): the first size is computed, the others constant."""
    return parse(f"""
    g (float[batch,6,32] x) => (float[{out}] y) {{
        s = Shape(x)
        i0 = Constant <value = int64 {{0}}> ()
        b = Gather <axis = 0> (s, i0)
        f = Constant <value = int64 {{{factor}}}> ()
        bb = Mul(b, f)
        ax = Constant <value = int64[1] {{0}}> ()
        b1 = Unsqueeze(bb, ax)
        rest = Constant <value = int64[2] {{{rest}}}> ()
        shp = Concat <axis = 0> (b1, rest)
        y = Reshape(x, shp)
    }}
    """)


def test_one_computed_size_becomes_minus_one():
    m = _scaled_batch(2, "3, 32", "b2,3,32")
    out, report = fuse(m, RULE)
    assert report.counts[RULE.name] == 1
    assert _target(out) == [-1, 3, 32]
    assert _ops(out) == Counter({"Reshape": 1})  # the whole size computation is gone
    for batch in (1, 3, 4):
        same_at(m, out, {"batch": batch})


def _split_last_dim(allowzero: int = 0):
    """x.view(*x.shape[:2], 4, 8): the first two sizes are a Slice of x's own Shape."""
    return parse(f"""
    g (float[batch,seq,32] x) => (float[batch,seq,4,8] y) {{
        s = Shape(x)
        a = Constant <value = int64[1] {{0}}> ()
        e = Constant <value = int64[1] {{2}}> ()
        bs = Slice(s, a, e)
        rest = Constant <value = int64[2] {{4, 8}}> ()
        shp = Concat <axis = 0> (bs, rest)
        y = Reshape <allowzero = {allowzero}> (x, shp)
    }}
    """)


def test_own_dimensions_become_copies():
    m = _split_last_dim()
    out, report = fuse(m, RULE)
    assert _target(out) == [0, 0, 4, 8]
    for dims in ({"batch": 2, "seq": 3}, {"batch": 1, "seq": 5}):
        same_at(m, out, dims)


def test_same_symbol_on_another_tensor_is_a_copy():
    # ViT's x.reshape(n, d, -1) with n read from the image, not from the conv output being reshaped.
    m = parse("""
    g (float[batch,3,8,8] img) => (float[batch,4,16] y) {
        x = Conv <strides = [2, 2]> (img, w)
        s = Shape(img)
        i0 = Constant <value = int64 {0}> ()
        n = Gather <axis = 0> (s, i0)
        ax = Constant <value = int64[1] {0}> ()
        n1 = Unsqueeze(n, ax)
        rest = Constant <value = int64[2] {4, -1}> ()
        shp = Concat <axis = 0> (n1, rest)
        y = Reshape(x, shp)
    }
    """, inits={"w": np.random.default_rng(0).standard_normal((4, 3, 2, 2)).astype(np.float32)})
    out, _ = fuse(m, RULE)
    assert _target(out) == [0, 4, -1]
    for batch in (1, 3):
        same_at(m, out, {"batch": batch})


TWO_COMPUTED = """
g (float[batch,seq,32] x, float[batch,seq] z) => (float[batch,seq,4,8] y) {
    s = Shape(z)
    i0 = Constant <value = int64 {0}> ()
    i1 = Constant <value = int64 {1}> ()
    b = Gather <axis = 0> (s, i0)
    t = Gather <axis = 0> (s, i1)
    ax = Constant <value = int64[1] {0}> ()
    b1 = Unsqueeze(b, ax)
    r = Relu(z)
    s2 = Shape(r)
    t0 = Gather <axis = 0> (s2, i1)
    t1 = Unsqueeze(t0, ax)
    rest = Constant <value = int64[2] {4, 8}> ()
    shp = Concat <axis = 0> (b1, t1, rest)
    y = Reshape(x, shp)
}
"""


def test_a_static_size_read_from_another_tensor_is_that_constant():
    # A YOLOv8 head's box.view(b, 4, reg, a) with b and a read from another tensor, z: its batch p is
    # not proven to be x's (no copy, computed), but its dimension 2 is static (12): wherever the model
    # runs that part is 12, a constant, which leaves b the one -1. Two computed sizes before.
    m = parse("""
    g (float[batch,16,12] box, float[p,16,12] z) => (float[batch,4,4,12] y) {
        s = Shape(z)
        i0 = Constant <value = int64 {0}> ()
        i2 = Constant <value = int64 {2}> ()
        b = Gather <axis = 0> (s, i0)
        a = Gather <axis = 0> (s, i2)
        ax = Constant <value = int64[1] {0}> ()
        b1 = Unsqueeze(b, ax)
        a1 = Unsqueeze(a, ax)
        mid = Constant <value = int64[2] {4, 4}> ()
        shp = Concat <axis = 0> (b1, mid, a1)
        y = Reshape(box, shp)
    }
    """)
    out, report = fuse(m, RULE)
    assert report.counts[RULE.name] == 1, refusals(report, RULE)
    assert _target(out) == [-1, 4, 4, 12]
    for batch in (1, 3):
        same_at(m, out, {"batch": batch, "p": batch})


def test_two_unproven_sizes_are_refused():
    # z's sizes carry their own symbols: nothing proves they are x's, and only one could be -1.
    m = parse(TWO_COMPUTED.replace("float[batch,seq] z", "float[p,q] z"))
    out, report = fuse(m, RULE)
    assert report.counts[RULE.name] == 0
    assert any("computed sizes" in r or "elements" in r for r in refusals(report, RULE)), refusals(report, RULE)
    assert _ops(out)["Concat"] == 1


def test_shape_inference_proves_both_sizes_are_copies():
    m = parse(TWO_COMPUTED)
    out, _ = fuse(m, RULE)  # z and x share the symbols batch and seq
    assert _target(out) == [0, 0, 4, 8]
    for dims in ({"batch": 2, "seq": 3}, {"batch": 3, "seq": 1}):
        same_at(m, out, dims)


def _allowzero(model) -> int:
    node = next(n for n in model.graph.node if n.op_type == "Reshape")
    return next((a.i for a in node.attribute if a.name == "allowzero"), 0)


def test_allowzero_copies_are_written_with_allowzero_0():
    # torch's dynamo exporter writes allowzero=1 on every view: a computed size that is x's own dimension
    # is that dimension literally, which a 0 under allowzero=0 copies, zero-size batch included.
    m = _split_last_dim(allowzero=1)
    out, report = fuse(m, RULE)
    assert report.counts[RULE.name] == 1
    assert _target(out) == [0, 0, 4, 8] and _allowzero(out) == 0
    for dims in ({"batch": 2, "seq": 3}, {"batch": 1, "seq": 5}, {"batch": 0, "seq": 3}):
        same_at(m, out, dims)


def test_allowzero_with_a_constant_zero_is_refused():
    # The literal 0 would become a copy of x's dimension once written under allowzero=0.
    m = _split_last_dim(allowzero=1)
    rest = next(n for n in m.graph.node if n.output[0] == "rest")
    rest.attribute[0].t.CopyFrom(onnx.numpy_helper.from_array(np.array([0, 8], dtype=np.int64)))
    out, report = fuse(m, RULE, infer=False)
    assert report.counts[RULE.name] == 0
    assert any("allowzero=1 with a constant 0" in r for r in refusals(report, RULE)), refusals(report, RULE)
    assert _ops(out)["Concat"] == 1


def test_zero_constant_with_a_computed_size_is_refused():
    m = _scaled_batch(1, "0, 32", "batch,6,32")
    out, report = fuse(m, RULE)
    assert report.counts[RULE.name] == 0
    assert any("not positive" in r for r in refusals(report, RULE)), refusals(report, RULE)


def test_below_opset_14_no_allowzero_attribute_is_written():
    # Reshape has no allowzero before opset 14: writing one would fail the checker (fuse() runs it)
    text = onnx.printer.to_text(_split_last_dim().graph).replace("Reshape <allowzero: int = 0> ", "Reshape ")
    m = parse(text, opset=13)
    out, report = fuse(m, RULE)
    assert report.counts[RULE.name] == 1
    node = next(n for n in out.graph.node if n.op_type == "Reshape")
    assert not [a for a in node.attribute if a.name == "allowzero"]
