"""``diff``: run two models on the same inputs and measure how far apart every output (and tensor) is.

Typical pairs: a model and its optimized copy, an fp32 model and its fp16 conversion, or one model on
the CPU provider against the same model on CUDA. The library function is :func:`diff_models`; the
command line (``onnxfuse diff``) only parses options and renders the :class:`DiffReport`.

Inputs. One seeded draw is made from model A's signature, floating inputs in float32; each model
receives that draw cast to its own input dtypes, so an fp16 model and its fp32 original see the same
values. ``samples`` draws use seeds ``seed, seed+1, ...``; every metric is then taken over all samples
together (the worst element's index carries its sample in ``extra``). The user's own inputs
(``inputs``: a dict ``{name: array}``, a list of such dicts — one sample each — or an ``.npz`` path)
replace the draws; they must have A's input dtypes.

Comparison. In float64, per tensor, by :mod:`onnxfuse.runtime.compare` (the comparator validation uses
too), the samples stacked (:func:`~onnxfuse.runtime.compare.compare_tensor`). Model A is the
reference (``worst_ref``/relative error are A's). Default tolerances are those of the *looser* of the
two dtypes (fp32 vs fp16 is judged as fp16); ``rtol``/``atol`` replace them for every tensor and
``tolerances`` ({name: (rtol, atol)}) for one tensor.

Intermediates. With ``intermediates=True``, every tensor produced by a top-level node of A that B also
produces (by name, or through B's :data:`TENSOR_MAP_KEY` metadata) is compared, in A's topological
order; the first one beyond tolerance is ``first_divergence``. Types come from
``onnx.shape_inference``; tensors of unknown or non-numeric type and tensors inside subgraphs are
skipped. Tensors are exposed as extra graph outputs ``batch_size`` at a time (run, compare, drop, next
batch), so memory stays bounded by one batch of activations whatever the model's size.

Tensor map (for fusion rules). An optimized model may record, in ``metadata_props``, the key
``onnxfuse.tensor_map`` whose value is a JSON object ``{"absorbed name": "equivalent name"}``: a tensor
of the original model that a rewrite removed, and the tensor of the optimized model holding the same
values (e.g. a fused node's extra output). ``diff`` honours the map found in either model.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import onnx

from onnxfuse.errors import ModelLoadError, UsageError
from onnxfuse.model_io import value_types
from onnxfuse.rewrites.facts.inference import onnx_inferred
from onnxfuse.runtime.compare import Comparison, Tolerance, compare_runs, compare_tensor
from onnxfuse.runtime.inputs import cast_feeds, make_samples
from onnxfuse.runtime.session import resolve_provider, run_samples
from onnxfuse.reports.jsonreport import diff_json

#: metadata_props key of an optimized model: JSON {absorbed tensor name: equivalent tensor name}.
TENSOR_MAP_KEY = "onnxfuse.tensor_map"
#: tensors exposed as extra graph outputs per run when comparing intermediates.
DEFAULT_BATCH_SIZE = 64

#: Element types not compared (strings are: exactly, see runtime.compare.compare_exactly).
_NON_NUMERIC = {onnx.TensorProto.COMPLEX64, onnx.TensorProto.COMPLEX128, onnx.TensorProto.UNDEFINED}


@dataclass
class DiffReport:
    """Everything ``diff`` measured. ``passed`` is decided by the model *outputs* only; intermediate
    drift is diagnostic (it explains a failure, or shows harmless drift that the outputs absorb)."""

    model_a: str
    model_b: str
    provider_a: str
    provider_b: str
    inputs: dict
    outputs: list[Comparison] = field(default_factory=list)
    intermediates: list[Comparison] = field(default_factory=list)
    intermediates_checked: bool = False
    first_divergence: dict | None = None
    tolerance: dict = field(default_factory=dict)
    histograms: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.outputs)

    def failing(self) -> list[str]:
        return [c.name for c in self.outputs if not c.passed]

    def failing_intermediates(self) -> list[str]:
        return [c.name for c in self.intermediates if not c.passed]

    def to_json(self) -> dict:
        """The report ``onnxfuse diff --json`` writes: the one contract of every command
        (:mod:`onnxfuse.reports.contract`) with :meth:`to_dict` as its ``result``."""
        return diff_json(self)

    def to_dict(self) -> dict:
        """The body of the JSON report (schema: ``$defs/diff`` in :func:`onnxfuse.reports.schema_path`)."""
        outputs = []
        for c in self.outputs:
            item = c.to_dict()
            if c.name in self.histograms and self.histograms[c.name] is not None:
                item["histogram"] = self.histograms[c.name]
            outputs.append(item)
        return {
            "passed": self.passed,
            "model_a": {"path": self.model_a, "provider": self.provider_a},
            "model_b": {"path": self.model_b, "provider": self.provider_b},
            "inputs": self.inputs,
            "tolerance": self.tolerance,
            "outputs": outputs,
            "intermediates_checked": self.intermediates_checked,
            "intermediates": [c.to_dict() for c in self.intermediates],
            "first_divergence": self.first_divergence,
            "summary": {
                "outputs": len(self.outputs),
                "outputs_failed": len(self.failing()),
                "intermediates": len(self.intermediates),
                "intermediates_failed": len(self.failing_intermediates()),
            },
            "notes": list(self.notes),
            "seconds": self.seconds,
        }


# ---------------------------------------------------------------------------------------------------
# option parsing (library side, so the CLI and scripts agree)


def parse_tol_options(values) -> dict[str, tuple[float, float]]:
    """Parse repeated ``NAME:RTOL:ATOL`` (the name may itself contain colons)."""
    out: dict[str, tuple[float, float]] = {}
    for value in values or ():
        parts = value.rsplit(":", 2)
        if len(parts) != 3 or not parts[0]:
            raise UsageError(f"--tol {value!r}: expected NAME:RTOL:ATOL (e.g. logits:1e-3:1e-5)")
        name, r, a = parts
        try:
            rtol, atol = float(r), float(a)
        except ValueError:
            raise UsageError(f"--tol {value!r}: RTOL and ATOL must be numbers (e.g. logits:1e-3:1e-5)") from None
        if not (math.isfinite(rtol) and math.isfinite(atol)) or rtol < 0 or atol < 0:
            raise UsageError(f"--tol {value!r}: RTOL and ATOL must be finite and non-negative")
        out[name] = (rtol, atol)
    return out


def tensor_map(model: onnx.ModelProto) -> dict[str, str]:
    """The model's :data:`TENSOR_MAP_KEY` metadata ({absorbed name: equivalent name}), or {}."""
    for prop in model.metadata_props:
        if prop.key == TENSOR_MAP_KEY:
            try:
                value = json.loads(prop.value)
            except ValueError:
                raise ModelLoadError(f"metadata {TENSOR_MAP_KEY!r} is not valid JSON") from None
            if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                      for k, v in value.items()):
                raise ModelLoadError(f"metadata {TENSOR_MAP_KEY!r} must be a JSON object of strings to strings")
            return dict(value)
    return {}


# ---------------------------------------------------------------------------------------------------
# intermediates


@dataclass
class _Pair:
    name_a: str
    name_b: str
    elem_a: int
    elem_b: int
    position: int
    node: str
    op_type: str


def _infer(model: onnx.ModelProto, label: str, notes: list[str]) -> onnx.ModelProto:
    try:
        return onnx_inferred(model)
    except Exception as exc:  # too large for in-memory inference, or a custom op it rejects
        notes.append(f"model {label}: shape inference failed ({type(exc).__name__}); only tensors whose "
                     "types the model already records are compared")
        copy = onnx.ModelProto()
        copy.CopyFrom(model)
        return copy


def _pairs(model_a, model_b, notes: list[str]) -> list[_Pair]:
    """Tensors of A (top-level node outputs, topological order) paired with B's equivalents."""
    types_a, types_b = value_types(model_a.graph), value_types(model_b.graph)
    outputs_a = {o.name for o in model_a.graph.output}
    produced_b = {o for n in model_b.graph.node for o in n.output if o} | {o.name for o in model_b.graph.output}
    mapping = tensor_map(model_b)
    for absorbed_b, equivalent_a in tensor_map(model_a).items():  # A is the optimized one: invert
        mapping.setdefault(equivalent_a, absorbed_b)
    pairs: list[_Pair] = []
    untyped = only_a = constants = 0
    position = 0
    for node in model_a.graph.node:
        for out in node.output:
            if not out or out in outputs_a:
                continue
            position += 1
            if node.op_type == "Constant" and not node.domain:
                constants += 1
                continue
            name_b = out if out in produced_b else mapping.get(out)
            if name_b is None or name_b not in produced_b:
                only_a += 1
                continue
            ea, eb = types_a.get(out), types_b.get(name_b)
            if not ea or not eb or ea in _NON_NUMERIC or eb in _NON_NUMERIC:
                untyped += 1
                continue
            pairs.append(_Pair(out, name_b, ea, eb, position, node.name, node.op_type))
    if only_a:
        notes.append(f"{only_a} intermediate tensor(s) of A have no counterpart in B (by name or "
                     f"{TENSOR_MAP_KEY}) and were not compared")
    if untyped:
        notes.append(f"{untyped} intermediate tensor(s) skipped: type unknown after shape inference or not numeric")
    if constants:
        notes.append(f"{constants} Constant node output(s) not compared (their consumers are)")
    return pairs


def _expose(model: onnx.ModelProto, names_types: list[tuple[str, int]]) -> int:
    """Append graph outputs for ``names_types`` not already outputs; return how many were added."""
    existing = {o.name for o in model.graph.output}
    added = 0
    for name, elem in names_types:
        if name not in existing:
            model.graph.output.append(onnx.helper.make_tensor_value_info(name, elem, None))
            existing.add(name)
            added += 1
    return added


def _run_batch(model, batch_names, provider, feeds_list, label):
    """Expose ``batch_names`` (name, elem type) in ``model`` (restored after), run every sample."""
    n = len(model.graph.output)
    _expose(model, batch_names)
    names = [nm for nm, _ in batch_names]
    try:
        return run_samples(model, feeds_list, provider, name=f"model {label}", output_names=names)
    finally:
        del model.graph.output[n:]


# ---------------------------------------------------------------------------------------------------


def _load(model, label: str):
    # looked up when called: tests/cli/test_cli_lazy.py stands in for load_model
    from onnxfuse.model_io import check_given_model, load_model

    if isinstance(model, onnx.ModelProto):
        return check_given_model(model, f"<model {label}>"), f"<model {label}>"
    return load_model(model), str(model)


def diff_models(
    model_a: onnx.ModelProto | str | Path,
    model_b: onnx.ModelProto | str | Path,
    *,
    shapes: dict[str, list[int]] | None = None,
    seed: int = 0,
    inputs_path: str | Path | None = None,
    inputs=None,
    samples: int = 1,
    provider_a: str = "auto",
    provider_b: str = "auto",
    rtol: float | None = None,
    atol: float | None = None,
    tolerances: dict[str, tuple[float, float]] | None = None,
    intermediates: bool = False,
    batch_size: int = DEFAULT_BATCH_SIZE,
    histograms: bool = True,
    progress: Callable[[str], None] | None = None,
    input_ranges=None,
    right_padded=(),
) -> DiffReport:
    """Run ``model_a`` and ``model_b`` on the same inputs and compare them (see the module docstring).

    Models may be given as ``ModelProto`` (never modified) or as paths (loaded with
    :func:`onnxfuse.model_io.load_model`). ``inputs``: the user's inputs (a dict ``{name: array}``, a list
    of such dicts, or an ``.npz`` path; ``inputs_path`` is the ``--inputs`` spelling of the last). Raises :class:`UsageError` for inconsistent arguments, :class:`InputsError`, :class:`ModelLoadError`
    or :class:`RuntimeFailure` for problems with the inputs or the models; drift is *reported*, never
    raised.
    """
    started = time.perf_counter()
    say = progress or (lambda _msg: None)
    if samples < 1:
        raise UsageError("--samples must be at least 1")
    if batch_size < 1:
        raise UsageError("--batch-size must be at least 1")
    if inputs is not None and inputs_path is not None:
        raise UsageError("give the inputs once: inputs or inputs_path, not both")
    given = inputs if inputs is not None else inputs_path
    if given is not None and samples != 1:
        if not isinstance(given, (list, tuple)):
            what = "the .npz file is" if isinstance(given, (str, os.PathLike)) else "the inputs are"
            raise UsageError(f"--samples cannot be combined with --inputs ({what} one sample)")
        if samples != len(given):
            raise UsageError(f"samples={samples} but {len(given)} input samples were given; leave samples out")
    for value, what in ((rtol, "--rtol"), (atol, "--atol")):
        if value is not None and (not math.isfinite(value) or value < 0):
            raise UsageError(f"{what} must be finite and non-negative")
    tolerances = dict(tolerances or {})
    shapes = dict(shapes or {})
    say("loading models")
    a, path_a = _load(model_a, "A")
    b, path_b = _load(model_b, "B")
    kind_a, kind_b = resolve_provider(provider_a), resolve_provider(provider_b)

    draws = make_samples(a, shapes, seed, given, input_ranges, count=samples, floats_as_float32=True,
                         right_padded=right_padded)
    first = draws[0]
    feeds_a = [cast_feeds(a, d.feeds, "A") for d in draws]
    feeds_b = [cast_feeds(b, d.feeds, "B") for d in draws]
    notes = list(first.notes)

    names_a = {o for n in a.graph.node for o in n.output if o} | {o.name for o in a.graph.output}
    unknown = sorted(set(tolerances) - names_a)
    if unknown:
        raise UsageError(f"--tol names unknown tensor(s) {', '.join(unknown)}; outputs of A: "
                         f"{', '.join(o.name for o in a.graph.output)}")

    report = DiffReport(
        model_a=path_a, model_b=path_b, provider_a=kind_a, provider_b=kind_b,
        inputs={
            "source": first.source, "seed": first.seed, "samples": len(draws),
            "seeds": [seed + i for i in range(len(draws))] if first.seed is not None else [],
            "shapes": {k: list(v.shape) for k, v in feeds_a[0].items()},
            "dtypes_a": {k: v.dtype.name for k, v in feeds_a[0].items()},
            "dtypes_b": {k: v.dtype.name for k, v in feeds_b[0].items()},
        },
        tolerance={"rtol": rtol, "atol": atol,
                   "overrides": {k: {"rtol": r, "atol": t} for k, (r, t) in tolerances.items()},
                   "defaults": "dtype-aware (looser of the two dtypes); see docs/diff.md"},
        notes=notes,
    )

    say(f"running model A ({kind_a})")
    outs_a = run_samples(a, feeds_a, kind_a, name="model A")
    say(f"running model B ({kind_b})")
    outs_b = run_samples(b, feeds_b, kind_b, name="model B")

    out_names_a = [o.name for o in a.graph.output]
    out_names_b = [o.name for o in b.graph.output]
    pairing = {n: n for n in out_names_a if n in out_names_b}
    if not pairing and len(out_names_a) == len(out_names_b):
        pairing = dict(zip(out_names_a, out_names_b))
        report.notes.append("no output names in common; outputs paired by position: "
                            + ", ".join(f"{x}↔{y}" for x, y in pairing.items()))
    tolerance = Tolerance(rtol=rtol, atol=atol, overrides=tolerances, both_dtypes=True)
    report.outputs, report.histograms = compare_runs(outs_a, outs_b, tolerance, pairing=pairing,
                                                     histograms=histograms, missing="missing in model B")
    extra_b = [n for n in out_names_b if n not in pairing.values()]
    if extra_b:
        report.notes.append(f"output(s) of B not in A, not compared: {', '.join(extra_b)}")
    del outs_a, outs_b

    if intermediates:
        report.intermediates_checked = True
        say("shape inference")
        # Tensors a FusedElementwise node computes internally become outputs of it, under their original
        # names, so drift inside a fused region is found and named (custom_ops.expose_fused_values).
        from onnxfuse.custom_ops import expose_fused_values

        (wide_a, n_a), (wide_b, n_b) = expose_fused_values(a), expose_fused_values(b)
        if n_a or n_b:
            report.notes.append(f"{n_a + n_b} tensor(s) computed inside FusedElementwise nodes exposed for comparison")
        ia, ib = _infer(wide_a, "A", report.notes), _infer(wide_b, "B", report.notes)
        pairs = _pairs(ia, ib, report.notes)
        for start in range(0, len(pairs), batch_size):
            batch = pairs[start:start + batch_size]
            say(f"intermediates {start + 1}-{start + len(batch)} of {len(pairs)}")
            got_a = _run_batch(ia, [(p.name_a, p.elem_a) for p in batch], kind_a, feeds_a, "A")
            got_b = _run_batch(ib, [(p.name_b, p.elem_b) for p in batch], kind_b, feeds_b, "B")
            for p in batch:
                c, _ = compare_tensor(p.name_a, [g[p.name_a] for g in got_a], [g[p.name_b] for g in got_b],
                                      tolerance)
                c.extra.update({"position": p.position, "node": p.node, "op_type": p.op_type})
                if p.name_b != p.name_a:
                    c.extra["name_b"] = p.name_b
                report.intermediates.append(c)
            del got_a, got_b
        del ia, ib

    report.first_divergence = _first_divergence(a, report)
    report.seconds = time.perf_counter() - started
    return report


def _first_divergence(model_a: onnx.ModelProto, report: DiffReport) -> dict | None:
    """The first tensor beyond tolerance in A's topological order (intermediates and outputs)."""
    order = {}
    position = 0
    for node in model_a.graph.node:
        for out in node.output:
            if out:
                position += 1
                order.setdefault(out, (position, node.name, node.op_type))
    candidates = [("intermediate", c) for c in report.intermediates if not c.passed]
    candidates += [("output", c) for c in report.outputs if not c.passed]
    if not candidates:
        return None
    out_index = {c.name: i for i, c in enumerate(report.outputs)}

    def key(item):
        _kind, c = item
        return (0, order[c.name][0]) if c.name in order else (1, out_index.get(c.name, 0))

    kind, c = min(candidates, key=key)
    pos, node, op = order.get(c.name, (None, None, None))
    return {
        "name": c.name, "name_b": c.extra.get("name_b", c.name), "kind": kind, "position": pos,
        "node": node, "op_type": op, "max_abs": c.max_abs, "max_rel": c.max_rel,
        "mismatch_fraction": c.mismatch_fraction, "error": c.error,
    }
