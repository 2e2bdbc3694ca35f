"""An elementwise op reading a nearest ``Resize`` by whole factors reads the Resize's input instead, by
broadcasting in a finer view (target ``cuda``).

Why: a feature pyramid's top-down path adds an upsampled coarse map to a lateral one,
``Add(lateral, Resize(coarse, ×2, nearest))`` (the DB text detector, RetinaNet-style FPNs). ONNX Runtime
writes the whole upsampled map, then reads it again for the Add: at batch 16 the DB detector's six
nearest Resizes took 0.86 ms and its three FPN Adds 0.39 ms of the optimized model's 11.6 ms of kernels
(ncu, H200, docs/benchmarks.md 5.69). Read in place, the coarse map costs a quarter of a full read and
the upsampled copy is never written.

The maths (exact): with o = k·s + r (0 <= r < s), such a Resize's output element o along an axis is the
input element k (:func:`~onnxfuse.rewrites.facts.resize.nearest_upsample_factors` says when). So viewing
each upsampled axis of length L = l·s as two axes (l, s), the upsampled map is the input viewed as
(l, 1) broadcast along the new axis of s. The rule views the op's operands that way, computes the op on
the view, and views its result back:

    E(a, Resize(b))  =  Reshape(E(Reshape(a, [.., l, s, ..]), Reshape(b, [.., l, 1, ..])), [.., L, ..])

Reshapes only relabel a contiguous tensor (ONNX Runtime runs them without a copy), and an elementwise op
computes each element from the operands' elements at its broadcast index, which the view keeps: the same
values, bit for bit. Other operands: a tensor of the op's output shape is viewed like ``a``; a constant is
reshaped into the view (1 stays 1 along an upsampled axis, a full length L becomes (l, s)); one element
broadcasts as it is. An operand of the output's shape written by another elementwise op that only this
region reads (a bias Add that conv-bias-into-elementwise lifted out of a Conv) is computed on the view
too, so the Reshape lands on the Conv's output and fuse-elementwise still makes one kernel of the whole
chain.

The dimensions before the first upsampled axis are copied by the Reshapes (target 0), so each operand
keeps its own there and the op broadcasts them as before (a dynamic batch stays dynamic). Refused: a
Resize that is not such an upsample (modes, lengths: see the facts module); an op the elementwise
language does not take; a dimension from the first upsampled axis on that is not a static size, or an
upsampled map or operand whose sizes there are not the output's; an operand that is none of the above;
an op whose other operands are all coarse or one element (``Relu(Resize(x))``, ``Max(Resize(x), 0)``): its
result in the view would be the coarse map's size, so the upsampled map would be written anyway.
Resize's other readers keep it.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from onnxfuse.rewrites.elementwise.regions import candidate_ops
from onnxfuse.rewrites.engine.edit import NameAllocator
from onnxfuse.rewrites.engine.rule import Plan, Refuse, Rule
from onnxfuse.rewrites.facts.graph import (
    POINTWISE, constant_value, dims_equal, is_alive, is_default_domain, is_graph_output, is_op, producer_of,
    shape_of, sole_reader,
)
from onnxfuse.rewrites.facts.resize import nearest_upsample_factors

#: Elementwise producers followed upward through the view, at most (a bias Add, an activation, ...).
MAX_HOISTED = 8

#: The highest rank of the view: a lone op stays ONNX Runtime's, whose CUDA broadcasting kernels index
#: through fixed arrays of 8 dimensions (``TArray``); a 4-D tensor upsampled on two axes is 6.
MAX_VIEW_RANK = 8


def _elementwise(node) -> bool:
    return (is_default_domain(node) and node.op in POINTWISE and node.op in candidate_ops()
            and len(node.outputs) == 1)


class _View:
    """The finer view of a shape ``dims`` (the op's output) upsampled by ``factors``: each axis i with
    factor s > 1 becomes (dims[i] / s, s). Dimensions before the first upsampled axis are copied by the
    Reshapes (0); the rest are static sizes."""

    def __init__(self, dims, factors):
        self.dims, self.factors = list(dims), list(factors)
        self.first = next(i for i, s in enumerate(factors) if s > 1)

    def problem(self) -> str | None:
        rank = len(self.dims) + sum(1 for s in self.factors if s > 1)
        if rank > MAX_VIEW_RANK:
            return f"the view would have rank {rank}, above the {MAX_VIEW_RANK} ONNX Runtime's broadcasting kernels take"
        for i in range(self.first, len(self.dims)):
            d = self.dims[i]
            if not isinstance(d, (int, np.integer)) or d <= 0:
                return f"dimension {i} of the output ({d}) is not a static size"
            if int(d) % self.factors[i]:
                return f"dimension {i} of the output ({d}) is not a multiple of the factor {self.factors[i]}"
        return None

    def spans(self, shape) -> bool:
        """``shape`` (an operand's) has the output's rank and its sizes from the first upsampled axis on,
        so the view's Reshape applies to it; the leading dimensions, copied by the Reshape, may be anything
        the op broadcasts (each operand keeps its own there, and so does the result)."""
        return shape is not None and len(shape) == len(self.dims) and all(
            dims_equal(a, b) for a, b in zip(shape[self.first:], self.dims[self.first:]))

    def target(self, coarse: bool) -> list[int]:
        """The Reshape target into the view: the full tensor's, or (``coarse``) the Resize input's."""
        out = [0] * self.first
        for i in range(self.first, len(self.dims)):
            d, s = int(self.dims[i]), self.factors[i]
            out += [d // s, 1 if coarse else s] if s > 1 else [d]
        return out

    def back(self) -> list[int]:
        return [0] * self.first + [int(d) for d in self.dims[self.first:]]

    def full(self, viewed: np.ndarray) -> bool:
        """A viewed constant spans each upsampled axis's s (so the op's result in the view is full size)."""
        shape = (1,) * (len(self.target(coarse=False)) - viewed.ndim) + viewed.shape
        return all(shape[k] == s for k, s in self._factor_positions())

    def _factor_positions(self):
        """(position in the view, s) of each upsampled axis's s."""
        k = 0
        for s in self.factors:
            if s > 1:
                yield k + 1, s
                k += 2
            else:
                k += 1

    def constant(self, value: np.ndarray) -> np.ndarray | None:
        """A constant operand in the view, or None when it does not broadcast there (a length other than
        1 or the full L along an upsampled axis, or more dimensions than the output)."""
        rank = len(self.dims)
        if value.ndim > rank:
            return None
        full = (1,) * (rank - value.ndim) + value.shape
        shape = []
        for i, (d, s) in enumerate(zip(full, self.factors)):
            if s == 1:
                shape.append(d)
            elif d == 1:
                shape += [1, 1]
            elif d == self.dims[i]:
                shape += [d // s, s]
            else:
                return None
        return value.reshape(shape)


class UpsampleByBroadcast(Rule):
    name = "upsample-by-broadcast"
    description = ("An elementwise op reading a nearest Resize by whole factors reads the Resize's input by "
                   "broadcasting in a finer view: the upsampled map is never written (for CUDA)")
    targets = frozenset({"cuda"})
    #: the view's Reshape back has a static target where a Resize by computed sizes had none: shapes below
    #: become inferable, and the next level of a feature pyramid (whose input they are) can be matched
    makes_shapes_inferable = True

    def match(self, graph):
        for node in list(graph.nodes):
            if is_op(node, "Resize") and node.outputs:
                seen = set()
                for reader in list(node.outputs[0].outputs):
                    if id(reader) not in seen:
                        seen.add(id(reader))
                        yield node, reader

    def anchor(self, match):
        return match[1]

    def check(self, graph, match):
        resize, reader = match
        if not (is_alive(resize) and is_alive(reader) and any(t is resize.outputs[0] for t in reader.inputs)):
            return Refuse("no longer reads the Resize")
        factors = nearest_upsample_factors(graph, resize)
        if factors is None:
            return Refuse(f"reads {resize.name or 'a Resize'!r}, not a nearest Resize by whole factors that reads "
                          "input element floor(o / s)")
        if not _elementwise(reader):
            return Refuse(f"{reader.op} reads the upsampled map: not an op of the elementwise language")
        dims = shape_of(graph, reader.outputs[0])
        if dims is None or len(dims) != len(factors):
            return Refuse("its output's rank is not known to be the Resize's")
        view = _View(dims, factors)
        if (why := view.problem()) is not None:
            return Refuse(why)
        coarse = shape_of(graph, resize.inputs[0])
        upsampled = None if coarse is None or len(coarse) != len(factors) else [
            d * s if isinstance(d, (int, np.integer)) else d for d, s in zip(coarse, factors)]
        if not view.spans(upsampled):  # (from the coarse map: inference may not know a Resize by computed sizes)
            return Refuse("the upsampled map's shape is not known to be the output's")
        region, operands = [], {}
        why = self._collect(graph, reader, resize.outputs[0], view, region, operands)
        if why is not None:
            return Refuse(why)
        if not any(kind in ("same", "hoist") or (kind == "constant" and view.full(value))
                   for t in reader.inputs for kind, value in [operands.get(id(t), ("as is", None))]):
            return Refuse("no other operand has the upsampled size: the view of the coarse map alone would stay "
                          "coarse, and the map would have to be written anyway")
        region.append(reader)
        self._extend_down(graph, region, resize.outputs[0], view, operands)
        return Plan(reader, (resize, view, region, operands))

    def _extend_down(self, graph, region, upsampled, view, operands) -> None:
        """Add to ``region`` the elementwise ops that alone read its last node's result, one after another
        (an activation after the Add), each with operands that fit the view, so that the view is left
        after the last of them: a Reshape between would split fuse-elementwise's kernel in two."""
        while len(region) <= MAX_HOISTED:
            out = region[-1].outputs[0]
            below = sole_reader(graph, out)
            if below is None or not _elementwise(below) or not view.spans(shape_of(graph, below.outputs[0])):
                return
            if not self._join(graph, below, upsampled, view, region, operands, {id(out): ("hoist", None)}):
                return
            region.append(below)

    def _join(self, graph, node, upsampled, view, region, operands, known) -> bool:
        """Classify ``node``'s operands (:meth:`_collect`) on a copy of ``operands`` with ``known`` added:
        where every one fits, keep what it found (the copy, and the producers it added to ``region``) and
        say True; else leave both as they were."""
        trial, kept = {**operands, **known}, len(region)
        if self._collect(graph, node, upsampled, view, region, trial) is not None:
            del region[kept:]  # what the failed attempt hoisted above it
            return False
        operands.clear()
        operands.update(trial)
        return True

    def _collect(self, graph, node, upsampled, view, region, operands) -> str | None:
        """Classify every operand of ``node`` (adding hoisted producers to ``region`` first, so that it
        ends up in graph order): "up", "same" (viewed by a Reshape), "hoist", a viewed constant, or
        "as is" (one element). A reason when one fits none."""
        for t in node.inputs:
            if not t.name or id(t) in operands:
                continue
            if t is upsampled:
                operands[id(t)] = ("up", None)
                continue
            shape = shape_of(graph, t)  # (a constant's own)
            if shape is not None and len(shape) <= len(view.dims) and all(
                    isinstance(d, (int, np.integer)) and d == 1 for d in shape):
                operands[id(t)] = ("as is", None)  # one element: broadcasts the same way in the view
                continue
            value = constant_value(graph, t)
            if value is not None:
                viewed = view.constant(value)
                if viewed is None:
                    return f"constant operand {t.name!r} {list(value.shape)} does not broadcast in the view"
                operands[id(t)] = ("constant", viewed)
                continue
            if not view.spans(shape):
                return f"operand {t.name!r} {list(shape) if shape else '?'} is neither the output's shape, a constant nor one element"
            producer = producer_of(t)
            if (producer is not None and _elementwise(producer) and sole_reader(graph, t) is node
                    and len(region) < MAX_HOISTED and not any(u is upsampled for u in producer.inputs)
                    and self._join(graph, producer, upsampled, view, region, operands, {})):
                operands[id(t)] = ("hoist", None)
                region.append(producer)
                continue
            operands[id(t)] = ("same", None)
        return None

    def rewrite(self, graph, plan: Plan):
        reader = plan.anchor
        resize, view, region, operands = plan.found
        names = NameAllocator(graph)
        viewed: dict[int, gs.Tensor] = {}

        def in_view(t, target):
            """``t``'s declared shape in the view: its own leading dimensions (a broadcast 1 stays 1), the
            view's from the first upsampled axis on."""
            own = shape_of(graph, t)
            return list(own[:view.first]) + target[view.first:] if own is not None else None

        def reshape(t, target):
            out = gs.Variable(names(f"{t.name}/view"), dtype=t.dtype, shape=in_view(t, target))
            graph.nodes.append(gs.Node("Reshape", names(f"{t.name}/to_view"),
                                       inputs=[t, gs.Constant(names(f"{t.name}/view_shape"),
                                                              np.array(target, np.int64))],
                                       outputs=[out]))
            return out

        def operand(t):
            kind, value = operands.get(id(t), ("as is", None))
            if kind == "as is":
                return t
            if id(t) in viewed:
                return viewed[id(t)]
            if kind == "constant":
                made = gs.Constant(names(f"{t.name}/view"), np.ascontiguousarray(value))
            elif kind == "up":
                made = reshape(resize.inputs[0], view.target(coarse=True))
            else:  # "same": a tensor of the output's shape ("hoist" is set by its producer below)
                made = reshape(t, view.target(coarse=False))
            viewed[id(t)] = made
            return made

        for node in region:  # producers first: graph order
            node.inputs = [operand(t) for t in node.inputs]
            out = node.outputs[0]
            twin = gs.Variable(names(f"{out.name}/view"), dtype=out.dtype, shape=in_view(out, view.target(False)))
            node.outputs = [twin]
            if node is region[-1]:
                graph.nodes.append(gs.Node("Reshape", names(f"{out.name}/from_view"),
                                           inputs=[twin, gs.Constant(names(f"{out.name}/shape"),
                                                                     np.array(view.back(), np.int64))],
                                           outputs=[out]))
            else:
                viewed[id(out)] = twin
        return {"factors": [s for s in view.factors if s > 1], "ops": len(region),
                "upsampled_map_not_written": not resize.outputs[0].outputs and not is_graph_output(
                    graph, resize.outputs[0])}
