"""Reading and writing ONNX models safely, whatever their size.

Why this module exists: a CI step must never corrupt its input or leave a half-written output behind,
every problem with a file has to become one clear sentence rather than a protobuf traceback, and a
model over protobuf's 2 GiB limit must work like any other.

* ``load_model`` reads a model and turns every way a file can be wrong into a :class:`ModelLoadError`
  naming the file. External data is found relative to the **model's own folder** (never the working
  directory). A model with :data:`~onnxfuse.lazy_weights.LAZY_MODEL_BYTES` (1 GiB; in ``onnxfuse
  optimize`` 32 MiB, :data:`~onnxfuse.lazy_weights.CLI_LAZY_MODEL_BYTES`) of weights or more is loaded
  *lazily*: its large tensors stay in their files and are memory-mapped when a rule reads them
  (:mod:`onnxfuse.lazy_weights` says how and why); smaller models are loaded whole, as before.
* ``save_model`` writes atomically through :class:`onnxfuse.atomic.OutputSet`: temporary files in the
  destination folder, renamed into place together (external data, then the model) under a folder
  lock, or not at all. Models whose serialized size would reach 2 GiB are written with external data
  (``<output>.data`` beside the model, large tensors 64 KiB-aligned); the weights are streamed from
  their files, never serialized in memory. A later inline save of the same output removes the
  ``.data`` the earlier one left.
* Sizes are *measured without serializing* (:func:`onnxfuse.lazy_weights.size_bound`): upb's
  ``ByteSize()`` serializes the message to count it, which raises over 2 GiB and costs a full copy below.
* ``to_graph`` / ``to_model`` convert to and from onnx-graphsurgeon graphs while keeping what
  graphsurgeon would otherwise drop: IR version, producer, model metadata, doc string and opset imports;
  for a lazy model, weights a rule did not change stay references and new ones go to the spill file.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import tempfile
from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from google.protobuf.message import DecodeError
from onnx_graphsurgeon.exporters.onnx_exporter import OnnxExporter
from onnx_graphsurgeon.ir.tensor import LazyValues, SparseValues

from onnxfuse import lazy_weights as lw
from onnxfuse.atomic import OutputSet, check_file_name, destination, pause_point, write_error
from onnxfuse.errors import ModelLoadError, ModelSaveError, ResourceError, first_line
from onnxfuse.rewrites.facts.graph import graphs_within
from onnxfuse.rewrites.facts.inference import onnx_inferred
from onnxfuse.rewrites.facts.range_dims import range_lengths
from onnxfuse import repair

#: protobuf's hard limit for one serialized message; larger models need external data.
PROTOBUF_LIMIT = 2**31 - 1
#: Leave room for the rest of the proto when deciding whether tensors must go external.
_EXTERNAL_THRESHOLD = PROTOBUF_LIMIT - 64 * 2**20
#: Tensors smaller than this stay inline even in a model written with external data.
_EXTERNAL_MIN_TENSOR = 1024

#: Weights (bytes) of the last model loaded from a file, for the out-of-memory message.
last_model_weights = 0


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _tmpdir_error(exc: OSError, what: str) -> ResourceError | ModelSaveError:
    """A one-line error for a failure to write temporary files (a full ``$TMPDIR`` above all)."""
    folder = tempfile.gettempdir()
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return ResourceError(f"no space left in the temporary folder {folder} while writing {what} "
                             f"({exc.strerror}); free space there or set TMPDIR to a folder with room")
    return ModelSaveError(f"cannot write {what} in the temporary folder {folder} ({exc.strerror or exc})")


# ---------------------------------------------------------------------------------------------------
# loading


def load_model(path: str | os.PathLike, check: bool = True) -> onnx.ModelProto:
    """Load ``path`` with its external data; raise :class:`ModelLoadError` with one clear line on failure.

    A model with :data:`~onnxfuse.lazy_weights.LAZY_MODEL_BYTES` of weights or more comes back lazy: its
    tensors over 1 MiB are references to their files (absolute paths, see :mod:`onnxfuse.lazy_weights`),
    inline weights of a large ``.onnx`` file included. Either way no weight is read twice and the
    working directory plays no part.
    """
    global last_model_weights
    p = Path(path)
    if not p.exists():
        raise ModelLoadError(f"{p}: no such file")
    if p.is_dir():
        raise ModelLoadError(f"{p}: is a directory, expected an .onnx file")
    try:
        size = p.stat().st_size
    except OSError as exc:
        raise ModelLoadError(f"{p}: cannot read ({first_line(exc)})") from None
    if size == 0:
        raise ModelLoadError(f"{p}: file is empty")
    model, stripped = _parse(p, size)
    if model.ir_version <= 0 or not model.HasField("graph") or len(model.graph.output) == 0:
        raise ModelLoadError(f"{p}: not a valid ONNX model (no graph, outputs or IR version)")
    weights = lw.payload_bytes(model)
    last_model_weights = weights
    lazy = weights >= lw.LAZY_MODEL_BYTES
    if lazy:
        lw.return_freed_memory()
    try:
        _resolve_external_data(model, p, lazy, stripped)
    except OSError as exc:
        raise ModelLoadError(f"{p}: cannot load external data ({first_line(exc)})") from None
    if check:
        _check_repairable(model, name=str(p))
    return model


def _check_repairable(model: onnx.ModelProto, name: str) -> None:
    """The load check: ``onnx.checker`` on the model as :mod:`onnxfuse.repair` would repair it (what ONNX
    Runtime runs, the checker's false refusals repaired); the model itself is returned unrepaired, the
    pipeline repairs it (and reports what it repaired)."""
    fixed, _ = repair.repaired(model)
    if fixed is model:  # onnx.checker accepted it as it is: no second check
        return
    problem = repair.validity_problem(fixed)
    if problem is not None:
        raise ModelLoadError(f"{name}: invalid ONNX model: {problem}")


def _parse(p: Path, size: int) -> tuple[onnx.ModelProto, bool]:
    """The model proto of ``p`` without external data, and whether its inline weights were stripped: a
    large file is parsed without them (they become references into ``p``), so neither protobuf nor
    memory sees them."""
    try:
        if size >= lw.LAZY_MODEL_BYTES:
            stripped = lw.strip_inline_weights(p)
            if stripped is not None:
                return stripped[0], True
        return onnx.load(str(p), load_external_data=False), False
    except lw.WireError as exc:
        raise ModelLoadError(f"{p}: not a valid ONNX model (protobuf parse failed: {exc})") from None
    except (DecodeError, RuntimeWarning, ValueError) as exc:
        too_big = " (a file over protobuf's 2 GiB limit: store the weights as external data)" \
            if size > PROTOBUF_LIMIT else ""
        raise ModelLoadError(f"{p}: not a valid ONNX model (protobuf parse failed: {first_line(exc)}){too_big}") from None
    except OSError as exc:
        raise ModelLoadError(f"{p}: cannot read ({first_line(exc)})") from None
    except Exception as exc:  # protobuf raises assorted types on garbage input
        raise ModelLoadError(f"{p}: not a valid ONNX model ({first_line(exc)})") from None


def _all_tensors(model: onnx.ModelProto):
    """(tensor, is a main-graph initializer) for every tensor of the model that can hold data."""
    for g in proto_graphs(model.graph):
        main = g is model.graph
        for t in g.initializer:
            yield t, main
        for s in g.sparse_initializer:
            yield s.values, False
            yield s.indices, False
        for node in g.node:
            for a in node.attribute:
                if a.type == onnx.AttributeProto.TENSOR:
                    yield a.t, False
                elif a.type == onnx.AttributeProto.TENSORS:
                    for t in a.tensors:
                        yield t, False


def external_file(base: Path, location: str, tensor: str) -> Path:
    """The file ``location`` names, relative to the model's folder ``base``; one-line
    :class:`ModelLoadError` when it is absolute, leaves the folder, or is not a regular file (the same
    rules as ``onnx`` and ONNX Runtime, which refuse such models)."""
    if not location:
        raise ModelLoadError(f"tensor {tensor!r} is stored externally but names no file")
    if "\x00" in location:
        raise ModelLoadError(f"tensor {tensor!r}: external data location {location!r} holds a NUL character")
    if os.path.isabs(location):
        raise ModelLoadError(f"tensor {tensor!r}: external data location {location!r} must be relative to the model's folder")
    path = base / location
    real_base = os.path.realpath(base)
    if os.path.commonpath([real_base, os.path.realpath(path)]) != real_base:
        raise ModelLoadError(f"tensor {tensor!r}: external data location {location!r} points outside the model's folder")
    if not path.exists():
        raise FileNotFoundError(errno.ENOENT, "external data file is missing", str(path))
    if not path.is_file():
        raise ModelLoadError(f"tensor {tensor!r}: external data {path} is not a regular file")
    return path


def _file_range_of(t: onnx.TensorProto, info: dict) -> "lw.FileRange":
    """The tensor's ``offset`` and ``length`` as ONNX defines them (non-negative decimal integers); one
    :class:`ModelLoadError` line for anything else a file may hold there."""
    for key in ("offset", "length"):
        value = info.get(key)
        if value is not None and value != "" and not (value.isascii() and value.isdigit()):
            raise ModelLoadError(f"tensor {t.name!r}: external data {key} {value!r} is not a non-negative integer")
    return lw.file_range(t)


def _resolve_external_data(model: onnx.ModelProto, p: Path, lazy: bool, stripped: bool) -> None:
    """Make every external tensor either inline (read from its file) or, in a lazy model, a large main
    graph initializer, a lazy reference (absolute path) checked against the file's size.

    Every location the *file* names goes through :func:`external_file` (relative, inside the model's
    folder, a regular file); only the references :func:`~onnxfuse.lazy_weights.strip_inline_weights`
    made into ``p`` itself (``stripped``) skip it."""
    base = p.parent.absolute()
    own = os.path.abspath(p)
    for t, main in _all_tensors(model):
        if not lw.is_external(t):
            continue
        if stripped and main and lw.is_lazy(t) and lw.file_range(t).path == own:  # made by strip_inline_weights for p itself
            where = lw.file_range(t)
        else:
            info = lw.external_info(t)
            try:
                path = external_file(base, info.get("location", ""), t.name)
                where = _file_range_of(t, info)
                where = lw.FileRange(str(path), where.offset, where.length)
            except FileNotFoundError as exc:
                raise ModelLoadError(f"{p}: external data file is missing: {exc.filename}") from None
            except ModelLoadError as exc:
                raise ModelLoadError(f"{p}: {exc}") from None
            end = where.offset + where.length
            if end > os.path.getsize(where.path):
                raise ModelLoadError(f"{p}: external data of tensor {t.name!r} ends at byte {end}, past the end "
                                     f"of {where.path} ({os.path.getsize(where.path)} bytes): the file is truncated "
                                     f"or belongs to another model")
        if lazy and main and where.length > lw.LAZY_MIN_TENSOR:
            lw.set_external(t, lw.trust_source(os.path.abspath(where.path)), where.offset, where.length)
        else:
            data = lw.read_range(where)
            del t.external_data[:]
            t.data_location = onnx.TensorProto.DEFAULT
            t.raw_data = data


def check_given_model(model: onnx.ModelProto, name: str) -> onnx.ModelProto:
    """Refuse, with one :class:`ModelLoadError` line, a ``ModelProto`` handed to the API whose external
    data could not be read safely: an absolute location this process did not make (it could name any
    file the process can read; onnx and ONNX Runtime refuse it too), or a relative one (a proto in
    memory has no folder to resolve it against: pass the path, or ``onnx.load`` it with its data). Then the
    load check a file gets (:func:`load_model`): a model ONNX's checker refuses even once repaired is the
    caller's error (exit 1), not, as it was when only the output was checked, onnxfuse's own (exit 5)."""
    for t, _main in _all_tensors(model):
        if not lw.is_external(t) or lw.is_lazy(t):
            continue
        location = lw.external_info(t).get("location", "")
        if os.path.isabs(location):
            raise ModelLoadError(f"{name}: tensor {t.name!r}: external data location {location!r} is absolute; "
                                 "it must be relative to the model's folder")
        raise ModelLoadError(f"{name}: tensor {t.name!r} keeps its data in {location!r}, which a model in memory "
                             "cannot resolve: pass the model's path, or load it with onnx.load(path)")
    _check_repairable(model, name)
    return model


@functools.lru_cache(maxsize=8)
def _data_files(path: str, _stamp) -> tuple[str, ...]:
    try:
        p = Path(path)
        model = _parse(p, p.stat().st_size)[0]
    except Exception:
        return ()
    files = set()
    for t, _ in _all_tensors(model):
        if lw.is_external(t):
            location = lw.external_info(t).get("location", "")
            if location and "\x00" not in location:
                files.add(os.path.realpath(location if os.path.isabs(location) else p.parent / location))
    files.discard(os.path.realpath(p))  # references into the .onnx file itself (inline weights)
    return tuple(sorted(files))


def input_data_files(path: str | os.PathLike) -> list[str]:
    """The external-data files (real paths) the model file ``path`` refers to; [] when unreadable."""
    try:
        st = os.stat(path)
    except OSError:
        return []
    return list(_data_files(os.path.realpath(path), (st.st_mtime_ns, st.st_size)))


def input_files(path, what: str = "input model") -> dict:
    """``{path: what}`` plus each of its external-data files: what a run reads and must never write over
    (reports included, also the failure report written after an error)."""
    if path is None:
        return {}
    return {path: what, **{f: f"{what}'s external data" for f in input_data_files(path)}}


# ---------------------------------------------------------------------------------------------------
# checking and measuring


def validity_problem(model: onnx.ModelProto) -> str | None:
    """What ``onnx.checker`` says is wrong with ``model`` (one line), or None when it is valid.

    A lazy or large model is checked as a skeleton written to a temporary folder, its large tensors
    pointing at an empty file: the checker verifies that external data exists, not its contents, so
    nothing of the weights is serialized or copied.
    """
    try:
        if lw.has_lazy(model) or lw.size_bound(model) >= _EXTERNAL_THRESHOLD:
            _check_skeleton(model)
        else:
            onnx.checker.check_model(model)
    except onnx.checker.ValidationError as exc:
        return first_line(exc)
    return None


def _check_skeleton(model: onnx.ModelProto) -> None:
    skeleton, payloads = lw.split_payloads(model, _EXTERNAL_MIN_TENSOR)
    for t, p in zip(skeleton.graph.initializer, payloads):
        if p is not None or lw.is_external(t):
            lw.set_external(t, "weights.data", 0, lw.tensor_nbytes(t))
    for t, main in _all_tensors(skeleton):
        if lw.is_external(t) and not main:
            lw.set_external(t, "weights.data", 0, lw.tensor_nbytes(t))
    bound = lw.size_bound(skeleton) - sum(lw.tensor_nbytes(t) for t in skeleton.graph.initializer if lw.is_external(t))
    if bound >= PROTOBUF_LIMIT:
        raise ResourceError(f"the model without its weights is about {_gib(bound)}, over protobuf's 2 GiB limit")
    try:
        with tempfile.TemporaryDirectory(prefix="onnxfuse-check-") as tmp:
            (Path(tmp) / "weights.data").touch()
            (Path(tmp) / "model.onnx").write_bytes(skeleton.SerializeToString())
            onnx.checker.check_model(str(Path(tmp) / "model.onnx"))
    except OSError as exc:
        raise _tmpdir_error(exc, "a copy of the model for the ONNX checker") from None


def check_model(model: onnx.ModelProto, name: str, error: type = ModelLoadError) -> None:
    """Run ``onnx.checker`` and raise ``error`` with its one-line complaint on failure."""
    problem = validity_problem(model)
    if problem is not None:
        raise error(f"{name}: invalid ONNX model: {problem}")


def needs_external_data(model: onnx.ModelProto) -> bool:
    """True when ``model`` must be written with external data for another program to read it: it holds
    lazy references, or its serialized size (bounded without serializing) reaches the 2 GiB limit."""
    return lw.has_lazy(model) or lw.size_bound(model) >= _EXTERNAL_THRESHOLD


# ---------------------------------------------------------------------------------------------------
# writing


def write_model(model: onnx.ModelProto, path: Path, link_sources: bool = True) -> None:
    """Plain (non-atomic) write for throw-away copies (ONNX Runtime sessions, tools); external data in
    ``<name>.data`` beside it when :func:`needs_external_data`.

    With ``link_sources``, a lazy model's source files are hard-linked beside ``path`` instead of copied
    (ONNX Runtime refuses absolute and symlinked locations; a hard link is neither), so a session file
    for a 2 GiB model costs a few kilobytes; sources on another file system are copied in the kernel.
    """
    path = Path(path)
    if not needs_external_data(model):
        with open(path, "wb") as f:
            f.write(model.SerializeToString())
        return
    skeleton, payloads = lw.split_payloads(model, _EXTERNAL_MIN_TENSOR)
    if link_sources:
        lw.link_or_copy_sources(skeleton, payloads, path.parent, path.name)
    data = path.with_name(path.name + ".data")
    with open(path, "wb") as m, open(data, "wb") as d:
        lw.write_external(m.fileno(), d.fileno(), data.name, skeleton, payloads)
    if not any(p is not None for p in payloads):
        data.unlink()


def session_source(model: onnx.ModelProto) -> tuple[bytes, dict]:
    """For ONNX Runtime, without any file: ``(model bytes, {initializer name: read-only memory map})``.

    The bytes are the skeleton (lazy tensors still absolute references, which ONNX Runtime would refuse
    on their own); pass the maps with ``SessionOptions.add_external_initializers(names, [OrtValue.
    ortvalue_from_numpy(a) for a in maps])``, which replaces those initializers before the locations
    are looked at, and keep the OrtValues alive as long as the session. On the CPU ONNX Runtime uses
    the mapped pages as they are: nothing is copied and nothing is written to ``$TMPDIR`` (the
    :func:`write_model` route hard-links or, across file systems, copies the weights)."""
    maps = {t.name: lw.map_tensor(t) for t in model.graph.initializer if lw.is_lazy(t)}
    return model.SerializeToString(), maps


def same_file(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """True when ``a`` and ``b`` name the same file (also through symlinks or relative paths)."""
    pa, pb = Path(a), Path(b)
    if pa.exists() and pb.exists():
        return os.path.samefile(pa, pb)
    return pa.resolve() == pb.resolve()


def data_path(out: str | os.PathLike) -> Path:
    """Where :func:`save_model` puts ``out``'s external data: ``<out>.data`` beside it."""
    out = Path(out)
    return out.with_name(out.name + ".data")


def check_output_path(path: str | os.PathLike, input_path=None, force: bool = False) -> Path:
    """Fail early (before any long work) if ``path`` cannot receive the output; return its folder.

    Refused even with ``force``: an output that *is* one of the input's external-data files, or whose
    ``<output>.data`` would replace one without replacing the input model itself (the input would be
    left pointing at another model's weights).
    """
    check_file_name(path, "output model")
    out = Path(path)
    if input_path is not None:
        replaces_input = same_file(out, input_path)
        if replaces_input and not force:
            raise ModelSaveError(f"{out}: output is the same file as the input; choose another path or pass --force")
        data = data_path(out)
        for f in input_data_files(input_path):
            if same_file(out, f):
                raise ModelSaveError(f"{out}: is the external-data file of the input model {input_path}; "
                                     "choose another output path")
            if not replaces_input and same_file(data, f):
                raise ModelSaveError(f"{out}: its external data would go to {data}, which holds the weights of "
                                     f"the input model {input_path}; choose another output name")
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        raise ModelSaveError(f"{out}: output directory {parent} does not exist")
    if out.is_dir():
        raise ModelSaveError(f"{out}: is a directory")
    if not os.access(parent, os.W_OK):
        raise ModelSaveError(f"{out}: output directory {parent} is not writable")
    destination(out, "output model")
    destination(data_path(out), "output model's external data")
    return parent


def save_model(
    model: onnx.ModelProto,
    path: str | os.PathLike,
    input_path: str | os.PathLike | None = None,
    force: bool = False,
    check: bool = True,
    outputs: OutputSet | None = None,
) -> Path:
    """Write ``model`` to ``path`` atomically; refuse to overwrite ``input_path`` unless ``force``.

    The model is checked with ``onnx.checker`` before anything reaches its final name, so a failure at
    any point leaves the destination exactly as it was. With ``outputs`` the files are only *staged* in
    that :class:`~onnxfuse.atomic.OutputSet` (the caller adds its reports and commits them together);
    without it they are committed here.
    """
    out = Path(path)
    check_output_path(out, input_path, force)
    if check:
        check_model(model, name=str(out), error=ModelSaveError)
    if outputs is not None:
        stage_model(outputs, model, out)
        return out
    with OutputSet() as own:
        stage_model(own, model, out)
        own.commit()
    return out


def stage_model(outputs: OutputSet, model: onnx.ModelProto, out: Path) -> None:
    """Write ``model`` to temporary files in ``out``'s folder, registered in ``outputs`` for commit:
    inline when the whole file stays under the 2 GiB limit (computed exactly from the skeleton's parts
    and the weights' lengths), else ``<out>.data`` + the model. Weights are streamed from their files
    (or from the proto's own ``raw_data``, one tensor at a time); the proto is never serialized whole."""
    out = Path(out)
    skeleton, payloads = lw.split_payloads(model, _EXTERNAL_MIN_TENSOR)
    data_final = data_path(out)
    try:
        external = lw.inline_size(skeleton, payloads) >= _EXTERNAL_THRESHOLD
    except ValueError as exc:  # protobuf refuses to serialize the skeleton itself
        raise ResourceError(f"{out}: the model cannot be serialized ({first_line(exc)})") from None
    current = (out, "model")
    try:
        if external:
            current = (data_final, "external data")
            data_tmp = outputs.temp_for(data_final, "external data")
            current = (out, "model")
            model_tmp = outputs.temp_for(out, "model")
            with open(data_tmp, "r+b") as d, open(model_tmp, "r+b") as m:
                current = (data_final, "external data")
                lw.write_external(m.fileno(), d.fileno(), data_final.name, skeleton, payloads)
        else:
            model_tmp = outputs.temp_for(out, "model")
            with open(model_tmp, "r+b") as m:
                lw.write_inline(m.fileno(), skeleton, payloads)
            if data_final.is_file():
                outputs.remove(data_final)  # the previous save's external data is stale now
    except OSError as exc:
        raise write_error(exc, *current) from None
    pause_point("data-written")


def make_lazy(model: onnx.ModelProto) -> onnx.ModelProto:
    """A lazy copy of an in-memory ``model``: main-graph tensors over 1 MiB are appended to the spill
    file (one at a time) and referenced. The copy costs the skeleton; ``model`` is unchanged."""
    lw.return_freed_memory()
    out = lw.model_without_initializers(model)
    for t in model.graph.initializer:
        if not lw.is_external(t) and t.HasField("raw_data") and lw.tensor_nbytes(t) > lw.LAZY_MIN_TENSOR:
            try:
                ref = lw.spill_raw(t)
            except OSError as exc:
                raise _tmpdir_error(exc, f"the weights of a {_gib(lw.payload_bytes(model))} model") from None
            out.graph.initializer.append(ref)
        else:
            out.graph.initializer.add().CopyFrom(t)
    return out


# ---------------------------------------------------------------------------------------------------
# onnx-graphsurgeon round trip


#: ONNX IR version from which an initializer listed among the graph inputs is a default value the
#: caller may override (ONNX Runtime treats it as non-constant); below it, every initializer must be
#: listed as an input and is a constant.
OVERRIDABLE_IR_VERSION = 4


def overridable_initializers(model: onnx.ModelProto) -> set[str]:
    """Names of the initializers a caller may feed (listed among the graph inputs, IR version >= 4)."""
    if model.ir_version < OVERRIDABLE_IR_VERSION:
        return set()
    inputs = {vi.name for vi in model.graph.input}
    return {t.name for t in model.graph.initializer if t.name in inputs}


@contextlib.contextmanager
def quiet_graphsurgeon():
    """onnx-graphsurgeon's warnings off for the block, its level restored after. It warns for every bfloat16
    tensor it imports or reads ("could not be converted to a NumPy type": onnx hands ml_dtypes' bfloat16,
    and the tensor exports as bfloat16 again; ``--precision bf16`` printed 600 lines on a 2-layer BERT) and
    for every subgraph constant folding cannot evaluate: expected, and onnxfuse reports what matters itself."""
    level = gs.logger.G_LOGGER.severity
    gs.logger.G_LOGGER.severity = gs.logger.G_LOGGER.ERROR
    try:
        yield
    finally:
        gs.logger.G_LOGGER.severity = level


def to_graph(model: onnx.ModelProto):
    """Import ``model`` into an onnx-graphsurgeon graph.

    Overridable initializers come in as graph inputs, not constants: graphsurgeon would make them
    constants, and a rule would then fold a value the caller may replace at run time (BatchNorm folded
    into a weight that stays an input under the same name gave outputs 0.44 off when a caller fed it).
    :func:`to_model` puts their initializers back unchanged.

    Lazy tensors become :class:`~onnxfuse.lazy_weights.MappedValues`: reading ``.values`` maps the file
    (read-only) instead of copying it. Their graphsurgeon ``data_location`` is cleared, since the values
    carry their own reference (graphsurgeon would otherwise mark a replaced, inline value EXTERNAL).
    """
    keep = overridable_initializers(model)
    if keep:
        # Only the graph's initializer list changes; the caller's proto is kept. No weight is copied
        # for a lazy model (its initializers are references).
        model = lw.model_without_initializers(model, keep=lambda t: t.name not in keep)
    try:
        graph = gs.import_onnx(model)
    except UnicodeDecodeError:
        raise ModelLoadError(_undecodable_attribute(model)) from None
    _densify_sparse(graph)
    _adopt_lazy(graph)
    lazy = lw.has_lazy(model)
    graph.__dict__["onnxfuse_lazy"] = lazy
    if lazy:
        _hook_graphsurgeon_export()
    return graph


_export_hooked = False


def _hook_graphsurgeon_export() -> None:
    """Make every graphsurgeon export of a *lazy* graph keep its weights out of the proto.

    Rules export the whole graph to run ONNX shape inference on it (fuse-elementwise does, per match).
    graphsurgeon copies every array it exports, twice (``tobytes()``, then into the proto), and a lazy
    graph's weights are arrays once a rule has read them (a read-only map) or made them (a fold): with
    the 2.25 GiB model at ``--target cuda`` that export took the peak from 1.5x to 3.8x the weights.
    The hook runs :func:`_externalize` on the graph first (maps back to their references, new arrays over
    1 MiB to the spill file, each once), so the export holds references only. Graphs that
    :func:`to_graph` did not mark lazy (all models under 1 GiB) are exported exactly as before.
    """
    global _export_hooked
    if _export_hooked:
        return

    original = OnnxExporter.export_graph

    def export_graph(graph, do_type_check=True):
        if getattr(graph, "__dict__", {}).get("onnxfuse_lazy"):
            _externalize(graph, lazy=True)
        return original(graph, do_type_check=do_type_check)

    OnnxExporter.export_graph = staticmethod(export_graph)
    _export_hooked = True


def store_weight(graph, values):
    """What a rule should give a graphsurgeon ``Constant`` for a weight it computed: in a lazy graph
    (from a lazy model), an array over 1 MiB is appended to the spill file at once and returned as
    :class:`~onnxfuse.lazy_weights.MappedValues`, so new weights never pile up in memory until
    :func:`to_model`; otherwise ``values`` itself. (Folding 9 BatchNorms into 256 MiB weights holds all
    nine new arrays until the export: 2.25 GiB; through this, one at a time.)"""
    if graph.__dict__.get("onnxfuse_lazy") and lw.spillable(values):
        try:
            ref = lw.spill_array(values, "weight")
        except OSError as exc:
            raise _tmpdir_error(exc, f"a new weight ({_gib(values.nbytes)})") from None
        return lw.mapped_values_class()(ref)
    return values


def _undecodable_attribute(model: onnx.ModelProto) -> str:
    """The one line for a string attribute that is not UTF-8 (graphsurgeon decodes every one; ONNX
    says strings attributes are UTF-8 text), naming the node and attribute."""
    for g in proto_graphs(model.graph):
        for node in g.node:
            for a in node.attribute:
                texts = [a.s] if a.type == onnx.AttributeProto.STRING else list(a.strings)
                for text in texts:
                    try:
                        text.decode("utf-8")
                    except UnicodeDecodeError:
                        return (f"node {node.name or node.op_type!r} ({node.op_type}): attribute {a.name!r} is not "
                                "UTF-8 text, as ONNX requires string attributes to be")
    return "a string attribute is not UTF-8 text, as ONNX requires"


def _densify_sparse(graph) -> None:
    """Sparse initializers as the dense arrays they stand for, in their own dtype.

    graphsurgeon's ``SparseValues`` builds the dense array with ``np.zeros(shape)`` (float64 whatever
    the values' type) and ignores ``raw_data``: a float sparse weight came back float64, and the model
    written (even with ``--no-validate``) was one ONNX Runtime refuses. Exact: the missing entries are
    zeros by definition, and ONNX Runtime densifies sparse initializers at load the same way."""
    for t in graph.tensors().values():
        if isinstance(t, gs.Constant) and isinstance(t._values, SparseValues):
            sparse = t._values.tensor
            values = onnx.numpy_helper.to_array(sparse.values)
            indices = onnx.numpy_helper.to_array(sparse.indices).astype(np.int64)
            dense = np.zeros(tuple(sparse.dims), dtype=values.dtype)
            if indices.ndim == 1:
                dense.reshape(-1)[indices] = values
            else:
                dense[tuple(indices.T)] = values
            t._values = dense


def _adopt_lazy(graph) -> None:
    """Every lazy constant as :class:`~onnxfuse.lazy_weights.MappedValues`, also those only bodies read
    (a merged decoder's weights: each If branch reads them, the main graph's nodes do not)."""
    mapped = lw.mapped_values_class()
    seen = {id(t): t for g in graphs_within(graph) for t in g.tensors().values()}
    for t in seen.values():
        if not isinstance(t, gs.Constant):
            continue
        values = t._values
        if isinstance(values, LazyValues) and not isinstance(values, (SparseValues, mapped)) \
                and isinstance(values.tensor, onnx.TensorProto) and lw.is_lazy(values.tensor):
            ref = onnx.TensorProto()
            ref.CopyFrom(values.tensor)
            t._values = mapped(ref)
            t.data_location = None


def proto_graphs(graph: onnx.GraphProto):
    """``graph`` and every subgraph in its nodes' attributes (If/Loop/Scan bodies), outermost first."""
    yield graph
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from proto_graphs(attr.g)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for g in attr.graphs:
                    yield from proto_graphs(g)


def node_subgraphs(node: onnx.NodeProto) -> list[onnx.GraphProto]:
    """The bodies ``node`` holds in its attributes (If branches, a Loop or Scan body)."""
    found = []
    for attr in node.attribute:
        if attr.type == onnx.AttributeProto.GRAPH:
            found.append(attr.g)
        elif attr.type == onnx.AttributeProto.GRAPHS:
            found.extend(attr.graphs)
    return found


def defined_names(graph: onnx.GraphProto) -> set[str]:
    """Names ``graph`` itself defines: its inputs, initializers and node outputs (not its subgraphs')."""
    return ({vi.name for vi in graph.input} | {t.name for t in graph.initializer}
            | {t.values.name for t in graph.sparse_initializer if t.values.name}
            | {o for n in graph.node for o in n.output if o})


def free_names(graph: onnx.GraphProto) -> list[str]:
    """Names ``graph`` reads (its nodes, its outputs, its subgraphs' free names) that it does not define,
    in first-read order: the values it takes from enclosing graphs."""
    defined, seen, order = defined_names(graph), set(), []

    def read(name):
        if name and name not in defined and name not in seen:
            seen.add(name)
            order.append(name)

    for node in graph.node:
        for name in node.input:
            read(name)
        for body in node_subgraphs(node):
            for name in free_names(body):
                read(name)
    for vi in graph.output:
        read(vi.name)
    return order


def rename_outer_reads(graph: onnx.GraphProto, mapping: dict[str, str]) -> None:
    """Rename ``mapping``'s names where ``graph`` (a body) reads them as values of an enclosing graph: in its
    nodes' inputs, its outputs and, the same way, its own bodies. A graph that defines such a name itself
    reads its own value under it (ONNX scopes), so the name stays there and in what it encloses."""
    outer = {k: v for k, v in mapping.items() if k not in defined_names(graph)}
    if not outer:
        return
    for node in graph.node:
        node.input[:] = [outer.get(n, n) for n in node.input]
        for body in node_subgraphs(node):
            rename_outer_reads(body, outer)
    for vi in graph.output:
        vi.name = outer.get(vi.name, vi.name)


def names_defined_twice(graph: onnx.GraphProto) -> bool:
    """Some tensor name is written by nodes of two different graphs of ``graph`` (itself and its
    subgraphs): legal in ONNX (each subgraph is its own scope), and it confuses name-keyed analyses
    that span scopes (:func:`_infer`)."""
    seen: dict[str, int] = {}
    for k, g in enumerate(proto_graphs(graph)):
        for node in g.node:
            for name in node.output:
                if name and seen.setdefault(name, k) != k:
                    return True
    return False


def _node_domains(graph: onnx.GraphProto) -> set[str]:
    return {node.domain or "" for g in proto_graphs(graph) for node in g.node}


def to_model(graph, template: onnx.ModelProto) -> onnx.ModelProto:
    """Export ``graph`` and restore the model-level fields of ``template`` that graphsurgeon drops.

    Opset imports are those of the template, plus version 1 of any new domain a rewrite introduced
    (``com.microsoft``, ``ai.onnxfuse``); the default domain's is raised to ``graph.opset`` where a
    rewrite raised that (``rewrites._opset``). Stale value_info is dropped by the export itself.

    Weights: a constant whose values still equal a lazy reference (never loaded, or loaded read-only)
    is exported as that reference; when the model is lazy (the template is, or the graph's new arrays
    reach :data:`~onnxfuse.lazy_weights.LAZY_MODEL_BYTES`), arrays over 1 MiB that rules created are
    appended to the spill file and exported as references too. graphsurgeon would otherwise copy each
    array twice (``tobytes()``, then into the proto). The graph's constants are switched to those
    references, so it stays usable and its arrays can be freed.
    """
    _externalize(graph, lazy=lw.has_lazy(template))
    _pack_sub_byte(graph)
    model = gs.export_onnx(graph, do_type_check=False)
    _hoist_body_initializers(model.graph)
    model.ir_version = template.ir_version
    model.producer_name = template.producer_name
    model.producer_version = template.producer_version
    model.domain = template.domain
    model.model_version = template.model_version
    model.doc_string = template.doc_string
    del model.metadata_props[:]
    model.metadata_props.extend(template.metadata_props)
    del model.opset_import[:]
    model.opset_import.extend(template.opset_import)
    raised = int(getattr(graph, "opset", 0) or 0)
    for imp in model.opset_import:
        if imp.domain in ("", "ai.onnx") and raised > imp.version:
            imp.version = raised
    _restore_initializer_inputs(model, template)
    known = {o.domain for o in model.opset_import}
    for domain in sorted(_node_domains(model.graph) - known):
        if domain in ("", "ai.onnx"):
            continue
        model.opset_import.append(onnx.helper.make_opsetid(domain, 1))
    return model


def _hoist_body_initializers(graph: onnx.GraphProto) -> None:
    """Move the initializers of If/Loop/Scan bodies up to the main graph, one copy per name.

    graphsurgeon exports every constant a graph's nodes read as that graph's initializer, so a weight of
    the main graph that only bodies read went into each body that reads it: optimum's merged decoders
    (both branches read every weight) came out with each weight twice, the file 1.7× the original's.
    A main-graph initializer is visible in every body (ONNX scopes), so one copy there means the same.
    Left in its body: an initializer whose name another body holds with other contents (sibling scopes
    may reuse a name), or that the main graph defines otherwise; read in there if it is a lazy reference
    (:func:`inline_lazy`)."""
    bodies = list(proto_graphs(graph))[1:]
    if not bodies:
        return
    taken = {vi.name for vi in graph.input} | {o for n in graph.node for o in n.output if o}
    chosen: dict[str, onnx.TensorProto] = {t.name: t for t in graph.initializer}
    clash: set[str] = set()
    for body in bodies:
        for t in body.initializer:
            if t.name in taken:
                clash.add(t.name)
            elif t.name in chosen and not same_tensor(chosen[t.name], t):
                clash.add(t.name)
            else:
                chosen.setdefault(t.name, t)
    main = {t.name for t in graph.initializer}
    hoisted = [chosen[name] for name in chosen if name not in main and name not in clash]
    up = {t.name for t in hoisted}
    graph.initializer.extend(hoisted)
    for body in bodies:  # what stays in a body is read in if lazy: the lazy machinery looks at the main graph
        kept = [t for t in body.initializer if t.name not in up and not (t.name in main and t.name not in clash
                                                                          and same_tensor(chosen[t.name], t))]
        if len(kept) != len(body.initializer) or any(lw.is_lazy(t) for t in kept):
            del body.initializer[:]
            body.initializer.extend(inline_lazy(kept))


def inline_lazy(tensors) -> list[onnx.TensorProto]:
    """``tensors`` with this process's lazy references read in (:func:`~onnxfuse.lazy_weights.inline_copy`):
    for a body's own initializers, which the lazy machinery (sessions, saving) never looks at, since it
    keeps references in the main graph only."""
    return [lw.inline_copy(t) if lw.is_lazy(t) else t for t in tensors]


def same_tensor(a: onnx.TensorProto, b: onnx.TensorProto) -> bool:
    """Two initializers hold the same value under the same name: type, dims and bytes (or the same
    external reference)."""
    if a.name != b.name or a.data_type != b.data_type or list(a.dims) != list(b.dims):
        return False
    if a.HasField("raw_data") and b.HasField("raw_data"):
        return a.raw_data == b.raw_data
    return a.SerializeToString(deterministic=True) == b.SerializeToString(deterministic=True)



def _externalize(graph, lazy: bool) -> None:
    mapped = lw.mapped_values_class()
    constants = [t for t in graph.tensors().values() if isinstance(t, gs.Constant)]
    if not lazy:
        new_bytes = sum(t._values.nbytes for t in constants if lw.spillable(t._values)
                        and lw.source_reference(t._values) is None)
        lazy = new_bytes >= lw.LAZY_MODEL_BYTES
    for t in constants:
        values = t._values
        if isinstance(values, mapped):
            continue
        ref = lw.source_reference(values)
        if ref is None and lazy and lw.spillable(values) and t._export_dtype is None:
            try:
                ref = lw.spill_array(values, t.name)
            except OSError as exc:
                raise _tmpdir_error(exc, f"the optimized model's new weights ({_gib(values.nbytes)} for {t.name!r})") from None
        if ref is not None:
            fresh = onnx.TensorProto()
            fresh.CopyFrom(ref)
            t._values = mapped(fresh)
            t.data_location = None


#: numpy (ml_dtypes) types of ONNX's 4-bit tensors: one byte per element in numpy, two per byte in ONNX.
_SUB_BYTE_DTYPES = frozenset({"int4", "uint4", "float4_e2m1fn"})


def _pack_sub_byte(graph) -> None:
    """Constants of a 4-bit type that a rule loaded (INT4/UINT4/FLOAT4E2M1 weights): graphsurgeon
    exports ``values.tobytes()``, one byte per element, which is twice the size ONNX expects (its export
    raises); ``onnx.numpy_helper.from_array`` packs two per byte, as ONNX stores them."""
    for t in graph.tensors().values():
        if isinstance(t, gs.Constant) and not isinstance(t._values, LazyValues) \
                and getattr(t._values, "dtype", None) is not None and t._values.dtype.name in _SUB_BYTE_DTYPES:
            t._values = LazyValues(onnx.numpy_helper.from_array(np.asarray(t._values), t.name))


def _restore_initializer_inputs(model: onnx.ModelProto, template: onnx.ModelProto) -> None:
    """Keep the signature and meaning of models that list initializers as graph inputs.

    IR version >= 4: those initializers are overridable; :func:`to_graph` kept them as graph inputs,
    so no rule touched them: their default values go back in unchanged (the inputs never left).
    IR version < 4 (older model zoos): every initializer must be listed as an input, including the
    ones rules created (a BatchNorm folded into a bias-less Conv adds a bias), and ones that rules
    consumed are gone from both lists.
    """
    if template.ir_version >= OVERRIDABLE_IR_VERSION:
        keep = overridable_initializers(template)
        if keep:
            present = {t.name for t in model.graph.initializer}
            model.graph.initializer.extend(t for t in template.graph.initializer if t.name in keep and t.name not in present)
        return
    listed = {vi.name for vi in model.graph.input}
    inits = {t.name: t for t in model.graph.initializer}
    for vi in template.graph.input:  # the surviving ones in their original order, then the new ones
        if vi.name in inits and vi.name not in listed:
            model.graph.input.append(vi)
            listed.add(vi.name)
    for t in model.graph.initializer:
        if t.name not in listed:
            model.graph.input.append(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))


def weightless(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` without its main graph's weights: each initializer a graph input of its type and shape (the
    nodes, outputs, annotations and subgraphs as they are). For what needs types only: types do not depend
    on weight values, and ONNX's inference of a model copies every weight twice (serialized to it, and
    back), 0.7-0.9 s per call on BERT-base (docs/benchmarks.md 5.56)."""
    g = model.graph
    declared = {i.name for i in g.input}
    inputs = list(g.input) + [onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
                              for t in g.initializer if t.name not in declared]
    graph = onnx.helper.make_graph(list(g.node), g.name, inputs, list(g.output), value_info=list(g.value_info))
    skeleton = onnx.helper.make_model(graph, opset_imports=list(model.opset_import))
    skeleton.ir_version = model.ir_version
    return skeleton


def value_types(graph: onnx.GraphProto) -> dict[str, int]:
    """The element type of each value ``graph`` records one for: its inputs, outputs and ``value_info``
    (tensors with a known type) and its initializers."""
    types = {v.name: v.type.tensor_type.elem_type for v in list(graph.value_info) + list(graph.output) + list(graph.input)
             if v.type.HasField("tensor_type") and v.type.tensor_type.elem_type}
    types.update({t.name: t.data_type for t in graph.initializer})
    return types


def infer_shapes(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` with ONNX shape inference applied (the model itself when inference fails).

    Inference is best-effort: ops ONNX has no schema for (contrib and custom domains) simply get no
    shapes, and an inference error leaves the model as it was rather than stopping the optimizer.

    The model's own ``value_info`` is ignored: an exporter's annotation can be stale (traced at
    batch 1, say) and rules must not prove anything from it. Shapes come from the graph inputs and
    the weights only. (It is set aside during inference and put back, so ``model`` is unchanged.)
    """
    saved = []
    for vi in model.graph.value_info:
        kept = onnx.ValueInfoProto()
        kept.CopyFrom(vi)
        saved.append(kept)
    del model.graph.value_info[:]
    try:
        return _infer(model)
    finally:
        model.graph.value_info.extend(saved)


def _infer(model: onnx.ModelProto) -> onnx.ModelProto:
    """Shape inference in memory, on the skeleton: a large in-memory model is made lazy first (its
    weights to the spill file), so what is serialized for ONNX is kilobytes, never the weights.
    ``Range(0, n, 1)`` with n a dimension gets that dimension as its length
    (:func:`onnxfuse.rewrites.facts.range_dims.range_lengths`), which ONNX's inference does not derive.

    Data propagation (shape values through ``Shape``/``Gather``/``Concat``) is left out where two graphs
    of the model (the main graph, If branches, loop bodies) write a tensor of the same name: ONNX keeps
    the propagated values by name across subgraphs, so one branch's values land on the other's tensor.
    Measured on optimum's merged T5 decoder (an If of the two decoders, tensor names shared): a
    ``[4]`` shape vector was declared ``[unk, decoder_sequence_length, 64]`` in the other branch, and
    ONNX Runtime refused the whole model ("Incompatible dimensions") though nothing was rewritten."""
    try:
        if not lw.has_lazy(model) and (lw.payload_bytes(model) >= lw.LAZY_MODEL_BYTES
                                       or lw.size_bound(model) >= _EXTERNAL_THRESHOLD):
            model = make_lazy(model)
        inferred = onnx_inferred(model, data_prop=not names_defined_twice(model.graph))
        range_lengths(inferred)  # a Range's proved length, where inference left a fresh symbol
        return inferred
    except (ResourceError, ModelSaveError):
        raise
    except Exception:
        return model


def set_metadata(model: onnx.ModelProto, key: str, value: str) -> None:
    """Set (or replace) one metadata_props entry."""
    for prop in model.metadata_props:
        if prop.key == key:
            prop.value = value
            return
    model.metadata_props.add(key=key, value=value)
