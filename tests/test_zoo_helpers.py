"""``benchmarks/zoo.py``'s own logic: the repairs of the transformers-optimizer anchor (each makes ONNX
Runtime's own output loadable without changing a value, and each is recorded in the zoo's results), the
runner that times models on several GPUs at once, and the NAME@attention variants."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from helpers import ROOT

_spec = importlib.util.spec_from_file_location("onnxfuse_bench_zoo", ROOT / "benchmarks" / "zoo.py")
zoo = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(zoo)


def _copies_model(copy_to_output: bool) -> onnx.ModelProto:
    """x -> Shape -> MemcpyFromHost -> Cast(float) -> Add(x) -> y, as a CUDA session writes such a graph;
    with ``copy_to_output`` the copy writes a graph output too."""
    nodes = [helper.make_node("Shape", ["x"], ["s"], name="shape"),
             helper.make_node("MemcpyFromHost", ["s"], ["s_gpu"], name="Memcpy"),
             helper.make_node("Cast", ["s_gpu"], ["sf"], to=TensorProto.FLOAT, name="cast"),
             helper.make_node("Add", ["x", "sf"], ["y"], name="add")]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])]
    if copy_to_output:
        nodes.append(helper.make_node("MemcpyToHost", ["y"], ["y_host"], name="Memcpy_1"))
        outputs.append(helper.make_tensor_value_info("y_host", TensorProto.FLOAT, [2]))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])], outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _run(model: onnx.ModelProto) -> list[np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": np.array([1.0, 5.0], np.float32)})


def test_device_copies_are_removed_and_the_values_kept():
    for to_output in (False, True):
        model = _copies_model(to_output)
        assert zoo._drop_device_copies(model) == (2 if to_output else 1)
        assert not [n for n in model.graph.node if n.op_type.startswith("Memcpy")]
        onnx.checker.check_model(model)
        got = _run(model)
        # y = x + float(shape(x)) = x + 2, whichever output reads it
        for value in got:
            np.testing.assert_array_equal(value, [3.0, 7.0])
        assert len(got) == (2 if to_output else 1)


def test_a_graph_without_copies_is_left_alone():
    model = _copies_model(False)
    del model.graph.node[1]
    model.graph.node[1].input[0] = "s"
    before = model.SerializeToString()
    assert zoo._drop_device_copies(model) == 0
    assert model.SerializeToString() == before


def test_the_checker_refuses_the_copy_before_the_repair():
    # the failure the zoo recorded for ViT and the sdpa BERT (2026-11-28): "No Op registered for
    # MemcpyFromHost with domain_version of 17", from ONNX's checker, which the anchor runs first
    try:
        onnx.checker.check_model(_copies_model(False))
    except onnx.checker.ValidationError as exc:
        assert "MemcpyFromHost" in str(exc)
    else:
        raise AssertionError("ONNX's checker accepted a model with an internal Memcpy node")


def test_layernorm_at_opset_14_gets_opset_17():
    node = helper.make_node("LayerNormalization", ["x", "g", "b"], ["y"], epsilon=1e-5)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
                              [helper.make_tensor("g", TensorProto.FLOAT, [4], [1.0] * 4),
                               helper.make_tensor("b", TensorProto.FLOAT, [4], [0.0] * 4)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)])
    assert zoo._raise_opset_for_layernorm(model) == 17
    onnx.checker.check_model(model)
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    (y,) = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    ref = (x - x.mean(1, keepdims=True)) / np.sqrt(x.var(1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(y, ref, atol=1e-5)
    assert zoo._raise_opset_for_layernorm(model) is None  # already 17


# --------------------------------------------------------------------------------------------- the zoo's runner


class _FakeChild:
    """A child that ends after ``ticks`` polls with ``rc``; records the clock ticks it ran at."""

    def __init__(self, name, slot, ticks, rc, log):
        self.name, self.slot, self.left, self.rc, self.log = name, slot, ticks, rc, log
        self.killed = False

    def poll(self):
        self.log.append(("poll", self.name, self.slot))
        if self.killed:
            return -9
        self.left -= 1
        return self.rc if self.left <= 0 else None

    def kill(self):
        self.killed = True

    def wait(self):
        return -9


def _schedule(names, slots, ticks, deadline=None, rcs=None):
    clock = {"now": 0.0}
    log, started, done = [], [], []

    def start(name, slot):
        started.append((name, slot, clock["now"]))
        return _FakeChild(name, slot, ticks[name], (rcs or {}).get(name, 0), log)

    def tick():
        clock["now"] += 1.0
        return clock["now"]

    outcomes = zoo.run_children(names, slots, deadline, start, lambda n, o, s: done.append((n, o)),
                                poll=0.0, clock=tick)
    return outcomes, started, done


def test_children_run_two_at_a_time_each_on_its_own_gpu():
    outcomes, started, done = _schedule(["a", "b", "c", "d"], ["0", "1"], {"a": 3, "b": 1, "c": 1, "d": 1})
    assert outcomes == {"a": 0, "b": 0, "c": 0, "d": 0}
    assert [(n, s) for n, s, _ in started[:2]] == [("a", "0"), ("b", "1")]
    # b ends first: c takes its GPU while a still runs on the other; never two children on one GPU
    assert ("c", "1") in [(n, s) for n, s, _ in started]
    assert [n for n, _ in done][0] == "b" and set(n for n, _ in done) == {"a", "b", "c", "d"}


def test_one_slot_runs_the_children_in_order():
    outcomes, started, done = _schedule(["a", "b", "c"], [None], {"a": 2, "b": 2, "c": 1}, rcs={"b": 1})
    assert [n for n, _, _ in started] == ["a", "b", "c"] and [n for n, _ in done] == ["a", "b", "c"]
    assert outcomes == {"a": 0, "b": 1, "c": 0}
    assert {s for _, s, _ in started} == {None}


def test_the_deadline_skips_late_models_and_stops_a_child_past_it():
    # deadline at clock 25: a runs forever and is killed past 55; b and c start after 5 (too late) and are skipped
    outcomes, started, done = _schedule(["a", "b", "c"], [None], {"a": 10 ** 6, "b": 1, "c": 1}, deadline=25.0)
    assert outcomes == {"a": "timeout", "b": "skipped", "c": "skipped"}
    assert [n for n, _, _ in started] == ["a"]


def test_gpu_slots():
    assert zoo.gpu_slots(1, "3") == [None]
    assert zoo.gpu_slots(2, None) == ["0", "1"]
    assert zoo.gpu_slots(2, "2,3,5") == ["2", "3"]
    try:
        zoo.gpu_slots(2, "1")
    except ValueError as exc:
        assert "--gpus 2" in str(exc)
    else:
        raise AssertionError("two slots from one visible GPU")


def test_variant_names():
    assert zoo.split_variant("bert_base@sdpa") == ("bert_base", "sdpa")
    assert zoo.split_variant("resnet50") == ("resnet50", None)
    assert zoo.variant_problem("bert_base@sdpa") is None and zoo.variant_problem("resnet50") is None
    assert "unknown model" in zoo.variant_problem("resnet5")
    assert "@sdpa needs" in zoo.variant_problem("resnet50@sdpa")
    assert "@flash needs" in zoo.variant_problem("bert_base@flash")
    args = zoo.parse_args(["--models", "bert_base@eager,bert_base@sdpa", "--gpus", "2"])
    assert args.models == ["bert_base@eager", "bert_base@sdpa"] and args.gpus == 2


def test_resume_reruns_only_what_the_deadline_or_a_crash_cut(tmp_path):
    def part(name, timings, errors):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"model": name, "info": {}, "timings": timings, "errors": errors}))
        return path

    cell = [{"variant": "ort", "batch": 1}]
    assert zoo.complete_part(part("done", cell, []))
    refused = {"stage": "ort b1 graph=True", "error": "SessionRefused: cannot use the graph capture feature"}
    assert zoo.complete_part(part("refused", cell, [refused]))  # fails again on a rerun: kept
    assert not zoo.complete_part(part("cut", cell, [{"stage": "fp16", "error": "skipped: deadline reached"}]))
    assert not zoo.complete_part(part("killed", cell, [{"stage": "run", "error": "child process ended: timeout"}]))
    assert not zoo.complete_part(part("skipped", [], [{"stage": "run", "error": "skipped: deadline"}]))
    assert not zoo.complete_part(part("empty", [], []))
    assert not zoo.complete_part(tmp_path / "missing.json")
    (tmp_path / "torn.json").write_text('{"model": ')
    assert not zoo.complete_part(tmp_path / "torn.json")


def test_the_bf16_cells_get_their_columns_against_fp32_and_half():
    def cell(variant, ms, batch=1, graph=False):
        return {"variant": variant, "batch": batch, "cuda_graph": graph, "status": "ok",
                "latency_ms": {"median_ms": ms}}

    timings = [cell("ort-original", 4.0), cell("ort-optimized", 2.0), cell("ort-fp16-original", 3.0),
               cell("ort-fp16-optimized", 1.0), cell("ort-fp16-precision", 1.2),
               cell("ort-fp16-precision-bf16", 1.6)]
    text = zoo.markdown({"config": {}, "env": {}, "models": {"bert_base@eager": {"timings": timings, "info": {}}}})
    header = next(line for line in text.splitlines() if "--precision bf16 |" in line)
    row = next(line for line in text.splitlines() if line.startswith("| bert_base@eager | 1 | no | 2.00×"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert header.count("|") == row.count("|")
    assert cells[-2:] == ["2.50×", "1.600"]  # 4.0 / 1.6 over the fp32 original; 1.6 / 1.0 over half() optimized
    args = zoo.parse_args(["--models", "bert_base@eager", "--bf16"])
    assert args.bf16
    # with --right-padded, bf16 under the promise gets its own two columns: 4.0 / 0.8, and 0.8 / 1.0
    timings.append(cell("ort-fp16-precision-bf16-right-padded", 0.8))
    text = zoo.markdown({"config": {}, "env": {}, "models": {"bert_base@eager": {"timings": timings, "info": {}}}})
    header = next(line for line in text.splitlines() if "bf16 --right-padded |" in line)
    row = next(line for line in text.splitlines() if line.startswith("| bert_base@eager | 1 | no | 2.00×"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert header.count("|") == row.count("|")
    assert cells[-4:] == ["2.50×", "1.600", "5.00×", "0.800"]


def test_the_first_size_choice_gets_its_table_with_the_ratio_to_the_default_output():
    """zoo --first-size-choice: the output decided at the first size alone, timed beside the default one,
    gets its own table; the ratio is its median over the default output's (above 1: the default, decided
    at every batch, is faster), fp32 and fp16 each where timed."""
    def cell(variant, ms, batch=16):
        return {"variant": variant, "batch": batch, "cuda_graph": False, "status": "ok",
                "latency_ms": {"median_ms": ms}}

    timings = [cell("ort-original", 8.0), cell("ort-optimized", 5.0), cell("ort-first-size", 6.0),
               cell("ort-fp16-original", 6.0), cell("ort-fp16-optimized", 3.0)]
    text = zoo.markdown({"config": {}, "env": {}, "models": {"yolo_silu": {"timings": timings, "info": {}}}})
    lines = text.splitlines()
    start = lines.index("## Against the first size's choice")
    header = next(line for line in lines[start:] if line.startswith("| model |"))
    row = next(line for line in lines[start:] if line.startswith("| yolo_silu | 16 |"))
    assert header.count("|") == row.count("|")
    assert [c.strip() for c in row.strip("|").split("|")][3:] == ["5.000", "6.000", "1.20", "3.000", "–", "–"]
    assert zoo.parse_args(["--models", "yolo_silu", "--first-size-choice"]).first_size_choice
    timings = [t for t in timings if t["variant"] != "ort-first-size"]
    text = zoo.markdown({"config": {}, "env": {}, "models": {"yolo_silu": {"timings": timings, "info": {}}}})
    assert "## Against the first size's choice" not in text


def test_the_never_slower_table_counts_every_configured_cell():
    """Issue 32's grid: each configured cell is measured (both models timed: the ratio), optimized only
    (the original could not be timed there) or not measured; the lowest ratio names its cell; the
    optimize calls' seconds are the tuning time."""
    def cell(variant, ms, batch, graph=False, status="ok"):
        return {"variant": variant, "batch": batch, "cuda_graph": graph, "status": status,
                "latency_ms": {"median_ms": ms}}

    timings = [cell("ort-original", 4.0, 1), cell("ort-optimized", 2.0, 1),
               cell("ort-original", 9.0, 16), cell("ort-optimized", 6.0, 16),
               cell("ort-optimized", 1.0, 1, graph=True),  # original not capturable
               cell("ort-fp16-original", 3.0, 1), cell("ort-fp16-optimized", 1.5, 1),
               cell("ort-fp16-original", 5.0, 16, status="failed"), cell("ort-fp16-optimized", 2.0, 16)]
    results = {"config": {"batches": [1, 16], "graph_modes": [False, True], "fp16_batches": [1, 16],
                          "fp16_graph_modes": [False], "fp16": True},
               "models": {"resnet50": {"timings": timings,
                                       "info": {"optimize": {"seconds": 38.2}, "optimize_fp16": {"seconds": 40.0}}}}}
    (row,) = zoo.never_slower_rows(results)
    assert row["measured"] == 3 and row["lowest_cell"] == "b16" and abs(row["lowest"] - 1.5) < 1e-12
    assert row["optimized_only"] == ["b1 graph", "fp16 b16"]  # the failed fp16 original counts as not timed
    assert row["missing"] == ["b16 graph"]
    assert row["optimize_s"] == [38.2, 40.0, None]
    text = zoo.markdown(results)
    line = next(x for x in text.splitlines() if x.startswith("| resnet50 | 3 |"))
    assert "1.50× (b16)" in line and line.endswith("| 38 / 40 / – |")
    assert "Lowest of the run: 1.50×." in text


def test_the_grid_can_leave_out_the_anchor_and_the_precision_cells():
    """Issue 32's grid on fewer GPUs: --no-anchors and --no-precision-cells reach the child (they are not
    --models) and default on."""
    args = zoo.parse_args(["--models", "bert_base@sdpa", "--no-anchors", "--no-precision-cells"])
    assert not args.anchors and not args.precision_cells
    defaults = zoo.parse_args(["--models", "resnet50"])
    assert defaults.anchors and defaults.precision_cells
    assert zoo._forward(["--models", "resnet50", "--no-anchors", "--no-precision-cells"]) == [
        "--no-anchors", "--no-precision-cells"]
