"""Malformed or unusual models from the hostile-input sweep (issue 29). Each test failed on 93e2115:
"internal error" or a traceback instead of one line, or a written model that ONNX Runtime refuses or
that reads other weights than protobuf does."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper

import large_models as lm
import onnxfuse
from onnxfuse.cli import main


def run(args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def ort_run(model_or_path, feeds):
    import onnxruntime as ort

    src = model_or_path.SerializeToString() if isinstance(model_or_path, onnx.ModelProto) else str(model_or_path)
    return ort.InferenceSession(src, providers=["CPUExecutionProvider"]).run(None, feeds)


@pytest.mark.parametrize("elem,vals", [(TensorProto.INT4, [1, -2, 3, -4, 5, -6, 7, -8]),
                                       (TensorProto.UINT4, [1, 2, 3, 4, 5, 6, 7, 15])], ids=["int4", "uint4"])
def test_int4_weights_are_written_packed(tmp_path, elem, vals):
    w = helper.make_tensor("w", elem, [8], vals=vals)
    s = helper.make_tensor("s", TensorProto.FLOAT, [], vals=[0.5])
    g = helper.make_graph([helper.make_node("DequantizeLinear", ["w", "s"], ["d"]),
                           helper.make_node("Add", ["x", "d"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [8])], [w, s])
    src = tmp_path / "int4.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)]), src)
    out = tmp_path / "out.onnx"
    result = run(["optimize", src, out, "--no-bench", "-q", "--target", "onnx"])
    assert result.exit_code == 0, result.stderr
    onnx.checker.check_model(onnx.load(out), full_check=True)
    x = np.zeros(8, np.float32)
    np.testing.assert_array_equal(ort_run(out, {"x": x})[0], 0.5 * np.array(vals, np.float32))


@pytest.mark.parametrize("indices_2d", [False, True])
def test_sparse_float_initializer_stays_float(tmp_path, indices_2d):
    idx = helper.make_tensor("si", TensorProto.INT64, [2, 1] if indices_2d else [2], [1, 5])
    sparse = helper.make_sparse_tensor(helper.make_tensor("sv", TensorProto.FLOAT, [2], [1.5, 2.5]), idx, [8])
    g = helper.make_graph([helper.make_node("Relu", ["sv"], ["t"]), helper.make_node("Add", ["x", "t"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [8])])
    g.sparse_initializer.append(sparse)
    src = tmp_path / "sparse.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), src)
    out = tmp_path / "out.onnx"
    result = run(["optimize", src, out, "--no-validate", "--no-bench", "-q", "--target", "onnx"])
    assert result.exit_code == 0, result.stderr
    x = np.ones(8, np.float32)
    got = ort_run(out, {"x": x})[0]  # ONNX Runtime refused the float64 initializer on 93e2115
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, [1, 2.5, 1, 1, 1, 3.5, 1, 1])


def _fused_model(program: bytes) -> onnx.ModelProto:
    node = helper.make_node("FusedElementwise", ["x"], ["y"], domain="ai.onnxfuse")
    node.attribute.append(onnx.AttributeProto(name="program", type=onnx.AttributeProto.STRING, s=program))
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.onnxfuse", 1)])


@pytest.mark.parametrize("program", [
    "onnxfuse.elementwise 1\ninput x0: float32\nt0: float32 = Neg(té)\noutput t0\n".encode(),
    b"onnxfuse.elementwise 1\ninput x0: float32\nt0: float32 = Neg(t\xff\xfe)\noutput t0\n",
], ids=["non-ascii", "not-utf8"])
@pytest.mark.parametrize("command", ["optimize", "diff"])
def test_foreign_program_bytes_give_one_line(tmp_path, program, command):
    src = tmp_path / "fused.onnx"
    onnx.save(_fused_model(program), src)
    args = ["optimize", src, tmp_path / "out.onnx", "--no-bench"] if command == "optimize" else ["diff", src, src]
    result = run(args)
    err = result.stderr.strip()
    assert result.exit_code == 1, err
    assert "internal error" not in err and "UnicodeDecodeError" not in err and "codec" not in err, err
    assert err.startswith("error:") and len(err.splitlines()) == 1, err
    assert not (tmp_path / "out.onnx").exists()


def _fused_concat_model(change: str) -> onnx.ModelProto:
    """Two copy segments concatenated along axis 0, broken one way."""
    copy = b"onnxfuse.elementwise 1\ninput x: float32\noutput x\n"
    programs = {"bad-program": [copy, "onnxfuse.elementwise 1\ninput x: float32\nt: float32 = Neg(té)\noutput t\n".encode()],
                "not-utf8": [copy, b"onnxfuse.elementwise 1\ninput x: float32\nt: float32 = Neg(t\xff)\noutput t\n"]}
    node = helper.make_node("FusedConcat", ["x", "x2"] + (["x"] if change == "extra-input" else []), ["y"],
                            domain="ai.onnxfuse", axis=99 if change == "axis" else 0)
    for k, text in enumerate(programs.get(change, [copy, copy])):
        node.attribute.append(onnx.AttributeProto(name=f"program_{k}", type=onnx.AttributeProto.STRING, s=text))
    second = [3] if change == "shapes" else [4]
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4]),
                                        helper.make_tensor_value_info("x2", TensorProto.FLOAT, [2] + second)],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.onnxfuse", 1)],
                             ir_version=8)


@pytest.mark.parametrize("change", ["bad-program", "not-utf8", "extra-input", "axis", "shapes"])
def test_a_broken_fused_concat_gives_one_line_and_no_output(tmp_path, change):
    """A model that holds a malformed FusedConcat (ours or a hostile file's): one clear line naming the node
    (or the program), exit 1, nothing written."""
    src = tmp_path / "concat.onnx"
    onnx.save(_fused_concat_model(change), src)
    result = run(["optimize", src, tmp_path / "out.onnx", "--no-bench"])
    err = result.stderr.strip()
    assert result.exit_code == 1, err
    assert "internal error" not in err and "UnicodeDecodeError" not in err, err
    assert err.startswith("error:") and len(err.splitlines()) == 1 and "FusedConcat" in err, err
    assert not (tmp_path / "out.onnx").exists()


def test_junit_is_well_formed_with_control_characters_in_names(tmp_path):
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["t"]), helper.make_node("Neg", ["t"], ["y\x01\x1b"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                          [helper.make_tensor_value_info("y\x01\x1b", TensorProto.FLOAT, [4])])
    src = tmp_path / "ctl.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), src)
    junit = tmp_path / "report.xml"
    result = run(["optimize", src, tmp_path / "out.onnx", "--no-bench", "-q", "--junit", junit])
    assert result.exit_code == 0, result.stderr
    names = [case.get("name") for case in ET.parse(junit).getroot().iter("testcase")]
    assert "y\\x01\\x1b" in names


def test_one_string_constant_does_not_stop_constant_folding():
    s = helper.make_tensor("s", TensorProto.STRING, [2], [b"a", b"b"])
    c1 = helper.make_tensor("c1", TensorProto.FLOAT, [4], [1, 2, 3, 4])
    c2 = helper.make_tensor("c2", TensorProto.FLOAT, [4], [1, 1, 1, 1])
    g = helper.make_graph([helper.make_node("Add", ["c1", "c2"], ["c3"]), helper.make_node("Add", ["x", "c3"], ["y"]),
                           helper.make_node("Identity", ["s"], ["so"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4]),
                           helper.make_tensor_value_info("so", TensorProto.STRING, [2])], [s, c1, c2])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    result = onnxfuse.optimize(model, target="onnx", bench=False)
    adds = [n for n in result.model.graph.node if n.op_type == "Add"]
    assert len(adds) == 1
    folded = {t.name: numpy_helper.to_array(t) for t in result.model.graph.initializer}
    assert any(v.dtype == np.float32 and np.array_equal(v, [2, 3, 4, 5]) for v in folded.values())
    assert any(v.dtype == object for v in folded.values())  # the string constant is still there


def test_bench_on_cpu_with_a_string_output_does_not_mention_cuda_graphs():
    s = helper.make_tensor("s", TensorProto.STRING, [2], [b"a", b"b"])
    g = helper.make_graph([helper.make_node("Neg", ["x"], ["y"]), helper.make_node("Identity", ["s"], ["so"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4]),
                           helper.make_tensor_value_info("so", TensorProto.STRING, [2])], [s])
    report = onnxfuse.bench(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), device="cpu",
                            iterations=3)
    assert report.to_json()["ok"] is True


@pytest.mark.parametrize("second", ["same-length", "short"])
def test_duplicated_raw_data_in_a_large_inline_file_reads_what_protobuf_reads(tmp_path, monkeypatch, second):
    """A tensor whose ``raw_data`` field occurs twice: protobuf (and onnx, ONNX Runtime) read the last.
    The large-model path parses the file itself; on 93e2115 it kept the first when the last was short."""
    from onnxfuse import lazy_weights as lw

    monkeypatch.setattr(lw, "LAZY_MODEL_BYTES", 1 << 20)
    src = tmp_path / "inline.onnx"
    lm.build(src, layers=2, inline=True)
    model = onnx.load(src)
    i, big = max(enumerate(model.graph.initializer), key=lambda it: len(it[1].raw_data))
    n = len(big.raw_data)
    replacement = np.arange(n, dtype=np.uint8).tobytes() if second == "same-length" else b"\x01\x02\x03\x04"
    tensor_bytes = big.SerializeToString() + onnx.TensorProto(raw_data=replacement).SerializeToString()
    del model.graph.initializer[i]
    graph_tail = bytes([(5 << 3) | 2]) + _varint(len(tensor_bytes)) + tensor_bytes  # GraphProto.initializer
    # a second GraphProto field: protobuf merges it into the first, appending this initializer
    src.write_bytes(model.SerializeToString() + bytes([(7 << 3) | 2]) + _varint(len(graph_tail)) + graph_tail)
    want = next(t for t in onnx.load(src).graph.initializer if t.name == big.name).raw_data
    assert want == replacement  # protobuf's reading, the one to match

    stripped = lw.strip_inline_weights(src)
    assert stripped is not None  # the other weights are still large: this is the large-model path
    got = next(t for t in stripped[0].graph.initializer if t.name == big.name)
    data = lw.read_range(lw.file_range(got)) if lw.is_external(got) else got.raw_data
    assert data == want


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)
