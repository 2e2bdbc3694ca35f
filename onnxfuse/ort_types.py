"""Element types of the values ONNX Runtime's own ops write, which ONNX's type inference leaves unknown.

Why: ONNX has no schemas for ONNX Runtime's contrib ops (``com.microsoft``: ``Attention``,
``SkipLayerNormalization``, ``FastGelu``, ...), so its inference types nothing they write nor anything
computed from it. The float16 converter (:mod:`onnxfuse.precision`) decides from those types which values
are float32: a float32 island node reading an untyped float16 value downstream of a contrib ``Attention``
was not cast up, and ONNX Runtime refused the conversion ("Type parameter (T) of Optype (Add) bound to
different types", ONNX Runtime's test model ``gpt2_attention_add_opt_no_skiplayernorm.onnx``: onnxfuse's
internal error, exit 5). Models already optimized by ONNX Runtime's tools carry such ops.

How: ONNX Runtime publishes its op schemas with their type constraints
(``onnxruntime.capi.onnxruntime_pybind11_state.get_all_operator_schema``). An output whose formal type
is a concrete tensor type gets it; one whose type variable an input shares gets that input's type, where
ONNX's inference knows it. Those outputs are annotated (``value_info``) and ONNX's inference run again, so
it carries the types on through the ONNX ops after them; repeated while anything new is typed, for chains
of contrib ops. Main graph only (the converter's islands live there). Nothing is typed that no schema
says: an op ONNX Runtime does not know either stays untyped, as before.
"""

from __future__ import annotations

import functools

import onnx

from onnxfuse.model_io import value_types, weightless

#: ONNX's element type of each ``tensor(...)`` type string an ONNX Runtime schema may name.
_ELEMENT = {onnx.helper.tensor_dtype_to_string(t).removeprefix("TensorProto."): t
            for t in onnx.TensorProto.DataType.values() if t != onnx.TensorProto.UNDEFINED}

#: Rounds of "type what the schemas say, infer again": each types at least one more contrib op's outputs (a
#: chain of contrib ops with ONNX ops between them takes a round per link; each is an inference of the graph
#: without its weights).
MAX_ROUNDS = 64


@functools.lru_cache(maxsize=1)
def ort_schemas() -> dict:
    """ONNX Runtime's op schemas outside the ONNX domain, the latest version of each: ``{(domain, op): schema}``
    ({} when this ONNX Runtime does not publish them)."""
    # start-up: the command line starts (and --help runs) without ONNX Runtime
    from onnxfuse.ort_runtime import import_onnxruntime

    ort = import_onnxruntime()
    try:
        every = ort.capi.onnxruntime_pybind11_state.get_all_operator_schema()
    except AttributeError:
        return {}
    latest: dict = {}
    for schema in every:
        if schema.domain in ("", "ai.onnx"):
            continue
        key = (schema.domain, schema.name)
        if key not in latest or schema.since_version > latest[key].since_version:
            latest[key] = schema
    return latest


def _element(type_str: str) -> int | None:
    """``tensor(float16)`` → TensorProto.FLOAT16; None for a type variable or a non-tensor type."""
    if type_str.startswith("tensor(") and type_str.endswith(")"):
        return _ELEMENT.get(type_str[len("tensor("):-1].upper())
    return None


def formal_at(formals, position: int):
    """The formal parameter of an op schema (ONNX's or ONNX Runtime's) at input or output ``position``, a
    variadic last one covering the rest; None when there are none."""
    if not formals:
        return None
    return formals[min(position, len(formals) - 1)]


def output_types(node: onnx.NodeProto, schema, known: dict[str, int]) -> dict[str, int]:
    """``{output name: element type}`` that ``schema`` gives ``node``'s untyped outputs, from their formal
    type or the known type (``known``) of an input of the same type variable."""
    found = {}
    for j, name in enumerate(node.output):
        formal = formal_at(schema.outputs, j)
        if not name or name in known or formal is None:
            continue
        elem = _element(formal.typeStr)
        if elem is None:
            elem = next((known[i] for k, i in enumerate(node.input)
                         if i in known and getattr(formal_at(schema.inputs, k), "typeStr", None) == formal.typeStr),
                        None)
        if elem is not None:
            found[name] = elem
    return found


def with_ort_types(inferred: onnx.ModelProto, infer) -> onnx.ModelProto:
    """``inferred`` (a model through ONNX's inference) with the outputs of its main graph's non-ONNX ops typed
    by ONNX Runtime's schemas and ``infer`` (ONNX's inference, the caller's) run again after each round, on a
    weightless copy (:func:`onnxfuse.model_io.weightless`: the rounds below infer a model up to
    :data:`MAX_ROUNDS` times, and types do not depend on weight values), and what that types annotated on
    ``inferred`` (module docstring).
    Returns ``inferred`` itself, unchanged when there is nothing to type."""
    if all((n.domain or "") in ("", "ai.onnx") for n in inferred.graph.node):
        return inferred
    schemas = ort_schemas()
    before = value_types(inferred.graph)
    skeleton = weightless(inferred)
    for _ in range(MAX_ROUNDS):
        known = value_types(skeleton.graph)
        added: dict[str, int] = {}
        for node in skeleton.graph.node:
            schema = schemas.get((node.domain, node.op_type)) if (node.domain or "") not in ("", "ai.onnx") else None
            if schema is not None:
                added.update(output_types(node, schema, {**known, **added}))
        if not added:
            break
        skeleton.graph.value_info.extend(onnx.helper.make_tensor_value_info(n, e, None) for n, e in added.items())
        skeleton = infer(skeleton)
    found = {name: elem for name, elem in value_types(skeleton.graph).items() if name not in before}
    inferred.graph.value_info.extend(onnx.helper.make_tensor_value_info(n, e, None) for n, e in found.items())
    return inferred


__all__ = ["MAX_ROUNDS", "formal_at", "ort_schemas", "output_types", "with_ort_types"]
