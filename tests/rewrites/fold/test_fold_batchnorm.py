"""BatchNormalization folding into Conv / ConvTranspose / Gemm / MatMul: counts, graphs, numerics, refusals."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from helpers import (
    TESTDATA,
    assert_same_outputs,
    load_testdata,
    make_model,
    make_models_module,
    op_types,
    optimize,
    snapshot,
    vi,
)

BN_RULES = "fold-batchnorm-conv,fold-batchnorm-convtranspose,fold-batchnorm-gemm"
FOLD_RULES = BN_RULES + ",fold-scale-bias"


# --- the committed models ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, rule, count, ops, rtol",
    [
        ("conv_bn_relu", "fold-batchnorm-conv", 4, ["Conv", "Relu"] * 4, 1e-5),
        ("conv1d_bn", "fold-batchnorm-conv", 1, ["Conv", "Relu"], 1e-5),
        ("conv3d_bn", "fold-batchnorm-conv", 1, ["Conv"], 1e-5),
        ("convtranspose_bn", "fold-batchnorm-convtranspose", 2, ["ConvTranspose", "Relu", "ConvTranspose"], 1e-5),
        ("gemm_bn", "fold-batchnorm-gemm", 3, ["Gemm", "Relu", "Gemm", "Relu", "Gemm"], 1e-5),
        ("matmul_bn", "fold-batchnorm-gemm", 1, ["Gemm", "Relu"], 1e-5),
        ("shared_weights", "fold-batchnorm-conv", 2, ["Conv", "Relu", "Conv", "Add"], 1e-5),
        # fp16 weights and activations: each folded weight is rounded once to fp16 (2^-11 relative)
        ("conv_bn_fp16", "fold-batchnorm-conv", 2, ["Conv", "Relu", "Conv"], 1e-2),
    ],
)
def test_folds_committed_models(name, rule, count, ops, rtol):
    model = load_testdata(name)
    out, report = optimize(model, only=BN_RULES)
    assert report.counts[rule] == count
    assert report.total == count
    assert op_types(out) == ops
    assert not report.refusals
    assert {d["folded"] for d in report.details} == {
        n.name for n in model.graph.node if n.op_type == "BatchNormalization"
    }
    onnx.checker.check_model(out, full_check=True)
    assert_same_outputs(model, out, rtol=rtol)


def test_fp16_weights_are_folded_in_float64_and_rounded_once():
    model = load_testdata("conv_bn_fp16")
    out, _ = optimize(model, only=BN_RULES)
    before = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    after = {i.name: numpy_helper.to_array(i) for i in out.graph.initializer}
    w = before["conv0.weight"].astype(np.float64)
    b = before["conv0.bias"].astype(np.float64)
    g, beta, mu, var = (before[f"bn0.{k}"].astype(np.float64) for k in ("gamma", "beta", "mean", "var"))
    s = g / np.sqrt(var + 1e-3)
    assert before["bn0.gamma"].dtype == np.float32
    conv0 = next(n for n in out.graph.node if n.name == "conv0")
    np.testing.assert_array_equal(after[conv0.input[1]], (w * s[:, None, None, None]).astype(np.float16))
    np.testing.assert_array_equal(after[conv0.input[2]], ((b - mu) * s + beta).astype(np.float16))
    assert after[conv0.input[1]].dtype == np.float16 and after[conv0.input[2]].dtype == np.float16


def test_shared_weight_other_reader_keeps_the_original():
    """conv_a and conv_b share W and bias; only conv_a has a BN. conv_a gets a copy, conv_b the original."""
    rng = np.random.default_rng(3)
    inits = [
        numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "W"),
        numpy_helper.from_array(rng.standard_normal(4).astype(np.float32), "bias"),
        *_bn_inits(rng, 4, "bn"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "W", "bias"], ["a"], name="conv_a"),
        helper.make_node("Conv", ["x", "W", "bias"], ["b_out"], name="conv_b"),
        helper.make_node("BatchNormalization", ["a", "bn.g", "bn.b", "bn.m", "bn.v"], ["a_out"], name="bn"),
    ]
    model = make_model(nodes, [vi("x", ["N", 3, 6, 6])], [vi("a_out", ["N", 4, 4, 4]), vi("b_out", ["N", 4, 4, 4])], inits)
    out, report = optimize(model, only=BN_RULES)
    assert report.counts["fold-batchnorm-conv"] == 1
    assert report.details[0]["copied"] == ["bias", "weight"]
    conv_a = next(n for n in out.graph.node if n.name == "conv_a")
    conv_b = next(n for n in out.graph.node if n.name == "conv_b")
    assert list(conv_b.input) == ["x", "W", "bias"]
    assert conv_a.input[1] not in ("W",) and conv_a.input[2] != "bias"
    after = {i.name: numpy_helper.to_array(i) for i in out.graph.initializer}
    np.testing.assert_array_equal(after["W"], numpy_helper.to_array(inits[0]))
    assert_same_outputs(model, out)


# --- refusals: nothing changes and the reason is reported ------------------------------------------


def _bn_inits(rng, c, prefix, dtype=np.float32):
    return [
        numpy_helper.from_array(rng.uniform(0.5, 1.5, c).astype(dtype), f"{prefix}.g"),
        numpy_helper.from_array((rng.standard_normal(c) * 0.5).astype(dtype), f"{prefix}.b"),
        numpy_helper.from_array((rng.standard_normal(c) * 0.5).astype(dtype), f"{prefix}.m"),
        numpy_helper.from_array(rng.uniform(0.2, 2.0, c).astype(dtype), f"{prefix}.v"),
    ]


def _conv_bn(bn_inputs=("c", "bn.g", "bn.b", "bn.m", "bn.v"), extra_inputs=(), extra_nodes=(), outputs=None,
             inits=None, w_name="W", bias_dtype=None, bn_channels=4):
    rng = np.random.default_rng(11)
    if inits is None:
        inits = [numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "W"),
                 *_bn_inits(rng, bn_channels, "bn")]
    conv_inputs = ["x", w_name]
    if bias_dtype is not None:
        inits.append(numpy_helper.from_array(np.ones(4, dtype=bias_dtype), "bias"))
        conv_inputs.append("bias")
    nodes = [helper.make_node("Conv", conv_inputs, ["c"], name="conv"),
             helper.make_node("BatchNormalization", list(bn_inputs), ["y"], name="bn"), *extra_nodes]
    return make_model(nodes, [vi("x", ["N", 3, 6, 6]), *extra_inputs], outputs or [vi("y", ["N", 4, 4, 4])], inits)


def _assert_refused(model, reason_part, rules=BN_RULES):
    out, report = optimize(model, only=rules)
    assert report.total == 0
    assert snapshot(out) == snapshot(model)
    reasons = [r.reason for r in report.refusals]
    assert any(reason_part in r for r in reasons), reasons
    assert all(r.rule in rules.split(",") for r in report.refusals)
    return report


def test_refuses_training_mode_committed():
    report = _assert_refused(load_testdata("bn_training"), "training mode")
    assert report.refusals[0].node == "bn"


def test_refuses_bn_input_that_is_a_graph_output_committed():
    _assert_refused(load_testdata("bn_input_is_output"), "'conv_out' is also a graph output")


def test_refuses_training_outputs_without_attribute():
    """Opset < 14 style: a BN with its mean/var outputs requested computes training statistics."""
    model = _conv_bn()
    bn = model.graph.node[1]
    bn.output.extend(["mean_out", "var_out"])
    model.opset_import[0].version = 9
    _assert_refused(model, "outputs (training statistics)")


def test_refuses_non_constant_bn_parameters():
    model = _conv_bn(bn_inputs=("c", "bn.g", "bn.b", "mean_in", "bn.v"), extra_inputs=[vi("mean_in", [4])])
    _assert_refused(model, "mean 'mean_in' is not a constant")


def test_refuses_intermediate_read_elsewhere():
    model = _conv_bn(extra_nodes=[helper.make_node("Relu", ["c"], ["r"], name="relu")],
                     outputs=[vi("y", ["N", 4, 4, 4]), vi("r", ["N", 4, 4, 4])])
    _assert_refused(model, "'c' is also read by 'relu'")


def test_refuses_channel_count_mismatch():
    model = _conv_bn(bn_channels=5)
    _assert_refused(model, "5 channels to fold but Conv produces 4")


def test_refuses_mismatched_parameter_shapes():
    model = _conv_bn()
    for init in model.graph.initializer:
        if init.name == "bn.m":
            init.CopyFrom(numpy_helper.from_array(np.zeros((2, 2), np.float32), "bn.m"))
    _assert_refused(model, "unknown channel count")


def test_refuses_bias_dtype_mismatch():
    _assert_refused(_conv_bn(bias_dtype=np.float64), "dtype mismatch")


def test_refuses_integer_weights():
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(np.ones((4, 3, 3, 3), np.int32), "W"), *_bn_inits(rng, 4, "bn")]
    _assert_refused(_conv_bn(inits=inits), "int32")


def test_refuses_fp16_overflow():
    rng = np.random.default_rng(0)
    w = np.full((4, 3, 3, 3), 60000, np.float16)
    g, b, m, v = _bn_inits(rng, 4, "bn", np.float16)
    g = numpy_helper.from_array(np.full(4, 8.0, np.float16), "bn.g")
    model = _conv_bn(inits=[numpy_helper.from_array(w, "W"), g, b, m, v])
    model.graph.input[0].type.tensor_type.elem_type = TensorProto.FLOAT16
    model.graph.output[0].type.tensor_type.elem_type = TensorProto.FLOAT16
    _assert_refused(model, "overflows float16")


# --- the committed files themselves -----------------------------------------------------------------


def test_make_models_is_deterministic_and_small(tmp_path):
    mm = make_models_module()
    for path in mm.build_all(tmp_path):
        committed = TESTDATA / path.name
        assert committed.exists(), f"{path.name} is not committed; run python testdata/make_models.py"
        assert path.read_bytes() == committed.read_bytes(), f"{path.name} differs from make_models.py output"
    for path in TESTDATA.glob("*.onnx"):
        assert path.stat().st_size < 2 * 2**20, path
    readme = (TESTDATA / "README.md").read_text()
    for name in [*mm.MODELS, "mobilenet_v2_w035"]:
        assert f"`{name}.onnx`" in readme, f"{name}.onnx is not described in testdata/README.md"


def test_hundred_layer_cnn_folds_quickly():
    """A 100 × (Conv+BN+ReLU) stack: every BN folds, outputs agree, and folding takes well under 5 s."""
    import time

    from onnxfuse.model_io import to_graph, to_model
    from onnxfuse.rewrites import apply_rules, select_rules

    rng = np.random.default_rng(100)
    nodes, inits, x = [], [], "x"
    for i in range(100):
        inits += [numpy_helper.from_array((rng.standard_normal((8, 8, 3, 3)) / 8).astype(np.float32), f"w{i}"),
                  *_bn_inits(rng, 8, f"bn{i}")]
        nodes += [helper.make_node("Conv", [x, f"w{i}"], [f"c{i}"], name=f"conv{i}", pads=[1, 1, 1, 1]),
                  helper.make_node("BatchNormalization", [f"c{i}", *(f"bn{i}.{k}" for k in "gbmv")], [f"b{i}"],
                                   name=f"bn{i}"),
                  helper.make_node("Relu", [f"b{i}"], [f"r{i}"], name=f"relu{i}")]
        x = f"r{i}"
    model = make_model(nodes, [vi("x", ["N", 8, 8, 8])], [vi(x, ["N", 8, 8, 8])], inits)
    graph = to_graph(model)
    start = time.perf_counter()
    report = apply_rules(graph, select_rules(only=FOLD_RULES))
    elapsed = time.perf_counter() - start
    assert report.counts["fold-batchnorm-conv"] == 100
    assert elapsed < 5.0, elapsed
    out = to_model(graph, model)
    assert op_types(out) == ["Conv", "Relu"] * 100
    assert_same_outputs(model, out, rtol=1e-4)
