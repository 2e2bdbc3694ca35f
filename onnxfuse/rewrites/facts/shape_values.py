"""The values of small integer shape tensors, as dimensions: what a ``Shape`` chain computes.

Why: exporters compute the targets of Expand and Reshape at run time from ``Shape`` of some tensor
(torch's ``x.expand(n, -1, -1)`` with ``n = x.shape[0]``): ``Shape → Gather → Unsqueeze → Concat``,
and for ``-1`` entries ``Where(Equal(s, -1), 1, s)``. ONNX's shape inference (with data propagation)
gives up at the Where and names the result ``unk__N``; a rule that wants to drop the chain must know
what it computes. :func:`shape_value` evaluates such a chain to a list of dimensions, each an int (a
static size or constant entry) or the symbolic name of a tensor's dimension (``batch``).

Only exact steps are followed, each keeping the list's meaning element by element: constants;
``Shape(T)`` (start/end) when T's dimensions are all known (ints or names other than ``unk__``: those
mean nothing outside one inference; with ``sums``, an ``unk__`` one proved by :func:`axis_length`);
``Gather`` on axis 0 with constant indices; ``Slice`` with constant bounds on axis 0, step 1; ``Concat`` on axis 0; ``Unsqueeze``/``Squeeze``/``Reshape``/``Identity`` and
integer ``Cast`` (a size fits in int32); ``Where(c, a, b)`` when c is known element by element;
``Equal(a, b)`` element by element, known when both are ints, or a name against a negative int (a size
is never negative, so ``batch == -1`` is False); ``Mul`` by 1 and ``Add`` of 0 keep a name, ints
multiply and add. Anything else gives None.

:func:`axis_length` proves one dimension of a tensor from how the tensor is made (Concat sums, index
grids, broadcasts, Shape-read Reshapes), with sums of named sizes as :class:`DimSum`, and
:func:`same_length` compares two such lengths (a sum only ever equals a sum with the same terms).
"""

from __future__ import annotations

import numpy as np

from onnxfuse.rewrites.facts.graph import axes_of, constant_value, is_op, producer_of, shape_of, slice_bounds, unit_range_limit

#: A dimension: an int, or a symbolic name ("batch").
Dim = int | str


class SourcedDim(str):
    """A dimension name that remembers where the chain read it: dimension ``axis`` of ``tensor``. Compares
    and hashes as its name; a rule that needs the value at run time takes it from ``tensor`` itself
    rather than from another tensor that only shares the name (names shared across graph inputs are a
    declaration ONNX Runtime does not check, and validation samples them unequal)."""

    def __new__(cls, name: str, tensor, axis: int):
        obj = super().__new__(cls, name)
        obj.tensor, obj.axis = tensor, axis
        return obj


def known_name(dim) -> bool:
    """A symbolic dimension name that means something beyond one shape inference: not empty, not the
    ``unk__N`` ONNX invents (the same ``dim_param`` elsewhere is the same size; an invented one is not)."""
    return isinstance(dim, str) and bool(dim) and not dim.startswith("unk__")


def _known(dim) -> bool:
    """A size, or a name that means one. A negative ``dim_value`` is not a size: exporters write -1 for
    a dynamic dimension and ONNX Runtime reads it so (read as -1, ORT's embed_layer_norm_format8 test
    model's ``Range(0, Shape(ids)[1], 1)`` became 0 long and the output contradicted its Expand)."""
    return (isinstance(dim, (int, np.integer)) and dim >= 0) or known_name(dim)


def tensor_dims(tensor) -> list[Dim] | None:
    """``tensor``'s shape when every dimension is known (see the module docstring), else None."""
    shape = getattr(tensor, "shape", None)
    if shape is None or not all(_known(d) for d in shape):
        return None
    return [int(d) if not isinstance(d, str) else d for d in shape]


class DimSum(str):
    """A sum of named sizes (and a constant): ``past_sequence + sequence``, what a KV-cache export's
    ``Shape(past)[2] + Shape(input_ids)[1]`` computes. Its text lists the names sorted, then the
    constant, so two sums of the same terms compare equal; ``terms`` holds the names, ``constant`` the
    int. Only :func:`shape_value` with ``sums=True`` makes one: a rule that compares it must prove the
    other side is the same sum term by term (:func:`concat_length`), never trust a ``dim_param`` that
    merely reads like one."""

    def __new__(cls, terms, constant: int = 0):
        terms = tuple(sorted(terms))
        obj = super().__new__(cls, " + ".join(terms + ((str(constant),) if constant else ())))
        obj.terms, obj.constant = terms, constant
        return obj


def _sum_parts(d):
    """(names, constant) of a size: an int, a known name, or a :class:`DimSum`; None otherwise."""
    if isinstance(d, DimSum):
        return list(d.terms), d.constant
    if isinstance(d, str):
        return ([str(d)], 0) if known_name(d) else None
    return ([], int(d)) if isinstance(d, (int, np.integer)) and d >= 0 else None


def dim_sum(dims):
    """The sum of sizes ``dims`` (ints, known names, sums): an int when every one is an int, a name when
    one name is all there is, else a :class:`DimSum`; None when one is not a size."""
    parts = [_sum_parts(d) for d in dims]
    if any(p is None for p in parts):
        return None
    names = [n for p in parts for n in p[0]]
    constant = sum(p[1] for p in parts)
    if not names:
        return constant
    if len(names) == 1 and not constant:
        return names[0]
    return DimSum(names, constant)


def concat_length(graph, tensor, axis: int):
    """The length of ``tensor`` along ``axis`` when a ``Concat`` on that axis makes it: the sum of its
    inputs' lengths there (:func:`dim_sum`), each an int or a known name; None otherwise. A KV-cache
    export's ``present = Concat(past, new, axis=2)`` is ``past_sequence + sequence`` long, proved here
    from the two inputs, not read from the name the exporter wrote on it."""
    node = producer_of(tensor)
    if not is_op(node, "Concat"):
        return None
    dims = [getattr(t, "shape", None) for t in node.inputs]
    if any(d is None for d in dims) or len({len(d) for d in dims}) != 1:
        return None
    rank = len(dims[0])
    along = int(node.attrs.get("axis", 0))
    along = along + rank if along < 0 else along
    axis = axis + rank if axis < 0 else axis
    if along != axis or not 0 <= axis < rank:
        return None
    return dim_sum([d[axis] for d in dims])


def _read_dims(graph, tensor, sums: bool) -> list | None:
    """What ``Shape(tensor)`` reads: :func:`tensor_dims`; with ``sums``, a dimension ONNX's inference
    invented (``unk__N``) is proved from how ``tensor`` is made instead (:func:`axis_length`: a KV cache
    ``Concat(past, new)`` that ``--precision fp16`` left unnamed, its past cast to float16, is
    ``past_sequence + sequence`` long). None when a dimension stays unknown."""
    dims = tensor_dims(tensor)
    if dims is not None or not sums:
        return dims
    shape = getattr(tensor, "shape", None)
    if shape is None:
        return None
    out = []
    for axis, d in enumerate(shape):
        length = (int(d) if isinstance(d, (int, np.integer)) else d) if _known(d) else axis_length(graph, tensor, axis)
        if length is None or _sum_parts(length) is None:
            return None
        out.append(length)
    return out


def _partly_known_shape(tensor, depth: int) -> list | None:
    """What ``Shape`` (start/end) computes in ``tensor`` when its input's rank is known but not every
    dimension: the known ones (:func:`_known`), None in place of the others. Only ``Gather`` reads it,
    and only where every index it picks is known: a YOLOv8 head exported with a dynamic batch reads
    its anchor count ``Shape(x)[2]`` (static, 8400) beside the batch (named ``unk__N`` by ONNX's
    inference once a Reshape lost the input's name), and the static one makes its Reshape target
    constant."""
    node = producer_of(tensor)
    if node is None or depth <= 0 or not is_op(node, "Shape"):
        return None
    shape = getattr(node.inputs[0], "shape", None)
    if shape is None:
        return None
    return _shape_output(node, [(int(d) if isinstance(d, (int, np.integer)) else d) if _known(d) else None
                                for d in shape])


def _shape_output(node, dims: list) -> list:
    """What ``Shape`` ``node`` gives of its input's ``dims``: its ``start``/``end`` slice, each name a
    :class:`SourcedDim` of the input's axis (a :class:`DimSum` stays as it is)."""
    dims = [SourcedDim(d, node.inputs[0], axis) if isinstance(d, str) and not isinstance(d, DimSum) else d
            for axis, d in enumerate(dims)]
    start, end = node.attrs.get("start"), node.attrs.get("end")
    return dims[slice(None if start is None else int(start), None if end is None else int(end))]


def shape_value(graph, tensor, depth: int = 16, _seen: dict | None = None, sums: bool = False) -> list | None:
    """The 0-D or 1-D integer (or bool, from Equal) ``tensor`` as a list of values, or None.

    An input is evaluated only by a step that reads it (``Shape`` reads its input's dimensions, not its
    values), and each (tensor, remaining depth) once per call: torch's ``Where(Equal(s, -1), 1, s)``
    reads s twice, and a chain of such steps would otherwise be evaluated exponentially often. With
    ``sums``, an ``Add`` of sizes that are not all ints gives a :class:`DimSum` (for the callers that
    prove the other side of a comparison term by term); without, it gives None, as before."""
    seen = {} if _seen is None else _seen
    key = (id(tensor), depth)
    if key not in seen:
        seen[key] = _evaluate(graph, tensor, depth, seen, sums)
    return seen[key]


def _evaluate(graph, tensor, depth: int, seen: dict, sums: bool = False) -> list | None:
    value = constant_value(graph, tensor)
    if value is not None:
        if value.ndim > 1 or not (np.issubdtype(value.dtype, np.integer) or value.dtype == np.bool_):
            return None
        return [v.item() for v in value.reshape(-1)]
    node = producer_of(tensor)
    if node is None or depth == 0:
        return None

    def arg(i):
        t = node.inputs[i] if i < len(node.inputs) else None
        return shape_value(graph, t, depth - 1, seen, sums) if t is not None and t.name else None

    if is_op(node, "Shape"):
        dims = _read_dims(graph, node.inputs[0], sums)
        return None if dims is None else _shape_output(node, dims)
    if is_op(node, "Identity", "Unsqueeze", "Squeeze", "Reshape"):
        return arg(0)
    if is_op(node, "Cast"):
        return arg(0) if int(node.attrs.get("to", 0)) in (6, 7) else None
    if is_op(node, "Gather"):
        values, idx = arg(0), constant_value(graph, node.inputs[1])
        if values is None:
            values = _partly_known_shape(node.inputs[0], depth - 1)
        if values is None or idx is None or int(node.attrs.get("axis", 0)) != 0 or idx.ndim > 1:
            return None
        picked = [int(i) for i in idx.reshape(-1)]
        if any(not -len(values) <= i < len(values) or values[i] is None for i in picked):
            return None
        return [values[i] for i in picked]
    if is_op(node, "Slice"):
        values = arg(0)
        bounds = [constant_value(graph, t) if t.name else None for t in node.inputs[1:]]
        if values is None or len(bounds) < 2 or any(b is None or b.size != 1 for b in bounds):
            return None
        starts, ends, *rest = (int(b.reshape(-1)[0]) for b in bounds)
        if (rest and rest[0] not in (0, -1)) or (len(rest) > 1 and rest[1] != 1):
            return None
        return values[slice(starts, ends)]
    if is_op(node, "Concat"):
        parts = [arg(i) for i in range(len(node.inputs))]
        if int(node.attrs.get("axis", 0)) not in (0, -1) or any(v is None for v in parts):
            return None
        return [v for part in parts for v in part]
    steps = {"Where": (3, lambda c, a, b: (a if c else b) if isinstance(c, bool) else None),
             "Equal": (2, _equal), "Mul": (2, _mul), "Add": (2, _add_sizes if sums else _add)}
    if node.op not in steps or not is_op(node, node.op) or len(node.inputs) != steps[node.op][0]:
        return None
    inputs = [arg(i) for i in range(len(node.inputs))]
    if any(v is None for v in inputs):
        return None
    return _elementwise(steps[node.op][1], *inputs)


def _elementwise(op, *lists):
    """``op`` over numpy-style broadcast 1-D lists (length 1 repeats), None when any result is unknown."""
    n = max(len(v) for v in lists)
    if any(len(v) not in (1, n) for v in lists):
        return None
    out = [op(*(v[0] if len(v) == 1 else v[i] for v in lists)) for i in range(n)]
    return None if any(o is None for o in out) else out


def _equal(a, b):
    if isinstance(a, str) and isinstance(b, str):
        return True if a == b else None
    if isinstance(a, str) or isinstance(b, str):
        number = b if isinstance(a, str) else a
        return False if isinstance(number, int) and number < 0 else None  # a size is never negative
    return bool(a == b)


def _mul(a, b):
    if isinstance(a, str) or isinstance(b, str):
        return a if b == 1 else b if a == 1 else None
    return a * b


def _add(a, b):
    if isinstance(a, str) or isinstance(b, str):
        return a if b == 0 else b if a == 0 else None
    return a + b


def _add_sizes(a, b):
    """``_add``, and a :class:`DimSum` where names meet (``shape_value(..., sums=True)``)."""
    plain = _add(a, b)
    return plain if plain is not None else dim_sum([a, b])


# Ops that pass a shape entry through unchanged (one element stays one element, value kept).
_KEEPS_VALUES = frozenset({"Unsqueeze", "Squeeze", "Identity", "Reshape", "Flatten"})


def shape_read(graph, part):
    """``(src, [a, a+1, ...])`` when ``part`` is ``Shape(src)[a:b]`` or one entry of it (a Gather with a
    scalar index), through ops that keep the values (Unsqueeze, Squeeze, Identity, Reshape, Flatten and
    Casts to int64), with non-negative positions; else None. Unlike :func:`shape_value` it needs no
    known dimension of ``src``: it says *which* dimensions are read, not their values."""
    t = part
    for _ in range(8):
        node = producer_of(t)
        if node is None:
            return None
        if is_op(node, *_KEEPS_VALUES) or (is_op(node, "Cast") and int(node.attrs.get("to", 0)) == 7):
            t = node.inputs[0]
            continue
        if is_op(node, "Gather") and int(node.attrs.get("axis", 0)) == 0:
            shape_node = producer_of(node.inputs[0])
            idx = constant_value(graph, node.inputs[1])
            if not is_op(shape_node, "Shape") or idx is None or idx.size != 1:
                return None
            src, positions = _shape_source(shape_node)
            if src is None:
                return None
            i = int(idx.reshape(-1)[0])
            i = i + len(positions) if i < 0 else i
            if not 0 <= i < len(positions):
                return None
            return src, [positions[i]]
        if is_op(node, "Shape"):
            src, positions = _shape_source(node)
            return (src, positions) if src is not None else None
        if is_op(node, "Slice"):
            shape_node = producer_of(node.inputs[0])
            if not is_op(shape_node, "Shape"):
                return None
            src, positions = _shape_source(shape_node)
            starts, ends = constant_value(graph, node.inputs[1]), constant_value(graph, node.inputs[2])
            extra = [constant_value(graph, t) for t in node.inputs[3:] if t.name]
            if src is None or starts is None or ends is None or starts.size != 1 or ends.size != 1:
                return None
            if any(e is None for e in extra):
                return None
            if len(extra) >= 1 and int(extra[0].reshape(-1)[0]) != 0:  # axes
                return None
            if len(extra) >= 2 and int(extra[1].reshape(-1)[0]) != 1:  # steps
                return None
            picked = positions[slice(int(starts.reshape(-1)[0]), int(ends.reshape(-1)[0]))]
            return (src, list(picked)) if picked else None
        return None
    return None


def positions_read(graph, shape_node) -> set | None:
    """The positions of ``Shape(src)`` that its readers use, when every reader is a ``Gather`` or ``Slice``
    that :func:`shape_read` follows (and no graph output is the shape itself); else None."""
    out = shape_node.outputs[0]
    if any(t is out for t in graph.outputs):
        return None
    read = set()
    for reader in list(out.outputs):
        found = shape_read(graph, reader.outputs[0]) if is_op(reader, "Gather", "Slice") and reader.outputs else None
        if found is None or found[0] is not shape_node.inputs[0]:
            return None
        read.update(found[1])
    return read


def move_shape_reads(graph, old, new, same_axes=None) -> None:
    """Each ``Shape(old)`` reads ``new`` instead: all of them when ``same_axes`` is None (``new`` has
    ``old``'s shape, as the caller proved), else those whose readers use only positions in ``same_axes``
    (axes where ``new`` has ``old``'s length); the others are left as they are. Exact: the values read
    are the same. Why: a rewrite that replaces ``old`` would otherwise keep it, and everything that
    makes it, alive only for a size."""
    for reader in [n for n in list(old.outputs) if is_op(n, "Shape")]:
        read = None if same_axes is None else positions_read(graph, reader)
        if same_axes is None or (read is not None and read <= set(same_axes)):
            reader.inputs[reader.inputs.index(old)] = new


def _shape_source(shape_node):
    """``(tensor, positions)`` for a Shape node (its start/end attributes applied); (None, None) when
    the source rank is unknown."""
    src = shape_node.inputs[0]
    shape = getattr(src, "shape", None)
    if shape is None:
        return None, None
    positions = list(range(len(shape)))
    start = shape_node.attrs.get("start")
    end = shape_node.attrs.get("end")
    if start is not None or end is not None:
        positions = positions[slice(int(start) if start is not None else None, int(end) if end is not None else None)]
    return src, positions


#: ONNX ops whose output has the numpy broadcast of all their inputs' shapes (the ones masks are built of).
_BROADCASTING = frozenset({"Add", "Sub", "Mul", "Div", "And", "Or", "Xor", "Equal", "Less", "LessOrEqual",
                           "Greater", "GreaterOrEqual", "Where", "Max", "Min"})
#: ONNX reductions: with keepdims=1 (the default) a reduced axis is 1 long and the others keep theirs.
_REDUCES = frozenset({"ReduceMax", "ReduceMin", "ReduceSum", "ReduceMean", "ReduceProd", "ReduceL1", "ReduceL2",
                      "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare"})
#: ONNX ops whose output 0 has exactly their input 0's shape.
_SAME_SHAPE = frozenset({"Identity", "Cast", "Not", "Neg", "Abs", "IsNaN", "IsInf"})


def same_length(a, b) -> bool:
    """Two proved lengths (:func:`axis_length`) are the same size: equal ints, the same name, or two
    :class:`DimSum` with the same terms. A sum never equals a plain name, however the name reads (a
    ``dim_param`` ``"past + sequence"`` is one opaque symbol, not a sum)."""
    if a is None or b is None or isinstance(a, DimSum) != isinstance(b, DimSum):
        return False
    if isinstance(a, str) or isinstance(b, str):
        return isinstance(a, str) and isinstance(b, str) and str(a) == str(b)
    return int(a) == int(b)


def axis_length(graph, tensor, axis: int, depth: int = 24, _seen: dict | None = None):
    """The length of ``tensor`` along ``axis`` proved from how it is made: an int, a known name
    (:func:`known_name`) or a :class:`DimSum`; None when not proved.

    Why: a KV-cache decoder's masks are built from index grids whose lengths ONNX's inference invents
    (``Range(0, past + sequence)``, broadcast against the padding mask), while the key they must fit
    is ``Concat(past, new)``, which an exporter declares with a name that only reads like a sum. Both
    are proved here term by term, never from a declared name that looks like one.

    Steps (each exact for the length it names): a constant's shape, or a declared static size;
    ``Concat`` along the axis: the sum of its inputs' lengths (:func:`dim_sum`; along another axis,
    their common length); ``Range`` (:func:`range_length`, sums of sizes included);
    ``Unsqueeze``/``Squeeze`` with constant axes (an inserted axis is 1 long); ops that keep their
    input's shape (Cast, Not, ...); ``Gather`` (data's length off the axis, the indices' on it);
    ``GatherND`` (the indices' leading lengths, then data's past the batch and indexed axes: the
    dynamo exporter gathers the padding mask by a [B, 1, S, T, 2] index grid);
    ``Transpose``; reductions with keepdims=1 (a reduced axis is 1 long); ``Reshape`` to ``Shape(t)`` read whole: t's length, where a 0 entry cannot copy the
    input's dimension instead (allowzero=1, an axis at or past the input's rank, or a positive int
    length); ``Expand`` and the broadcasting ops (numpy rules, inputs right-aligned): the inputs'
    lengths there with the 1s dropped, when those left are all the same (1 when none is left). Then a
    declared known name. Anything else gives None. Each (tensor, axis) is evaluated once per call (a
    mask reads the same grid along several paths)."""
    rank = proved_rank(graph, tensor)
    if rank is None or not -rank <= axis < rank or depth == 0:
        return None
    axis %= rank
    seen = {} if _seen is None else _seen
    key = (id(tensor), axis)
    if key not in seen:
        seen[key] = None  # a cycle (none in a valid graph) proves nothing
        seen[key] = _axis_length(graph, tensor, axis, rank, depth, seen)
    return seen[key]


def _axis_length(graph, tensor, axis: int, rank: int, depth: int, seen: dict):
    value = constant_value(graph, tensor)
    if value is not None:
        return int(value.shape[axis])
    shape = getattr(tensor, "shape", None)
    declared = shape[axis] if shape is not None else None
    if isinstance(declared, (int, np.integer)) and declared >= 0:
        return int(declared)
    node = producer_of(tensor)
    found = _made_length(graph, node, axis, rank, depth - 1, seen) if node is not None else None
    if found is not None:
        return found
    return declared if known_name(declared) else None


def proved_rank(graph, tensor, depth: int = 16):
    """``tensor``'s rank: a constant's, the declared one, or else one proved from its producer (up to
    ``depth`` producers back): ops that keep their input's shape (Cast, Not, Identity, ...), a
    ``Flatten`` (2), ``Unsqueeze``/``Squeeze`` with constant axes (the input's plus / minus their
    count), a reduction that keeps its axes, a broadcasting op (the largest of its inputs'), an
    ``Expand`` (the larger of its target's length and its input's rank), a ``GatherND`` whose index depth
    is static; None if unknown."""
    value = constant_value(graph, tensor)
    if value is not None:
        return value.ndim
    shape = getattr(tensor, "shape", None)
    if shape is not None:
        return len(shape)
    node = producer_of(tensor)
    if node is None or not node.inputs or depth == 0:
        return None
    if is_op(node, "Flatten"):
        return 2
    if is_op(node, *_SAME_SHAPE) or (is_op(node, *_REDUCES) and int(node.attrs.get("keepdims", 1)) == 1):
        return proved_rank(graph, node.inputs[0], depth - 1)
    if is_op(node, "Unsqueeze", "Squeeze"):
        axes, source = axes_of(graph, node), proved_rank(graph, node.inputs[0], depth - 1)
        if axes is None or source is None:
            return None
        return source + len(axes) if node.op == "Unsqueeze" else source - len(axes)
    if is_op(node, *_BROADCASTING):  # numpy broadcasting: the largest input rank
        ranks = [proved_rank(graph, t, depth - 1) for t in node.inputs]
        return None if None in ranks else max(ranks)
    if is_op(node, "Expand") and len(node.inputs) == 2:  # a target computed at run time
        target, source = shape_of(graph, node.inputs[1]), proved_rank(graph, node.inputs[0], depth - 1)
        length = target[0] if target is not None and len(target) == 1 and isinstance(target[0], int) else None
        if length is None:
            value = shape_value(graph, node.inputs[1], sums=True)
            length = None if value is None else len(value)
        if length is not None and source is not None:
            return max(length, source)
    if is_op(node, "GatherND") and len(node.inputs) == 2:  # indices' rank - 1 + data's past batch_dims + k
        data, indices = proved_rank(graph, node.inputs[0], depth - 1), shape_of(graph, node.inputs[1])
        k, batch = (indices[-1] if indices else None), int(node.attrs.get("batch_dims", 0))
        if data is not None and isinstance(k, int) and batch + k <= data:
            return len(indices) - 1 + data - batch - k
    return None


def _made_length(graph, node, axis: int, rank: int, depth: int, seen: dict):
    """:func:`axis_length` of ``node``'s output 0 from the node that makes it (see there), or None."""
    if is_op(node, "Concat"):
        along = int(node.attrs.get("axis", 0))
        if along % rank != axis:
            parts = [axis_length(graph, t, axis, depth, seen) for t in node.inputs]
            return parts[0] if parts and all(same_length(p, parts[0]) for p in parts) else None
        return dim_sum([axis_length(graph, t, axis, depth, seen) for t in node.inputs]) \
            if all(proved_rank(graph, t) == rank for t in node.inputs) else None
    if is_op(node, "Range") and len(node.inputs) == 3:
        return range_length(graph, node, sums=True)
    if is_op(node, *_SAME_SHAPE) and node.inputs:
        return axis_length(graph, node.inputs[0], axis, depth, seen)
    if is_op(node, "Unsqueeze", "Squeeze"):
        axes = axes_of(graph, node)
        if axes is None:
            return None
        if node.op == "Unsqueeze":
            axes = sorted(a % rank for a in axes)
            if axis in axes:
                return 1
            return axis_length(graph, node.inputs[0], axis - sum(a < axis for a in axes), depth, seen)
        source_rank = rank + len(axes)
        axes = sorted(a % source_rank for a in axes)
        for a in axes:  # the output's axis is the source's axis past every removed one before it
            if a <= axis:
                axis += 1
        return axis_length(graph, node.inputs[0], axis, depth, seen)
    if is_op(node, *_REDUCES) and int(node.attrs.get("keepdims", 1)) == 1 and node.inputs:
        axes = axes_of(graph, node)
        if axes is None:  # all axes, unless noop_with_empty_axes keeps them
            return None if int(node.attrs.get("noop_with_empty_axes", 0)) else 1
        return 1 if axis in {a % rank for a in axes} else axis_length(graph, node.inputs[0], axis, depth, seen)
    if is_op(node, "Transpose"):
        perm = node.attrs.get("perm")
        perm = list(perm) if perm is not None else list(range(rank))[::-1]
        return axis_length(graph, node.inputs[0], perm[axis], depth, seen) if len(perm) == rank else None
    if is_op(node, "GatherND") and len(node.inputs) == 2:
        # out = indices.shape[:-1] + data.shape[batch_dims + k:], k = indices.shape[-1] (static)
        data_rank, idx_rank = proved_rank(graph, node.inputs[0]), proved_rank(graph, node.inputs[1])
        k = axis_length(graph, node.inputs[1], -1, depth, seen) if idx_rank else None
        batch = int(node.attrs.get("batch_dims", 0))
        if data_rank is None or not isinstance(k, int) or batch + k > data_rank:
            return None
        if axis < idx_rank - 1:
            return axis_length(graph, node.inputs[1], axis, depth, seen)
        return axis_length(graph, node.inputs[0], batch + k + axis - (idx_rank - 1), depth, seen)
    if is_op(node, "Gather") and len(node.inputs) == 2:
        data_rank, idx_rank = proved_rank(graph, node.inputs[0]), proved_rank(graph, node.inputs[1])
        if data_rank is None or idx_rank is None:
            return None
        along = int(node.attrs.get("axis", 0)) % data_rank
        if axis < along:
            return axis_length(graph, node.inputs[0], axis, depth, seen)
        if axis < along + idx_rank:
            return axis_length(graph, node.inputs[1], axis - along, depth, seen)
        return axis_length(graph, node.inputs[0], axis - idx_rank + 1, depth, seen)
    if is_op(node, "Reshape") and len(node.inputs) == 2:
        read = shape_read(graph, node.inputs[1])
        if read is None or read[1] != list(range(len(getattr(read[0], "shape", None) or []))):
            return None
        length = axis_length(graph, read[0], axis, depth, seen)
        source_rank = proved_rank(graph, node.inputs[0])
        # a 0 entry copies the input's dimension at that index (allowzero=0): none to copy past its rank
        zero_copies = int(node.attrs.get("allowzero", 0)) == 0 and (source_rank is None or axis < source_rank)
        return None if zero_copies and not (isinstance(length, int) and length > 0) else length
    if is_op(node, "Expand") and len(node.inputs) == 2:
        target = shape_value(graph, node.inputs[1], sums=True)
        if target is None or len(target) > rank:
            return None
        offset = rank - len(target)
        lengths = [target[axis - offset] if axis >= offset else 1]
        if _sum_parts(lengths[0]) is None:  # not a size (a negative or bool entry): the Expand fails
            return None
        lengths.append(_aligned_length(graph, node.inputs[0], axis, rank, depth, seen))
        return _broadcast_length(lengths)
    if is_op(node, *_BROADCASTING):
        return _broadcast_length([_aligned_length(graph, t, axis, rank, depth, seen) for t in node.inputs])
    return None


def _aligned_length(graph, tensor, axis: int, rank: int, depth: int, seen: dict):
    """``tensor``'s length at the output's ``axis`` of a broadcast to ``rank`` (right-aligned: a missing
    leading axis is 1)."""
    own = proved_rank(graph, tensor)
    if own is None:
        return None
    return 1 if axis < rank - own else axis_length(graph, tensor, axis - (rank - own), depth, seen)


def _broadcast_length(lengths):
    """The numpy broadcast of lengths at one axis: the ones that are not 1, when they are all the same
    size (1 when none is left); None when one is not proved or two differ (or may: two names)."""
    if any(n is None for n in lengths):
        return None
    rest = [n for n in lengths if not (isinstance(n, int) and n == 1)]
    if not rest:
        return 1
    return rest[0] if all(same_length(n, rest[0]) for n in rest) else None


def range_length(graph, node, sums: bool = False):
    """The length of ``Range(0, n, 1)`` or of integer ``Range(s, s + n, 1)`` (the limit an ``Add`` of the
    start, or of a value equal to it, and n; through int64 → int64 Casts, which torch's legacy exporter
    writes around transformers 4.57's ``cache_position`` sum): ``max(0, ceil((s + n − s) / 1)) = max(0,
    n)``, so n for a size, evaluated by :func:`shape_value` (with ``sums``: a sum of sizes too); None
    otherwise. The start and n are integers (:func:`shape_value` evaluates only those): the sum is exact."""
    if not is_op(node, "Range") or len(node.inputs) != 3:
        return None
    limit = unit_range_limit(graph, node)
    if limit is not None:
        n = shape_value(graph, limit, sums=sums)
        return _length(n[0]) if n is not None and len(n) == 1 else None
    start, limit, delta = node.inputs
    step = constant_value(graph, delta)
    if step is None or step.size != 1 or float(step.reshape(-1)[0]) != 1:
        return None
    first = shape_value(graph, start, sums=sums)
    if first is None or len(first) != 1:
        return None
    add = producer_of(limit)
    while is_op(add, "Cast") and int(add.attrs.get("to", 0)) == 7 and add.inputs and _is_int64(graph, add.inputs[0]):
        add = producer_of(add.inputs[0])
    if not is_op(add, "Add") or len(add.inputs) != 2:
        return None
    for i in (0, 1):
        if add.inputs[i] is start or shape_value(graph, add.inputs[i], sums=sums) == first:
            n = shape_value(graph, add.inputs[1 - i], sums=sums)
            if n is not None and len(n) == 1:
                return _length(n[0])
    return None


def _length(n):
    """``max(0, n)``, a Range's length for an int limit − start n; n itself for a name or a sum of sizes
    (never negative); None for anything else (a bool)."""
    if isinstance(n, bool):
        return None
    if isinstance(n, (int, np.integer)) and not isinstance(n, str):
        return max(0, int(n))
    return n if _sum_parts(n) is not None else None


def _is_int64(graph, tensor) -> bool:
    value = constant_value(graph, tensor)
    dtype = value.dtype if value is not None else getattr(tensor, "dtype", None)
    return dtype is not None and np.dtype(dtype) == np.dtype(np.int64)


#: an end at or past this keeps the whole axis of any tensor that fits in memory (torch writes INT64_MAX)
_WHOLE_AXIS_END = 2**62


def whole_slice(graph, node) -> bool:
    """``node`` is a ``Slice`` that keeps every element of its input: on each sliced axis, step 1, a start
    that is 0 (or negative past the axis' static length: ONNX clamps it to 0), and an end at or past the
    axis' length, that is at a constant >= 2^62, at a constant >= the static length, or at a length
    proved the same as the axis' (its end a size read from ``Shape``, both proved from how the tensors
    are made: :func:`axis_length`). ONNX clamps an end to the axis, so the output is then the input.

    Read by the attention masks (transformers' sdpa mask is cut to the key length it already has) and
    by cleanup (Phi-3 slices the rotated part of a head even when the rotation covers all of it)."""
    if not is_op(node, "Slice") or len(node.outputs) != 1:
        return False
    rank = len(shape_of(graph, node.inputs[0]) or ())
    bounds = slice_bounds(graph, node, constant_ends=False)
    if bounds is None or not rank:
        return False
    starts, ends, axes, steps = bounds
    if len(axes) != len(starts) or len(steps) != len(starts) or any(step != 1 for step in steps):
        return False
    for k, (start, axis) in enumerate(zip(starts, axes)):
        if not -rank <= axis < rank:
            return False
        length = axis_length(graph, node.inputs[0], axis)
        if start != 0 and not (start < 0 and isinstance(length, int) and start + length <= 0):
            return False
        if ends is not None:
            if not (ends[k] >= _WHOLE_AXIS_END or (isinstance(length, int) and ends[k] >= length)):
                return False
            continue
        if len(starts) != 1:
            return False
        read = shape_read(graph, node.inputs[2])
        if read is None or len(read[1]) != 1 or not same_length(axis_length(graph, read[0], read[1][0]), length):
            return False
    return True
