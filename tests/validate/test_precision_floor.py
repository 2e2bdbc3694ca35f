"""Default tolerances follow the least precise float type a model computes in."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.parser
import pytest

from onnxfuse.runtime.compare import compare_arrays, lowest_float_precision
from onnxfuse.validate import validate_models
from onnxfuse.runtime.inputs import Inputs


def _parse(text):
    return onnx.parser.parse_model('<ir_version: 8, opset_import: ["" : 17]>\n' + text)


FP32 = "g (float[4] x) => (float[4] y) { y = Relu(x) }"
VIA_FP16 = "g (float[4] x) => (float[4] y) { h = Cast <to = 10> (x)\n r = Relu(h)\n y = Cast <to = 1> (r) }"
VIA_BF16 = "g (float[4] x) => (float[4] y) { h = Cast <to = 16> (x)\n y = Cast <to = 1> (h) }"
IN_BODY = """g (float[4] x, bool c) => (float[4] y) {
    y = If (c) <then_branch = t () => (float[4] a) { h = Cast <to = 10> (x)
                                                     a = Cast <to = 1> (h) },
                else_branch = e () => (float[4] b) { b = Identity(x) }>
}"""


@pytest.mark.parametrize("text,want", [(FP32, None), (VIA_FP16, "float16"), (VIA_BF16, "bfloat16"),
                                       (IN_BODY, "float16")])
def test_lowest_float_precision(text, want):
    assert lowest_float_precision(_parse(text)) == want


def test_compare_arrays_takes_the_looser_tolerance():
    ref = np.array([1.0, 2.0, 3.0], dtype=np.float32)
    got = ref * np.float32(1 + 2e-3)  # a float16-sized difference
    assert not compare_arrays("y", ref, got).passed
    c = compare_arrays("y", ref, got, precision="float16")
    assert c.passed and c.rtol == 1e-2
    # explicit tolerances are never widened
    assert not compare_arrays("y", ref, got, rtol=1e-4, atol=0.0, precision="float16").passed
    # integer outputs stay exact
    ints = np.array([1, 2], dtype=np.int64)
    assert not compare_arrays("i", ints, ints + 1, precision="float16").passed


def test_validate_models_notes_the_float16_floor():
    model = _parse(VIA_FP16)
    inputs = Inputs(feeds={"x": np.array([1.0, -2.0, 3.5, 0.25], dtype=np.float32)})
    report = validate_models(model, model, inputs, provider="cpu")
    assert report.passed
    assert report.outputs[0].rtol == 1e-2
    assert any("computes in float16" in n for n in report.notes)
    plain = validate_models(_parse(FP32), _parse(FP32), inputs, provider="cpu")
    assert plain.outputs[0].rtol == 1e-4 and not any("computes in" in n for n in plain.notes)
