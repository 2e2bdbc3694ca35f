"""Weights that stay on disk: references instead of bytes, memory-mapped reads, streamed writes.

Why: a ``ModelProto`` holds its weights in one protobuf arena, protobuf cannot serialize a message over
2 GiB (the default upb backend raises ``EncodeError``, and ``ByteSize()`` serializes to count, so even
*measuring* a model over 2 GiB fails), and every ``CopyFrom``/``SerializeToString`` of a model costs its
weights' size again. Optimizing a 1.97 GiB model used to peak at 16.6 GB (8x): load, shape inference,
graphsurgeon's copies, checker and session bytes, the save's copy. Here the weights of a large model
never enter a protobuf at all.

**Lazy references.** A large model (:data:`LAZY_MODEL_BYTES` of weights or more) is held as a
*skeleton*: every initializer over :data:`LAZY_MIN_TENSOR` bytes is an external-data reference whose
``location`` is an **absolute** path (the model's own data file, the ``.onnx`` file itself for weights
stored inline, or this process's spill file). Absolute locations never leave the process: ONNX forbids
them in files, and every writer here (:func:`write_payloads`) turns them into a proper relative
``<model>.data``; :func:`is_lazy` tells them from a file's own (relative) references. Small tensors are
always inline, so shape inference, data propagation and constant folding see every value they can use
(the constant folder's limit is 1 MiB; :data:`LAZY_MIN_TENSOR` is above it).

**Reading** (:class:`MappedValues`): graphsurgeon gets a ``LazyValues`` whose ``load()`` returns a
read-only ``np.memmap`` of the tensor's bytes; pages are read on touch and released when the array is
dropped. Read-only also proves the array still equals its file range, so when a rule only *looked* at a
weight, exporting it costs a reference again, not a copy.

**New weights** (:func:`spill_array`): arrays a rule created (a BatchNorm folded into a weight) are
appended to one spill file per process in ``$TMPDIR`` (created with ``O_TMPFILE`` where the file system
allows it: it has no name and disappears when the process ends, however it ends; otherwise a named file
deleted at exit) and referenced from there, so the optimized model is a skeleton too.

**Writing** (:func:`write_payloads`): a model file is written from the skeleton's small serialized parts
and the weights streamed from their files with ``copy_file_range`` (no pass through Python memory),
either inline (protobuf wire format written by hand: tag, length, bytes; exactly what protobuf would
write) or as ``<model>.data`` with every large tensor 64 KiB-aligned so ONNX Runtime maps it rather
than copying it.

**Inline files** (:func:`strip_inline_weights`): the ``.onnx`` file of a large model with inline weights
is scanned at the protobuf wire level (tags and lengths, through ``mmap``) and parsed without its
``raw_data`` fields, which become references into the ``.onnx`` file itself.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import errno
import math
import mmap
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

#: Weights (bytes of tensor data) from which a model is held lazily. Below it everything is in memory
#: as before (a ``ModelProto`` returned by the API is then self-contained).
LAZY_MODEL_BYTES = 1 << 30
#: The threshold the command line holds models lazily from (:func:`lazy_from`), far below
#: :data:`LAZY_MODEL_BYTES`: the CLI never hands its ``ModelProto`` to anyone, it only writes it, so a
#: self-contained proto buys nothing there, and every serialization of an in-memory model (shape
#: inference, the checker, each ONNX Runtime session) copies its weights again. Measured on BERT-base
#: (435 MB, legacy export, CPU validation, this 2-core machine; docs/benchmarks.md 5.23): `onnxfuse
#: optimize` took 21-24 s and peaked at 3.44 GB held in memory (13 s of it serializing and re-parsing the
#: weights), 2.9-3.2 s and 0.45 GB held lazily, with the same output bytes and report. At that rate 32 MiB
#: of weights cost about a second in memory; every testdata model (the largest 1.8 MB) stays on the
#: in-memory path as before, and held lazily gives the same bytes too (tools/check_identical.py
#: --lazy-bytes 0).
CLI_LAZY_MODEL_BYTES = 32 << 20
#: Tensors larger than this stay on disk in a lazy model; smaller ones are loaded inline. Must be at
#: least the constant folder's limit (rewrites.fold.SIZE_LIMIT, 1 MiB): every tensor it may
#: evaluate must be inline, since ONNX Runtime refuses absolute external locations.
LAZY_MIN_TENSOR = 1 << 20
#: Alignment of large tensors in written data files. ONNX Runtime maps external data with ``mmap``
#: when the offset is a multiple of the allocation granularity (4 KiB on Linux, 64 KiB on Windows)
#: and otherwise reads it into a buffer.
ALIGN_LARGE = 1 << 16
ALIGN_SMALL = 64

_RAW_DATA = 9  # TensorProto.raw_data
_INITIALIZER = 5  # GraphProto.initializer
_GRAPH = 7  # ModelProto.graph

_EXTERNAL = onnx.TensorProto.EXTERNAL


# ---------------------------------------------------------------------------------------------------
# tensor sizes and references


def _itemsize_bits(data_type: int) -> int | None:
    if data_type in (onnx.TensorProto.STRING, onnx.TensorProto.UNDEFINED):
        return None
    if data_type in (getattr(onnx.TensorProto, n, -1) for n in ("INT4", "UINT4", "FLOAT4E2M1")):
        return 4
    if data_type in (getattr(onnx.TensorProto, n, -1) for n in ("INT2", "UINT2")):
        return 2
    try:
        return 8 * onnx.helper.tensor_dtype_to_np_dtype(data_type).itemsize
    except Exception:
        return None


def element_count(tensor: onnx.TensorProto) -> int:
    return math.prod(int(d) for d in tensor.dims)


def tensor_nbytes(tensor: onnx.TensorProto) -> int:
    """Bytes of ``tensor``'s data, from its dims and type (never touches the data itself: reading a bytes
    field of a upb message copies it). Strings: the sum of their lengths."""
    bits = _itemsize_bits(tensor.data_type)
    if bits is None:
        if tensor.data_type == onnx.TensorProto.STRING:
            return sum(len(s) for s in tensor.string_data)
        return 0
    return (element_count(tensor) * bits + 7) // 8


def external_info(tensor: onnx.TensorProto) -> dict[str, str]:
    return {e.key: e.value for e in tensor.external_data}


def is_external(tensor: onnx.TensorProto) -> bool:
    return tensor.data_location == _EXTERNAL


#: The absolute locations this process itself made references to: a large model's ``.onnx`` file and
#: data files once :func:`onnxfuse.model_io.load_model` has checked them, and the spill file. Only these
#: make a tensor lazy: an absolute location written in a file or in a ``ModelProto`` someone hands us is
#: *not* trusted (it could name any file the process can read, ``/etc/shadow`` or ``/dev/zero``); the
#: loaders refuse it with one line instead.
_own_sources: set[str] = set()


def trust_source(location: str) -> str:
    """Record ``location`` (absolute) as a file this process checked and may reference lazily."""
    _own_sources.add(location)
    return location


def is_lazy(tensor: onnx.TensorProto) -> bool:
    """True for this process's own references (an absolute ``location`` it recorded with
    :func:`trust_source`), as opposed to a file's relative ones or a foreign absolute one."""
    return is_external(tensor) and external_info(tensor).get("location", "") in _own_sources


def set_external(tensor: onnx.TensorProto, location: str, offset: int, length: int) -> None:
    """Make ``tensor`` a reference to ``length`` bytes at ``offset`` of ``location`` (its data cleared)."""
    tensor.ClearField("raw_data")
    del tensor.external_data[:]
    tensor.data_location = _EXTERNAL
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
        tensor.external_data.add(key=key, value=value)


@dataclass(frozen=True)
class FileRange:
    path: str
    offset: int
    length: int


def file_range(tensor: onnx.TensorProto) -> FileRange:
    info = external_info(tensor)
    length = int(info["length"]) if "length" in info else tensor_nbytes(tensor)
    return FileRange(info["location"], int(info.get("offset", 0) or 0), length)


@contextlib.contextmanager
def lazy_from(nbytes: int):
    """Hold models with ``nbytes`` of weights or more lazily while the block runs (loads, shape
    inference's skeleton, rewritten models), then restore :data:`LAZY_MODEL_BYTES`: the command line's
    :data:`CLI_LAZY_MODEL_BYTES`, without changing what the API returns to a program."""
    global LAZY_MODEL_BYTES
    saved = LAZY_MODEL_BYTES
    LAZY_MODEL_BYTES = min(saved, nbytes)
    try:
        yield
    finally:
        LAZY_MODEL_BYTES = saved


def top_initializers(model: onnx.ModelProto):
    return model.graph.initializer


def has_lazy(model: onnx.ModelProto) -> bool:
    return any(is_lazy(t) for t in top_initializers(model))


def payload_bytes(model: onnx.ModelProto) -> int:
    """Bytes of weights in ``model``'s main graph, wherever they are (inline, in files, lazy)."""
    return sum(tensor_nbytes(t) for t in top_initializers(model))


# ---------------------------------------------------------------------------------------------------
# measuring without serializing


def _varint_len(n: int) -> int:
    return max(1, (n.bit_length() + 6) // 7)


def _tensor_bound(t: onnx.TensorProto) -> int:
    """Upper bound of ``t``'s serialized size with all its data inline (no data is read)."""
    size = 64 + len(t.name) + len(t.doc_string) + 11 * len(t.dims)
    if is_external(t) or t.HasField("raw_data"):
        size += tensor_nbytes(t) + 11
    else:
        # Typed fields: varints take up to 10 bytes per element; fixed-width ones their width.
        size += 10 * (len(t.int32_data) + len(t.int64_data) + len(t.uint64_data))
        size += 4 * len(t.float_data) + 8 * len(t.double_data)
        size += sum(len(s) + 11 for s in t.string_data)
    for e in t.external_data:
        size += len(e.key) + len(e.value) + 8
    return size


def _node_bound(node: onnx.NodeProto) -> int:
    heavy = any(a.type in (onnx.AttributeProto.TENSOR, onnx.AttributeProto.TENSORS, onnx.AttributeProto.GRAPH,
                           onnx.AttributeProto.GRAPHS, onnx.AttributeProto.SPARSE_TENSOR,
                           onnx.AttributeProto.SPARSE_TENSORS) for a in node.attribute)
    if not heavy:
        return node.ByteSize() + 11
    size = 64 + len(node.name) + len(node.op_type) + len(node.domain) + len(node.doc_string)
    size += sum(len(x) + 11 for x in list(node.input) + list(node.output))
    for a in node.attribute:
        size += 32 + len(a.name)
        if a.type == onnx.AttributeProto.TENSOR:
            size += _tensor_bound(a.t)
        elif a.type == onnx.AttributeProto.TENSORS:
            size += sum(_tensor_bound(t) + 11 for t in a.tensors)
        elif a.type == onnx.AttributeProto.GRAPH:
            size += graph_bound(a.g)
        elif a.type == onnx.AttributeProto.GRAPHS:
            size += sum(graph_bound(g) + 11 for g in a.graphs)
        elif a.type == onnx.AttributeProto.SPARSE_TENSOR:
            size += _tensor_bound(a.sparse_tensor.values) + _tensor_bound(a.sparse_tensor.indices) + 32
        elif a.type == onnx.AttributeProto.SPARSE_TENSORS:
            size += sum(_tensor_bound(s.values) + _tensor_bound(s.indices) + 32 for s in a.sparse_tensors)
        else:
            size += a.ByteSize()
    return size


def graph_bound(graph: onnx.GraphProto) -> int:
    """Upper bound of ``graph``'s serialized size with every tensor inline; reads no tensor data."""
    size = 64 + len(graph.name) + len(graph.doc_string)
    size += sum(_tensor_bound(t) + 11 for t in graph.initializer)
    size += sum(_tensor_bound(s.values) + _tensor_bound(s.indices) + 32 for s in graph.sparse_initializer)
    size += sum(_node_bound(n) + 11 for n in graph.node)
    for vi in list(graph.input) + list(graph.output) + list(graph.value_info):
        size += vi.ByteSize() + 11
    size += sum(q.ByteSize() + 11 for q in graph.quantization_annotation)
    return size


def size_bound(model: onnx.ModelProto) -> int:
    """Upper bound of ``model``'s serialized size **with all its weights inline** (external and lazy
    ones included), computed from dims and field counts: no serialization, no copy. ``ByteSize()``
    would serialize the model (and raise over 2 GiB)."""
    size = 256 + len(model.producer_name) + len(model.producer_version) + len(model.domain) + len(model.doc_string)
    size += graph_bound(model.graph) + 11
    size += sum(o.ByteSize() + 11 for o in model.opset_import)
    size += sum(p.ByteSize() + 11 for p in model.metadata_props)
    for f in model.functions:
        size += 64 + sum(_node_bound(n) + 11 for n in f.node) + len(f.name) + len(f.domain) + len(f.doc_string)
        size += sum(len(x) + 11 for x in list(f.input) + list(f.output) + list(f.attribute))
        size += sum(o.ByteSize() + 11 for o in f.opset_import)
    for ti in model.training_info:
        size += 64 + graph_bound(ti.initialization) + graph_bound(ti.algorithm)
    return size


def skeleton_bound(model: onnx.ModelProto) -> int:
    """Like :func:`size_bound`, but external and lazy tensors count only their reference."""
    lazy_data = sum(tensor_nbytes(t) for t in top_initializers(model) if is_external(t))
    return size_bound(model) - lazy_data


# ---------------------------------------------------------------------------------------------------
# copying protos without their weights


def _is_repeated(fd) -> bool:
    flag = getattr(fd, "is_repeated", None)
    if flag is not None:
        return bool(flag)
    return fd.label == fd.LABEL_REPEATED


def copy_except(src, dst, skip: set[str]):
    """Copy every set field of ``src`` into ``dst`` except the ``skip`` names (no other data copied)."""
    for fd, value in src.ListFields():
        if fd.name in skip:
            continue
        if _is_repeated(fd):
            getattr(dst, fd.name).extend(value)
        elif fd.message_type is not None:
            getattr(dst, fd.name).CopyFrom(value)
        else:
            setattr(dst, fd.name, value)
    return dst


def tensor_header(t: onnx.TensorProto) -> onnx.TensorProto:
    """``t`` without its data or external reference (name, dims, type, doc string, metadata)."""
    return copy_except(t, onnx.TensorProto(), {"raw_data", "external_data", "data_location"})


def model_without_initializers(model: onnx.ModelProto, keep=None) -> onnx.ModelProto:
    """A copy of ``model`` whose main graph has only the initializers ``keep(t)`` accepts (default none);
    the other fields are copied, the dropped tensors' data never is."""
    out = copy_except(model, onnx.ModelProto(), {"graph"})
    copy_except(model.graph, out.graph, {"initializer"})
    if keep is not None:
        out.graph.initializer.extend(t for t in model.graph.initializer if keep(t))
    return out


# ---------------------------------------------------------------------------------------------------
# protobuf wire format (only what is needed to skip the weights of an inline .onnx file)


class WireError(ValueError):
    pass


def _read_varint(buf, pos: int, end: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= end:
            raise WireError("truncated varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise WireError("varint too long")


def _encode_varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _fields(buf, pos: int, end: int):
    """(field number, wire type, start of the field, start of its payload, end of the field)."""
    while pos < end:
        start = pos
        key, pos = _read_varint(buf, pos, end)
        number, wire = key >> 3, key & 7
        if wire == 0:
            _, after = _read_varint(buf, pos, end)
        elif wire == 1:
            after = pos + 8
        elif wire == 2:
            n, pos = _read_varint(buf, pos, end)
            after = pos + n
        elif wire == 5:
            after = pos + 4
        else:
            raise WireError(f"unsupported wire type {wire}")
        if after > end:
            raise WireError("field runs past the end of its message")
        yield number, wire, start, pos, after
        pos = after


def _strip_tensor(buf, pos, end, min_bytes, found):
    """The tensor's fields without its ``raw_data`` when that is large, recording where it lies.

    A field that occurs twice is protobuf's *last* occurrence (what protobuf, onnx and ONNX Runtime
    read), so only the last ``raw_data`` decides: when it is large every ``raw_data`` is dropped and the
    last one referenced; when it is small they all stay and protobuf picks it as usual."""
    fields = list(_fields(buf, pos, end))
    raws = [(body, after) for number, wire, _, body, after in fields if number == _RAW_DATA and wire == 2]
    stripped = None
    if raws and raws[-1][1] - raws[-1][0] >= min_bytes:
        stripped = (raws[-1][0], raws[-1][1] - raws[-1][0])
    out = bytearray()
    for number, wire, start, body, after in fields:
        if stripped is not None and number == _RAW_DATA and wire == 2:
            continue
        out += buf[start:after]
    found.append(stripped)
    return bytes(out)


def _strip_graph(buf, pos, end, min_bytes, found):
    out = bytearray()
    for number, wire, start, body, after in _fields(buf, pos, end):
        if number == _INITIALIZER and wire == 2:
            tensor = _strip_tensor(buf, body, after, min_bytes, found)
            out += _encode_varint((_INITIALIZER << 3) | 2) + _encode_varint(len(tensor)) + tensor
        else:
            out += buf[start:after]
    return bytes(out)


def strip_inline_weights(path: Path, min_bytes: int = LAZY_MIN_TENSOR) -> tuple[onnx.ModelProto, int] | None:
    """Parse the ``.onnx`` file ``path`` without the ``raw_data`` of main-graph initializers of at least
    ``min_bytes``; those tensors become lazy references into ``path`` itself. Returns ``(model, number
    of tensors stripped)``, or None when there is nothing to strip. The file is read through ``mmap``:
    only tags and lengths are touched, never the weights' pages."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        end = len(buf)
        out = bytearray()
        found: list[tuple[int, int] | None] = []
        for number, wire, start, body, after in _fields(buf, 0, end):
            if number == _GRAPH and wire == 2:
                graph = _strip_graph(buf, body, after, min_bytes, found)
                out += _encode_varint((_GRAPH << 3) | 2) + _encode_varint(len(graph)) + graph
            else:
                out += buf[start:after]
    if not any(found):
        return None
    model = onnx.ModelProto.FromString(bytes(out))
    if len(model.graph.initializer) != len(found):
        raise WireError("initializer count mismatch")
    location = trust_source(os.path.abspath(path))
    for tensor, where in zip(model.graph.initializer, found):
        if where is not None:
            offset, length = where
            if length != tensor_nbytes(tensor):
                raise WireError(f"tensor {tensor.name!r} holds {length} bytes of raw data, its dims and type "
                                f"make {tensor_nbytes(tensor)}")
            set_external(tensor, location, offset, length)
    return model, sum(1 for w in found if w)


# ---------------------------------------------------------------------------------------------------
# reading: memory maps for graphsurgeon


_PLAIN_DTYPES = {
    onnx.TensorProto.FLOAT: np.float32, onnx.TensorProto.FLOAT16: np.float16, onnx.TensorProto.DOUBLE: np.float64,
    onnx.TensorProto.INT8: np.int8, onnx.TensorProto.INT16: np.int16, onnx.TensorProto.INT32: np.int32,
    onnx.TensorProto.INT64: np.int64, onnx.TensorProto.UINT8: np.uint8, onnx.TensorProto.UINT16: np.uint16,
    onnx.TensorProto.UINT32: np.uint32, onnx.TensorProto.UINT64: np.uint64, onnx.TensorProto.BOOL: np.bool_,
}
_ONNX_OF = {np.dtype(v): k for k, v in _PLAIN_DTYPES.items()}


class MappedArray(np.memmap):
    """A read-only memory map of one lazy tensor; ``onnxfuse_ref`` is the reference it was mapped from
    (set on the array :func:`map_tensor` returns, never on views of it)."""

    def __array_finalize__(self, obj):
        super().__array_finalize__(obj)
        self.onnxfuse_ref = None


def map_tensor(tensor: onnx.TensorProto) -> np.ndarray:
    """The values of a lazy tensor: a read-only ``MappedArray`` for plain numeric types, else a copy
    converted by ``onnx.numpy_helper`` (bfloat16, float8, 4-bit types, strings)."""
    where = file_range(tensor)
    shape = tuple(int(d) for d in tensor.dims)
    dtype = _PLAIN_DTYPES.get(tensor.data_type)
    if dtype is None or not shape or where.length == 0:
        return onnx.numpy_helper.to_array(inline_copy(tensor))
    arr = MappedArray(where.path, dtype=dtype, mode="r", offset=where.offset, shape=shape)
    ref = onnx.TensorProto()
    ref.CopyFrom(tensor)
    arr.onnxfuse_ref = ref
    return arr


def read_range(where: FileRange) -> bytes:
    with open(where.path, "rb") as f:
        f.seek(where.offset)
        data = f.read(where.length)
    if len(data) != where.length:
        raise OSError(errno.EIO, f"{where.path} ends before offset {where.offset + where.length}")
    return data


def inline_copy(tensor: onnx.TensorProto) -> onnx.TensorProto:
    """A copy of lazy ``tensor`` with its bytes read into ``raw_data``."""
    out = tensor_header(tensor)
    out.raw_data = read_range(file_range(tensor))
    return out


def mapped_values_class():
    """:class:`MappedValues` (a graphsurgeon ``LazyValues``), defined on first use so that importing this
    module does not import onnx-graphsurgeon."""
    global _MappedValues
    if _MappedValues is None:
        # start-up: it loads graphsurgeon, which importing this module does not
        from onnx_graphsurgeon.ir.tensor import LazyValues

        class MappedValues(LazyValues):
            """graphsurgeon's lazy values for a lazy tensor: ``load()`` maps the file instead of copying
            the bytes, and exporting keeps the reference (``self.tensor``)."""

            def load(self):
                return map_tensor(self.tensor)

        _MappedValues = MappedValues
    return _MappedValues


_MappedValues = None


def source_reference(values) -> onnx.TensorProto | None:
    """The reference a graphsurgeon constant's values still equal, if any: a lazy ``LazyValues`` not yet
    loaded, or the exact read-only map :func:`map_tensor` returned (a rule looked, nothing changed)."""
    # start-up: it loads graphsurgeon, which importing this module does not
    from onnx_graphsurgeon.ir.tensor import LazyValues

    if isinstance(values, LazyValues):
        t = values.tensor
        return t if isinstance(t, onnx.TensorProto) and is_lazy(t) else None
    ref = getattr(values, "onnxfuse_ref", None)
    if ref is not None and isinstance(values, MappedArray) and not values.flags.writeable:
        return ref
    return None


# ---------------------------------------------------------------------------------------------------
# the C allocator


_malloc_tuned = False


def return_freed_memory() -> bool:
    """Make glibc give freed blocks of 1 MiB or more back to the system at once (``mallopt(
    M_MMAP_THRESHOLD, 1 MiB)``); once per process, only with glibc. Returns whether it was set.

    Why: glibc serves a large allocation with its own ``mmap`` (returned to the system on ``free``),
    but each such free *raises* the threshold to the freed size, up to 32 MiB, after which blocks of
    that size come from the heap and stay with the process when freed. Every ONNX Runtime session and
    every weight a rule makes allocates such blocks: optimizing a 1.0 GiB model made of 16 MiB weights
    peaked at 2.13 GiB with the default and at 1.16 GiB with the threshold fixed at 1 MiB (and ran in
    13.8 s instead of 18.0 s). Weights over 32 MiB were never affected. Called for large (lazy) models
    only, so small runs keep glibc's defaults.
    """
    global _malloc_tuned
    if _malloc_tuned:
        return True
    try:
        libc = ctypes.CDLL(None)
        if not hasattr(libc, "gnu_get_libc_version"):
            return False
        _malloc_tuned = bool(libc.mallopt(-3, LAZY_MIN_TENSOR))  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False
    return _malloc_tuned


# ---------------------------------------------------------------------------------------------------
# the spill file: new weights made during a run


class _Spill:
    """One append-only file per process in ``$TMPDIR`` holding the arrays rules created."""

    def __init__(self):
        folder = tempfile.gettempdir()
        self.dir = None
        self.fd = None
        if hasattr(os, "O_TMPFILE") and os.path.isdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                self.fd = os.open(folder, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
                self.location = trust_source(f"/proc/self/fd/{self.fd}")
                self.anonymous = True
        if self.fd is None:
            self.dir = tempfile.mkdtemp(prefix="onnxfuse-weights-")
            path = os.path.join(self.dir, "spill.data")
            self.fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
            self.location = trust_source(path)
            self.anonymous = False
        self.size = 0
        atexit.register(self.close)

    def append(self, arr: np.ndarray) -> tuple[int, int]:
        offset = _aligned(self.size, arr.nbytes)
        os.lseek(self.fd, offset, os.SEEK_SET)
        _write_array(self.fd, arr)
        self.size = offset + arr.nbytes
        return offset, arr.nbytes

    def close(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = None
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None


_spill: _Spill | None = None


def spill_array(arr: np.ndarray, name: str) -> onnx.TensorProto:
    """Append ``arr`` to this process's spill file; return a lazy reference to it named ``name``.
    Raises ``OSError`` (ENOSPC when ``$TMPDIR`` is full)."""
    global _spill
    if _spill is None:
        _spill = _Spill()
    offset, length = _spill.append(arr)
    ref = onnx.TensorProto(name=name, data_type=_ONNX_OF[np.dtype(arr.dtype)], dims=list(arr.shape))
    set_external(ref, _spill.location, offset, length)
    return ref


def spill_raw(tensor: onnx.TensorProto) -> onnx.TensorProto:
    """Append an inline tensor's ``raw_data`` to the spill file; return a lazy reference with its header."""
    global _spill
    if _spill is None:
        _spill = _Spill()
    offset, length = _spill.append(np.frombuffer(tensor.raw_data, dtype=np.uint8))
    ref = tensor_header(tensor)
    set_external(ref, _spill.location, offset, length)
    return ref


def spillable(arr) -> bool:
    return isinstance(arr, np.ndarray) and arr.dtype in _ONNX_OF and arr.nbytes > LAZY_MIN_TENSOR


def _aligned(pos: int, nbytes: int) -> int:
    align = ALIGN_LARGE if nbytes >= LAZY_MIN_TENSOR else ALIGN_SMALL
    return -(-pos // align) * align


def _write_all(fd: int, data) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = os.write(fd, view[: 1 << 30])
        view = view[n:]


def _write_array(fd: int, arr: np.ndarray) -> None:
    """Write ``arr``'s bytes (C order) without copying it whole: contiguous arrays straight from their
    buffer, others one slice along the first axis at a time."""
    if arr.flags.c_contiguous:
        _write_all(fd, arr.reshape(-1).view(np.uint8) if arr.ndim else arr.tobytes())
        return
    for row in arr:
        _write_all(fd, np.ascontiguousarray(row).reshape(-1).view(np.uint8))


# ---------------------------------------------------------------------------------------------------
# writing


def copy_range(src: FileRange, dst_fd: int) -> None:
    """Append ``src``'s bytes at ``dst_fd``'s position: in the kernel with ``copy_file_range`` (a
    reflink where the file system can), else ``sendfile``, else 8 MiB at a time."""
    with open(src.path, "rb") as f:
        fd = f.fileno()
        size = os.fstat(fd).st_size
        if src.offset + src.length > size:
            raise OSError(errno.EIO, f"{src.path} is {size} bytes, the model expects data up to "
                                     f"{src.offset + src.length} (was it changed during the run?)")
        offset, left = src.offset, src.length
        for method in ("copy_file_range", "sendfile"):
            if not left or not hasattr(os, method):
                continue
            try:
                while left:
                    if method == "copy_file_range":
                        n = os.copy_file_range(fd, dst_fd, min(left, 1 << 30), offset)
                    else:
                        n = os.sendfile(dst_fd, fd, offset, min(left, 1 << 30))
                    if n <= 0:
                        break
                    offset += n
                    left -= n
            except OSError as exc:
                if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EBADF):
                    raise
        while left:
            chunk = os.pread(fd, min(left, 8 << 20), offset)
            if not chunk:
                raise OSError(errno.EIO, f"{src.path}: unexpected end of file")
            _write_all(dst_fd, chunk)
            offset += len(chunk)
            left -= len(chunk)


class Payload:
    """The data of one main-graph initializer, written by :func:`write_payloads`: a file range (lazy) or
    the tensor's own inline ``raw_data`` (read once, when written)."""

    def __init__(self, tensor: onnx.TensorProto):
        self.tensor = tensor
        self.lazy = is_lazy(tensor)
        self.nbytes = file_range(tensor).length if self.lazy else tensor_nbytes(tensor)

    def write(self, fd: int) -> None:
        if self.lazy:
            copy_range(file_range(self.tensor), fd)
        else:
            _write_all(fd, self.tensor.raw_data)


def split_payloads(model: onnx.ModelProto, min_bytes: int):
    """``(skeleton, payloads)``: ``payloads[i]`` is the :class:`Payload` of main-graph initializer ``i``
    when its data must be streamed (lazy, or inline ``raw_data`` of ``min_bytes`` or more), else None;
    in ``skeleton`` those tensors are headers only. Relative (a file's own) references are kept as
    they are. No weight bytes are copied."""
    skeleton = model_without_initializers(model)
    payloads: list[Payload | None] = []
    for t in model.graph.initializer:
        if is_lazy(t) or (not is_external(t) and t.HasField("raw_data") and tensor_nbytes(t) >= min_bytes):
            payloads.append(Payload(t))
            skeleton.graph.initializer.append(tensor_header(t))
        else:
            payloads.append(None)
            skeleton.graph.initializer.add().CopyFrom(t)
    return skeleton, payloads


def inline_size(skeleton: onnx.ModelProto, payloads) -> int:
    """Exact size of the file :func:`write_inline` writes (serializes only the skeleton's parts)."""
    head, prefixes = _inline_parts(skeleton, payloads)
    return len(head) + sum(len(x) for x in prefixes) + sum(p.nbytes for p in payloads if p is not None)


def _inline_parts(skeleton: onnx.ModelProto, payloads) -> tuple[bytes, list[bytes]]:
    """The bytes of an inline file other than the payloads: the head (model fields, the graph's key and
    length, the graph's fields but initializers) and, per initializer, what precedes its payload."""
    head_model = copy_except(skeleton, onnx.ModelProto(), {"graph"}).SerializeToString()
    graph_rest = copy_except(skeleton.graph, onnx.GraphProto(), {"initializer"}).SerializeToString()
    prefixes = []
    graph_len = len(graph_rest)
    for t, p in zip(skeleton.graph.initializer, payloads):
        body = t.SerializeToString()
        if p is not None:
            raw_key = _encode_varint((_RAW_DATA << 3) | 2) + _encode_varint(p.nbytes)
            tlen = len(body) + len(raw_key) + p.nbytes
            prefix = _encode_varint((_INITIALIZER << 3) | 2) + _encode_varint(tlen) + body + raw_key
            graph_len += p.nbytes
        else:
            prefix = _encode_varint((_INITIALIZER << 3) | 2) + _encode_varint(len(body)) + body
        prefixes.append(prefix)
        graph_len += len(prefix)
    head = head_model + _encode_varint((_GRAPH << 3) | 2) + _encode_varint(graph_len) + graph_rest
    return head, prefixes


def write_inline(fd: int, skeleton: onnx.ModelProto, payloads) -> None:
    """Write one self-contained ``.onnx`` file: the wire format protobuf would write, with each
    initializer's ``raw_data`` streamed from its source (protobuf accepts fields in any order)."""
    head, prefixes = _inline_parts(skeleton, payloads)
    _write_all(fd, head)
    for prefix, p in zip(prefixes, payloads):
        _write_all(fd, prefix)
        if p is not None:
            p.write(fd)


def write_external(model_fd: int, data_fd: int, location: str, skeleton: onnx.ModelProto, payloads) -> int:
    """Write ``skeleton`` with every payload tensor referencing ``location`` (relative: the data file's
    name), and the payloads into ``data_fd``, aligned. Returns the data file's size."""
    pos = 0
    for t, p in zip(skeleton.graph.initializer, payloads):
        if p is None:
            continue
        offset = _aligned(pos, p.nbytes)
        if offset != pos:
            os.lseek(data_fd, offset, os.SEEK_SET)
        p.write(data_fd)
        set_external(t, location, offset, p.nbytes)
        pos = offset + p.nbytes
    if os.lseek(data_fd, 0, os.SEEK_END) < pos:
        os.ftruncate(data_fd, pos)
    _write_all(model_fd, skeleton.SerializeToString())
    return pos


def link_or_copy_sources(skeleton: onnx.ModelProto, payloads, folder: Path, prefix: str) -> list[Path]:
    """For a throw-away copy of a model (a session file): make the lazy payloads' source files visible in
    ``folder`` as hard links (``<prefix>.src<k>.data``) and point their tensors there, offsets kept.
    Returns the links; payloads whose file cannot be linked (another file system, permissions) stay in
    ``payloads`` to be copied, the linked ones are set to None."""
    links: dict[str, str] = {}
    made = []
    for i, (t, p) in enumerate(zip(skeleton.graph.initializer, payloads)):
        if p is None or not p.lazy:
            continue
        src = file_range(p.tensor)
        if src.path not in links:
            name = f"{prefix}.src{len(links)}.data"
            try:
                _hard_link(src.path, folder / name)
            except OSError:
                links[src.path] = ""
                continue
            links[src.path] = name
            made.append(folder / name)
        if links[src.path]:
            set_external(t, links[src.path], src.offset, src.length)
            payloads[i] = None
    return made


def _hard_link(src: str, dst: Path) -> None:
    if src.startswith("/proc/self/fd/"):
        # An O_TMPFILE file has no name: link it through its /proc entry, following the magic link.
        root = os.open("/", os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.link(src.lstrip("/"), dst, src_dir_fd=root, follow_symlinks=True)
        finally:
            os.close(root)
    else:
        os.link(src, dst)
