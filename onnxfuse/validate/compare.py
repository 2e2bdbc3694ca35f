"""Comparing two tensors the way a person deciding "is this still the same model?" needs.

Tolerance rule, per element: ``|got - ref| <= atol + rtol * |ref|``, and NaN/Inf must appear in the
same places with the same signs. Default tolerances depend on the dtype (see :func:`default_tolerance`);
the default ``atol`` is scaled by the output's largest magnitude, because a model whose outputs are in
the hundreds cannot be judged by an absolute 1e-5 on its near-zero elements. An explicit ``--atol`` is
taken literally.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

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
    import onnx

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
    rv, gv = r[both], g[both]
    nr, ng = float(np.linalg.norm(rv)), float(np.linalg.norm(gv))
    if nr == 0.0 and ng == 0.0:
        cosine = 1.0
    elif nr == 0.0 or ng == 0.0:
        cosine = 0.0
    else:
        cosine = float(np.dot(rv, gv) / (nr * ng))
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
        cosine=cosine,
        mismatch_fraction=float(bad.mean()),
        worst_index=[int(i) for i in worst],
        worst_ref=_finite_or_none(r[worst]) if r.size else None,
        worst_got=_finite_or_none(g[worst]) if g.size else None,
        nonfinite_mismatches=int(nonfinite_bad.sum()),
    )
