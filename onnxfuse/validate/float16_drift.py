"""Which nodes of a float32 model must stay float32 for its float16 form to stay within the drift budget
(``--precision fp16`` / ``fp16-io`` with the budget of ``--max-drift``, or its default; issue 33 item 2).

Why: :mod:`onnxfuse.validate.float16_range` keeps the nodes whose values float16 cannot hold. A value
float16 does hold can still lose what the model needs: ``(x + 1000) - 1000`` rounds ``x + 1000`` to
float16's step of 0.5 there, and hands on ``x`` with an error of up to 0.25 (a planted test drifts 8% of
its output's scale, cosine 0.997, against the default budget's 2% and 0.999). ONNX Runtime's automatic
mixed precision and Polygraphy's precision fallbacks find such nodes by running the model; so does this,
and only when the float16 form (with the range islands) breaks the budget: a model within it is left as
converted, so the default costs one run of the converted model.

The search: the candidate nodes (main graph, ONNX domain, named, no subgraph, writing a float32 value) in
the graph's order, which ONNX keeps topological. Converting a prefix of them and keeping the rest float32
drifts more as the prefix grows (more float16 rounding), so a bisection finds the shortest prefix that
breaks the budget; its last node is the one whose float16 result breaks it, given the float16 results
before it. That node stays float32, and the search repeats on the conversion with it kept, until the
budget holds or :data:`MAX_NODES` are kept. Keeping a node keeps its float32 inputs' readers' values in
float32 too where both are kept (:func:`onnxfuse.precision.convert_to_fp16`), which is why the planted
chain needs its Add and its Sub: either alone still rounds ``x + 1000`` on the way between them. Cost: a
run of the converted model per bisection step, about ``log2(candidates)`` per kept node.

How a trial is run: on CUDA as converted (its kernels round each float16 result, as ONNX specifies); on
the CPU through :func:`onnxfuse.validate.onnx_semantics.per_op_rounding`, because ONNX Runtime's CPU
provider computes chains of float16 ops in float32 and rounds once, which hides exactly the rounding this
search is for (a model with subgraphs, which that rewrite does not take, runs as converted); a bfloat16
trial likewise, which is also the only way the CPU provider runs one (it lacks most bfloat16 kernels).
"""

from __future__ import annotations

from typing import Callable

import onnx

from onnxfuse.errors import PrecisionError
from onnxfuse.lazy_weights import tensor_nbytes
from onnxfuse.model_io import node_subgraphs
from onnxfuse.precision import FLOAT16, LowFloat, convert_to_fp16, float32_values
from onnxfuse.runtime.session import resolve_provider
from onnxfuse.validate import conversion_drift
from onnxfuse.validate.drift_budget import Drift, DriftBudget
from onnxfuse.validate.precision_judge import rounded_drift

#: Models with more weights than this get no search (a note says so): each trial converts and runs the whole
#: model, and on the CPU the per-op rounding run of a 1 GiB model takes minutes. The range islands and the
#: judge apply to every model as before.
MAX_SEARCH_WEIGHT_BYTES = 1 << 30

#: The most nodes kept float32 for the budget: each costs a bisection, and a model needing more is better
#: left to the user's judgement (none is then kept, and the validation judges the plain conversion).
MAX_NODES = 8


def within_budget(drift: dict[str, Drift], budget: DriftBudget) -> bool:
    """Whether every float output's drift is within ``budget`` (False when the run gave no figures)."""
    return bool(drift) and all(budget.admits(d) for d in drift.values())


def candidates(model: onnx.ModelProto) -> list[str]:
    """The nodes the converter can keep float32 (by name: main graph, ONNX domain, no subgraph) that write
    a float32 value, in graph order."""
    floats = float32_values(model)
    return [n.name for n in model.graph.node
            if n.name and (n.domain or "") in ("", "ai.onnx") and not node_subgraphs(n)
            and any(o in floats for o in n.output)]


class DriftTrials:
    """The drift of ``model`` converted to float16 with given nodes kept float32, against the float32
    original's ``reference`` on ``samples`` (module docstring: how a trial runs)."""

    def __init__(self, model: onnx.ModelProto, samples: list, reference: list[dict], provider: str = "auto",
                 float16_io: bool = False, name: str = "model", target: LowFloat = FLOAT16):
        self.model, self.samples, self.reference, self.target = model, samples, reference, target
        self.provider, self.float16_io, self.name = resolve_provider(provider), float16_io, name
        self.count = 0
        self.per_op = False  # whether the last trial ran rounded per op (the CPU)

    def drift(self, keep: dict[str, str]) -> dict[str, Drift]:
        """Per float output, its drift with ``keep`` float32; {} when the converted model does not run."""
        self.count += 1
        try:
            converted, _ = convert_to_fp16(self.model, keep_nodes=keep, float16_io=self.float16_io, target=self.target)
        except PrecisionError:  # this set of kept nodes does not convert: no figures, so it counts as beyond
            return {}
        name = f"{self.name} ({self.target.name} drift search)"
        rounded = (rounded_drift(converted, self.samples, self.reference, name, self.target.elem)
                   if self.provider == "cpu" else None)
        self.per_op = rounded is not None
        return rounded if rounded is not None else conversion_drift(converted, self.samples, self.reference,
                                                                    self.provider, name=name)


def _worst(drift: dict[str, Drift]) -> tuple[str, Drift] | None:
    return max(drift.items(), key=lambda item: item[1].error, default=None)


def drift_islands(model: onnx.ModelProto, keep: dict[str, str], samples: list, reference: list[dict],
                  budget: DriftBudget, provider: str = "auto", float16_io: bool = False, name: str = "model",
                  max_nodes: int = MAX_NODES, rounded: dict | None = None,
                  target: LowFloat = FLOAT16,
                  progress: Callable[[str], None] | None = None) -> tuple[dict[str, str], list[str]]:
    """``({node name: why}, notes)``: the nodes besides ``keep`` (the range islands) that stay float32 so
    that ``model``'s float16 form drifts within ``budget``, found as the module docstring says; ({}, [])
    when the conversion is within it already. When :data:`MAX_NODES` kept float32 still leave it beyond the
    budget, none is kept (they would cost time and buy nothing the judge asks for) and a note says so: the
    validation then judges the plain conversion as before.

    ``rounded``: a dict that receives, under ``"drift"``, each output's drift of the conversion kept as
    returned, rounded per op, when the trials ran so (the CPU): the judge's rounded yardstick
    (:class:`~onnxfuse.validate.drift_budget.PrecisionJudge`), measured once. ``target``: the type the
    model is converted to (``--precision bf16``: bfloat16, whose trials run on CUDA as converted).
    ``progress``: told when a search starts (how many candidates) and each node it keeps, the run count so
    far with it: a search costs a run of the converted model per bisection step (128 s on a GPT-2 small in
    bfloat16, docs/benchmarks.md 5.51), which a user should see moving."""
    say = progress or (lambda _message: None)
    flag = f"--precision {target.short}"
    weights = sum(tensor_nbytes(t) for t in model.graph.initializer)
    if weights > MAX_SEARCH_WEIGHT_BYTES:
        return {}, [f"{flag}: no search for nodes whose {target.name} results break the drift budget: the model "
                    f"holds {weights / 2 ** 30:.1f} GiB of weights (the search converts and runs it per step; "
                    f"the limit is {MAX_SEARCH_WEIGHT_BYTES / 2 ** 30:g} GiB)"]
    trials = DriftTrials(model, samples, reference, provider, float16_io, name, target)
    current = trials.drift(dict(keep))
    if rounded is not None and trials.per_op and current:
        rounded["drift"] = current  # the conversion with ``keep`` alone: replaced below if nodes are kept
    if not current or within_budget(current, budget):
        return {}, []
    order = [n for n in candidates(model) if n not in keep]
    ops = {n.name: n.op_type for n in model.graph.node}
    say(f"{target.name} drift beyond the budget: searching {len(order)} candidate node(s), up to {max_nodes} kept")
    found: dict[str, str] = {}

    def breaks(prefix: int) -> bool:
        kept = {**keep, **{n: f"{target.name} drift search" for n in order[prefix:]}, **found}
        return not within_budget(trials.drift(kept), budget)

    lo = 0  # converting order[:lo] (the found ones kept) stays within the budget
    if breaks(lo):
        return {}, [f"{flag}: the drift is beyond the budget with every candidate node kept float32 "
                    f"(it comes from what no kept node changes: the inputs entering as {target.name}, or nodes of "
                    "other domains or "
                    "with subgraphs); none kept for it"]
    while len(found) < max_nodes and lo < len(order):
        hi = len(order)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if breaks(mid):
                hi = mid
            else:
                lo = mid
        culprit = order[hi - 1]
        if culprit in found:  # not monotone here (a float16 rounding that cancels another): stop searching
            break
        before = _worst(current)
        found[culprit] = f"{target.name} drift search"
        say(f"kept float32 for the drift budget: {culprit} ({ops[culprit]}), after {trials.count} runs")
        current = trials.drift({**keep, **found})
        after = _worst(current)
        found[culprit] = (f"{ops[culprit]}: its {target.name} result took {before[0]!r} beyond the drift budget "
                          f"(normalized error {before[1].error:.3g}, cosine {before[1].cosine:.6f}; "
                          + (f"{after[1].error:.3g}, {after[1].cosine:.6f} with it float32)" if after else
                             "the model without it did not run)"))
        if within_budget(current, budget):
            break
    if not within_budget(current, budget):  # float32 nodes that do not buy the budget would only cost time
        worst = _worst(current)
        figures = f"{worst[0]!r}: {worst[1].error:.3g}, {worst[1].cosine:.6f}" if worst else "the model did not run"
        return {}, [f"{flag}: the drift budget (normalized error {budget.error:g}, cosine {budget.cosine:g}) "
                    f"still failed with {len(found)} node(s) kept float32 ({figures}), so none is kept for it"]
    if rounded is not None and trials.per_op:
        rounded["drift"] = current
    # the nodes and why are in the converter's note (onnxfuse.precision); this one says what the search did
    return found, [f"{flag}: {len(found)} node(s) kept float32 for the drift budget (normalized error "
                   f"{budget.error:g}, cosine {budget.cosine:g}), found in {trials.count} runs of the converted model"]


__all__ = ["MAX_NODES", "MAX_SEARCH_WEIGHT_BYTES", "DriftTrials", "candidates", "drift_islands", "within_budget"]
