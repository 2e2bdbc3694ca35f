"""The noise floor cannot hide real bugs: wrong rewrites planted as rules must still fail validation
(non-strict, floor active) with the planted rule named; and the floor is measured and reported."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper

import onnxfuse
from onnxfuse.errors import ValidationFailed
from onnxfuse.validate.precision_judge import CONVERSION_MULTIPLE
from onnxfuse.rewrites import RULES
from onnxfuse.rewrites import Rule

RNG = np.random.default_rng(7)


def _f32(*shape, lo=None, hi=None):
    if lo is not None:
        return RNG.uniform(lo, hi, size=shape).astype(np.float32)
    return RNG.standard_normal(shape).astype(np.float32)


def _model(nodes, inputs, outputs, inits, opset=17):
    m = h.make_model(h.make_graph(nodes, "g", inputs, outputs, [numpy_helper.from_array(v, k) for k, v in inits.items()]),
                     opset_imports=[h.make_opsetid("", opset)])
    m.ir_version = 8
    return m


def conv_bn() -> onnx.ModelProto:
    return _model([h.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
                   h.make_node("BatchNormalization", ["c", "g", "beta", "mean", "var"], ["y"], epsilon=1e-3)],
                  [h.make_tensor_value_info("x", T.FLOAT, [1, 4, 6, 6])], [h.make_tensor_value_info("y", T.FLOAT, [1, 4, 6, 6])],
                  {"w": _f32(4, 4, 3, 3), "b": _f32(4), "g": _f32(4, lo=0.5, hi=1.5), "beta": _f32(4),
                   "mean": _f32(4), "var": _f32(4, lo=0.05, hi=0.5)})


def conv_scale() -> onnx.ModelProto:
    return _model([h.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]), h.make_node("Mul", ["c", "s"], ["y"])],
                  [h.make_tensor_value_info("x", T.FLOAT, [1, 4, 6, 6])], [h.make_tensor_value_info("y", T.FLOAT, [1, 4, 6, 6])],
                  {"w": _f32(4, 4, 3, 3), "s": _f32(1, 4, 1, 1, lo=0.5, hi=2.0)})


def gelu() -> onnx.ModelProto:
    return _model([h.make_node("Div", ["x", "r2"], ["d"]), h.make_node("Erf", ["d"], ["e"]), h.make_node("Add", ["e", "one"], ["p"]),
                   h.make_node("Mul", ["x", "p"], ["m"]), h.make_node("Mul", ["m", "half"], ["y"])],
                  [h.make_tensor_value_info("x", T.FLOAT, [4, 16])], [h.make_tensor_value_info("y", T.FLOAT, [4, 16])],
                  {"r2": np.array(np.sqrt(2), np.float32), "one": np.array(1, np.float32), "half": np.array(0.5, np.float32)})


def attention(d: int = 16) -> onnx.ModelProto:
    return _model([h.make_node("Transpose", ["k"], ["kt"], perm=[0, 2, 1]), h.make_node("MatMul", ["q", "kt"], ["s"]),
                   h.make_node("Mul", ["s", "scale"], ["ss"]), h.make_node("Softmax", ["ss"], ["p"], axis=-1),
                   h.make_node("MatMul", ["p", "v"], ["y"])],
                  [h.make_tensor_value_info(n, T.FLOAT, [2, 8, d]) for n in ("q", "k", "v")],
                  [h.make_tensor_value_info("y", T.FLOAT, [2, 8, d])], {"scale": np.array(1 / np.sqrt(d), np.float32)})


def conv_bias() -> onnx.ModelProto:
    return _model([h.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]), h.make_node("Relu", ["c"], ["y"])],
                  [h.make_tensor_value_info("x", T.FLOAT, [1, 4, 6, 6])], [h.make_tensor_value_info("y", T.FLOAT, [1, 4, 6, 6])],
                  {"w": _f32(4, 4, 3, 3), "b": _f32(4, lo=0.1, hi=0.3)})


class Planted(Rule):
    """A deliberately wrong rewrite, applied once to the first node of ``op``."""

    name = "planted"
    description = "test only"

    def __init__(self, name, op, mutate):
        self.name, self.op, self.mutate, self.done = name, op, mutate, False

    def match(self, graph):
        return [] if self.done else [n for n in graph.nodes if n.op == self.op][:1]

    def rewrite(self, graph, node):
        self.done = True
        self.mutate(graph, node)
        return {"node": node.name}


# The mutations keep each constant's dtype, so they plant the same bug in a model converted to float16.
def _fold_bn_without_eps(graph, bn):
    conv = bn.inputs[0].inputs[0]
    w, b = conv.inputs[1].values, conv.inputs[2].values
    g, beta, mean, var = (t.values.astype(np.float32) for t in bn.inputs[1:])
    k = g / np.sqrt(var)  # the bug: ε forgotten
    conv.inputs[1] = gs.Constant(w.name + "_f" if hasattr(w, "name") else "w_f", (w * k[:, None, None, None]).astype(w.dtype))
    conv.inputs[2] = gs.Constant("b_f", ((b - mean) * k + beta).astype(w.dtype))
    conv.outputs[0] = bn.outputs[0]
    bn.outputs.clear()


def _scale_wrong_channel(graph, mul):
    conv = mul.inputs[0].inputs[0]
    s = np.roll(mul.inputs[1].values.reshape(-1), 1)  # the bug: channel c gets channel c-1's scale
    w = conv.inputs[1].values
    conv.inputs[1] = gs.Constant("w_s", (w * s[:, None, None, None]).astype(w.dtype))
    conv.outputs[0] = mul.outputs[0]
    mul.outputs.clear()


def _gelu_constant_off(graph, div):
    div.inputs[1] = gs.Constant("r2_off", np.array(np.sqrt(2) * 1.01, div.inputs[1].values.dtype))  # 1% off


def _scale_1_over_d(graph, mul):
    mul.inputs[1] = gs.Constant("scale_d", np.array(1 / 16, mul.inputs[1].values.dtype))  # 1/d instead of 1/sqrt(d)


def _drop_bias(graph, conv):
    del conv.inputs[2]


PLANTED = [
    (conv_bn, Planted("planted-bn-without-eps", "BatchNormalization", _fold_bn_without_eps)),
    (conv_scale, Planted("planted-scale-wrong-channel", "Mul", _scale_wrong_channel)),
    (gelu, Planted("planted-gelu-constant", "Div", _gelu_constant_off)),
    (attention, Planted("planted-scale-1-over-d", "Mul", _scale_1_over_d)),
    (conv_bias, Planted("planted-dropped-bias", "Conv", _drop_bias)),
]
PLANTED_IDS = ["bn-eps", "scale-channel", "gelu-1pct", "attention-scale", "dropped-bias"]


@pytest.mark.parametrize("build, planted", PLANTED, ids=PLANTED_IDS)
def test_planted_bug_fails_validation_with_its_rule_named(build, planted):
    model = build()
    with pytest.raises(ValidationFailed) as err:
        onnxfuse.optimize(model, target="onnx", rules=[planted, *RULES])
    assert err.value.culprit == planted.name
    rows = err.value.report.validation.outputs
    assert all("noise_floor" in c.extra for c in rows)  # judged with the floor active


@pytest.mark.parametrize("build, planted", PLANTED, ids=PLANTED_IDS)
def test_planted_bug_in_float16_is_caught_by_the_drift_budget(build, planted):
    """--precision fp16 with explicit tolerances: the drift budget (onnxfuse/validate/drift_budget.py) is
    then what could pass these outputs. Its 2e-2 / 0.999 alone would pass the GELU, BatchNorm-ε and
    dropped-bias bugs (normalized max error ~2e-3, ~5e-3, ~2e-2; cosine >= 0.9995): the bound at
    CONVERSION_MULTIPLE x the plain conversion's error is what catches them."""
    planted.done = False
    with pytest.raises(ValidationFailed) as err:
        onnxfuse.optimize(build(), target="onnx", rules=[planted, *RULES], precision="fp16", provider="cpu",
                          rtol=1e-2, atol=1e-3)
    assert err.value.culprit == planted.name
    for c in err.value.report.validation.outputs:
        assert c.extra.get("passed_by") != "drift budget"
        assert c.extra["drift_error"] > CONVERSION_MULTIPLE * c.extra["conversion_error"], c.to_dict()
        # and beyond the conversion rounded per op, the budget's other arm on the CPU
        assert c.extra["drift_error"] > c.extra["conversion_error_rounded"], c.to_dict()
    assert "normalized max error" in str(err.value)


@pytest.mark.parametrize("build", [conv_bn, conv_scale, gelu, attention, conv_bias])
def test_real_rules_pass_and_report_their_multiple_of_the_floor(build):
    result = onnxfuse.optimize(build())
    for c in result.validation.outputs:
        assert c.passed and "noise_floor" in c.extra and "floor_multiple" in c.extra
        assert c.to_dict()["noise_floor"] == c.extra["noise_floor"]  # in the JSON report too


def test_every_report_shows_the_multiple_of_the_floor(tmp_path):
    from click.testing import CliRunner

    from onnxfuse.cli import main

    path = tmp_path / "m.onnx"
    onnx.save(conv_bn(), path)
    md, xml, js = tmp_path / "r.md", tmp_path / "r.xml", tmp_path / "r.json"
    res = CliRunner().invoke(main, ["optimize", str(path), str(tmp_path / "o.onnx"), "--no-bench", "--markdown", str(md),
                                    "--junit", str(xml), "--json", str(js)], catch_exceptions=False)
    assert res.exit_code == 0
    assert "x floor" in res.stdout
    assert "noise floor" in md.read_text() and "noise floor:" in xml.read_text()
    import json

    row = json.loads(js.read_text())["result"]["validation"]["outputs"][0]
    assert row["noise_floor"] >= 0 and "floor_multiple" in row
