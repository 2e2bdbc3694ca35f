"""A Concat of a Split's parts, in order, concatenates what was split: ``Concat(…, Split(x)[0], …,
Split(x)[k-1], …)`` along the Split's axis becomes ``Concat(…, x, …)``; a part nobody else reads is then
not written at all (the Split becomes one ``Slice`` per part still read). The same for consecutive
``Slice``s of ``x`` that tile its axis from start to end (how some exports write ``chunk``).

Why
---
CSP blocks, YOLOv5's C3 and YOLOv8's C2f (``y = cv1(x).chunk(2, 1); cat(y + [m(y[-1])], 1)``), split a
tensor along channels and concatenate its parts again beside new ones. The Concat then copies each part
on its own, and the Split writes a part that only the Concat reads. In channels-last layout both are
copies along the innermost axis: the YOLO-style detector at batch 16, fp32, on an H200 spends 0.48 ms
in Concat and 0.27 ms in Split of 5.14 ms of kernels (docs/benchmarks.md 5.27). With the rule the Concat
reads the split tensor once, as one part, and the Split's first half is never written.

What (exact)
------------
Pure data movement: the parts of ``Split(x, axis)`` in order are ``x`` cut along ``axis``, and a Concat
along the same axis glues them back, so a run of them in the Concat's inputs, every part once and in
order, is ``x``. After that rewrite, a Split whose parts are read only in part (no reader left for some,
none a graph output) becomes a ``Slice`` per part still read, with the part's bounds, when those are
known: a constant ``split`` (input or, before opset 13, attribute), or an axis of known length split
evenly (``num_outputs`` at opset 18 included, its last part the remainder). A run of Slices (constant
starts, ends and one axis, step 1) tiles the axis when the first starts at 0, each starts where the
previous ended, and the last ends at the axis's known length or beyond (ONNX clamps); a Slice left
unread is dropped by cleanup.

Refused: a Concat and a Split over different axes (negative axes counted from the rank, which must then
be known), a run that misses a part, repeats one or changes their order (nothing to do).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_graphsurgeon as gs

from onnxfuse.rewrites.engine.edit import new_constant, unique_name
from onnxfuse.rewrites.engine.rule import TARGETS, Plan, Refuse, Rule
from onnxfuse.rewrites.facts.graph import constant_value, is_graph_output, is_op, opset_of, producer_of, rank_of, slice_bounds
from onnxfuse.rewrites.facts.shape_values import axis_length


def _axis(graph, node, tensor) -> int | None:
    """``node``'s axis attribute as a non-negative axis of ``tensor`` (None when negative and the rank
    is unknown)."""
    return _nonnegative(graph, int(node.attrs.get("axis", 0)), tensor)


def _nonnegative(graph, axis: int, tensor) -> int | None:
    if axis >= 0:
        return axis
    rank = rank_of(graph, tensor)
    return None if rank is None else axis + rank


def _static_length(graph, tensor, axis: int) -> int | None:
    """``tensor``'s length along ``axis`` when proved to be a number (:func:`axis_length`)."""
    length = axis_length(graph, tensor, axis)
    return int(length) if isinstance(length, (int, np.integer)) else None


def _slice_part(graph, tensor) -> tuple[Any, int, int, int] | None:
    """(source, axis, start, end) when ``tensor`` is a step-1 ``Slice`` of one axis with constant bounds
    (negative axis and start resolved against the source's known rank and length); else None."""
    node = producer_of(tensor)
    if not is_op(node, "Slice") or len(node.inputs) < 4 or node.inputs[3].is_empty():  # axes given
        return None
    bounds = slice_bounds(graph, node)
    if bounds is None or any(len(b) != 1 for b in bounds) or bounds[3][0] != 1:
        return None
    (start,), (end,), (axis,), _ = bounds
    axis = _nonnegative(graph, axis, node.inputs[0])
    if axis is None or start < 0:
        return None
    return node.inputs[0], axis, start, end


def _slice_run(graph, inputs, i: int, axis: int) -> int:
    """How many inputs from ``i`` on are Slices tiling one source's ``axis`` from 0 to its end (0: none)."""
    first = _slice_part(graph, inputs[i])
    if first is None or first[1] != axis or first[2] != 0:
        return 0
    source, _, _, end = first
    length = _static_length(graph, source, axis)
    count = 1
    while True:
        if end >= (length if length is not None else 2**31 - 1):
            return count if count > 1 else 0
        if i + count >= len(inputs):
            return 0
        part = _slice_part(graph, inputs[i + count])
        if part is None or part[0] is not source or part[1] != axis or part[2] != end:
            return 0
        end = part[3]
        count += 1


def _whole_runs(graph, concat) -> list[tuple[int, int, Any, gs.Node | None]]:
    """(first input index, inputs in the run, the tensor they tile, its Split or None for Slices) for every
    run of Concat inputs that is a whole Split in order, or Slices tiling one tensor, along the Concat's
    axis."""
    runs, i, inputs = [], 0, concat.inputs
    concat_axis = _axis(graph, concat, concat.outputs[0])
    while i < len(inputs):
        sliced = 0 if concat_axis is None else _slice_run(graph, inputs, i, concat_axis)
        if sliced:
            runs.append((i, sliced, _slice_part(graph, inputs[i])[0], None))
            i += sliced
            continue
        split = producer_of(inputs[i])
        count = len(split.outputs) if is_op(split, "Split") else 0
        if count > 1 and inputs[i] is split.outputs[0] and i + count <= len(inputs) and all(
                inputs[i + k] is split.outputs[k] for k in range(count)):
            axis = _axis(graph, split, split.inputs[0])
            if axis is not None and axis == concat_axis:
                runs.append((i, count, split.inputs[0], split))
                i += count
                continue
        i += 1
    return runs


def _part_bounds(graph, split) -> list[tuple[int, int]] | None:
    """[start, end) of each part of ``split`` along its axis, or None when they are not known."""
    count = len(split.outputs)
    sizes = None
    if len(split.inputs) > 1 and split.inputs[1].name:
        value = constant_value(graph, split.inputs[1])
        sizes = None if value is None else [int(v) for v in value.reshape(-1)]
    elif "split" in split.attrs:
        sizes = [int(v) for v in split.attrs["split"]]
    else:
        axis = _axis(graph, split, split.inputs[0])
        length = None if axis is None else _static_length(graph, split.inputs[0], axis)
        if length is None:
            return None
        step = -(-length // count)  # ONNX: equal parts, the last one the remainder
        sizes = [min(step, max(0, length - k * step)) for k in range(count)]
    if sizes is None or len(sizes) != count:
        return None
    ends = np.cumsum(sizes).tolist()
    return [(int(e - s), int(e)) for s, e in zip(sizes, ends)]


class ConcatSplitParts(Rule):
    """Concat(…, Split(x) parts in order, …) → Concat(…, x, …); the parts left unread not written."""

    name = "concat-split-parts"
    description = ("a Concat of a Split's parts in order reads the split tensor itself; parts nobody reads "
                   "are not written (CSP blocks: YOLOv5's C3, YOLOv8's C2f)")
    targets = frozenset(TARGETS)

    def match(self, graph):
        for node in graph.nodes:  # only Concats reading a Split or a Slice: the others are not candidates
            if is_op(node, "Concat") and len(node.inputs) > 1 and any(
                    is_op(producer_of(t), "Split") or is_op(producer_of(t), "Slice") for t in node.inputs):
                yield node

    def check(self, graph, concat):
        runs = _whole_runs(graph, concat)
        if not runs:
            return Refuse("no Split's parts (or Slices tiling a tensor), all and in order, along the Concat's axis")
        return Plan(concat, runs)

    def rewrite(self, graph, plan: Plan) -> dict[str, Any]:
        concat, runs = plan.anchor, plan.found
        inputs = list(concat.inputs)
        for first, count, whole, _ in reversed(runs):  # from the back: earlier indices stay valid
            inputs[first:first + count] = [whole]
        concat.inputs.clear()  # graphsurgeon's synchronized list: no slice assignment
        concat.inputs.extend(inputs)
        sliced = sum(self._slice_read_parts(graph, split) for *_, split in runs if split is not None)
        return {"node": concat.name, "runs": len(runs), "parts_sliced": sliced}

    @staticmethod
    def _slice_read_parts(graph, split) -> int:
        """Replace ``split`` by a Slice per part still read when another part is no longer read; the
        number of Slices written (0: the Split stays)."""
        read = [bool(t.outputs) or is_graph_output(graph, t) for t in split.outputs]
        if all(read) or opset_of(graph) < 10:
            return 0
        bounds = _part_bounds(graph, split)
        if bounds is None:
            return 0
        axis = _axis(graph, split, split.inputs[0])
        source, parts = split.inputs[0], list(split.outputs)
        base = split.name or parts[0].name
        split.inputs.clear()
        split.outputs.clear()  # before the Slices take its parts as their outputs
        axes = new_constant(graph, f"{base}/axes", np.array([axis], np.int64))
        written = 0
        for part, (start, end), is_read in zip(parts, bounds, read):
            if not is_read:
                continue
            graph.nodes.append(gs.Node("Slice", unique_name(graph, f"{base}/part"), inputs=[
                source, new_constant(graph, f"{base}/start", np.array([start], np.int64)),
                new_constant(graph, f"{base}/end", np.array([end], np.int64)), axes], outputs=[part]))
            written += 1
        return written
