"""The one comparator: how far two runs (of two models, or one model two ways) are apart, tensor by tensor.

``optimize``'s validation, ``diff`` and the benchmarks all judge drift here. Layers, bottom up:

* :func:`compare_arrays` — one tensor against its reference → :class:`Comparison` (metrics, pass/fail);
* :class:`Tolerance` — which ``(rtol, atol)`` a tensor is judged with (explicit values, per-tensor
  overrides, dtype-aware defaults: the reference's dtype, optionally also the candidate's and the
  least precise float type the model computes in);
* :func:`compare_tensor` — one tensor over several samples: stacked into one comparison (``diff``; large
  tensors piece by piece) or sample by sample keeping the worst (validation);
* :func:`compare_runs` — every output of a reference run against a candidate run (missing outputs,
  failed runs, outputs paired under other names).

Tolerance rule, per element: ``|got - ref| <= atol + rtol * |ref|``, and NaN/Inf must appear in the
same places with the same signs. Default tolerances depend on the dtype (see :func:`default_tolerance`);
the default ``atol`` is scaled by the output's largest magnitude, because a model whose outputs are in
the hundreds cannot be judged by an absolute 1e-5 on its near-zero elements. An explicit ``--atol`` is
taken literally.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np

from onnxfuse.runtime.histogram import error_histogram, log_bin_edges

#: dtype name -> (rtol, atol relative to max(1, max|ref|))
DEFAULT_TOLERANCES = {
    "float64": (1e-7, 1e-9),
    "float32": (1e-4, 1e-5),
    "float16": (1e-2, 1e-3),
    "bfloat16": (2e-2, 1e-2),
}


def lowest_float_precision(model) -> str | None:
    """``"bfloat16"`` or ``"float16"`` when ``model`` holds or computes tensors of that type anywhere
    (inputs, outputs, initializers, annotated values, Cast targets, in subgraphs too), else ``None``."""
    # start-up: it loads numpy, onnx, which importing this module does not
    import onnx

    # start-up: it loads numpy, onnx, graphsurgeon, which importing this module does not
    from onnxfuse.model_io import proto_graphs

    found: set[int] = set()
    for graph in proto_graphs(model.graph):
        for vi in list(graph.input) + list(graph.output) + list(graph.value_info):
            found.add(vi.type.tensor_type.elem_type)
        found.update(t.data_type for t in graph.initializer)
        for node in graph.node:
            for a in node.attribute:
                if node.op_type == "Cast" and a.name == "to":
                    found.add(a.i)
                elif a.type == onnx.AttributeProto.TENSOR:
                    found.add(a.t.data_type)
    if onnx.TensorProto.BFLOAT16 in found:
        return "bfloat16"
    return "float16" if onnx.TensorProto.FLOAT16 in found else None


def default_tolerance(dtype, ref: np.ndarray | None = None) -> tuple[float, float]:
    """(rtol, atol) for ``dtype``; integers and bools must match exactly."""
    name = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
    if name not in DEFAULT_TOLERANCES:
        return 0.0, 0.0
    rtol, atol = DEFAULT_TOLERANCES[name]
    if ref is not None and ref.size:
        finite = np.abs(ref[np.isfinite(ref)].astype(np.float64)) if np.issubdtype(ref.dtype, np.floating) else np.abs(ref.astype(np.float64))
        scale = float(finite.max()) if finite.size else 1.0
        atol *= max(1.0, scale)
    return rtol, atol


@dataclass
class Comparison:
    """Drift of one tensor ``got`` against the reference ``ref``."""

    name: str
    dtype: str
    shape: list
    passed: bool
    rtol: float
    atol: float
    max_abs: float = 0.0
    max_rel: float = 0.0
    mean_abs: float = 0.0
    rms: float = 0.0
    cosine: float = 1.0
    mismatch_fraction: float = 0.0
    worst_index: list | None = None
    worst_ref: float | None = None
    worst_got: float | None = None
    nonfinite_mismatches: int = 0
    error: str | None = None
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("extra")
        d.update(self.extra)
        return d


def is_text(arr: np.ndarray) -> bool:
    """True for string tensors (ONNX Runtime returns them as object arrays of ``str``) and bytes."""
    return arr.dtype.kind in "OUS"


def _show(value, limit: int = 40) -> str:
    text = repr(value.decode("utf-8", "replace") if isinstance(value, bytes) else value)
    return text if len(text) <= limit else text[: limit - 1] + "…'"


def compare_exactly(name: str, ref: np.ndarray, got: np.ndarray) -> Comparison:
    """Strings have no distance: equal or not, element by element (tolerances do not apply).

    A mismatch is reported in ``error`` with how many elements differ and the first one, so every
    report (tables, Markdown, JUnit, HTML) shows it as text; the numeric metrics stay 0 and
    ``mismatch_fraction`` is the fraction of elements that differ."""
    base = dict(name=name, dtype=ref.dtype.name, shape=list(ref.shape), rtol=0.0, atol=0.0,
                extra={"comparison": "exact"})
    if ref.dtype.kind in "OUS" and got.dtype.kind not in "OUS" or got.dtype.kind in "OUS" and ref.dtype.kind not in "OUS":
        return Comparison(**base, passed=False, mismatch_fraction=1.0,
                          error=f"dtype mismatch: {ref.dtype.name} vs {got.dtype.name}")
    if ref.shape != got.shape:
        return Comparison(**base, passed=False, mismatch_fraction=1.0,
                          error=f"shape mismatch: {list(ref.shape)} vs {list(got.shape)}")
    if ref.size == 0:
        return Comparison(**base, passed=True)
    equal = np.frompyfunc(lambda a, b: a == b, 2, 1)(ref, got).astype(bool)
    bad = int(equal.size - np.count_nonzero(equal))
    if not bad:
        return Comparison(**base, passed=True)
    first = np.unravel_index(int(np.argmin(equal)), ref.shape) if ref.ndim else ()
    where = [int(i) for i in first]
    return Comparison(**base, passed=False, mismatch_fraction=bad / equal.size, worst_index=where,
                      error=f"strings differ at {bad} of {equal.size} element(s); first at {where}: "
                            f"{_show(ref[first])} vs {_show(got[first])}")


def _cosine(dot: float, nr: float, ng: float) -> float:
    """The cosine from a dot product and two norms: 1 for two zero vectors, 0 for one."""
    if nr == 0.0 and ng == 0.0:
        return 1.0
    if nr == 0.0 or ng == 0.0:
        return 0.0
    return float(dot / (nr * ng))


def cosine(r: np.ndarray, g: np.ndarray) -> float:
    """The cosine of two float64 vectors (finite elements): the comparator's, and the drift budget's
    (:mod:`onnxfuse.validate.drift_budget`)."""
    return _cosine(np.dot(r, g), float(np.linalg.norm(r)), float(np.linalg.norm(g)))


def _finite_or_none(x: float) -> float | None:
    return float(x) if np.isfinite(x) else None


def compare_arrays(
    name: str, ref: np.ndarray, got: np.ndarray, rtol: float | None = None, atol: float | None = None,
    precision: str | None = None,
) -> Comparison:
    """Compare ``got`` to ``ref`` (same shape expected; a mismatch is reported, not raised).

    ``precision``: the least precise float type the model computes in (``"float16"``…). A float output
    of a model that computes in float16 carries float16 rounding whatever its own type, so its default
    tolerance is the looser of its type's and ``precision``'s.
    """
    ref = np.asarray(ref)
    got = np.asarray(got)
    if is_text(ref) or is_text(got):
        return compare_exactly(name, ref, got)
    d_rtol, d_atol = default_tolerance(ref.dtype, ref)
    if precision is not None and np.issubdtype(ref.dtype, np.floating):
        p_rtol, p_atol = default_tolerance(precision, ref)
        d_rtol, d_atol = max(d_rtol, p_rtol), max(d_atol, p_atol)
    rtol = d_rtol if rtol is None else rtol
    atol = d_atol if atol is None else atol
    base = dict(name=name, dtype=ref.dtype.name, shape=list(ref.shape), rtol=rtol, atol=atol)
    if ref.shape != got.shape:
        return Comparison(**base, passed=False, mismatch_fraction=1.0,
                          error=f"shape mismatch: {list(ref.shape)} vs {list(got.shape)}")
    if ref.dtype != got.dtype:
        base["extra"] = {"dtype_b": got.dtype.name}
    if ref.size == 0:
        return Comparison(**base, passed=True)
    r = ref.astype(np.float64)
    g = got.astype(np.float64)
    r_fin, g_fin = np.isfinite(r), np.isfinite(g)
    # Non-finite values must agree exactly (NaN with NaN, +Inf with +Inf).
    nonfinite_bad = (r_fin != g_fin) | (~r_fin & ~g_fin & ~((np.isnan(r) & np.isnan(g)) | (r == g)))
    both = r_fin & g_fin
    diff = np.zeros_like(r)
    diff[both] = np.abs(g[both] - r[both])
    rel = np.zeros_like(r)
    with np.errstate(over="ignore"):  # a reference of 0 gives inf here; rel_mask below never reads it
        rel[both] = diff[both] / np.maximum(np.abs(r[both]), np.finfo(np.float64).tiny)
    bad = nonfinite_bad | (both & (diff > atol + rtol * np.abs(np.where(both, r, 0.0))))
    if ref.dtype.kind in "biu" and got.dtype.kind in "biu" and rtol == 0 and atol == 0:
        # Integers and bools compare exactly, in their own type: through float64, 2**60 + 1 equals 2**60.
        bad = ref != got
    n_both = int(both.sum())
    max_abs = float(diff.max()) if n_both else 0.0
    # Relative error is only meaningful where the reference is not tiny: ignore those within atol.
    rel_mask = both & (np.abs(r) > atol)
    max_rel = float(rel[rel_mask].max()) if rel_mask.any() else 0.0
    mean_abs = float(diff[both].mean()) if n_both else 0.0
    rms = float(np.sqrt((diff[both] ** 2).mean())) if n_both else 0.0
    cos = cosine(r[both], g[both])
    # The worst element is where the absolute error is largest (a NaN/Inf mismatch beats any number),
    # so it matches the max-abs column.
    score = np.where(nonfinite_bad, np.inf, np.where(both, diff, -np.inf))
    worst = np.unravel_index(int(np.argmax(score)), r.shape) if r.ndim else ()
    return Comparison(
        **base,
        passed=not bool(bad.any()),
        max_abs=max_abs,
        max_rel=max_rel,
        mean_abs=mean_abs,
        rms=rms,
        cosine=cos,
        mismatch_fraction=float(bad.mean()),
        worst_index=[int(i) for i in worst],
        worst_ref=_finite_or_none(r[worst]) if r.size else None,
        worst_got=_finite_or_none(g[worst]) if g.size else None,
        nonfinite_mismatches=int(nonfinite_bad.sum()),
    )


@dataclass
class Tolerance:
    """How tensors are judged: ``|got - ref| <= atol + rtol * |ref|`` per element.

    ``overrides`` ({name: (rtol, atol)}) wins for its tensors; else ``rtol``/``atol`` when given; else the
    dtype-aware default of the reference's dtype (:func:`default_tolerance`, ``atol`` scaled by the
    reference's largest magnitude), loosened to the candidate's dtype default with ``both_dtypes`` (an
    fp32 model against its fp16 copy is judged as fp16) and, for float references, to ``precision``'s (the
    least precise float type the model computes in, :func:`lowest_float_precision`).
    """

    rtol: float | None = None
    atol: float | None = None
    overrides: dict = field(default_factory=dict)
    precision: str | None = None
    both_dtypes: bool = False

    def _defaults(self, ref_dtype, got_dtype, scaled) -> tuple[float, float]:
        """The default (rtol, atol) for these dtypes; ``scaled(dtype)`` is :func:`default_tolerance`'s."""
        rtol, atol = scaled(ref_dtype)
        extra = [got_dtype] if self.both_dtypes else []
        if self.precision is not None and np.issubdtype(ref_dtype, np.floating):
            extra.append(self.precision)
        for dtype in extra:
            r, a = scaled(dtype)
            rtol, atol = max(rtol, r), max(atol, a)
        return rtol, atol

    def resolve(self, name: str, ref: np.ndarray, got: np.ndarray) -> tuple[float, float]:
        """``(rtol, atol)`` for tensor ``name`` with reference ``ref`` and candidate ``got``."""
        if name in self.overrides:
            return self.overrides[name]
        rtol, atol = self._defaults(ref.dtype, got.dtype, lambda dtype: default_tolerance(dtype, ref))
        return (rtol if self.rtol is None else self.rtol, atol if self.atol is None else self.atol)

    def resolve_pieces(self, name: str, refs: list[np.ndarray], gots: list[np.ndarray]) -> tuple[float, float]:
        """:meth:`resolve` for the stacked samples, the default atol's scale (max |finite ref|) taken
        piece by piece (``default_tolerance`` with no array gives the unscaled value)."""
        if name in self.overrides:
            return self.overrides[name]
        rtol, atol = self._defaults(refs[0].dtype, gots[0].dtype, default_tolerance)
        if self.atol is None and atol > 0:
            scale = 0.0
            floating = np.issubdtype(refs[0].dtype, np.floating)
            for _, piece in _pieces(refs):
                mag = np.abs(piece[np.isfinite(piece)] if floating else piece).astype(np.float64)
                if mag.size:
                    scale = max(scale, float(mag.max()))
            atol *= max(1.0, scale)
        return (rtol if self.rtol is None else self.rtol, atol if self.atol is None else self.atol)


def worst_of(rows: list[Comparison], extras: list | None = None):
    """The row of the worst sample (a failing one first, else the largest max abs error), passing only
    when every sample passes, numbered in ``extra["worst_sample"]``; with ``extras`` (one per row) also
    the worst sample's extra. One row: returned as it is."""
    if len(rows) == 1:
        return (rows[0], extras[0]) if extras is not None else rows[0]
    k = max(range(len(rows)), key=lambda i: (not rows[i].passed, rows[i].max_abs))
    row = rows[k]
    row.passed = all(r.passed for r in rows)
    row.extra["worst_sample"] = k
    return (row, extras[k]) if extras is not None else row


def compare_tensor(name: str, refs: list[np.ndarray], gots: list[np.ndarray], tolerance: Tolerance | None = None,
                   *, stack: bool = True, histogram: bool = False) -> tuple[Comparison, dict | None]:
    """Compare one tensor over all samples; returns the comparison and, with ``histogram``, its error
    histogram (:func:`onnxfuse.runtime.histogram.error_histogram`).

    ``stack=True`` (``diff``): the samples are compared as one stacked tensor (every metric over all of
    them; the worst element's sample in ``extra["worst_sample"]``); tensors of more than
    :data:`CHUNK_ELEMENTS` elements (all samples together) piece by piece, without stacking the samples
    (``compare_arrays`` holds about 20 times a float32 tensor in float64 temporaries at once, which for a
    1 GiB output was 20 GiB). ``stack=False`` (validation), or shapes that differ between samples or
    sides: sample by sample, keeping the worst (:func:`worst_of`).
    """
    tolerance = tolerance or Tolerance()
    refs, gots = [np.asarray(r) for r in refs], [np.asarray(g) for g in gots]
    same = len({r.shape for r in refs}) == 1 and {r.shape for r in refs} == {g.shape for g in gots}
    if len(refs) > 1 and not (stack and same):
        results = [compare_tensor(name, [r], [g], tolerance, stack=stack, histogram=histogram)
                   for r, g in zip(refs, gots)]
        return worst_of([c for c, _ in results], [h for _, h in results])
    numeric = not any(is_text(x) for x in refs + gots)
    if stack and same and numeric and sum(r.size for r in refs) > CHUNK_ELEMENTS:
        rt, at = tolerance.resolve_pieces(name, refs, gots)
        c = _compare_pieces(name, refs, gots, rt, at)
        hist = _histogram_pieces(refs, gots) if histogram else None
    else:
        ref, got = (refs[0], gots[0]) if len(refs) == 1 else (np.stack(refs), np.stack(gots))
        rt, at = tolerance.resolve(name, ref, got)
        c = compare_arrays(name, ref, got, rtol=rt, atol=at)
        hist = None
        if histogram and numeric:
            hist = error_histogram(ref, got)
    c.cosine = min(1.0, max(-1.0, c.cosine)) if math.isfinite(c.cosine) else c.cosine  # rounding: 1+1e-16
    if len(refs) > 1 and c.error is None:
        c.shape = c.shape[1:]
        if c.worst_index is not None and c.worst_index:
            c.extra["worst_sample"] = c.worst_index[0]
            c.worst_index = c.worst_index[1:]
    if refs[0].dtype != gots[0].dtype:
        c.extra.setdefault("dtype_b", gots[0].dtype.name)
    return c, hist


def failed(name: str, ref, error: str) -> Comparison:
    """A failing row for output ``name`` (reference ``ref``) that could not be compared: ``error`` says why."""
    return Comparison(name=name, dtype=str(getattr(ref, "dtype", "?")), shape=list(getattr(ref, "shape", [])),
                      passed=False, rtol=0.0, atol=0.0, mismatch_fraction=1.0, error=error)


def compare_outputs(reference: dict, candidate: dict | str, tolerance: Tolerance | None = None) -> list[Comparison]:
    """:func:`compare_runs` for one sample: every output of ``reference`` against ``candidate``'s."""
    return compare_runs([reference], [candidate], tolerance, stack=False)[0]


def compare_runs(references: list[dict], candidates: list, tolerance: Tolerance | None = None, *,
                 pairing: dict[str, str] | None = None, stack: bool = True, histograms: bool = False,
                 missing: str = "output missing") -> tuple[list[Comparison], dict[str, dict | None]]:
    """Compare every output of a reference run with the candidate's, over all samples.

    ``references``: one ``{output name: array}`` per sample. ``candidates``: per sample the candidate's
    outputs, or a ``str`` when the candidate failed on that sample (every output's row fails with that
    text as its error). ``pairing``: {reference name: candidate name} (default: the same names; a row
    compared under another name carries ``extra["name_b"]``); an output without a counterpart fails with
    ``missing`` as its error. ``stack``: see :func:`compare_tensor`; without it each sample is judged on
    its own (a missing output or a failed run too) and the row is the worst sample's.
    Returns the rows in the reference's order and, per compared output, its histogram (or None).
    """
    tolerance = tolerance or Tolerance()
    pairing = {n: n for n in references[0]} if pairing is None else pairing
    rows: list[Comparison] = []
    hists: dict[str, dict | None] = {}
    for name, ref0 in references[0].items():
        other = pairing.get(name)
        if stack:
            if other is None or any(isinstance(c, str) or other not in c for c in candidates):
                error = next((c for c in candidates if isinstance(c, str)), missing)
                rows.append(failed(name, ref0, error if other is not None else missing))
                continue
            row, hists[name] = compare_tensor(name, [r[name] for r in references], [c[other] for c in candidates],
                                              tolerance, stack=True, histogram=histograms)
        else:
            per_sample = []
            for ref, cand in zip(references, candidates):
                if isinstance(cand, str):
                    per_sample.append(failed(name, ref[name], cand))
                elif other is None or other not in cand:
                    per_sample.append(failed(name, ref[name], missing))
                else:
                    per_sample.append(compare_tensor(name, [ref[name]], [cand[other]], tolerance, stack=False)[0])
            row = worst_of(per_sample)
        if other is not None and other != name:
            row.extra["name_b"] = other
        rows.append(row)
    return rows, hists


# ---------------------------------------------------------------------------------------------------
# large tensors, piece by piece (the same numbers as compare_arrays / error_histogram on the whole)

#: Elements compared at once for large tensors: ``compare_arrays``' float64 temporaries take about 60
#: bytes per element, so a piece costs ~60 MiB whatever the tensor's size.
CHUNK_ELEMENTS = 1 << 20


def _pieces(arrays: list[np.ndarray]):
    """(flat offset, piece) over the samples' elements in stacked (C) order, without stacking."""
    offset = 0
    for arr in arrays:
        flat = arr.reshape(-1)
        for start in range(0, flat.size, CHUNK_ELEMENTS):
            yield offset + start, flat[start:start + CHUNK_ELEMENTS]
        offset += flat.size




def _compare_pieces(name: str, refs, gots, rtol: float, atol: float) -> Comparison:
    """``compare_arrays`` of the stacked samples (one sample: the tensor), computed piece by piece and
    merged: maxima and counts exactly, means and norms from per-piece sums (equal up to float64
    rounding of the summation order), the worst element as the first of the largest error."""
    total = sum(r.size for r in refs)
    shape = list(refs[0].shape) if len(refs) == 1 else [len(refs)] + list(refs[0].shape)
    n_both = 0
    sum_abs = sum_sq = dot = nr2 = ng2 = 0.0
    mismatches = 0
    nonfinite = 0
    passed = True
    max_abs = max_rel = 0.0
    worst = None  # (score, flat index, worst_ref, worst_got)
    for (offset, r), (_, g) in zip(_pieces(refs), _pieces(gots)):
        c = compare_arrays(name, r, g, rtol=rtol, atol=atol)
        both = np.isfinite(r) & np.isfinite(g)
        k = int(np.count_nonzero(both))
        rv, gv = r[both].astype(np.float64), g[both].astype(np.float64)
        dot += float(np.dot(rv, gv))
        nr2 += float(np.dot(rv, rv))
        ng2 += float(np.dot(gv, gv))
        del both, rv, gv
        passed = passed and c.passed
        if k:
            max_abs = max(max_abs, c.max_abs)
        max_rel = max(max_rel, c.max_rel)
        n_both += k
        sum_abs += c.mean_abs * k
        sum_sq += c.rms ** 2 * k
        mismatches += round(c.mismatch_fraction * r.size)
        nonfinite += c.nonfinite_mismatches
        score = math.inf if c.nonfinite_mismatches else (c.max_abs if k else -math.inf)
        if worst is None or score > worst[0]:
            worst = (score, offset + c.worst_index[0], c.worst_ref, c.worst_got)
    cos = _cosine(dot, math.sqrt(nr2), math.sqrt(ng2))
    index = [int(i) for i in np.unravel_index(worst[1], shape)] if shape else []
    return Comparison(
        name=name, dtype=refs[0].dtype.name, shape=shape, rtol=rtol, atol=atol, passed=passed,
        max_abs=max_abs, max_rel=max_rel, mean_abs=sum_abs / n_both if n_both else 0.0,
        rms=math.sqrt(sum_sq / n_both) if n_both else 0.0, cosine=cos, mismatch_fraction=mismatches / total,
        worst_index=index, worst_ref=worst[2], worst_got=worst[3], nonfinite_mismatches=nonfinite,
        extra={"dtype_b": gots[0].dtype.name} if refs[0].dtype != gots[0].dtype else {},
    )


def _histogram_pieces(refs, gots, bins_per_decade: int = 2, max_bins: int = 40) -> dict:
    """``error_histogram`` of the stacked samples in two passes over pieces (range, then counts); the
    bins are computed by the same formulas, so the result is the same."""
    zeros = nonfinite = 0
    lo_err, hi_err = math.inf, 0.0
    for (_, r), (_, g) in zip(_pieces(refs), _pieces(gots)):
        r, g = r.astype(np.float64), g.astype(np.float64)
        both = np.isfinite(r) & np.isfinite(g)
        err = np.abs(g[both] - r[both])
        nonzero = err[err > 0]
        zeros += int(err.size - nonzero.size)
        nonfinite += int((~both).sum())
        if nonzero.size:
            lo_err, hi_err = min(lo_err, float(nonzero.min())), max(hi_err, float(nonzero.max()))
    hist = {"zeros": zeros, "edges": [], "counts": [], "nonfinite": nonfinite}
    if hi_err == 0.0:
        return hist

    log_edges = log_bin_edges(lo_err, hi_err, bins_per_decade, max_bins)
    counts = np.zeros(len(log_edges) - 1, dtype=np.int64)
    for (_, r), (_, g) in zip(_pieces(refs), _pieces(gots)):
        r, g = r.astype(np.float64), g.astype(np.float64)
        both = np.isfinite(r) & np.isfinite(g)
        err = np.abs(g[both] - r[both])
        nonzero = err[err > 0]
        if nonzero.size:
            counts += np.histogram(np.log10(nonzero), bins=log_edges)[0]
    hist["edges"] = [float(10.0**e) for e in log_edges]
    hist["counts"] = [int(c) for c in counts]
    return hist
