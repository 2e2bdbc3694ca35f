"""contrib-bias-softmax (opt-in, CUDA only): Softmax(x + bias) → com.microsoft BiasSoftmax."""

from __future__ import annotations

import onnxruntime as ort
import pytest
from contrib_testlib import attrs, fuse, ops, parse, refusals
from onnxfuse.rewrites.contrib.contrib_bias_softmax import ContribBiasSoftmax

BSM = ContribBiasSoftmax()


BSM_CASES = [
    # BERT: scores [B,H,S,S] + mask [B,1,1,S]
    ("float[2,3,4,4] s, float[2,1,1,4] mask", "x = Add(s, mask)", 1),
    ("float[2,3,4,4] s, float[2,1,1,4] mask", "x = Add(mask, s)", 1),
    ("float[2,3,4,4] s, float[2,3,4,4] mask", "x = Add(s, mask)", 1),  # same shape
    ("float[2,3,4,4] s, float[3,4,4] mask", "x = Add(s, mask)", 0),  # outer broadcast, lower rank
    ("float[2,3,4,4] s, float[1,3,4,4] mask", "x = Add(s, mask)", 0),
]

@pytest.mark.parametrize("inputs,add,inner", BSM_CASES)
def test_bias_softmax_structure(inputs, add, inner):
    m = parse(f"g ({inputs}) => (float[2,3,4,4] y) {{\n{add}\ny = Softmax <axis = -1> (x)\n}}")
    out, report = fuse(m, BSM)
    assert ops(out) == {"com.microsoft:BiasSoftmax": 1}, refusals(report)
    node = out.graph.node[0]
    assert node.input[0] == "s" and node.input[1] == "mask"
    a = attrs(node)
    assert a == {"axis": 3, "is_inner_broadcast": inner}

@pytest.mark.parametrize(
    "inputs,body",
    [
        ("float[2,3,4,4] s, float[2,1,1,4] mask", "x = Add(s, mask)\ny = Softmax <axis = 2> (x)"),  # not last axis
        ("float[2,3,4,4] s, float[2,1,4,1] mask", "x = Add(s, mask)\ny = Softmax <axis = -1> (x)"),  # broadcast on axis
        ("float[2,3,4,4] s, float[1,3,1,4] mask", "x = Add(s, mask)\ny = Softmax <axis = -1> (x)"),  # mixed broadcast
        ("float[2,3,4,4] s, float[2,1,1,4] mask", "x = Add(s, mask)\ny = Softmax <axis = -1> (x)\nz = Neg(x)"),
    ],
)
def test_bias_softmax_near_misses(inputs, body):
    outs = "float[2,3,4,4] y" + (", float[2,3,4,4] z" if "z =" in body else "")
    m = parse(f"g ({inputs}) => ({outs}) {{\n{body}\n}}")
    out, report = fuse(m, BSM)
    assert report.counts[BSM.name] == 0

def test_bias_softmax_unknown_shapes_refused():
    # without shape inference an intermediate tensor has no shape: refused
    m2 = parse("g (float[2,3,4,4] s, float[2,1,1,4] mask) => (float[2,3,4,4] y) {\nr = Relu(s)\nx = Add(r, mask)\n"
               "y = Softmax <axis = -1> (x)\n}")
    out2, report2 = fuse(m2, BSM, infer=False)
    assert report2.counts[BSM.name] == 0
    assert any("shape inference" in r for r in refusals(report2, BSM))

def test_bias_softmax_has_no_cpu_kernel_in_this_onnxruntime():
    """The reason BiasSoftmax is not in the default registry and not compared numerically here."""
    m = parse("g (float[2,3,4,4] s, float[2,1,1,4] mask) => (float[2,3,4,4] y) {\nx = Add(s, mask)\n"
              "y = Softmax <axis = -1> (x)\n}")
    out, _ = fuse(m, BSM)
    opts = ort.SessionOptions()
    opts.log_severity_level = 4
    try:
        ort.InferenceSession(out.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    except Exception as exc:  # NOT_IMPLEMENTED: no kernel
        assert "BiasSoftmax" in str(exc)
    else:
        pytest.fail("ONNX Runtime now has a CPU BiasSoftmax kernel: add a numeric test and register the rule")

def test_bias_softmax_registry():
    from onnxfuse.rewrites import rule_names

    assert BSM.name not in rule_names()  # CUDA-only op: explicit opt-in pools only
