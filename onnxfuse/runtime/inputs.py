"""Seeded model inputs from a model's signature, or the user's own: arrays in memory or an .npz file.

Both ``optimize`` (validation) and ``diff``/``bench`` draw inputs here, so every command feeds a model
the same data for the same seed and shapes. Dynamic dimensions come from ``--shape NAME:D0,D1,...``;
any left unspecified default to 1, and that is reported as a note (never silently). Where the graph
ties dynamic dimensions so that all at 1 cannot run (a KV-cache decoder: mask length = past +
sequence), they get sizes that satisfy the ties instead (:func:`derived_shapes`,
:mod:`onnxfuse.runtime.dim_relations`), also with notes.

User inputs (:func:`given_inputs`) come as a dict ``{input name: array}`` (one sample), a list of such
dicts (several samples), or the path of an ``.npz`` file (one sample, ``--inputs``). Every one is
checked against the model's signature the same way: each model input present, same dtype (no silent
cast), fixed dimensions equal. Arrays for names the model does not take are ignored.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import onnx

from onnxfuse.errors import InputsError, UsageError


@dataclass
class InputSpec:
    name: str
    dtype: np.dtype
    shape: list  # ints, or str/None for dynamic dimensions


@dataclass
class Inputs:
    feeds: dict[str, np.ndarray]
    notes: list[str] = field(default_factory=list)
    seed: int | None = None
    source: str = "random"
    ranges: dict = field(default_factory=dict)  # the value ranges a random draw used (name -> ValueRange)

    def shapes(self) -> dict[str, list[int]]:
        return {k: list(v.shape) for k, v in self.feeds.items()}


def _np_dtype(elem_type: int) -> np.dtype:
    try:
        return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem_type))
    except Exception:
        raise InputsError(f"unsupported input element type {onnx.TensorProto.DataType.Name(elem_type)}") from None


def input_specs(model: onnx.ModelProto) -> list[InputSpec]:
    """The model's real inputs (graph inputs that are not initializers)."""
    inits = {t.name for t in model.graph.initializer}
    specs = []
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        tt = vi.type.tensor_type
        if not vi.type.HasField("tensor_type"):
            raise InputsError(f"input {vi.name!r} is not a tensor; onnxfuse only feeds tensor inputs")
        shape: list = []
        if tt.HasField("shape"):
            for d in tt.shape.dim:
                if d.HasField("dim_value") and d.dim_value >= 0:  # a declared 0 is a fixed, empty dimension
                    shape.append(int(d.dim_value))
                else:
                    shape.append(d.dim_param or None)
        specs.append(InputSpec(vi.name, _np_dtype(tt.elem_type), shape))
    return specs


def parse_shape_options(values) -> dict[str, list[int]]:
    """Parse repeated ``NAME:D0,D1,...`` options (``NAME:`` alone means a scalar)."""
    shapes: dict[str, list[int]] = {}
    for value in values or ():
        name, sep, dims = value.rpartition(":")
        if not sep or not name:
            raise UsageError(f"--shape {value!r}: expected NAME:D0,D1,... (e.g. input:1,3,224,224)")
        try:
            shapes[name] = [int(d) for d in dims.split(",") if d.strip()] if dims.strip() else []
        except ValueError:
            raise UsageError(f"--shape {value!r}: dimensions must be integers") from None
        if any(d < 0 for d in shapes[name]):
            raise UsageError(f"--shape {value!r}: dimensions must be non-negative")
    return shapes


def _random(rng: np.random.Generator, dtype: np.dtype, shape: list[int], value_range=None) -> np.ndarray:
    """Random data of ``dtype`` and ``shape``, always an ndarray (numpy returns a bare scalar for a
    rank-0 draw, which ONNX Runtime refuses)."""
    return np.asarray(_draw(rng, dtype, shape, value_range), dtype=dtype)


def _draw(rng: np.random.Generator, dtype: np.dtype, shape: list[int], value_range=None):
    """bool: fair coin. Integers: uniform in the input's range, inclusive (``input_ranges``: what the
    graph implies, or ``--input-range``), else 0 or 1 (masks, token types). Floats: standard normal,
    or uniform in ``[lo, hi)`` with a range. A law with its own ``draw`` (:class:`~onnxfuse.runtime.
    right_padding.RightPadded`) draws for itself."""
    if hasattr(value_range, "draw"):
        return value_range.draw(rng, dtype, shape)
    if dtype == np.bool_:
        return rng.random(shape) < 0.5
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        lo, hi = (0, 1) if value_range is None else (int(np.ceil(value_range.lo)), int(np.floor(value_range.hi)))
        lo, hi = max(lo, int(info.min)), min(hi, int(info.max))
        return rng.integers(lo, hi + 1, size=shape, dtype=np.int64).astype(dtype)
    if np.issubdtype(dtype, np.floating) or dtype.kind == "V" or str(dtype) == "bfloat16":
        if value_range is not None:
            return rng.uniform(value_range.lo, value_range.hi, size=shape).astype(np.float32).astype(dtype)
        return rng.standard_normal(shape).astype(np.float32).astype(dtype)
    raise InputsError(f"cannot generate random data of type {dtype}")


def value_ranges(model: onnx.ModelProto, given=None) -> tuple[dict, list[str]]:
    """The ranges to draw ``model``'s inputs from: what the graph implies for integer inputs
    (:mod:`onnxfuse.runtime.input_ranges`), overridden by ``given`` (``--input-range``); and a note
    for each implied one. Unknown names in ``given`` are usage errors."""
    # start-up: the command line starts (and --help runs) without onnxfuse.runtime.input_ranges (nor graphsurgeon)
    from onnxfuse.runtime.input_ranges import implied_ranges

    given = dict(given or {})
    specs = input_specs(model)
    unknown = set(given) - {s.name for s in specs}
    if unknown:
        raise UsageError(f"--input-range names unknown input(s) {', '.join(sorted(unknown))}; model inputs: "
                         f"{', '.join(s.name for s in specs) or '(none)'}")
    implied = {k: v for k, v in implied_ranges(model).items() if k not in given}
    notes = [r.describe(k) for k, r in implied.items()]
    return {**implied, **given}, notes


def dimension_symbols(specs: list[InputSpec], shapes: dict[str, list[int]]) -> dict[str, int]:
    """Named dynamic dimensions fixed by ``--shape`` (``batch`` → 8), to apply to every other input.

    Inputs that share a symbolic dimension (``input_ids`` and ``attention_mask`` both ``[batch,
    sequence]``) must agree, so giving the shape of one of them sizes the others.
    """
    symbols: dict[str, int] = {}
    for spec in specs:
        for want, got in zip(spec.shape, shapes.get(spec.name, ())):
            if isinstance(want, str) and want:
                symbols.setdefault(want, got)
    return symbols


def resolve_shape(spec: InputSpec, shapes: dict[str, list[int]], notes: list[str],
                  symbols: dict[str, int] | None = None, default: int = 1) -> list[int]:
    if spec.name in shapes:
        given = shapes[spec.name]
        if spec.shape and len(given) != len(spec.shape):
            raise UsageError(f"--shape {spec.name}: model expects rank {len(spec.shape)}, got {len(given)}")
        for want, got in zip(spec.shape, given):
            if isinstance(want, int) and want != got:
                raise UsageError(f"--shape {spec.name}: dimension {want} is fixed in the model, got {got}")
        return list(given)
    out = []
    defaulted = []
    for d in spec.shape:
        if isinstance(d, int):
            out.append(d)
        elif symbols and d in symbols:
            out.append(symbols[d])
        else:
            out.append(default)
            defaulted.append(str(d) if d else "?")
    if defaulted:
        example = [x if isinstance(d, int) else (8 if k == 0 else 128) for k, (x, d) in enumerate(zip(out, spec.shape))]
        notes.append(
            f"input {spec.name!r}: dynamic dimension(s) {', '.join(defaulted)} set to {default} "
            f"(other sizes: e.g. --shape {spec.name}:{','.join(str(x) for x in example)})"
        )
    return out


def make_inputs(
    model: onnx.ModelProto,
    shapes: dict[str, list[int]] | None = None,
    seed: int = 0,
    npz_path: str | Path | None = None,
    ranges=None,
) -> Inputs:
    """Inputs for ``model``: from ``npz_path`` when given, else seeded random data (:func:`_draw`)."""
    specs = input_specs(model)
    shapes = shapes or {}
    check_shape_names(specs, shapes)
    if npz_path is not None:
        return load_npz(specs, Path(npz_path))
    value_range, notes = value_ranges(model, ranges)
    derived = derived_shapes(model, specs, shapes)
    inputs = random_inputs(specs, derived[0] if derived else shapes, seed, value_range)
    inputs.notes.extend((derived[1] if derived else []) + notes)
    return inputs


def make_samples(
    model: onnx.ModelProto,
    shapes: dict[str, list[int]] | None = None,
    seed: int = 0,
    given=None,
    ranges=None,
    default_dim: int = 1,
    count: int = 1,
    floats_as_float32: bool = False,
    right_padded=(),
    derive: bool = True,
) -> list[Inputs]:
    """The samples to run ``model`` on: the user's (``given``, see :func:`given_inputs`) when given,
    else ``count`` seeded draws (seeds ``seed``, ``seed+1``, ...; as :func:`make_inputs`, value ranges
    included). ``floats_as_float32``: floating inputs are left in float32, to be cast for each model
    (:func:`cast_feeds`), so an fp16 model and its fp32 original see the same values.
    ``right_padded``: inputs promised right-padded (``--right-padded``, :mod:`.right_padding`): drawn as
    such, and given inputs must keep the promise. ``derive``: where the graph ties dynamic dimensions
    so that all at 1 cannot run (a KV-cache decoder's mask is past + sequence long), the unsized ones
    get sizes that satisfy the ties (:func:`derived_shapes`), with notes naming them."""
    # start-up: the command line starts (and --help runs) without onnxfuse.runtime.right_padding
    from onnxfuse.runtime import right_padding

    specs = input_specs(model)
    check_shape_names(specs, shapes or {})
    padded = right_padding.right_padded_draws(specs, right_padded)
    if given is not None and (shapes or ranges):
        what = "--shape" if shapes else "--input-range"
        raise UsageError(f"{what} sizes or draws random inputs; it cannot apply to given inputs (--inputs): "
                         "give one or the other")
    if given is None:
        clash = sorted(set(padded) & set(ranges or {}))
        if clash:
            raise UsageError(f"--right-padded and --input-range both name {', '.join(clash)}: give one")
        value_range, notes = value_ranges(model, {**(ranges or {}), **padded})
        notes.extend(law.describe(name) for name, law in padded.items())
        if floats_as_float32:
            specs = [replace(s, dtype=np.dtype(np.float32)) if is_floating(s.dtype) else s for s in specs]
        derived = derived_shapes(model, specs, shapes or {}, default_dim) if derive else None
        sized = derived[0] if derived else (shapes or {})
        if derived:
            notes = derived[1] + notes
        draws = [random_inputs(specs, sized, seed + k, value_range, default_dim) for k in range(max(1, count))]
        draws[0].notes.extend(notes)
        return draws
    samples = given_inputs(specs, given)
    right_padding.check_given(samples, right_padded)
    return samples


def _relations(model: onnx.ModelProto, specs: list[InputSpec], shapes: dict[str, list[int]]):
    """The model's dimension relations with ``shapes`` (``--shape``) fixed, when sizes must be derived
    (:attr:`~onnxfuse.runtime.dim_relations.Relations.needed`); else None."""
    if not any(not isinstance(d, int) for s in specs for d in s.shape):
        return None
    from onnxfuse.runtime.dim_relations import derive  # only for models with dynamic dimensions

    fixed = _fixed_symbols(specs, shapes)
    try:  # whether the model has binding ties is a question about the graph, asked before --shape fixes any
        unfixed = derive(model)
        if unfixed is None or not unfixed.needed:
            return None
        if not fixed:
            return unfixed
        rel = derive(model, fixed)
        if rel is not None:  # a cache still grows by the new tokens when --shape fixed the tokens' count
            rel.summed = [x for x in rel.free if x in unfixed.summed]
            rel.cache = [x for x in rel.free if x in unfixed.cache]
        return rel
    except Exception:  # reading relations is a help, never a reason to stop validation
        return None


def derived_shapes(model: onnx.ModelProto, specs: list[InputSpec], shapes: dict[str, list[int]],
                   default_dim: int = 1) -> tuple[dict, list[str]] | None:
    """Every input's shape where the graph ties dynamic dimensions that cannot all be 1
    (:mod:`onnxfuse.runtime.dim_relations`), ``shapes`` kept; and the notes naming the relations,
    the untied dimensions and the sizes. None for models without such ties (they keep the default
    sizes) or when no assignment satisfies them."""
    rel = _relations(model, specs, shapes)
    if rel is None:
        return None
    values = rel.assign(rel.primary(_fixed_symbols(specs, shapes), default_dim))
    if values is None:
        return None
    sized = {**rel.shapes(specs, values), **shapes}
    shown = ", ".join(f"{s.name} {'x'.join(map(str, sized[s.name]))}" for s in specs if s.name not in shapes
                      and any(not isinstance(d, int) for d in s.shape))
    notes = rel.describe() + ([f"sizes that satisfy them: {shown} (use --shape to choose)"] if shown else [])
    return sized, notes


def _fixed_symbols(specs: list[InputSpec], shapes: dict[str, list[int]]) -> dict[str, int]:
    """``input[axis]`` → size for every dynamic dimension ``shapes`` (``--shape``) sizes."""
    return {f"{s.name}[{k}]": shapes[s.name][k] for s in specs if s.name in shapes
            for k, d in enumerate(s.shape) if not isinstance(d, int) and k < len(shapes[s.name])}


def relation_variants(model: onnx.ModelProto, first: Inputs, seed: int = 0) -> list[tuple[str, list[Inputs]]]:
    """Further samples for a model whose dynamic dimensions are tied (:func:`derived_shapes`): groups of
    (what, candidates), the caller keeping the first candidate of each group the original runs on.

    * a second size: every free dimension one larger than in ``first``, the tied ones computed (else
      all but one of them, each in turn);
    * for a KV-cache model (a free dimension the graph concatenates new entries to): a *prefill* sample
      (cache length 0, else 1; the new tokens one more than in ``first``) and a *decode* sample (one new
      token, the cache as in ``first``), batch one larger: the two shapes a generation loop feeds.

    Empty for models without such ties: they keep :func:`second_size_candidates`.
    """
    specs = input_specs(model)
    rel = _relations(model, specs, {})
    if rel is None:
        return []
    base = {}
    for sym in rel.free:
        name, axis, _ = rel.symbols[sym]
        if name not in first.feeds or axis >= first.feeds[name].ndim:
            return []
        base[sym] = int(first.feeds[name].shape[axis])
    bigger = {s: v + 1 for s, v in base.items()}
    second = "second size (free dimensions one larger)"
    # then with one free dimension kept at a time: a kernel may refuse one combination (ONNX Runtime's
    # GroupQueryAttention on the CPU: batch 1 only when several new tokens follow a cache)
    plans = [("second size", [(second, bigger)] + [(second, {**bigger, s: base[s]}) for s in rel.free])]
    if rel.cache:
        others = [s for s in rel.summed if s not in rel.cache]
        plans.append(("prefill", [("prefill (empty cache)", {**bigger, **{c: 0 for c in rel.cache}}),
                                  ("prefill (a cache of 1: the original does not run on an empty one)",
                                   {**bigger, **{c: 1 for c in rel.cache}})]))
        plans.append(("decode", [("decode (one new token)",
                                  {**bigger, **{c: max(1, base[c]) for c in rel.cache}, **{s: 1 for s in others}})]))
    groups = []
    for group, assignments in plans:
        draws = []
        for how, free in assignments:
            values = rel.assign(free)
            if values is None:
                continue
            shapes = rel.shapes(specs, values)
            draw = random_inputs(specs, shapes, seed + 1 + len(groups), first.ranges)
            draw.notes = [f"{how}: " + ", ".join(f"{k} {values[k]}" for k in rel.free)]
            draws.append(draw)
        if draws:
            groups.append((group, draws))
    return groups


def is_floating(dtype: np.dtype) -> bool:
    """Float types, bfloat16 included (numpy does not count it as floating)."""
    return np.issubdtype(dtype, np.floating) or str(dtype) == "bfloat16"


def cast_feeds(model: onnx.ModelProto, feeds: dict, label: str) -> dict:
    """``feeds`` (drawn or given for another model, "model A") cast to ``model``'s input dtypes and
    restricted to its inputs; shapes checked. Float and integer types do not mix (bool casts to either)."""
    out = {}
    for spec in input_specs(model):
        if spec.name not in feeds:
            raise InputsError(f"model {label} has input {spec.name!r} that model A does not "
                              f"(A's inputs: {', '.join(feeds) or '(none)'})")
        arr = feeds[spec.name]
        if spec.shape and (len(spec.shape) != arr.ndim or any(
                isinstance(w, int) and w != g for w, g in zip(spec.shape, arr.shape))):
            raise InputsError(f"model {label}: input {spec.name!r} expects shape {spec.shape}, "
                              f"the inputs have {list(arr.shape)}")
        if arr.dtype != spec.dtype:
            if is_floating(arr.dtype) != is_floating(spec.dtype) and arr.dtype != np.bool_:
                raise InputsError(f"model {label}: input {spec.name!r} is {spec.dtype}, model A's is {arr.dtype}")
            arr = arr.astype(spec.dtype)
        out[spec.name] = arr
    return out


def for_model(model: onnx.ModelProto, inputs: "Inputs") -> "Inputs":
    """``inputs`` (drawn for another model) with each float feed cast to the float type ``model`` declares
    for it (``--precision fp16 --float16-io``: the optimized model takes float16 where its original took
    float32; the values are the same draw, rounded once). Other feeds, and inputs that need no cast, are
    returned as they are."""
    given = inputs if isinstance(inputs, dict) else inputs.feeds  # (a plain feeds dict works too)
    declared = {spec.name: spec.dtype for spec in input_specs(model)}
    casts = {k: declared[k] for k, v in given.items()
             if k in declared and v.dtype != declared[k] and is_floating(v.dtype) and is_floating(declared[k])}
    if not casts:
        return inputs
    feeds = {k: (v.astype(casts[k]) if k in casts else v) for k, v in given.items()}
    if isinstance(inputs, dict):
        return feeds
    return Inputs(feeds=feeds, notes=list(inputs.notes), seed=inputs.seed, source=inputs.source, ranges=inputs.ranges)


def unsized_dimensions(specs: list[InputSpec], shapes: dict[str, list[int]]) -> list[str]:
    """``input[axis] (name)`` for every dynamic dimension neither ``shapes`` nor a shared name sizes."""
    symbols = dimension_symbols(specs, shapes or {})
    out = []
    for spec in specs:
        if spec.name in (shapes or {}):
            continue
        for k, d in enumerate(spec.shape):
            if not isinstance(d, int) and not (d and d in symbols):
                out.append(f"{spec.name}[{k}]" + (f" ({d})" if d else ""))
    return out


def second_size_candidates(model: onnx.ModelProto, first: Inputs, seed: int = 0) -> list[Inputs]:
    """Draws at a second size of every dynamic dimension, to run validation on as well as ``first``.

    One size is blind to rewrites that specialise a shape (a Reshape target baked to the sample's
    length, or a dimension copied from a tensor whose size differs). So every dynamic dimension is
    also tried larger than in ``first``: first with each symbolic name, and each unnamed dimension, on
    a size of its own (``batch`` and ``sequence`` differ, so a rewrite that confuses them is caught),
    then, for models that cannot run like that, every dimension one larger. Dimensions that share a
    name keep one size in both: the same ``dim_param`` on two inputs declares them equal (ONNX's
    convention, which TensorRT checks and rewrites such as constant-reshape-target rely on), and a
    model fed sizes that break its declaration is outside its contract. An earlier version gave them
    different sizes too: optimum's Whisper decoder still runs with ``input_ids`` and
    ``encoder_hidden_states`` of different batch sizes (its cross-attention's ``view(bsz, -1, H, D)``
    folds the mismatch into the key length), so validation compared outputs the model does not define.
    The caller keeps the first candidate the original model runs on. Empty when the model has no
    dynamic dimension. Values come from the ranges ``first`` was drawn with.
    """
    specs = input_specs(model)
    if not any(not isinstance(d, int) for s in specs for d in s.shape):
        return []
    own: dict = {}  # a name's own size; unnamed dimensions get one each
    independent, by_name = {}, {}
    for s in specs:
        base = list(first.feeds[s.name].shape)
        ind, con = list(base), list(base)
        for k, d in enumerate(s.shape):
            if isinstance(d, int):
                continue
            key = d if d else ("unnamed", s.name, k)
            if key not in own:
                own[key] = base[k] + 1 + len(own)
            ind[k] = own[key]
            con[k] = base[k] + 1
        independent[s.name], by_name[s.name] = ind, con
    out = []
    for shapes, how in ((independent, "each dimension name on its own size"),
                        (by_name, "dynamic dimensions one larger")):
        if out and shapes == by_name and by_name == independent:
            break
        draw = random_inputs(specs, shapes, seed + 1, first.ranges)
        draw.notes = [f"second size ({how}): " + ", ".join(f"{k} {v}" for k, v in shapes.items())]
        out.append(draw)
    return out


def given_inputs(specs: list[InputSpec], given) -> list[Inputs]:
    """User inputs as a list of samples: ``given`` is a dict ``{name: array}``, a list (or tuple) of such
    dicts, or the path (str or ``os.PathLike``) of an ``.npz`` file. Raises :class:`InputsError` with one
    line when they do not fit ``specs``."""
    if isinstance(given, (str, os.PathLike)):
        return load_npz_samples(specs, Path(given))
    if isinstance(given, Mapping):
        return [from_arrays(specs, given)]
    if isinstance(given, (list, tuple)):
        if not given:
            raise InputsError("inputs: the list of samples is empty")
        if not all(isinstance(g, Mapping) for g in given):
            raise InputsError("inputs: a list of samples must hold dicts {input name: array}")
        many = len(given) > 1
        return [from_arrays(specs, g, where=f"inputs[{i}]" if many else "inputs") for i, g in enumerate(given)]
    raise InputsError(f"inputs: expected a dict {{input name: array}}, a list of such dicts or the path of an "
                      f".npz file, got {type(given).__name__}")


def from_arrays(specs: list[InputSpec], arrays: Mapping, where: str = "inputs") -> Inputs:
    """One sample from in-memory arrays (anything ``numpy.asarray`` takes), checked like an .npz file."""
    feeds = checked_feeds(specs, {str(k): np.asarray(v) for k, v in arrays.items()}, where)
    return Inputs(feeds=feeds, notes=[], seed=None, source="arrays")


def checked_feeds(specs: list[InputSpec], arrays: Mapping[str, np.ndarray], where: str) -> dict[str, np.ndarray]:
    """``arrays`` restricted to ``specs``, each checked for presence, dtype and fixed dimensions."""
    feeds = {}
    for spec in specs:
        if spec.name not in arrays:
            raise InputsError(f"{where}: no array named {spec.name!r} (model inputs: {', '.join(s.name for s in specs)})")
        arr = arrays[spec.name]
        if arr.dtype != spec.dtype:
            raise InputsError(f"{where}: {spec.name!r} has dtype {arr.dtype}, model expects {spec.dtype}")
        if spec.shape and (
            len(arr.shape) != len(spec.shape)
            or any(isinstance(w, int) and w != g for w, g in zip(spec.shape, arr.shape))
        ):
            raise InputsError(f"{where}: {spec.name!r} has shape {list(arr.shape)}, model expects {spec.shape}")
        feeds[spec.name] = arr
    return feeds


def check_shape_names(specs: list[InputSpec], shapes: dict[str, list[int]], flag: str = "--shape") -> None:
    """Raise :class:`UsageError` (exit 2) when ``--shape`` (or ``flag``) names an input the model does not have."""
    unknown = set(shapes or {}) - {s.name for s in specs}
    if unknown:
        raise UsageError(
            f"{flag} names unknown input(s) {', '.join(sorted(unknown))}; model inputs: "
            f"{', '.join(s.name for s in specs) or '(none)'}"
        )


def random_inputs(specs: list[InputSpec], shapes: dict[str, list[int]] | None = None, seed: int = 0,
                  ranges=None, default_dim: int = 1) -> Inputs:
    """The seeded draw :func:`make_inputs` makes, for explicit ``specs``.

    Floating inputs are drawn in float32 and cast to the spec's dtype, so specs that differ only in
    float precision (an fp16 model and its fp32 original) get the same values for the same seed.
    Sizes are checked (:func:`check_input_sizes`) before anything is drawn.
    """
    notes: list[str] = []
    rng = np.random.default_rng(seed)
    shapes = shapes or {}
    symbols = dimension_symbols(specs, shapes)
    ranges = ranges or {}
    resolved = [(s, resolve_shape(s, shapes, notes, symbols, default_dim)) for s in specs]
    check_input_sizes(resolved)
    feeds = {s.name: _random(rng, s.dtype, shape, ranges.get(s.name)) for s, shape in resolved}
    return Inputs(feeds=feeds, notes=notes, seed=seed, source="random", ranges=dict(ranges))


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if n < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PiB"


def available_memory() -> int | None:
    """Bytes of memory available to a new allocation (``MemAvailable`` + free swap), or None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if line.split()[1:2]}
        return info["MemAvailable"] + info.get("SwapFree", 0)
    except (OSError, KeyError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_input_sizes(resolved: list[tuple[InputSpec, list[int]]], available: int | None = None) -> None:
    """Raise :class:`InputsError` naming the input when the random inputs cannot fit in memory.

    Drawing an input of ``n`` elements holds ``n`` float64 values (numpy's normal and uniform
    generators draw in float64; integers are drawn as int64) besides the result in the input's own
    dtype, and every input stays alive for the run: the need is the sum of the inputs plus the largest
    draw. Checked before any allocation, so a declared 1e12-element input (7.3 TiB while drawing) is
    one line, not a ``MemoryError`` after minutes of swapping.
    """
    if not resolved:
        return
    sizes = [(spec, shape, math.prod(int(d) for d in shape)) for spec, shape in resolved]
    total = sum(n * spec.dtype.itemsize for spec, _, n in sizes)
    spec, shape, n = max(sizes, key=lambda x: x[2] * (8 + x[0].dtype.itemsize))
    need = total + 8 * n
    if available is None:
        available = available_memory()
    if available is None or need <= available:
        return
    raise InputsError(
        f"input {spec.name!r}: shape {list(shape)} is {n:.3g} elements ({_human(n * spec.dtype.itemsize)} as "
        f"{spec.dtype}, {_human(8 * n)} more while drawing it): the random inputs need {_human(need)}, "
        f"{_human(available)} of memory is available; give smaller dynamic dimensions with --shape "
        f"{spec.name}:... or your own data with --inputs")


def _read_npz(path: Path) -> dict[str, np.ndarray]:
    if not path.is_file():
        raise InputsError(f"{path}: no such inputs file")
    try:
        data = np.load(path, allow_pickle=False)
        return {k: data[k] for k in data.files}
    except Exception as exc:
        raise InputsError(f"{path}: not a readable .npz file ({exc.__class__.__name__})") from None


def _samples_of(arrays: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]] | None:
    """Several samples in one .npz: every key ``<k>/<input name>`` (what ``--save-inputs`` writes)."""
    groups: dict[int, dict[str, np.ndarray]] = {}
    for key, value in arrays.items():
        k, sep, name = key.partition("/")
        if not sep or not k.isdigit():
            return None
        groups.setdefault(int(k), {})[name] = value
    return [groups[k] for k in sorted(groups)] if groups else None


def load_npz(specs: list[InputSpec], path: Path) -> Inputs:
    """Inputs for ``specs`` from an .npz file (its first sample when it holds several), checked against
    each spec's dtype and fixed dimensions."""
    return load_npz_samples(specs, path)[0]


def load_npz_samples(specs: list[InputSpec], path: Path) -> list[Inputs]:
    """Every sample of an .npz file: arrays named after the inputs (one sample), or ``<k>/<input>``
    (several, as ``--save-inputs`` writes them)."""
    arrays = _read_npz(path)
    several = _samples_of(arrays)
    if several is None:
        return [Inputs(feeds=checked_feeds(specs, arrays, str(path)), notes=[], seed=None, source=str(path))]
    return [Inputs(feeds=checked_feeds(specs, sample, f"{path} sample {k}"), notes=[], seed=None, source=str(path))
            for k, sample in enumerate(several)]


def save_samples(samples: list[Inputs], path: str | Path) -> None:
    """Write ``samples`` as one .npz (``<k>/<input>`` keys), for ``--inputs`` to replay them exactly."""
    arrays = {f"{k}/{name}": value for k, s in enumerate(samples) for name, value in s.feeds.items()}
    try:
        with open(path, "wb") as f:
            np.savez(f, **arrays)
    except OSError as exc:
        raise InputsError(f"--save-inputs {path}: cannot write ({exc.strerror or exc})") from None

