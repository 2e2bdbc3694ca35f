"""Symbolic sizes through a graph: what every dynamic input dimension becomes, and what the ops demand.

Why
---
A KV-cache decoder's inputs are tied: ``attention_mask`` holds one column per key, past and new, so its
length must be ``past + sequence``; every input's batch is the same. ONNX declares each dimension on its
own (names are not enforced), so validation has to read the ties from the graph (:mod:`.dim_relations`
solves them). This module walks the graph once, in order, with one symbol per dynamic input dimension
(``input_ids[1]``), and records:

* **equalities** ``a = b``: elementwise broadcasting of two dimensions neither of which is the constant 1
  (Add, Mul, Where, Expand, ...; such an equality also holds with either side 1, so it is *loose*), and
  *strict* ones: MatMul's inner dimensions, the other axes of a Concat, Gemm's inner dimensions;
* **sums** are not recorded apart: a ``Concat(past, new)`` along an axis gives the output dimension the
  polynomial ``P + S``, and that polynomial meeting ``attention_mask[1]`` in a broadcast is the equality
  ``attention_mask[1] = P + S``; sizes computed from ``Shape`` (Gather of a shape, Add, Sub, Mul,
  Concat of sizes, Range, ConstantOfShape, Expand's target with ``Where(Equal(s, -1), 1, s)``) are
  followed the same way;
* **bounds** ``expr >= 0``: a Gather's indices must stay inside the data's axis. Indices built from
  ``Range`` carry bounds (``Range(0, n)`` is ``[0, n-1]``, sums and scaled copies add up), so
  transformers' mask lookup ``Gather(Flatten(mask), b * M + kv)`` gives ``M - (P + S) >= 0`` (and the
  dynamo exporter's ``GatherND(mask, Concat(b, kv))`` the same, entry by entry); a Slice to a symbolic
  end ``e`` gives ``d - e >= 0``.

Dimensions are polynomials (:mod:`.dim_poly`) with integer coefficients over the symbols (a flattened ``[B, M]`` is
``B*M``), all symbols non-negative. Anything the walk cannot follow (an op it does not know, a size it
cannot compute) becomes unknown and ties nothing: the relations found are those the graph proves under
the usual assumption that a broadcast dimension is not secretly 1, never guesses.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import numpy_helper

from onnxfuse.rewrites.facts.constants import constant_node_value
from onnxfuse.runtime.dim_poly import Poly, poly_divide, poly_product, poly_sum

#: A small integer tensor (a shape, an index) whose elements are followed one by one.
SMALL = 64
#: A Slice end at or beyond this is "to the end" (exporters write INT64_MAX or INT32_MAX).
BIG = 2**30


@dataclass
class Info:
    """What is known of one tensor: its dimensions, and for integer tensors its elements (small ones,
    flattened) or bounds on them."""

    shape: list | None = None  # [Poly | None] or None (rank unknown)
    value: list | None = None  # [Poly | None], flattened, when small
    bounds: tuple | None = None  # (lo Poly | None, hi Poly | None)
    parts: list | None = None  # bounds of each entry along the last axis (GatherND indices built by Concat)


@dataclass
class Walk:
    """The result of :func:`walk`: symbols (``input[axis]`` → (input, axis, dim_param)), equalities
    (pairs of Polys), bounds (Polys that must be >= 0) and concatenations (input symbol of a Concat's
    first operand along its axis, with the output dimension), for :mod:`.dim_relations`."""

    symbols: dict = field(default_factory=dict)
    equalities: list = field(default_factory=list)
    strict: list = field(default_factory=list)  # the equalities no broadcast can relax (MatMul, Concat, Gemm)
    bounds: list = field(default_factory=list)
    appended: list = field(default_factory=list)  # (symbol of the cached part, Poly of the result)


ELEMENTWISE = {"Add", "Sub", "Mul", "Div", "Pow", "Where", "Equal", "Less", "Greater", "LessOrEqual",
               "GreaterOrEqual", "And", "Or", "Xor", "Max", "Min", "Mod", "BitShift", "PRelu", "Sum", "Mean",
               "BitwiseAnd", "BitwiseOr", "BitwiseXor"}
SAME_SHAPE = {"Cast", "CastLike", "Relu", "Neg", "Sqrt", "Exp", "Log", "Tanh", "Sigmoid", "Erf", "Cos", "Sin",
              "Abs", "Not", "Identity", "Softmax", "LogSoftmax", "Reciprocal", "Floor", "Ceil", "Round", "Sign",
              "IsNaN", "IsInf", "Clip", "LeakyRelu", "Elu", "Gelu", "HardSigmoid", "Dropout", "LayerNormalization",
              "SimplifiedLayerNormalization", "Trilu", "Softplus", "Selu", "Celu", "Mish", "HardSwish",
              "BitwiseNot", "CumSum", "QuickGelu", "FastGelu", "BiasGelu", "SkipLayerNormalization",
              "SkipSimplifiedLayerNormalization", "RotaryEmbedding", "Shrink", "ThresholdedRelu", "Tan", "Atan"}


def _attr(node, name, default=None):
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


def _broadcast(shapes: list, eqs: list) -> list | None:
    """Numpy broadcasting of dimension lists; two dimensions that both may exceed 1 must be equal."""
    if any(s is None for s in shapes):
        return None
    rank = max((len(s) for s in shapes), default=0)
    out = []
    for k in range(rank):
        dims = [s[len(s) - rank + k] for s in shapes if len(s) - rank + k >= 0]
        known = [d for d in dims if d is not None and not (d.is_const and d.value == 1)]
        if not known:
            out.append(Poly.const(1) if all(d is not None for d in dims) else None)
            continue
        first = min(known, key=lambda d: (not d.is_const, len(d.terms)))
        for d in known:
            if d != first:
                eqs.append((first, d))
        out.append(first if all(d is not None for d in dims) or first.is_const else None)
    return out


def _norm_axis(axis: int, rank: int) -> int | None:
    axis = axis + rank if axis < 0 else axis
    return axis if 0 <= axis < rank else None


class _Walker:
    def __init__(self, model: onnx.ModelProto):
        self.model = model
        self.info: dict[str, Info] = {}
        self.result = Walk()
        self.origin: dict[str, tuple] = {}  # tensor → (graph input, axis map) for the cache detection
        self._alias: dict[str, str] = {}
        self._aliased = 0

    # --- helpers -------------------------------------------------------------------------------------
    def get(self, name: str) -> Info:
        return self.info.get(name) or Info()

    def canon(self, p: Poly | None) -> Poly | None:
        """``p`` with every symbol replaced by one representative of the symbols found equal to it so
        far (``B_ids = B_mask``): a Reshape's ``-1`` divides dimensions read from different inputs."""
        if p is None:
            return None
        eqs = self.result.equalities
        for a, b in eqs[self._aliased:]:
            if _single(a) and _single(b):
                ra, rb = self._find(_single(a)), self._find(_single(b))
                if ra != rb:
                    self._alias[max(ra, rb)] = min(ra, rb)
        self._aliased = len(eqs)
        return p.substitute({x: Poly.sym(self._find(x)) for x in p.symbols() if self._find(x) != x})

    def _find(self, x: str) -> str:
        while x in self._alias:
            x = self._alias[x]
        return x

    def eq(self, a, b) -> None:
        if a is not None and b is not None and a != b:
            self.result.equalities.append((a, b))
            self.result.strict.append((a, b))

    def value_of(self, name: str) -> list | None:
        return self.get(name).value if name else None

    def scalar(self, name: str) -> Poly | None:
        v = self.value_of(name)
        return v[0] if v is not None and len(v) == 1 else None

    def const_ints(self, name: str) -> list | None:
        v = self.value_of(name)
        if v is None or any(p is None or not p.is_const for p in v):
            return None
        return [p.value for p in v]

    def set_const(self, name: str, array: np.ndarray) -> None:
        info = Info(shape=[Poly.const(d) for d in array.shape])
        if array.dtype.kind in "iub" and array.size <= SMALL:
            info.value = [Poly.const(int(x)) for x in array.reshape(-1)]
            if array.size:
                info.bounds = (Poly.const(int(array.min())), Poly.const(int(array.max())))
        self.info[name] = info

    # --- the walk -------------------------------------------------------------------------------------
    def run(self) -> Walk:
        graph = self.model.graph
        inits = set()
        for t in graph.initializer:
            inits.add(t.name)
            if t.data_location == onnx.TensorProto.EXTERNAL or np.prod(t.dims, dtype=np.int64) > SMALL:
                self.info[t.name] = Info(shape=[Poly.const(d) for d in t.dims])
            else:
                try:
                    self.set_const(t.name, numpy_helper.to_array(t))
                except Exception:
                    self.info[t.name] = Info(shape=[Poly.const(d) for d in t.dims])
        for vi in graph.input:
            if vi.name in inits or not vi.type.HasField("tensor_type"):
                continue
            tt = vi.type.tensor_type
            if not tt.HasField("shape"):
                continue
            dims = []
            for k, d in enumerate(tt.shape.dim):
                if d.HasField("dim_value") and d.dim_value >= 0:
                    dims.append(Poly.const(d.dim_value))
                else:
                    sym = f"{vi.name}[{k}]"
                    self.result.symbols[sym] = (vi.name, k, d.dim_param or None)
                    dims.append(Poly.sym(sym))
            self.info[vi.name] = Info(shape=dims)
            self.origin[vi.name] = (vi.name, list(range(len(dims))))
        for node in graph.node:
            try:
                self.node(node)
            except Exception:  # a node the walk misreads ties nothing; its outputs stay unknown
                for o in node.output:
                    self.info.pop(o, None)
        return self.result

    def node(self, node: onnx.NodeProto) -> None:  # noqa: C901 - one branch per op family
        op, ins, outs = node.op_type, list(node.input), list(node.output)
        if node.domain not in ("", "ai.onnx", "com.microsoft"):
            return
        if op == "Constant":
            value = constant_node_value(node)
            if value is not None:
                self.set_const(outs[0], np.asarray(value))
            return
        shapes = [self.get(i).shape if i else None for i in ins]
        if op in ELEMENTWISE:
            shape = _broadcast([s for i, s in zip(ins, shapes) if i], self.result.equalities)
            self.info[outs[0]] = Info(shape=shape, value=self.elementwise_value(op, ins, shape),
                                      bounds=self.elementwise_bounds(op, ins))
        elif op in SAME_SHAPE:
            src = self.get(ins[0])
            keep = op in ("Cast", "Identity") and (op == "Identity" or _attr(node, "to") in _INT_TYPES)
            self.info[outs[0]] = Info(shape=src.shape, value=src.value if keep else None,
                                      bounds=src.bounds if keep else None)
            if op in ("Identity", "Cast") and ins[0] in self.origin:
                self.origin[outs[0]] = self.origin[ins[0]]
        elif op == "Shape":
            shape = shapes[0]
            if shape is not None:
                rank = len(shape)
                start, end = _attr(node, "start", 0), _attr(node, "end", rank)
                start, end = (max(0, min(rank, x + rank if x < 0 else x)) for x in (start, end))
                dims = shape[start:end]
                self.info[outs[0]] = Info(shape=[Poly.const(len(dims))], value=list(dims))
        elif op == "Size":
            shape = shapes[0]
            if shape is not None and all(d is not None for d in shape):
                total = Poly.const(1)
                for d in shape:
                    total = total * d
                self.info[outs[0]] = Info(shape=[], value=[total])
        elif op == "MatMul":
            self.matmul(ins, outs, shapes)
        elif op == "Gemm":
            a, b = shapes[0], shapes[1]
            if a is not None and b is not None and len(a) == 2 and len(b) == 2:
                a = a[::-1] if _attr(node, "transA", 0) else a
                b = b[::-1] if _attr(node, "transB", 0) else b
                self.eq(a[1], b[0])
                self.info[outs[0]] = Info(shape=[a[0], b[1]])
        elif op == "Concat":
            self.concat(node, ins, outs, shapes)
        elif op == "Gather":
            self.gather(node, ins, outs, shapes)
        elif op == "GatherND":
            self.gather_nd(node, ins, outs, shapes)
        elif op in ("Unsqueeze", "Squeeze"):
            self.squeeze(node, op, ins, outs, shapes)
        elif op == "Reshape":
            self.reshape(node, ins, outs, shapes)
        elif op == "Flatten":
            shape = shapes[0]
            if shape is not None:
                axis = _norm_axis(_attr(node, "axis", 1), len(shape) + 1)
                if axis is not None:
                    self.info[outs[0]] = Info(shape=[poly_product(shape[:axis]), poly_product(shape[axis:])],
                                              bounds=self.get(ins[0]).bounds)
        elif op == "Transpose":
            shape = shapes[0]
            if shape is not None:
                perm = _attr(node, "perm", list(range(len(shape)))[::-1])
                self.info[outs[0]] = Info(shape=[shape[p] for p in perm], bounds=self.get(ins[0]).bounds)
                if ins[0] in self.origin:
                    name, axes = self.origin[ins[0]]
                    self.origin[outs[0]] = (name, [axes[p] for p in perm])
        elif op == "Expand":
            target = self.value_of(ins[1])
            if shapes[0] is not None and target is not None:
                ones = [Poly.const(1) if (t is not None and t.is_const and t.value == 1) else t for t in target]
                shape = _broadcast([shapes[0], ones], self.result.equalities)
                src = self.get(ins[0])
                self.info[outs[0]] = Info(shape=shape, bounds=src.bounds)
        elif op == "ConstantOfShape":
            target = self.value_of(ins[0])
            if target is not None:
                fill = _attr(node, "value")
                fill_value = None
                if fill is not None:
                    arr = numpy_helper.to_array(fill).reshape(-1)
                    if arr.dtype.kind in "iub" and arr.size == 1:
                        fill_value = int(arr[0])
                info = Info(shape=list(target))
                n = poly_product(target)
                if fill_value is not None and n is not None and n.is_const and n.value <= SMALL:
                    info.value = [Poly.const(fill_value)] * n.value
                self.info[outs[0]] = info
        elif op == "Range":
            self.range(ins, outs)
        elif op == "Slice":
            self.slice(node, ins, outs, shapes)
        elif op == "Split":
            self.split(node, ins, outs, shapes)
        elif op.startswith("Reduce") or op in ("ArgMax", "ArgMin"):
            self.reduce(node, op, ins, outs, shapes)
        elif op == "GroupQueryAttention" and node.domain == "com.microsoft":
            self.group_query_attention(node, ins, outs, shapes)
        elif op == "Tile":
            reps = self.value_of(ins[1]) if len(ins) > 1 else None
            if shapes[0] is not None and reps is not None and len(reps) == len(shapes[0]):
                self.info[outs[0]] = Info(shape=[d * r if d is not None and r is not None else None
                                                 for d, r in zip(shapes[0], reps)])

    # --- op families ----------------------------------------------------------------------------------
    def elementwise_value(self, op, ins, shape):
        values = [self.value_of(i) for i in ins]
        if any(v is None for v in values) or shape is None:
            return None
        n = poly_product(shape)
        if n is None or not n.is_const or n.value > SMALL:
            return None
        n = n.value
        if any(len(v) not in (1, n) for v in values):
            return None  # rank > 1 broadcasting of small tensors: not followed
        values = [v * n if len(v) == 1 else v for v in values]
        out = []
        for items in zip(*values):
            out.append(_element(op, items))
        return out

    def elementwise_bounds(self, op, ins):
        if op not in ("Add", "Sub", "Mul") or len(ins) != 2:
            return None
        a, b = self.get(ins[0]), self.get(ins[1])
        ab, bb = _bounds_of(a), _bounds_of(b)
        if ab is None or bb is None:
            return None
        (alo, ahi), (blo, bhi) = ab, bb
        if op == "Add":
            return _opt_add(alo, blo), _opt_add(ahi, bhi)
        if op == "Sub":
            return _opt_sub(alo, bhi), _opt_sub(ahi, blo)
        # Mul: only by a single non-negative factor (a size), the other side non-negative
        if blo is not None and blo == bhi and blo.nonneg and alo is not None and alo.nonneg:
            return alo * blo, (ahi * blo if ahi is not None else None)
        if alo is not None and alo == ahi and alo.nonneg and blo is not None and blo.nonneg:
            return blo * alo, (bhi * alo if bhi is not None else None)
        return None

    def group_query_attention(self, node, ins, outs, shapes):
        """ONNX Runtime's GroupQueryAttention (what onnxruntime-genai's builder writes): query ``[B, S,
        N·D]`` (or q, k and v packed, ``(N + 2·Nkv)·D``), ``past_key``/``past_value`` ``[B, Nkv, P, D]``,
        ``total_sequence_length`` a scalar T. The kernel checks the batch, the heads and the head size;
        T counts every key, past and new: ``T = P + S`` (the attention mask's length, in the builder's
        graph). Outputs: ``[B, S, N·D]`` and the present caches ``[B, Nkv, T, D]``."""
        q = shapes[0]
        heads, kv_heads = _attr(node, "num_heads", 0), _attr(node, "kv_num_heads", 0)
        if q is None or len(q) != 3 or not heads or not kv_heads:
            return
        packed = len(ins) < 2 or not ins[1]
        size = poly_divide(q[2], Poly.const(heads + 2 * kv_heads if packed else heads)) if q[2] is not None else None
        past = shapes[3] if len(ins) > 3 and ins[3] else None
        total = self.scalar(ins[6]) if len(ins) > 6 and ins[6] else None
        for k in (3, 4):
            cache = shapes[k] if len(ins) > k and ins[k] else None
            if cache is not None and len(cache) == 4:
                self.eq(cache[0], q[0])
                self.eq(cache[1], Poly.const(kv_heads))
                self.eq(cache[3], size)
        if past is not None and len(past) == 4 and total is not None and past[2] is not None and q[1] is not None:
            self.eq(total, past[2] + q[1])
            if len(past[2].symbols()) == 1 and past[2].linear:  # the op appends the new keys to this cache
                self.result.appended.append((next(iter(past[2].symbols())), total))
        self.info[outs[0]] = Info(shape=[q[0], q[1], size * Poly.const(heads) if size is not None else None])
        present = total if total is not None else None
        for o in outs[1:3]:
            self.info[o] = Info(shape=[q[0], Poly.const(kv_heads), present, size])

    def matmul(self, ins, outs, shapes):
        a, b = shapes[0], shapes[1]
        if a is None or b is None or not a or not b:
            return
        a2 = a if len(a) > 1 else [Poly.const(1)] + a
        b2 = b if len(b) > 1 else b + [Poly.const(1)]
        self.eq(a2[-1], b2[-2])
        batch = _broadcast([a2[:-2], b2[:-2]], self.result.equalities)
        if batch is None:
            return
        shape = batch + ([a2[-2]] if len(a) > 1 else []) + ([b2[-1]] if len(b) > 1 else [])
        self.info[outs[0]] = Info(shape=shape)

    def concat(self, node, ins, outs, shapes):
        ins = [i for i in ins if i]
        shapes = [self.get(i).shape for i in ins]
        if any(s is None for s in shapes) or not shapes:
            return
        rank = len(shapes[0])
        axis = _norm_axis(_attr(node, "axis", 0), rank)
        if axis is None or any(len(s) != rank for s in shapes):
            return
        out = []
        for k in range(rank):
            dims = [s[k] for s in shapes]
            if k == axis:
                out.append(poly_sum(dims))
            else:
                known = [d for d in dims if d is not None]
                for d in known[1:]:
                    self.eq(known[0], d)
                out.append(known[0] if len(known) == len(dims) else None)
        values = [self.value_of(i) for i in ins]
        value = [x for v in values for x in v] if rank == 1 and all(v is not None for v in values) else None
        parts = None
        if axis == rank - 1 and rank > 1:  # index tuples: each operand's bounds, one per last-axis entry
            parts = []
            for i, shape in zip(ins, shapes):
                info = self.get(i)
                width = shape[-1]
                if info.parts is not None:
                    parts += info.parts
                elif width is not None and width.is_const and info.bounds is not None:
                    parts += [info.bounds] * width.value
                else:
                    parts = None
                    break
        self.info[outs[0]] = Info(shape=out, value=value, parts=parts)
        if len(ins) >= 2 and ins[0] in self.origin and out[axis] is not None:
            name, axes = self.origin[ins[0]]
            first = shapes[0][axis]
            if first is not None and len(first.symbols()) == 1 and first.linear:
                self.result.appended.append((next(iter(first.symbols())), out[axis]))
        elif len(ins) == 1 and ins[0] in self.origin:
            self.origin[outs[0]] = self.origin[ins[0]]

    def gather(self, node, ins, outs, shapes):
        data, idx = shapes[0], shapes[1]
        if data is None:
            return
        axis = _norm_axis(_attr(node, "axis", 0), len(data))
        if axis is None:
            return
        bounds = _bounds_of(self.get(ins[1]))
        if bounds is not None and bounds[1] is not None and data[axis] is not None:
            need = data[axis] - Poly.const(1) - bounds[1]  # the largest index stays inside the axis
            if not need.is_const:
                self.result.bounds.append(need)
        if idx is None:
            return
        value = None
        dv, iv = self.value_of(ins[0]), self.const_ints(ins[1])
        if len(data) == 1 and dv is not None and iv is not None:
            n = len(dv)
            if all(-n <= i < n for i in iv):
                value = [dv[i] for i in iv]
        self.info[outs[0]] = Info(shape=data[:axis] + list(idx) + data[axis + 1:], value=value)

    def gather_nd(self, node, ins, outs, shapes):
        """``GatherND(data, indices)``: the last axis of ``indices`` (k entries) indexes data's axes
        ``batch_dims .. batch_dims + k - 1``; each entry built from a Range stays inside its axis (the
        dynamo exporter's mask lookup ``mask[batch_idx, kv_idx]``)."""
        data, idx = shapes[0], shapes[1]
        batch = _attr(node, "batch_dims", 0)
        if data is None or idx is None or not idx or idx[-1] is None or not idx[-1].is_const:
            return
        k = idx[-1].value
        parts = self.get(ins[1]).parts
        if parts is not None and len(parts) == k:
            for axis, part in enumerate(parts):
                if part is not None and part[1] is not None and batch + axis < len(data) \
                        and data[batch + axis] is not None:
                    need = data[batch + axis] - Poly.const(1) - part[1]
                    if not need.is_const:
                        self.result.bounds.append(need)
        self.info[outs[0]] = Info(shape=list(idx[:-1]) + data[batch + k:])

    def squeeze(self, node, op, ins, outs, shapes):
        shape = shapes[0]
        if shape is None:
            return
        axes = _attr(node, "axes")
        if axes is None and len(ins) > 1 and ins[1]:
            axes = self.const_ints(ins[1])
            if axes is None:
                return
        src = self.get(ins[0])
        if op == "Unsqueeze":
            rank = len(shape) + len(axes or [])
            axes = sorted(_norm_axis(a, rank) for a in axes or [])
            out = list(shape)
            for a in axes:
                out.insert(a, Poly.const(1))
        else:
            rank = len(shape)
            if axes is None:
                drop = {k for k, d in enumerate(shape) if d is not None and d.is_const and d.value == 1}
            else:
                drop = {_norm_axis(a, rank) for a in axes}
            out = [d for k, d in enumerate(shape) if k not in drop]
        self.info[outs[0]] = Info(shape=out, value=src.value, bounds=src.bounds)

    def reshape(self, node, ins, outs, shapes):
        target = self.value_of(ins[1])
        src = self.get(ins[0])
        if target is None:
            return
        shape = shapes[0]
        allowzero = _attr(node, "allowzero", 0)
        out = []
        for k, t in enumerate(target):
            if t is not None and t.is_const and t.value == 0 and not allowzero:
                out.append(shape[k] if shape is not None and k < len(shape) else None)
            elif t is not None and t.is_const and t.value == -1:
                out.append("infer")
            else:
                out.append(t)
        if "infer" in out:
            k = out.index("infer")
            total = poly_product(shape) if shape is not None else None
            out[k] = poly_divide(self.canon(total), self.canon(poly_product(out[:k] + out[k + 1:])))
        self.info[outs[0]] = Info(shape=out, value=src.value, bounds=src.bounds)

    def range(self, ins, outs):
        start, limit, delta = (self.scalar(i) for i in ins[:3])
        if start is None or limit is None or delta is None or not delta.is_const or delta.value != 1:
            return
        length = limit - start
        value = None
        if length.is_const and start.is_const and 0 <= length.value <= SMALL:
            value = [Poly.const(start.value + i) for i in range(length.value)]
        self.info[outs[0]] = Info(shape=[length], value=value, bounds=(start, limit - Poly.const(1)))

    def slice(self, node, ins, outs, shapes):
        shape = shapes[0]
        if shape is None:
            return
        rank = len(shape)
        if len(ins) > 1:  # opset >= 10: starts, ends, axes, steps as inputs
            starts, ends = self.value_of(ins[1]), self.value_of(ins[2])
            axes = self.const_ints(ins[3]) if len(ins) > 3 and ins[3] else list(range(len(starts or [])))
            steps = self.const_ints(ins[4]) if len(ins) > 4 and ins[4] else [1] * len(starts or [])
        else:
            starts = [Poly.const(s) for s in _attr(node, "starts", [])]
            ends = [Poly.const(e) for e in _attr(node, "ends", [])]
            axes = _attr(node, "axes", list(range(len(starts))))
            steps = [1] * len(starts)
        if starts is None or ends is None or axes is None or steps is None:
            return
        out = list(shape)
        for s, e, a, step in zip(starts, ends, axes, steps):
            a = _norm_axis(a, rank)
            if a is None:
                return
            out[a] = self.slice_length(shape[a], s, e, step)
        src = self.get(ins[0])
        value = None
        if rank == 1 and src.value is not None and all(p is not None and p.is_const for p in starts + ends):
            value = src.value[slice(starts[0].value, ends[0].value, steps[0])] if len(starts) == 1 else None
        self.info[outs[0]] = Info(shape=out, value=value, bounds=src.bounds)

    def slice_length(self, d, s, e, step):
        if d is None or s is None or e is None or step != 1:
            return None
        if d.is_const and s.is_const and e.is_const:
            n = d.value
            lo = max(0, min(n, s.value + n if s.value < 0 else s.value))
            hi = max(0, min(n, e.value + n if e.value < 0 else e.value))
            return Poly.const(max(0, hi - lo))
        if s.is_const and s.value >= 0 and e.is_const and e.value >= BIG:
            return d - s
        if s.is_const and s.value < 0 and e.is_const and e.value >= BIG:
            return Poly.const(-s.value)  # the last -s elements: the axis holds at least that many
        if s.is_const and s.value == 0 and not e.is_const and e.nonneg:
            self.result.bounds.append(d - e)  # the end stays inside the axis
            return e
        return None

    def split(self, node, ins, outs, shapes):
        shape = shapes[0]
        if shape is None:
            return
        axis = _norm_axis(_attr(node, "axis", 0), len(shape))
        if axis is None:
            return
        sizes = _attr(node, "split")
        if sizes is None and len(ins) > 1 and ins[1]:
            sizes = self.const_ints(ins[1])
        if sizes is None:
            d = shape[axis]
            if d is None or not d.is_const or d.value % len(outs):
                return
            sizes = [d.value // len(outs)] * len(outs)
        for o, n in zip(outs, sizes):
            self.info[o] = Info(shape=shape[:axis] + [Poly.const(n)] + shape[axis + 1:])

    def reduce(self, node, op, ins, outs, shapes):
        shape = shapes[0]
        if shape is None:
            return
        keep = _attr(node, "keepdims", 1)
        if op in ("ArgMax", "ArgMin"):
            axes = [_attr(node, "axis", 0)]
        else:
            axes = _attr(node, "axes")
            if axes is None and len(ins) > 1 and ins[1]:
                axes = self.const_ints(ins[1])
                if axes is None:
                    return
        axes = set(range(len(shape))) if not axes else {_norm_axis(a, len(shape)) for a in axes}
        out = []
        for k, d in enumerate(shape):
            if k in axes:
                if keep:
                    out.append(Poly.const(1))
            else:
                out.append(d)
        self.info[outs[0]] = Info(shape=out)


_INT_TYPES = {onnx.TensorProto.INT32, onnx.TensorProto.INT64, onnx.TensorProto.INT16, onnx.TensorProto.INT8,
              onnx.TensorProto.UINT8, onnx.TensorProto.UINT16, onnx.TensorProto.UINT32, onnx.TensorProto.UINT64}


def _element(op: str, items: tuple):
    """One element of a small integer elementwise op, symbolic where that is exact."""
    if any(x is None for x in items):
        return None
    if op == "Where":
        c, a, b = items
        return (a if c.value else b) if c.is_const else None
    a, b = items[0], items[1] if len(items) > 1 else None
    if op == "Add":
        return a + b
    if op == "Sub":
        return a - b
    if op == "Mul":
        return a * b
    if op == "Equal":
        if a.is_const and b.is_const:
            return Poly.const(int(a.value == b.value))
        if a == b:
            return Poly.const(1)
        for x, y in ((a, b), (b, a)):  # a size (non-negative) never equals a negative constant
            if x.nonneg and y.is_const and y.value < 0:
                return Poly.const(0)
        return None
    if all(x.is_const for x in items):
        x, y = a.value, b.value if b is not None else None
        table = {"Div": lambda: int(x / y) if y else None, "Max": lambda: max(x, y), "Min": lambda: min(x, y),
                 "Less": lambda: int(x < y), "Greater": lambda: int(x > y), "LessOrEqual": lambda: int(x <= y),
                 "GreaterOrEqual": lambda: int(x >= y), "And": lambda: int(bool(x) and bool(y)),
                 "Or": lambda: int(bool(x) or bool(y)), "Mod": lambda: x % y if y else None}
        if op in table:
            r = table[op]()
            return None if r is None else Poly.const(r)
    if op in ("Max", "Min") and b is not None and b.is_const and b.value <= 0 and a.nonneg:
        return a if op == "Max" else (b if b.value == 0 else None)
    return None


def _bounds_of(info: Info):
    if info.bounds is not None:
        return info.bounds
    if info.value is not None and len(info.value) == 1 and info.value[0] is not None:
        return info.value[0], info.value[0]
    return None


def _opt_add(a, b):
    return None if a is None or b is None else a + b


def _opt_sub(a, b):
    return None if a is None or b is None else a - b


def _single(p: Poly) -> str | None:
    """The symbol ``p`` is, when it is one symbol alone."""
    if len(p.terms) == 1:
        ((k, v),) = p.terms.items()
        if len(k) == 1 and v == 1:
            return k[0]
    return None


def walk(model: onnx.ModelProto) -> Walk:
    """Symbols, equalities, bounds and cache concatenations of ``model``'s top-level graph (see the
    module docstring). Never raises for a graph it cannot follow: it finds less."""
    return _Walker(model).run()


__all__ = ["Walk", "walk"]
