"""Reading and writing ONNX models safely.

Why this module exists: a CI step must never corrupt its input or leave a half-written output behind,
and every problem with a file has to become one clear sentence rather than a protobuf traceback.

* ``load_model`` reads a model (with its external data), and turns every way a file can be wrong into a
  :class:`ModelLoadError` naming the file.
* ``save_model`` writes atomically: everything goes to a temporary name in the destination folder,
  is checked with ``onnx.checker``, and is renamed into place only when complete. Models of 2 GB or
  more are written with external data (``<output>.data`` beside the model).
* ``to_graph`` / ``to_model`` convert to and from onnx-graphsurgeon graphs while keeping what
  graphsurgeon would otherwise drop: IR version, producer, model metadata, doc string and opset imports.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import onnx
from google.protobuf.message import DecodeError

from onnxfuse.errors import ModelLoadError, ModelSaveError, first_line

#: protobuf's hard limit for one serialized message; larger models need external data.
PROTOBUF_LIMIT = 2**31 - 1
#: Leave room for the rest of the proto when deciding whether tensors must go external.
_EXTERNAL_THRESHOLD = PROTOBUF_LIMIT - 64 * 2**20
#: Tensors smaller than this stay inline even in a model written with external data.
_EXTERNAL_MIN_TENSOR = 1024


def load_model(path: str | os.PathLike, check: bool = True) -> onnx.ModelProto:
    """Load ``path`` with its external data; raise :class:`ModelLoadError` with one clear line on failure."""
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
    try:
        model = onnx.load(str(p), load_external_data=False)
    except (DecodeError, RuntimeWarning, ValueError) as exc:
        raise ModelLoadError(f"{p}: not a valid ONNX model (protobuf parse failed: {first_line(exc)})") from None
    except OSError as exc:
        raise ModelLoadError(f"{p}: cannot read ({first_line(exc)})") from None
    except Exception as exc:  # protobuf raises assorted types on garbage input
        raise ModelLoadError(f"{p}: not a valid ONNX model ({first_line(exc)})") from None
    if model.ir_version <= 0 or not model.HasField("graph") or len(model.graph.output) == 0:
        raise ModelLoadError(f"{p}: not a valid ONNX model (no graph, outputs or IR version)")
    try:
        onnx.external_data_helper.load_external_data_for_model(model, str(p.parent))
    except FileNotFoundError as exc:
        missing = getattr(exc, "filename", None) or first_line(exc)
        raise ModelLoadError(f"{p}: external data file is missing: {missing}") from None
    except Exception as exc:
        raise ModelLoadError(f"{p}: cannot load external data ({first_line(exc)})") from None
    if check:
        check_model(model, name=str(p), error=ModelLoadError)
    return model


def validity_problem(model: onnx.ModelProto) -> str | None:
    """What ``onnx.checker`` says is wrong with ``model`` (one line), or None when it is valid
    (checked by path for models too large to serialize)."""
    try:
        if model.ByteSize() < _EXTERNAL_THRESHOLD:
            onnx.checker.check_model(model)
        else:
            with tempfile.TemporaryDirectory() as tmp:
                tmp_path = Path(tmp) / "model.onnx"
                write_model(model, tmp_path)
                onnx.checker.check_model(str(tmp_path))
    except onnx.checker.ValidationError as exc:
        return first_line(exc)
    return None


def check_model(model: onnx.ModelProto, name: str, error: type = ModelLoadError) -> None:
    """Run ``onnx.checker`` and raise ``error`` with its one-line complaint on failure."""
    problem = validity_problem(model)
    if problem is not None:
        raise error(f"{name}: invalid ONNX model: {problem}")


def needs_external_data(model: onnx.ModelProto) -> bool:
    """True when ``model`` is too large for one protobuf message (tensors must go to external data)."""
    return model.ByteSize() >= _EXTERNAL_THRESHOLD


def write_model(model: onnx.ModelProto, path: Path) -> None:
    """Plain (non-atomic) write; external data beside it (``<name>.data``) when the model needs it."""
    if needs_external_data(model):
        # onnx converts the proto it saves in place (tensors become references to the file): write a
        # copy, so the caller's model stays whole.
        copy = onnx.ModelProto()
        copy.CopyFrom(model)
        model = copy
        onnx.save_model(
            model,
            str(path),
            save_as_external_data=True,
            all_tensors_to_one_file=True,
            location=path.name + ".data",
            size_threshold=_EXTERNAL_MIN_TENSOR,
        )
    else:
        onnx.save_model(model, str(path))


def same_file(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """True when ``a`` and ``b`` name the same file (also through symlinks or relative paths)."""
    pa, pb = Path(a), Path(b)
    if pa.exists() and pb.exists():
        return os.path.samefile(pa, pb)
    return pa.resolve() == pb.resolve()


def check_output_path(path: str | os.PathLike, input_path=None, force: bool = False) -> Path:
    """Fail early (before any long work) if ``path`` cannot receive the output; return its folder."""
    out = Path(path)
    if input_path is not None and not force and same_file(out, input_path):
        raise ModelSaveError(f"{out}: output is the same file as the input; choose another path or pass --force")
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        raise ModelSaveError(f"{out}: output directory {parent} does not exist")
    if out.is_dir():
        raise ModelSaveError(f"{out}: is a directory")
    if not os.access(parent, os.W_OK):
        raise ModelSaveError(f"{out}: output directory {parent} is not writable")
    return parent


def save_model(
    model: onnx.ModelProto,
    path: str | os.PathLike,
    input_path: str | os.PathLike | None = None,
    force: bool = False,
    check: bool = True,
) -> Path:
    """Write ``model`` to ``path`` atomically; refuse to overwrite ``input_path`` unless ``force``.

    The model is checked with ``onnx.checker`` before anything reaches its final name, so a failure at
    any point leaves the destination exactly as it was.
    """
    out = Path(path)
    parent = check_output_path(out, input_path, force)
    if check:
        check_model(model, name=str(out), error=ModelSaveError)
    try:
        tmp_dir = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=parent))
    except OSError as exc:
        raise ModelSaveError(f"{out}: cannot write to {parent} ({first_line(exc)})") from None
    try:
        tmp_model = tmp_dir / out.name
        write_model(model, tmp_model)
        data = tmp_dir / (out.name + ".data")
        if data.exists():
            os.replace(data, parent / data.name)
        os.replace(tmp_model, out)
    except OSError as exc:
        raise ModelSaveError(f"{out}: cannot write ({first_line(exc)})") from None
    finally:
        for leftover in tmp_dir.glob("*"):
            leftover.unlink(missing_ok=True)
        tmp_dir.rmdir()
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


def to_graph(model: onnx.ModelProto):
    """Import ``model`` into an onnx-graphsurgeon graph.

    Overridable initializers come in as graph inputs, not constants: graphsurgeon would make them
    constants, and a rule would then fold a value the caller may replace at run time (BatchNorm folded
    into a weight that stays an input under the same name gave outputs 0.44 off when a caller fed it).
    :func:`to_model` puts their initializers back unchanged.
    """
    import onnx_graphsurgeon as gs

    keep = overridable_initializers(model)
    if not keep:
        return gs.import_onnx(model)
    stripped = onnx.ModelProto()
    stripped.CopyFrom(model)  # only the graph's initializer list changes; the caller's proto is kept
    del stripped.graph.initializer[:]
    stripped.graph.initializer.extend(t for t in model.graph.initializer if t.name not in keep)
    return gs.import_onnx(stripped)


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


def _node_domains(graph: onnx.GraphProto) -> set[str]:
    return {node.domain or "" for g in proto_graphs(graph) for node in g.node}


def to_model(graph, template: onnx.ModelProto) -> onnx.ModelProto:
    """Export ``graph`` and restore the model-level fields of ``template`` that graphsurgeon drops.

    Opset imports are those of the template, plus version 1 of any new domain a rewrite introduced
    (``com.microsoft``, ``ai.onnxfuse``); the default domain's is raised to ``graph.opset`` where a
    rewrite raised that (``rewrites._opset``). Stale value_info is dropped by the export itself.
    """
    import onnx_graphsurgeon as gs

    model = gs.export_onnx(graph, do_type_check=False)
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
    try:
        if model.ByteSize() < _EXTERNAL_THRESHOLD:
            return onnx.shape_inference.infer_shapes(model, strict_mode=False, data_prop=True)
        with tempfile.TemporaryDirectory() as tmp:
            src, dst = Path(tmp) / "in.onnx", Path(tmp) / "out.onnx"
            write_model(model, src)
            onnx.shape_inference.infer_shapes_path(str(src), str(dst), strict_mode=False, data_prop=True)
            return onnx.load(str(dst))
    except Exception:
        return model


def set_metadata(model: onnx.ModelProto, key: str, value: str) -> None:
    """Set (or replace) one metadata_props entry."""
    for prop in model.metadata_props:
        if prop.key == key:
            prop.value = value
            return
    model.metadata_props.add(key=key, value=value)
