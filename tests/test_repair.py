"""If ONNX Runtime runs a model, onnxfuse accepts it (issue 29, onnxfuse/repair.py).

Each model below is one that ``onnx.checker`` refuses and ONNX Runtime's CPU provider runs (the first
test pins both facts). ``optimize`` must accept it, say what it repaired in one note, write an output
that passes the full checker (except where ORT's own ONNX-domain op stays: then it loads wherever the
input loads), and compute what ORT computes for the original as given. A real cycle and an unknown op
are still refused, in one line.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxfuse
from onnxfuse.errors import ModelLoadError
from onnxfuse.model_io import load_model

F = TensorProto.FLOAT
RNG = np.random.default_rng(0)


def _vi(name, shape, dtype=F):
    return helper.make_tensor_value_info(name, dtype, shape)


def _w(name, shape):
    return numpy_helper.from_array(RNG.standard_normal(shape).astype(np.float32), name)


def _model(nodes, inputs, outputs, inits=(), opset=13, ir=None, imports=None):
    g = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    m = helper.make_model(g, opset_imports=imports or [helper.make_opsetid("", opset)])
    if ir is not None:
        m.ir_version = ir
    return m


def unsorted():
    # y = Relu(x·W + b) + x, written consumer first
    nodes = [helper.make_node("Add", ["r", "x"], ["y"]), helper.make_node("Relu", ["a"], ["r"]),
             helper.make_node("Add", ["m", "b"], ["a"]), helper.make_node("MatMul", ["x", "W"], ["m"])]
    return _model(nodes, [_vi("x", [2, 3, 8])], [_vi("y", [2, 3, 8])], [_w("W", [8, 8]), _w("b", [8])])


def unsorted_subgraph():
    # an If whose branch reads an outer value computed after the If in the main graph (ORT sorts the
    # main graph by such implicit inputs too; it refuses an unsorted subgraph, which we sort anyway)
    then_g = helper.make_graph([helper.make_node("Mul", ["n", "n"], ["t"]), helper.make_node("Neg", ["t"], ["o"])],
                               "then", [], [_vi("o", [2, 4])])
    else_g = helper.make_graph([helper.make_node("Identity", ["n"], ["o2"])], "else", [], [_vi("o2", [2, 4])])
    nodes = [helper.make_node("If", ["c"], ["y"], then_branch=then_g, else_branch=else_g),
             helper.make_node("Abs", ["x"], ["n"])]
    return _model(nodes, [_vi("x", [2, 4]), _vi("c", [], TensorProto.BOOL)], [_vi("y", [2, 4])])


def layernorm_opset13():
    # ORT's BERT generator writes LayerNormalization at opsets 11-16: ORT's own kernel below 17
    nodes = [helper.make_node("Add", ["x", "s"], ["h"]),
             helper.make_node("LayerNormalization", ["h", "g", "b"], ["y"], axis=-1, epsilon=1e-5)]
    return _model(nodes, [_vi("x", [2, 3, 8]), _vi("s", [2, 3, 8])], [_vi("y", [2, 3, 8])],
                  [_w("g", [8]), _w("b", [8])], opset=13)


def layernorm_chain_opset16():
    # the second LayerNormalization reads the first's output: its dtype is known only through it
    nodes = [helper.make_node("LayerNormalization", ["x", "g", "b"], ["h"], axis=-1),
             helper.make_node("Add", ["h", "x"], ["r"]),
             helper.make_node("LayerNormalization", ["r", "g", "b"], ["y"], axis=-1)]
    return _model(nodes, [_vi("x", [2, 3, 8])], [_vi("y", [2, 3, 8])], [_w("g", [8]), _w("b", [8])], opset=16)


def layernorm_opset11_blocked():
    # opset 11 → 17 would change Unsqueeze (axes became an input at 13): the op stays ORT's
    nodes = [helper.make_node("Unsqueeze", ["x"], ["u"], axes=[0]),
             helper.make_node("LayerNormalization", ["u", "g", "b"], ["y"], axis=-1, epsilon=1e-5)]
    return _model(nodes, [_vi("x", [3, 8])], [_vi("y", [1, 3, 8])], [_w("g", [8]), _w("b", [8])], opset=11)


def ir3_initializer():
    nodes = [helper.make_node("Gemm", ["x", "W", "b"], ["y"])]
    return _model(nodes, [_vi("x", [2, 8])], [_vi("y", [2, 4])], [_w("W", [8, 4]), _w("b", [4])], opset=8, ir=3)


def shapeless_output():
    nodes = [helper.make_node("MatMul", ["x", "W"], ["m"]), helper.make_node("Relu", ["m"], ["y"])]
    return _model(nodes, [_vi("x", [2, 8])], [helper.make_tensor_value_info("y", F, None)], [_w("W", [8, 4])])


def contrib_without_import():
    nodes = [helper.make_node("MatMul", ["x", "W"], ["m"]),
             helper.make_node("FastGelu", ["m", "b"], ["y"], domain="com.microsoft")]
    return _model(nodes, [_vi("x", [2, 8])], [_vi("y", [2, 4])], [_w("W", [8, 4]), _w("b", [4])])


def simplified_layernorm_onnx_domain():
    # onnxruntime-genai's builder: SimplifiedLayerNormalization in the ONNX domain at opset 21
    nodes = [helper.make_node("Add", ["x", "s"], ["h"]),
             helper.make_node("SimplifiedLayerNormalization", ["h", "g"], ["y"], axis=-1, epsilon=1e-6)]
    return _model(nodes, [_vi("x", [2, 3, 8]), _vi("s", [2, 3, 8])], [_vi("y", [2, 3, 8])], [_w("g", [8])], opset=21)


CASES = {
    "unsorted": (unsorted, "nodes sorted topologically"),
    "unsorted-subgraph": (unsorted_subgraph, "nodes sorted topologically"),
    "layernorm-opset13": (layernorm_opset13, "opset raised to 17 for LayerNormalization (from 13"),
    "layernorm-chain-opset16": (layernorm_chain_opset16, "opset raised to 17 for LayerNormalization (from 16"),
    "layernorm-opset11-kept": (layernorm_opset11_blocked, "ONNX Runtime's ONNX-domain op"),
    "ir3-initializer": (ir3_initializer, "listed as graph inputs"),
    "shapeless-output": (shapeless_output, "output types declared"),
    "contrib-without-import": (contrib_without_import, "opset import added (com.microsoft 1)"),
    "simplified-layernorm": (simplified_layernorm_onnx_domain, "ONNX Runtime's ONNX-domain op"),
}
#: Where ORT's own ONNX-domain op stays: the output fails the checker as the input does.
ORT_OPS_KEPT = {"layernorm-opset11-kept", "simplified-layernorm"}


def _feeds(model):
    feeds = {}
    for v in model.graph.input:
        if v.name in {t.name for t in model.graph.initializer}:
            continue
        t = v.type.tensor_type
        shape = [d.dim_value for d in t.shape.dim]
        if t.elem_type == TensorProto.BOOL:
            feeds[v.name] = np.array(True)
        else:
            feeds[v.name] = RNG.standard_normal(shape).astype(np.float32)
    return feeds


def _ort(model, feeds):
    import onnxruntime as ort

    s = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in s.get_outputs()], s.run(None, feeds)))


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_checker_refuses_what_ort_runs(case):
    model = CASES[case][0]()
    with pytest.raises(onnx.checker.ValidationError):
        onnx.checker.check_model(model)
    _ort(model, _feeds(model))  # runs


@pytest.mark.parametrize("case", sorted(CASES))
def test_optimize_accepts_repairs_and_matches_ort(case, tmp_path):
    from onnxfuse import repair

    build, phrase = CASES[case]
    model = build()
    path = tmp_path / "in.onnx"
    onnx.save(model, path)
    result = onnxfuse.optimize(str(path), tmp_path / "out.onnx", target="contrib", provider="cpu")
    notes = [n for n in result.validation.notes if n.startswith("the input was repaired")]
    assert len(notes) == 1 and phrase in notes[0], result.validation.notes
    out = onnx.load(str(tmp_path / "out.onnx"))
    assert phrase in {p.key: p.value for p in out.metadata_props}[repair.METADATA_KEY]
    if case in ORT_OPS_KEPT:
        assert repair.validity_problem(out) is None  # valid as ORT reads it
    else:
        onnx.checker.check_model(out, full_check=True)
    feeds = _feeds(model)
    want, got = _ort(model, feeds), _ort(out, feeds)
    assert set(got) == set(want)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-5)


def test_the_input_proto_is_not_modified():
    model = unsorted()
    before = model.SerializeToString()
    result = onnxfuse.optimize(model, target="contrib", provider="cpu")
    assert model.SerializeToString() == before
    assert any("nodes sorted topologically" in n for n in result.validation.notes)


def test_a_valid_model_is_not_copied_or_noted():
    from onnxfuse import repair

    model = unsorted()
    fixed, repairs = repair.repaired(model)
    assert repairs == ["nodes sorted topologically"]
    again, none = repair.repaired(fixed)
    assert again is fixed and none == []


def cycle():
    nodes = [helper.make_node("Relu", ["b"], ["a"]), helper.make_node("Neg", ["a"], ["b"]),
             helper.make_node("Abs", ["x"], ["y"])]
    nodes[1].input.append("x")  # Neg takes one input: make it a real two-node cycle through Add instead
    nodes[1] = helper.make_node("Add", ["a", "x"], ["b"])
    nodes[2] = helper.make_node("Mul", ["a", "x"], ["y"])
    return _model(nodes, [_vi("x", [2])], [_vi("y", [2])])


def unknown_op():
    return _model([helper.make_node("NoSuchOp", ["x"], ["y"])], [_vi("x", [2])], [_vi("y", [2])])


@pytest.mark.parametrize("build,message", [(cycle, "topologically sorted"), (unknown_op, "No Op registered for NoSuchOp")])
def test_what_ort_cannot_run_is_still_refused_in_one_line(build, message, tmp_path):
    path = tmp_path / "bad.onnx"
    onnx.save(build(), path)
    with pytest.raises(ModelLoadError, match=message) as info:
        load_model(path)
    assert "\n" not in str(info.value)
    r = subprocess.run([sys.executable, "-m", "onnxfuse", "optimize", str(path), str(tmp_path / "out.onnx")],
                       capture_output=True, text=True)
    assert r.returncode == 1
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "invalid ONNX model" in lines[0], r.stderr


def test_repairs_are_reported_without_validation_too(tmp_path):
    """With --no-validate there is no validation note: the repairs are in the report's ``repairs`` and
    one note line on the terminal."""
    import json

    from click.testing import CliRunner

    from onnxfuse.cli import main

    src = tmp_path / "unsorted.onnx"
    onnx.save(unsorted(), src)
    report = tmp_path / "r.json"
    res = CliRunner().invoke(main, ["optimize", str(src), str(tmp_path / "out.onnx"), "--no-validate", "--no-bench",
                                    "--json", str(report)], catch_exceptions=False)
    assert res.exit_code == 0, res.stderr
    repairs = json.loads(report.read_text())["result"]["repairs"]
    assert repairs and "sorted" in " ".join(repairs)
    assert "the input was repaired" in " ".join(res.stdout.split())
    plain = onnxfuse.optimize(_model([helper.make_node("Relu", ["x"], ["y"])], [_vi("x", [2])], [_vi("y", [2])]),
                              validate=False, bench=False)
    assert plain.to_dict()["repairs"] == []
