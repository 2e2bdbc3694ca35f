"""Float32 islands for the drift budget under ``--precision fp16`` (issue 33 item 2): a node whose float16
result is in range but loses what the output needs (a cancellation) is found by running the model,
kept float32 by name, and the output then drifts within the budget."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

import onnxfuse
from helpers import run_ort
from onnxfuse.precision import convert_to_fp16
from onnxfuse.runtime.session import run_samples
from onnxfuse.validate.drift_budget import DEFAULT_BUDGET, DriftBudget
from onnxfuse.validate.float16_drift import DriftTrials, candidates, drift_islands, within_budget


def cancelling_model(offset: float = 1000.0) -> onnx.ModelProto:
    """y = tanh(((x + offset) - offset) · 0.5) + z·0.1: in float16, x + 1000 is rounded to a step of 0.5 and
    the Sub hands on x with up to 0.25 of error; every value stays far inside float16's range."""
    nodes = [helper.make_node("Add", ["x", "c"], ["t"], name="add_offset"),
             helper.make_node("Sub", ["t", "c"], ["u"], name="remove_offset"),
             helper.make_node("Mul", ["u", "half"], ["v"], name="scale"),
             helper.make_node("Tanh", ["v"], ["w"], name="squash"),
             helper.make_node("Mul", ["z", "tenth"], ["zz"], name="scale_z"),
             helper.make_node("Add", ["w", "zz"], ["y"], name="combine")]
    f = onnx.TensorProto.FLOAT
    graph = helper.make_graph(
        nodes, "cancel", [helper.make_tensor_value_info("x", f, ["B", 64]), helper.make_tensor_value_info("z", f, ["B", 64])],
        [helper.make_tensor_value_info("y", f, ["B", 64])],
        initializer=[numpy_helper.from_array(np.array(offset, np.float32), "c"),
                     numpy_helper.from_array(np.array(0.5, np.float32), "half"),
                     numpy_helper.from_array(np.array(0.1, np.float32), "tenth")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _samples(n=2):
    rng = np.random.default_rng(0)
    return [{"x": rng.standard_normal((3, 64)).astype(np.float32),
             "z": rng.standard_normal((3, 64)).astype(np.float32)} for _ in range(n)]


def _reference(model, samples):
    return [run_ort(model, s) for s in samples]


def test_the_plain_conversion_breaks_the_default_budget():
    model, samples = cancelling_model(), _samples()
    drift = DriftTrials(model, samples, _reference(model, samples), "cpu").drift({})
    assert not within_budget(drift, DEFAULT_BUDGET)
    assert drift["y"].error > 0.03  # what float16 does to x + 1000 - 1000, not noise


def test_the_search_keeps_the_add_and_the_sub_by_name_and_the_budget_then_holds():
    model, samples = cancelling_model(), _samples()
    reference = _reference(model, samples)
    found, notes = drift_islands(model, {}, samples, reference, DEFAULT_BUDGET, "cpu")
    assert set(found) == {"add_offset", "remove_offset"}, found
    assert found["add_offset"].startswith("Add: its float16 result took 'y' beyond the drift budget")
    assert "2 node(s) kept float32 for the drift budget" in notes[0] and len(notes) == 1
    kept = DriftTrials(model, samples, reference, "cpu").drift(found)
    assert within_budget(kept, DEFAULT_BUDGET) and kept["y"].error < 5e-3
    # the island computes in float32 between its Add and its Sub: no Cast to float16 between them
    converted, _ = convert_to_fp16(model, keep_nodes=found)
    producers = {o: n for n in converted.graph.node for o in n.output}
    sub = next(n for n in converted.graph.node if n.name == "remove_offset")
    assert producers[sub.input[0]].name == "add_offset"


def test_either_node_alone_is_not_enough():
    # why the search repeats: keeping one of the two still rounds x + 1000 between them
    model, samples = cancelling_model(), _samples()
    trials = DriftTrials(model, samples, _reference(model, samples), "cpu")
    for one in ("add_offset", "remove_offset"):
        assert not within_budget(trials.drift({one: "test"}), DEFAULT_BUDGET)


def test_a_model_within_the_budget_costs_one_run_and_keeps_nothing():
    model, samples = cancelling_model(offset=1.0), _samples()  # x + 1 - 1: float16 keeps x to 1e-3
    found, notes = drift_islands(model, {}, samples, _reference(model, samples), DEFAULT_BUDGET, "cpu")
    assert found == {} and notes == []


def test_max_nodes_stops_the_search_and_keeps_nothing_that_does_not_buy_the_budget():
    model, samples = cancelling_model(), _samples()
    found, notes = drift_islands(model, {}, samples, _reference(model, samples), DEFAULT_BUDGET, "cpu", max_nodes=1)
    assert found == {} and "still failed with 1 node(s) kept float32" in notes[-1] and "'y'" in notes[-1]


def test_a_budget_no_island_can_meet_keeps_nothing_and_says_why():
    # 1e-9: even with every node float32 the inputs enter as float16, so keeping nodes cannot help
    model, samples = cancelling_model(offset=1.0), _samples()
    found, notes = drift_islands(model, {}, samples, _reference(model, samples), DriftBudget(1e-9, 1.0), "cpu")
    assert found == {} and "with every candidate node kept float32" in notes[0]


def test_a_model_over_the_weight_limit_is_not_searched_and_says_so(monkeypatch):
    import onnxfuse.validate.float16_drift as float16_drift

    monkeypatch.setattr(float16_drift, "MAX_SEARCH_WEIGHT_BYTES", 4)  # the planted model holds 12 bytes
    model, samples = cancelling_model(), _samples()
    found, notes = drift_islands(model, {}, samples, _reference(model, samples), DEFAULT_BUDGET, "cpu")
    assert found == {} and "no search" in notes[0] and "GiB of weights" in notes[0]


def test_a_keep_set_that_does_not_convert_counts_as_beyond_the_budget(monkeypatch):
    import onnxfuse.validate.float16_drift as float16_drift
    from onnxfuse.errors import PrecisionError

    def refuse(*args, **kwargs):
        raise PrecisionError("planted")

    monkeypatch.setattr(float16_drift, "convert_to_fp16", refuse)
    model, samples = cancelling_model(), _samples()
    assert DriftTrials(model, samples, _reference(model, samples), "cpu").drift({}) == {}


def test_candidates_are_the_named_float_nodes_in_order():
    model = cancelling_model()
    assert candidates(model) == ["add_offset", "remove_offset", "scale", "squash", "scale_z", "combine"]


def test_optimize_keeps_the_island_reports_it_and_validates():
    model = cancelling_model()
    result = onnxfuse.optimize(model, provider="cpu", precision="fp16", samples=2)
    assert result.validation.passed, result.validation
    kept = result.extra["precision"]["float32_nodes"]
    assert {"add_offset", "remove_offset"} <= set(kept), kept
    assert any("kept float32 for the drift budget" in n for n in result.validation.notes)
    # and the output is within the budget of the float32 original on fresh inputs
    feeds = {"x": np.random.default_rng(7).standard_normal((5, 64)).astype(np.float32),
             "z": np.random.default_rng(8).standard_normal((5, 64)).astype(np.float32)}
    want, got = run_ort(model, feeds)["y"], run_samples(result.model, [feeds], "cpu")[0]["y"]
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-2


def test_a_real_export_meets_a_budget_tighter_than_its_plain_conversion():
    # BERT tiny (transformers' legacy export): converted to float16 it drifts 1.9e-3 of its output's scale
    # on the validation inputs; a budget of 1.2e-3 keeps a few of its second layer's residual and LayerNorm
    # steps float32, and the rewritten output then meets it
    from helpers import load_testdata

    result = onnxfuse.optimize(load_testdata("bert_tiny_opset14"), provider="cpu", precision="fp16",
                               max_drift=1.2e-3)
    assert result.validation.passed, result.validation
    kept = result.extra["precision"]["float32_nodes"]
    drift_kept = [n for n, why in kept.items() if "beyond the drift budget" in why]
    assert 1 <= len(drift_kept) <= 8, kept
    errors = {o.name: o.extra.get("drift_error") for o in result.validation.outputs}
    assert errors and all(e is not None and e <= 1.2e-3 for e in errors.values()), errors


def test_the_budget_passes_what_is_no_worse_than_the_conversion_rounded_per_op():
    # BERT-base's figures on the CPU (docs/benchmarks.md 5.45): 1.83e-3 against the conversion's CPU run 4.9e-4
    # (3.7x) and the conversion rounded per op 3.19e-3; the planted GELU bug: 1.57e-3 against the conversion's
    # CPU run 1.6e-5 (96x) and at most 7.5e-4 rounded per op
    from onnxfuse.validate.drift_budget import Drift, PrecisionJudge

    judge = PrecisionJudge("float16", DEFAULT_BUDGET, multiple=3.0)
    bert, bert_cpu, bert_rounded = Drift(1.0, 1.83e-3, 0.999999), Drift(1.0, 4.9e-4, 1.0), Drift(1.0, 3.19e-3, 0.999998)
    assert not judge.within(bert, bert_cpu) and judge.within(bert, bert_cpu, bert_rounded)
    gelu, gelu_cpu, gelu_rounded = Drift(1.0, 1.57e-3, 0.999999), Drift(1.0, 1.6e-5, 1.0), Drift(1.0, 7.5e-4, 1.0)
    assert not judge.within(gelu, gelu_cpu, gelu_rounded)
    # the arm never passes beyond the budget itself, nor with a worse cosine
    assert not judge.within(Drift(1.0, 3e-2, 1.0), bert_cpu, Drift(1.0, 5e-2, 0.99))
    assert not judge.within(Drift(1.0, 2e-3, 0.9999985), bert_cpu, Drift(1.0, 3e-3, 0.999999))
    assert not PrecisionJudge("float16", None).within(bert, bert_cpu, bert_rounded)  # --strict: no budget


def test_the_search_says_when_it_starts_and_each_node_it_keeps():
    model, samples = cancelling_model(), _samples()
    said: list[str] = []
    found, _ = drift_islands(model, {}, samples, _reference(model, samples), DEFAULT_BUDGET, "cpu", progress=said.append)
    assert said[0].startswith("float16 drift beyond the budget: searching ") and "up to 8 kept" in said[0]
    kept = [m for m in said[1:] if m.startswith("kept float32 for the drift budget: ")]
    assert len(kept) == len(found) == len(said) - 1
    assert {m.split(": ", 1)[1].split(" (")[0] for m in kept} == set(found)


# ---- bfloat16 (--precision bf16): its own default budget, and its trials on the CPU rounded per op


def test_the_default_budget_is_the_target_types():
    from onnxfuse.pipeline import OptimizeOptions
    from onnxfuse.validate.drift_budget import BFLOAT16_BUDGET
    from onnxfuse.validate.precision_judge import drift_budget_of

    assert drift_budget_of(OptimizeOptions(precision="fp16")) == DEFAULT_BUDGET == DriftBudget(2e-2, 0.999)
    assert drift_budget_of(OptimizeOptions(precision="fp16-io")) == DEFAULT_BUDGET
    assert drift_budget_of(OptimizeOptions(precision="bf16")) == BFLOAT16_BUDGET == DriftBudget(0.16, 0.999)
    assert drift_budget_of(OptimizeOptions(precision="bf16", strict=True)) is None
    given = DriftBudget(1e-2, 0.9999)
    assert drift_budget_of(OptimizeOptions(precision="bf16", max_drift=given)) == given


def _bf16(values) -> np.ndarray:
    """float32 values rounded to bfloat16, to nearest even, back in float32 (ml_dtypes: independent of
    onnxfuse's bit arithmetic and of ONNX Runtime)."""
    import ml_dtypes

    return np.asarray(values, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def test_a_bfloat16_trial_on_the_cpu_rounds_every_result_as_bfloat16():
    # the planted model step by step in numpy, each result rounded to bfloat16, against the trial's run
    from onnxfuse.precision import BFLOAT16
    from onnxfuse.validate.onnx_semantics import per_op_rounding

    model, samples = cancelling_model(), _samples(1)
    converted, _ = convert_to_fp16(model, target=BFLOAT16)
    got = run_samples(per_op_rounding(converted, onnx.TensorProto.BFLOAT16), samples, "cpu")[0]["y"]
    x, z = _bf16(samples[0]["x"]), _bf16(samples[0]["z"])
    c, half, tenth = _bf16(1000.0), _bf16(0.5), _bf16(0.1)
    w = _bf16(np.tanh(_bf16(_bf16(_bf16(x + c) - c) * half)))
    want = _bf16(w + _bf16(z * tenth))
    # tanh in float32 may differ from ONNX Runtime's by a float32 ulp, which can move a bfloat16 rounding
    # by one bfloat16 step (2^-8 relative at most): everything else is exact
    assert np.mean(got == want) > 0.95
    assert np.all(np.abs(got - want) <= np.abs(want) * 2.0 ** -7 + 1e-30)
    # bfloat16's step at 1000 is 4: the Sub hands x on with errors far beyond float16's 0.25
    assert np.abs(_bf16(_bf16(x + c) - c) - x).max() > 0.5


def test_the_search_keeps_the_planted_sum_float32_in_bfloat16_too():
    from onnxfuse.precision import BFLOAT16
    from onnxfuse.validate.drift_budget import BFLOAT16_BUDGET

    model, samples = cancelling_model(), _samples()
    reference = _reference(model, samples)
    trials = DriftTrials(model, samples, reference, "cpu", target=BFLOAT16)
    plain = trials.drift({})
    assert not within_budget(plain, BFLOAT16_BUDGET) and plain["y"].error > 0.3, plain
    found, notes = drift_islands(model, {}, samples, reference, BFLOAT16_BUDGET, "cpu", target=BFLOAT16)
    assert set(found) == {"add_offset", "remove_offset"}, found
    assert found["add_offset"].startswith("Add: its bfloat16 result took 'y' beyond the drift budget")
    kept = trials.drift(found)
    assert within_budget(kept, BFLOAT16_BUDGET) and kept["y"].error < 3e-2, kept
    # x + 16 - 16 rounds x to bfloat16's step at 16 (1/8): ordinary bfloat16 rounding, 3.5e-2 of the output's
    # scale, which float16's budget would send the search after and bfloat16's takes
    gentle = cancelling_model(offset=16.0)
    drift = DriftTrials(gentle, samples, _reference(gentle, samples), "cpu", target=BFLOAT16).drift({})
    assert within_budget(drift, BFLOAT16_BUDGET) and not within_budget(drift, DEFAULT_BUDGET), drift
