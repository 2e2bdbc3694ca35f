"""Dimensions ONNX shape inference leaves invented (``unk__N``) that exact reasoning proves.

Why
---
An export with a dynamic sequence axis computes its position and token-type indices from slices of
fixed-size buffers: BERT's ``position_ids = buffer[:, 0:S]`` is ``Slice(P[1, 512], 0, S)``, whose
length is ``min(S, 512)``, and the token-type ids are ``Expand(GatherElements(zeros[1, 512],
position_ids), [B, S])``. ONNX's inference has no ``min``: it names the slice's length ``unk__1``, the
Expand's output ``[unk__3, unk__4]`` and every broadcast that meets them a fresh symbol, so the
embeddings' sum, every layer after it and the mask index grids built from their ``Shape`` lose
``batch`` and ``sequence``. Measured on BERT-base exported by transformers 5.17 with a dynamic
sequence axis: no ``mask_index`` (the attention mask stayed an expanded float bias), no
EmbedLayerNormalization, three CPU Range chains; 18% slower than ONNX Runtime's transformers optimizer
at batch 1 (docs/benchmarks.md 5.10).

What is proved
--------------
A dimension is an int, a name, or ``Clamped(n, m)``: the value ``min(n, m)`` for a size ``n`` and a
constant ``m >= 1``. For nodes whose outputs inference left invented or unknown, in topological order:

* ``Slice`` on an axis of size D, start 0, step 1, end e (:func:`shape_value`: a constant or a size
  read from ``Shape``): ``min(e, D)``, which is e when D is the same name, ``Clamped(e, D)`` for a
  constant D, ``Clamped(D, e)`` for a constant e (ONNX clamps the end to the axis; a size is >= 0);
* ``Range(0, n, 1)`` with n a size: n elements (``max(0, n)``, and a size is >= 0); integer
  ``Range(s, s + n, 1)`` (an ``Add`` of the start and n, through int64 → int64 Casts): n elements too;
* ``Reshape(x, target)`` with the target's ``0`` entries x's dimensions and its ``-1`` the quotient of
  x's product by the other entries', names cancelled (``[B, S, 12, 64]`` by ``[0, -1, 768]``: S); a
  target with neither is the output's shape whatever x's is (tf2onnx's ``Tensordot`` writes
  ``Reshape(MatMul(·), Concat(Gather(Shape(x), [0, 1]), [H]))``, where x's product is a ReduceProd);
* ``Gather`` (data's dimensions before the axis, the indices', data's after it) and ``Gemm``
  ([M, N] from A and B, transposed as its attributes say);
* the ops that keep their input's shape (:data:`SAME_SHAPE_OPS`: Softmax, Cast, Sqrt, Reciprocal, ...)
  and reductions (:data:`REDUCE_OPS`: the reduced axes 1 with keepdims, dropped without): ONNX's
  inference derives these too, but it does not run between the rounds of this pass, so without them a
  proved shape would stop at the first Softmax (tf2onnx's opset-11 BERT, where inference lost every
  shape after the first computed Reshape target: each layer's are proved in one pass);
* ``Tile(x, repeats)``: x's dimension times the repeat on each axis where one of them is 1 or both are
  ints (transformers' Whisper decoder tiles its position ids to the batch: ``repeats`` [B, 1] from
  ``Shape(input_ids)``); ``ConstantOfShape(s)``: s's value (:func:`shape_value`);
* ``MatMul``: the broadcast of the operands' leading (batch) dimensions, then [M, N]; ``Transpose``:
  its input's dimensions permuted (rotary frequencies ``inv_freq [B, D/2, 1] @ positions [B, 1, S]``,
  transposed, as transformers 5.17 writes them: inference names the product's batch ``unk__``);
* ``Expand(x, target)`` and the broadcasting ops (Add, Where, Equal, ...): the broadcast of the
  inputs' dimensions (and the target's), where besides ``1 ⊕ d = d`` and ``d ⊕ d = d``,
  ``Clamped(n, m) ⊕ n = n``: if n <= m both are n; if n > m >= 1 then ``min(n, m) = m`` differs from n,
  so broadcasting needs m = 1 (giving n) or fails. A pair of different names is left unknown (either
  may be 1 at run time). The result holds whenever the model runs, which is all a rewrite may assume.

Inference shares an invented symbol only between dimensions it proved equal (an elementwise op keeps
it, a Gather keeps its indices' symbols), so a symbol proved to be a size or a name is renamed
everywhere it occurs (:func:`~onnxfuse.rewrites.facts.shapes.unify_dims`), which reaches every tensor
downstream without another inference. A ``Clamped`` value is never written onto a tensor: ONNX shapes
have no ``min``; it is kept only for the reasoning of this pass. Rounds repeat until nothing new is
proved, since a size read through ``Shape`` is only known once its tensor's symbols are renamed.
"""

from __future__ import annotations

from dataclasses import dataclass

from onnxfuse.rewrites.facts.graph import constant_value, graphs_within, is_op, unit_range_limit
from onnxfuse.rewrites.facts.shape_values import range_length, shape_value
from onnxfuse.rewrites.facts.shapes import unify_dims

#: ONNX ops whose output has the numpy broadcast of all their inputs' shapes.
BROADCAST_OPS = frozenset({
    "Add", "Sub", "Mul", "Div", "Pow", "Mod", "Max", "Min", "Sum", "Mean", "And", "Or", "Xor", "Equal",
    "Greater", "GreaterOrEqual", "Less", "LessOrEqual", "Where", "BitShift", "BitwiseAnd", "BitwiseOr",
    "BitwiseXor",
})

#: ONNX ops whose output 0 has exactly their input 0's shape (elementwise on one tensor; Clip's bounds
#: and the Dropout ratio are scalars; Softmax at any axis).
SAME_SHAPE_OPS = frozenset({
    "Identity", "Cast", "Softmax", "LogSoftmax", "Sqrt", "Reciprocal", "Relu", "Erf", "Tanh", "Sigmoid",
    "Neg", "Abs", "Exp", "Log", "Not", "Floor", "Ceil", "Round", "Sign", "Sin", "Cos", "Clip", "Dropout",
    "LeakyRelu", "Elu", "Selu", "HardSigmoid", "Softplus", "Softsign", "IsNaN", "IsInf",
})

#: Reductions over ``axes`` (attribute, or the second input from opset 18; ReduceSum from 13).
REDUCE_OPS = frozenset({
    "ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
    "ReduceSumSquare", "ReduceLogSum", "ReduceLogSumExp",
})

#: Rounds of the whole pass: a rename found in one round can only help the next one.
MAX_ROUNDS = 6


@dataclass(frozen=True)
class Clamped:
    """``min(size, limit)``: ``size`` a dimension name (a size, so >= 0), ``limit`` an int >= 1."""

    size: str
    limit: int


def _invented(d) -> bool:
    return d is None or (isinstance(d, str) and (not d or d.startswith("unk__")))


def broadcast_dims(a: list, b: list) -> list | None:
    """Numpy broadcast of two dimension lists (ints, names, :class:`Clamped`), or None when a pair is
    provably incompatible. A pair that cannot be resolved (two different names) gives None in its place
    inside the list; a ``Clamped`` against its own size gives the size (see the module docstring)."""
    rank = max(len(a), len(b))
    a, b = [1] * (rank - len(a)) + list(a), [1] * (rank - len(b)) + list(b)
    out = []
    for x, y in zip(a, b):
        if x is None or y is None:
            out.append(None if x != 1 and y != 1 else (y if x == 1 else x))
        elif x == 1:
            out.append(y)
        elif y == 1 or x == y:
            out.append(x)
        elif isinstance(x, Clamped) and x.size == y or isinstance(y, Clamped) and y.size == x:
            out.append(y if isinstance(x, Clamped) else x)
        elif isinstance(x, int) and isinstance(y, int):
            return None
        elif isinstance(x, int) or isinstance(y, int):
            out.append(x if isinstance(x, int) else y)  # a size other than 1 wins, or the op fails
        else:
            out.append(None)
    return out


class _Pass:
    """One round over one graph: ``proved`` maps invented symbols to what they are."""

    def __init__(self, graph, proved: dict, clamped: dict):
        self.graph, self.proved, self.clamped = graph, proved, clamped

    def dim(self, d):
        """A tensor's dimension as this pass knows it: an int, a name, a Clamped, or None."""
        if isinstance(d, str) and d in self.proved:
            return self.proved[d]
        if isinstance(d, str) and d in self.clamped:
            return self.clamped[d]
        if isinstance(d, int) and d < 0:
            return None  # a declared -1: a dynamic dimension (shape_values._known), not a size
        return None if d is None or d == "" else d  # an unresolved invented name is a symbol still

    def dims(self, tensor):
        value = constant_value(self.graph, tensor)
        if value is not None:
            return [int(v) for v in value.shape]
        shape = getattr(tensor, "shape", None)
        return None if shape is None else [self.dim(d) for d in shape]

    def sizes(self, tensor) -> list | None:
        """``tensor``'s value as a list of ints and names (:func:`shape_value`), or None."""
        value = shape_value(self.graph, tensor)
        if value is None or any(isinstance(v, bool) or not isinstance(v, (int, str)) for v in value):
            return None
        return [v if isinstance(v, int) else str(v) for v in value]

    def result(self, node) -> list | None:
        """The proved dims of ``node``'s output 0 (entries may be None: not proved), or None."""
        if is_op(node, *BROADCAST_OPS) or is_op(node, "Expand"):
            shapes = [self.dims(t) for t in (node.inputs[:1] if node.op == "Expand" else node.inputs)]
            if node.op == "Expand":
                target = self.sizes(node.inputs[1]) if len(node.inputs) == 2 else None
                if target is None or any(isinstance(v, int) and v < 0 for v in target):
                    return None
                shapes.append(target)
            if not shapes or any(s is None for s in shapes):
                return None
            out = shapes[0]
            for s in shapes[1:]:
                out = broadcast_dims(out, s)
                if out is None:
                    return None
            return out
        limit_tensor = unit_range_limit(self.graph, node)
        if limit_tensor is not None:
            limit = self.sizes(limit_tensor)
            if limit is None or len(limit) != 1:
                return None
            return [max(0, limit[0]) if isinstance(limit[0], int) else limit[0]]
        if is_op(node, "Range") and len(node.inputs) == 3:
            return self.offset_range_result(node)
        if is_op(node, "Slice") and len(node.inputs) >= 3:
            return self.slice_result(node)
        if is_op(node, "Reshape") and len(node.inputs) == 2:
            return self.reshape_result(node)
        if is_op(node, "MatMul") and len(node.inputs) == 2:
            return self.matmul_result(node)
        if is_op(node, "Gather") and len(node.inputs) == 2:
            data, idx = self.dims(node.inputs[0]), self.dims(node.inputs[1])
            axis = int(node.attrs.get("axis", 0))
            if data is None or idx is None or not -len(data) <= axis < len(data):
                return None
            axis %= len(data)
            return data[:axis] + idx + data[axis + 1:]
        if is_op(node, "Gemm") and len(node.inputs) >= 2:
            a, b = self.dims(node.inputs[0]), self.dims(node.inputs[1])
            if a is None or b is None or len(a) != 2 or len(b) != 2:
                return None
            return [a[1] if int(node.attrs.get("transA", 0)) else a[0],
                    b[0] if int(node.attrs.get("transB", 0)) else b[1]]
        if is_op(node, *SAME_SHAPE_OPS) and node.inputs:
            return self.dims(node.inputs[0])
        if is_op(node, *REDUCE_OPS) and node.inputs:
            return self.reduce_result(node)
        if is_op(node, "Tile") and len(node.inputs) == 2:
            return self.tile_result(node)
        if is_op(node, "ConstantOfShape") and len(node.inputs) == 1:
            sizes = self.sizes(node.inputs[0])
            return None if sizes is None or any(isinstance(v, int) and v < 0 for v in sizes) else sizes
        if is_op(node, "Transpose") and len(node.inputs) == 1:
            data, perm = self.dims(node.inputs[0]), node.attrs.get("perm")
            if data is None:
                return None
            perm = list(perm) if perm is not None else list(range(len(data)))[::-1]
            return [data[p] for p in perm] if sorted(perm) == list(range(len(data))) else None
        return None

    def tile_result(self, node) -> list | None:
        """``Tile(x, repeats)``: axis i is x's dimension times ``repeats[i]`` (:func:`shape_value`), proved where
        one factor is 1 (the other then) or both are ints; None elsewhere on that axis."""
        data, repeats = self.dims(node.inputs[0]), self.sizes(node.inputs[1])
        if data is None or repeats is None or len(repeats) != len(data):
            return None
        out = []
        for d, r in zip(data, repeats):
            if isinstance(r, int) and r < 0:
                return None
            if d == 1:
                out.append(r)
            elif r == 1:
                out.append(d)
            else:
                out.append(d * r if isinstance(d, int) and isinstance(r, int) else None)
        return out

    def offset_range_result(self, node) -> list | None:
        """``Range(s, Add(s, n), 1)`` over integers (a past length s and a new length n: GPT-2's position
        ids with a KV cache; transformers 4.57's ``cache_position``, whose limit torch's legacy exporter
        casts from int64 to int64): ``max(0, n)`` elements, n itself for a size
        (:func:`~onnxfuse.rewrites.facts.shape_values.range_length`)."""
        n = range_length(self.graph, node)
        return None if n is None else [n if isinstance(n, int) else str(n)]

    def reduce_result(self, node) -> list | None:
        """A reduction's output: its input's dimensions, those of the reduced axes 1 (keepdims=1) or
        dropped (keepdims=0); axes from the attribute or a constant second input; no axes reduces all
        of them unless noop_with_empty_axes=1 (then the output is the input)."""
        data = self.dims(node.inputs[0])
        if data is None:
            return None
        if "axes" in node.attrs:
            axes = [int(a) for a in node.attrs["axes"]]
        elif len(node.inputs) > 1 and node.inputs[1].name:
            value = constant_value(self.graph, node.inputs[1])
            if value is None:
                return None
            axes = [int(a) for a in value.reshape(-1)]
        else:
            axes = []
        if not axes:
            if int(node.attrs.get("noop_with_empty_axes", 0)) == 1:
                return list(data)
            axes = list(range(len(data)))
        if any(not -len(data) <= a < len(data) for a in axes):
            return None
        axes = {a % len(data) for a in axes}
        keep = int(node.attrs.get("keepdims", 1)) == 1
        return [1 if i in axes else d for i, d in enumerate(data) if keep or i not in axes]

    def matmul_result(self, node) -> list | None:
        """numpy matmul: the broadcast of the leading (batch) dimensions, then [M, N] (a rank-1 operand's
        axis is dropped); None for ranks below 1."""
        a, b = self.dims(node.inputs[0]), self.dims(node.inputs[1])
        if a is None or b is None or not a or not b:
            return None
        rows = [a[-2]] if len(a) >= 2 else []
        cols = [b[-1]] if len(b) >= 2 else []
        batch = broadcast_dims(a[:-2], b[:-2])
        return None if batch is None else batch + rows + cols

    def reshape_result(self, node) -> list | None:
        data, target = self.dims(node.inputs[0]), self.sizes(node.inputs[1])
        keep_zero = int(node.attrs.get("allowzero", 0)) == 1
        if target is None or target.count(-1) > 1:
            return None
        if data is None:  # the target alone decides, unless an entry copies or divides x's dimensions
            if -1 in target or (0 in target and not keep_zero):
                return None
            data = []
        out = []
        for i, t in enumerate(target):
            if t == 0 and not keep_zero:
                if i >= len(data):
                    return None
                t = data[i]
            elif isinstance(t, int) and t < -1:
                return None
            out.append(t)
        if -1 in out:
            i = out.index(-1)
            out[i] = _quotient(data, out[:i] + out[i + 1:])
        return out

    def slice_result(self, node) -> list | None:
        data = self.dims(node.inputs[0])
        bounds = [self.sizes(t) if t.name else None for t in node.inputs[1:5]]
        if data is None or any(b is None for b in bounds[:2]):
            return None
        starts, ends = bounds[0], bounds[1]
        axes = bounds[2] if len(bounds) > 2 and bounds[2] is not None else list(range(len(starts)))
        steps = bounds[3] if len(bounds) > 3 and bounds[3] is not None else [1] * len(starts)
        if len(node.inputs) > 3 and node.inputs[3].name and bounds[2] is None:
            return None
        if len(node.inputs) > 4 and node.inputs[4].name and bounds[3] is None:
            return None
        if not len(starts) == len(ends) == len(axes) == len(steps):
            return None
        out = list(data)
        for start, end, axis, step in zip(starts, ends, axes, steps):
            if not isinstance(axis, int) or not -len(data) <= axis < len(data):
                return None
            out[axis] = _slice_length(data[axis], start, end, step)
        return out

    def run(self) -> bool:
        """One round over the graph; True when something new was proved."""
        new = False
        for node in self.graph.nodes:
            if len(node.outputs) != 1:
                continue
            out = node.outputs[0]
            shape = getattr(out, "shape", None)
            if shape is not None and not any(_invented(d) and d not in self.proved and d not in self.clamped
                                             for d in shape):
                continue
            proved = self.result(node)
            if proved is None or (shape is not None and len(shape) != len(proved)):
                continue
            if shape is None:
                if all(isinstance(d, (int, str)) for d in proved):
                    out.shape = list(proved)
                    new = True
                continue
            fixed = list(shape)
            for i, (have, got) in enumerate(zip(shape, proved)):
                if got is None or not _invented(have) or have in self.proved or have in self.clamped:
                    continue
                if isinstance(got, Clamped):
                    if have and got.size != have:
                        self.clamped[have] = got
                        new = True
                elif have:
                    if got != have:
                        self.proved[have] = got
                        new = True
                else:
                    fixed[i] = got
                    new = True
            if fixed != list(shape):
                out.shape = fixed
        return new


def _product(dims):
    """``(coefficient, sorted names)`` of the product of ``dims``, or None when one is not an int or name."""
    coefficient, names = 1, []
    for d in dims:
        if isinstance(d, bool) or not isinstance(d, (int, str)):
            return None
        if isinstance(d, int):
            coefficient *= d
        else:
            names.append(str(d))
    return coefficient, sorted(names)


def _quotient(numerator: list, denominator: list):
    """The dimension a Reshape's ``-1`` stands for, ``prod(numerator) / prod(denominator)``, when that is
    one name or a positive int by cancelling names and dividing the constants exactly; else None.
    (ONNX's inference does no symbolic division: ``Reshape([B, S, 12, 64], [0, -1, 768])`` is [B, unk, 768].)"""
    top, bottom = _product(numerator), _product(denominator)
    if top is None or bottom is None or bottom[0] <= 0 or top[0] % bottom[0]:
        return None
    names = list(top[1])
    for name in bottom[1]:
        if name not in names:
            return None
        names.remove(name)
    coefficient = top[0] // bottom[0]
    if not names:
        return coefficient
    return names[0] if len(names) == 1 and coefficient == 1 else None


def _slice_length(size, start, end, step):
    """The length of ``x[start:end:step]`` on an axis of ``size`` (see the module docstring), or None."""
    if step != 1 or start != 0:
        return None
    if isinstance(end, int) and isinstance(size, int):
        return max(0, min(size, end if end >= 0 else max(0, size + end)))
    if isinstance(end, str):  # a size: never negative, so ONNX only clamps it to the axis
        if end == size:
            return size
        return Clamped(end, size) if isinstance(size, int) and size >= 1 else None
    if isinstance(end, int) and isinstance(size, str) and end >= 1:
        return size if end >= 2**31 - 1 else Clamped(size, end)
    return None


def prove_dims(graph) -> int:
    """Name the invented dimensions of ``graph`` (and its subgraphs) that this module proves; returns
    how many symbols were renamed."""
    renamed = 0
    for g in graphs_within(graph):
        proved, clamped = {}, {}
        for _ in range(MAX_ROUNDS):
            if not _Pass(g, proved, clamped).run():
                break
            unify_dims(g, dict(proved))
            renamed += len(proved)
            for symbol, c in list(clamped.items()):  # a clamped size may itself have been a symbol
                size = proved.get(c.size, c.size)
                clamped[symbol] = Clamped(size, c.limit) if isinstance(size, str) else None
            clamped = {k: v for k, v in clamped.items() if v is not None}
            proved.clear()
    return renamed
