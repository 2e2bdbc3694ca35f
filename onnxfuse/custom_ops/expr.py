"""The FusedElementwise program language, Python side (spec: ``docs/program-language.md``).

A ``FusedElementwise`` node carries a small straight-line program of ONNX elementwise ops. This module
is the single Python source of truth for that language:

* the data model (:class:`Program`, :class:`Const`, :class:`Op`) and the dtype tables;
* :data:`OP_TABLE`, one :class:`OpSpec` row per supported op (arity, dtypes, attributes, result-dtype
  rule, numpy reference, and the ``csrc/ops.h`` function of the C++ kernels). The fusion rewriter
  asks it which ONNX nodes it may fuse; the C++ library's op table is generated from it
  (``tools/gen_op_table.py``); adding an op is one row here plus its function in ``csrc/ops.h``
  (``csrc/README.md``);
* :func:`parse` / :func:`print_program` (canonical text, exact round trip of every constant);
* :class:`ProgramBuilder`, what the graph rewriter uses to emit programs without writing text;
* :func:`evaluate`, the numpy reference evaluator with ONNX semantics (each op rounded to its dtype);
* :func:`onnx_equivalent_model`, the same computation as an *unfused* graph of standard ONNX ops, the
  independent ONNX Runtime reference the custom kernels are tested against.

The C++ parser (``csrc/``) implements the same grammar; anything this module rejects, it rejects too.
That is why the lexical rules here are stricter than Python's own (no ``1_000``, no ``Infinity``):
they must be expressible with ``strtod``/``strtoll`` and a hand-written tokenizer.

The library never imports click or rich: this module is used inside the rewriter and the tests.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np

try:  # onnx depends on ml_dtypes, so this is always present where onnx is.
    import ml_dtypes as _ml_dtypes
except ImportError:  # pragma: no cover - only without onnx's dependency
    _ml_dtypes = None

__all__ = [
    "LANGUAGE_VERSION",
    "HEADER",
    "DOMAIN",
    "OP_TYPE",
    "DOMAIN_OPSET",
    "DTYPES",
    "FLOAT_DTYPES",
    "INT_DTYPES",
    "ONNX_DTYPE",
    "DTYPE_FROM_ONNX",
    "numpy_dtype",
    "dtype_from_numpy",
    "ProgramError",
    "AttrSpec",
    "OpSpec",
    "OP_TABLE",
    "op_spec",
    "result_dtype",
    "Const",
    "Op",
    "Program",
    "parse",
    "print_program",
    "ProgramBuilder",
    "evaluate",
    "round_to_dtype",
    "onnx_equivalent_model",
]

# The op's contract constants are defined once, in the package (which imports nothing heavy).
from onnxfuse.custom_ops import DOMAIN, LANGUAGE_VERSION, OP_TYPE  # noqa: E402
from onnxfuse.custom_ops import OPSET_VERSION as DOMAIN_OPSET  # noqa: E402
from onnxfuse.custom_ops import fast_cuda  # noqa: E402

HEADER = "onnxfuse.elementwise"

# --------------------------------------------------------------------------------------------------
# Data types
# --------------------------------------------------------------------------------------------------

FLOAT_DTYPES: tuple[str, ...] = ("float32", "float16", "bfloat16")
INT_DTYPES: tuple[str, ...] = ("int32", "int64")
DTYPES: tuple[str, ...] = FLOAT_DTYPES + INT_DTYPES + ("bool",)
_NUMERIC = frozenset(FLOAT_DTYPES + INT_DTYPES)
_FLOATS = frozenset(FLOAT_DTYPES)
_ALL = frozenset(DTYPES)
_BOOL = frozenset(("bool",))

# TensorProto enum values (hard-coded so that importing this module does not need onnx).
ONNX_DTYPE: dict[str, int] = {
    "float32": 1,  # TensorProto.FLOAT
    "float16": 10,  # TensorProto.FLOAT16
    "bfloat16": 16,  # TensorProto.BFLOAT16
    "int32": 6,  # TensorProto.INT32
    "int64": 7,  # TensorProto.INT64
    "bool": 9,  # TensorProto.BOOL
}
DTYPE_FROM_ONNX: dict[int, str] = {v: k for k, v in ONNX_DTYPE.items()}

_NP_DTYPES: dict[str, np.dtype] = {
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "int32": np.dtype(np.int32),
    "int64": np.dtype(np.int64),
    "bool": np.dtype(np.bool_),
}
if _ml_dtypes is not None:
    _NP_DTYPES["bfloat16"] = np.dtype(_ml_dtypes.bfloat16)


def numpy_dtype(dtype: str) -> np.dtype:
    """The numpy dtype that stores values of program dtype ``dtype`` (bfloat16 needs ml_dtypes)."""
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}")
    if dtype not in _NP_DTYPES:  # pragma: no cover - only without ml_dtypes
        raise ValueError("bfloat16 needs the ml_dtypes package (a dependency of onnx)")
    return _NP_DTYPES[dtype]


def dtype_from_numpy(dt: Any) -> str:
    """The program dtype name of a numpy dtype; ValueError for dtypes the language does not have."""
    dt = np.dtype(dt)
    for name, npdt in _NP_DTYPES.items():
        if npdt == dt:
            return name
    raise ValueError(f"numpy dtype {dt} has no program dtype (supported: {', '.join(DTYPES)})")


def _f64_to_bf16(x: np.ndarray) -> np.ndarray:
    """Round float64 to bfloat16 once (round-to-nearest-even).

    ml_dtypes converts float64 -> float32 -> bfloat16, which rounds twice and can be off by one ulp on
    a tie. We first round to float32 *to odd* (truncate, then set the last bit if inexact); float32 has
    more than 2*8+2 significand bits, so the second rounding is then exact RNE.
    """
    x = np.asarray(x, dtype=np.float64)
    f = x.astype(np.float32)
    bits = f.view(np.uint32).copy()
    with np.errstate(invalid="ignore", over="ignore"):
        inexact = np.isfinite(f) & (f.astype(np.float64) != x)
        too_big = np.abs(f.astype(np.float64)) > np.abs(x)
    bits = np.where(inexact & too_big, bits - np.uint32(1), bits)
    bits = np.where(inexact, bits | np.uint32(1), bits)
    return bits.view(np.float32).astype(numpy_dtype("bfloat16"))


def round_to_dtype(x: Any, dtype: str) -> np.ndarray:
    """Convert values to ``dtype`` the way ONNX stores an op's result.

    Floats round once to nearest-even from their exact (float64) value; float -> int truncates toward
    zero (out-of-range and NaN are undefined in ONNX; numpy's result is returned); float -> bool is
    ``!= 0``; int -> int wraps (two's complement, as ``static_cast`` in ONNX Runtime).
    """
    a = np.asarray(x)
    target = numpy_dtype(dtype)
    if a.dtype == target:
        return a
    with np.errstate(all="ignore"):
        if dtype == "bool":
            return a != 0
        if dtype in _FLOATS:
            if a.dtype.kind in "iub":
                a = a.astype(np.float64) if dtype != "float32" else a
                return a.astype(target) if dtype != "bfloat16" else _f64_to_bf16(a)
            a = a.astype(np.float64)
            return _f64_to_bf16(a) if dtype == "bfloat16" else a.astype(target)
        # integer target
        if a.dtype.kind == "f" or a.dtype == numpy_dtype("bfloat16"):
            a = np.trunc(a.astype(np.float64))
        return a.astype(target)


# --------------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------------


class ProgramError(ValueError):
    """An invalid program. ``line`` is the 1-based line of the problem in the text (None when the
    program was not parsed from text, e.g. it came from :class:`ProgramBuilder`)."""

    def __init__(self, problem: str, line: int | None = None):
        self.problem = problem
        self.line = line
        super().__init__(f"line {line}: {problem}" if line is not None else problem)


# --------------------------------------------------------------------------------------------------
# The op table
# --------------------------------------------------------------------------------------------------

_REQUIRED = object()


@dataclass(frozen=True)
class AttrSpec:
    """One attribute of an op.

    ``kind``:
      * ``"float"`` - an ONNX float attribute (32-bit): written as any number, stored as a Python float,
        rounded to float32 when used (as ONNX Runtime does);
      * ``"bound"`` - a Clip bound: a number in the operand's dtype (rounded to it when used); for
        integer operands an integer, or ``inf``/``-inf`` meaning "no bound";
      * ``"dtype"`` - a dtype word (``to=float16``);
      * ``"word"`` - one of ``choices`` (``approximate=tanh``).
    ``default`` is ``REQUIRED`` when the attribute must be given.
    """

    name: str
    kind: str
    default: Any = _REQUIRED
    choices: tuple[str, ...] = ()

    @property
    def required(self) -> bool:
        return self.default is _REQUIRED


# Numpy reference implementations. Arguments arrive as float64 for float operands (exact), native
# for int/bool; the caller rounds the result to the declared dtype. Computing float ops in float64
# and rounding once gives IEEE-exact results for + - * / sqrt and near-correctly-rounded
# transcendental functions, i.e. "ONNX semantics, each op rounded to its dtype".

_erf = np.vectorize(math.erf, otypes=[np.float64])


def _f32(v: float) -> float:
    return float(np.float32(v))


def _int_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    # ONNX Runtime's integer Div is C division: truncation toward zero (numpy's // floors).
    q = a // b
    fix = (q < 0) & (q * b != a)
    return np.where(fix, q + 1, q).astype(np.result_type(a, b))


def _div(a, b, at, dt):
    return a / b if dt in _FLOATS else _int_div(a, b)


def _clip(a, at, dt):
    lo, hi = at["min"], at["max"]
    if dt in _FLOATS:
        lo = float(round_to_dtype(np.float64(lo), dt).astype(np.float64))
        hi = float(round_to_dtype(np.float64(hi), dt).astype(np.float64))
        return np.minimum(np.maximum(a, lo), hi)
    info = np.iinfo(numpy_dtype(dt))
    lo = info.min if math.isinf(lo) and lo < 0 else (info.max if math.isinf(lo) else int(lo))
    hi = info.max if math.isinf(hi) and hi > 0 else (info.min if math.isinf(hi) else int(hi))
    return np.minimum(np.maximum(a, a.dtype.type(lo)), a.dtype.type(hi))


def _cast(a, at, dt):
    # Conversion rules live in round_to_dtype (the caller applies it with dt == at["to"]).
    return a


def _gelu(a, at, dt):
    if at["approximate"] == "tanh":
        return 0.5 * a * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (a + 0.044715 * a**3)))
    return 0.5 * a * (1.0 + _erf(a / math.sqrt(2.0)))


def _selu(a, at, dt):
    al, g = _f32(at["alpha"]), _f32(at["gamma"])
    return np.where(a > 0, g * a, g * (al * np.exp(a) - al))


def _celu(a, at, dt):
    al = _f32(at["alpha"])
    return np.maximum(0.0, a) + np.minimum(0.0, al * np.expm1(a / al))


def _hard_sigmoid(a, at, dt):
    return np.maximum(0.0, np.minimum(1.0, _f32(at["alpha"]) * a + _f32(at["beta"])))


def _where(c, a, b, at, dt):
    return np.where(c, a, b)


@dataclass(frozen=True)
class OpSpec:
    """One row of :data:`OP_TABLE`.

    ``dtypes``: the dtypes the (data) operands may have; all data operands share one dtype.
    ``result``: ``"same"`` (the operands' dtype), ``"bool"``, or ``"to"`` (the ``to`` attribute).
    ``cond_first``: the first operand is a ``bool`` condition outside ``dtypes`` (Where).
    ``onnx_dtypes``: dtypes the ONNX op itself accepts when they differ from ``dtypes`` (Celu is
    float32-only in ONNX); :func:`onnx_equivalent_model` computes others in float32.
    ``compute``: numpy reference, ``compute(*args, attrs, result_dtype)``.

    What the C++ library needs besides (``tools/gen_op_table.py`` writes every row, in this order,
    into ``csrc/op_table.gen.h``: ``enum Op``, the parser's arity/dtype/attribute checks, the CPU
    kernel's dispatch, the CUDA generator's calls):
    ``cfunc``: the ``csrc/ops.h`` function computing the op (default ``ofx_`` + the name in
    snake_case: ``HardSwish`` -> ``ofx_hard_swish``); float attributes are passed after the operands.
    ``fast``: the CUDA function, a hardware approximation, used when the result is float16/bfloat16
    (``fast_bf16``: another one for bfloat16); empty: ``cfunc`` in every dtype. ``fast_src``: their
    CUDA source (:mod:`onnxfuse.custom_ops.fast_cuda`), emitted in table order into the generated
    header's ``kFastPrelude``: a row with a fast path is the only place that says so.
    """

    op_type: str
    arity: int
    dtypes: frozenset
    result: str
    compute: Callable[..., np.ndarray]
    attrs: tuple[AttrSpec, ...] = ()
    cond_first: bool = False
    onnx_dtypes: frozenset | None = None
    cfunc: str = ""
    fast: str = ""
    fast_bf16: str = ""
    fast_src: str = ""

    @property
    def c_function(self) -> str:
        """The ``csrc/ops.h`` function (``cfunc``, or its default)."""
        return self.cfunc or "ofx_" + re.sub(r"(?<!^)(?=[A-Z])", "_", self.op_type).lower()

    def attr(self, name: str) -> AttrSpec | None:
        for a in self.attrs:
            if a.name == name:
                return a
        return None

    @property
    def defaults(self) -> dict[str, Any]:
        """Attribute defaults (required attributes are left out)."""
        return {a.name: a.default for a in self.attrs if not a.required}


def _u(fn):  # unary float/int op without attributes
    return lambda a, at, dt: fn(a)


def _b(fn):  # binary op without attributes
    return lambda a, b, at, dt: fn(a, b)


_ALPHA = lambda d: AttrSpec("alpha", "float", d)  # noqa: E731

OP_TABLE: dict[str, OpSpec] = {
    s.op_type: s
    for s in [
        OpSpec("Add", 2, _NUMERIC, "same", _b(np.add)),
        OpSpec("Sub", 2, _NUMERIC, "same", _b(np.subtract)),
        OpSpec("Mul", 2, _NUMERIC, "same", _b(np.multiply)),
        OpSpec("Div", 2, _NUMERIC, "same", _div, fast="ofx_fast_div", fast_src=fast_cuda.DIV),
        OpSpec("Pow", 2, _FLOATS, "same", _b(np.power)),
        OpSpec("Min", 2, _NUMERIC, "same", _b(np.minimum)),
        OpSpec("Max", 2, _NUMERIC, "same", _b(np.maximum)),
        OpSpec("Neg", 1, _NUMERIC, "same", _u(np.negative)),
        OpSpec("Abs", 1, _NUMERIC, "same", _u(np.abs)),
        OpSpec("Sign", 1, _NUMERIC, "same", _u(np.sign)),
        OpSpec("Exp", 1, _FLOATS, "same", _u(np.exp), fast="ofx_fast_exp", fast_src=fast_cuda.EXP),
        OpSpec("Log", 1, _FLOATS, "same", _u(np.log)),
        OpSpec("Sqrt", 1, _FLOATS, "same", _u(np.sqrt)),
        OpSpec("Reciprocal", 1, _FLOATS, "same", _u(lambda a: 1.0 / a), fast="ofx_fast_reciprocal",
               fast_src=fast_cuda.RECIPROCAL),
        OpSpec("Sin", 1, _FLOATS, "same", _u(np.sin)),
        OpSpec("Cos", 1, _FLOATS, "same", _u(np.cos)),
        OpSpec("Atan", 1, _FLOATS, "same", _u(np.arctan)),
        OpSpec("Tanh", 1, _FLOATS, "same", _u(np.tanh), fast="ofx_fast_tanh", fast_bf16="ofx_fast_tanh_bf16",
               fast_src=fast_cuda.TANH),
        OpSpec("Erf", 1, _FLOATS, "same", _u(_erf)),
        OpSpec("Floor", 1, _FLOATS, "same", _u(np.floor)),
        OpSpec("Ceil", 1, _FLOATS, "same", _u(np.ceil)),
        OpSpec("Round", 1, _FLOATS, "same", _u(np.rint)),  # rint: half to even
        OpSpec("Sigmoid", 1, _FLOATS, "same", _u(lambda a: 1.0 / (1.0 + np.exp(-a))), fast="ofx_fast_sigmoid",
               fast_src=fast_cuda.SIGMOID),
        OpSpec("Relu", 1, _NUMERIC, "same", _u(lambda a: np.maximum(a, a.dtype.type(0)))),
        # Softplus = ln(exp(x) + 1); logaddexp is the same value without overflow.
        OpSpec("Softplus", 1, _FLOATS, "same", _u(lambda a: np.logaddexp(0.0, a))),
        OpSpec("Softsign", 1, _FLOATS, "same", _u(lambda a: a / (1.0 + np.abs(a))), fast="ofx_fast_softsign",
               fast_src=fast_cuda.SOFTSIGN),
        OpSpec("Mish", 1, _FLOATS, "same", _u(lambda a: a * np.tanh(np.logaddexp(0.0, a)))),
        OpSpec("HardSwish", 1, _FLOATS, "same",
               _u(lambda a: a * np.maximum(0.0, np.minimum(1.0, a / 6.0 + 0.5)))),
        OpSpec("LeakyRelu", 1, _FLOATS, "same",
               lambda a, at, dt: np.where(a < 0, _f32(at["alpha"]) * a, a), (_ALPHA(0.01),)),
        OpSpec("Elu", 1, _FLOATS, "same",
               lambda a, at, dt: np.where(a < 0, _f32(at["alpha"]) * np.expm1(a), a), (_ALPHA(1.0),)),
        OpSpec("Celu", 1, _FLOATS, "same", _celu, (_ALPHA(1.0),),
               onnx_dtypes=frozenset(("float32",))),
        OpSpec("Selu", 1, _FLOATS, "same", _selu,
               (_ALPHA(1.67326319217681884765625), AttrSpec("gamma", "float", 1.05070102214813232421875))),
        OpSpec("HardSigmoid", 1, _FLOATS, "same", _hard_sigmoid,
               (_ALPHA(0.2), AttrSpec("beta", "float", 0.5))),
        # Gelu: ofx_gelu, or ofx_gelu_tanh with approximate=tanh; fast only for the tanh form.
        OpSpec("Gelu", 1, _FLOATS, "same", _gelu,
               (AttrSpec("approximate", "word", "none", ("none", "tanh")),), fast="ofx_fast_gelu_tanh",
               fast_src=fast_cuda.GELU_TANH),
        OpSpec("Clip", 1, _NUMERIC, "same", _clip,
               (AttrSpec("min", "bound", -math.inf), AttrSpec("max", "bound", math.inf))),
        OpSpec("Identity", 1, _ALL, "same", _u(lambda a: a)),
        OpSpec("Cast", 1, _ALL, "to", _cast, (AttrSpec("to", "dtype"),)),
        OpSpec("Where", 3, _ALL, "same", _where, cond_first=True),
        OpSpec("Equal", 2, _ALL, "bool", _b(np.equal)),
        OpSpec("Less", 2, _NUMERIC, "bool", _b(np.less)),
        OpSpec("LessOrEqual", 2, _NUMERIC, "bool", _b(np.less_equal), cfunc="ofx_less_equal"),
        OpSpec("Greater", 2, _NUMERIC, "bool", _b(np.greater)),
        OpSpec("GreaterOrEqual", 2, _NUMERIC, "bool", _b(np.greater_equal), cfunc="ofx_greater_equal"),
        OpSpec("Not", 1, _BOOL, "same", _u(np.logical_not)),
        OpSpec("And", 2, _BOOL, "same", _b(np.logical_and)),
        OpSpec("Or", 2, _BOOL, "same", _b(np.logical_or)),
        OpSpec("Xor", 2, _BOOL, "same", _b(np.logical_xor)),
    ]
}


def op_spec(op_type: str) -> OpSpec | None:
    """The :data:`OP_TABLE` row for an ONNX op type, or None if the language does not have it."""
    return OP_TABLE.get(op_type)


# --------------------------------------------------------------------------------------------------
# Values: normalisation and canonical formatting
# --------------------------------------------------------------------------------------------------


def _py(v: Any) -> Any:
    """numpy scalars -> Python scalars (so that printing and equality only see Python types)."""
    if isinstance(v, np.ndarray) and v.shape == ():
        v = v[()]
    if isinstance(v, np.generic):
        v = v.item()
    return v


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _fmt_number(v: Any) -> str:
    """Canonical number text: integers as integers, floats as repr(float) (exact round trip)."""
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, int):
        return str(v)
    return repr(float(v))


def _value_key(v: Any) -> Any:
    """Equality key for constants/attributes: -0.0 != 0.0, nan == nan, 1 != 1.0."""
    if isinstance(v, float):
        return ("f", repr(v))
    return (type(v).__name__, v)


def _normalize_int(v: Any, dtype: str, what: str, from_text: bool) -> int:
    if isinstance(v, bool) or not _is_number(v):
        raise ProgramError(f"{what} must be an integer, got {v!r}")
    if isinstance(v, float):
        if from_text or not v.is_integer():
            raise ProgramError(f"{what} must be an integer literal for {dtype}, got {_fmt_number(v)}")
        v = int(v)
    info = np.iinfo(numpy_dtype(dtype))
    if not info.min <= v <= info.max:
        raise ProgramError(f"{what} {v} is out of range for {dtype}")
    return v


def _normalize_const(value: Any, dtype: str, from_text: bool) -> Any:
    value = _py(value)
    if dtype in _FLOATS:
        if isinstance(value, bool) or not _is_number(value):
            raise ProgramError(f"constant of dtype {dtype} must be a number, got {value!r}")
        return float(value)
    if dtype == "bool":
        if isinstance(value, bool):
            return value
        if not isinstance(value, int) or value not in (0, 1):
            raise ProgramError(f"bool constant must be 0 or 1, got {value!r}")
        return bool(value)
    return _normalize_int(value, dtype, "constant", from_text)


def _normalize_attr(spec: OpSpec, a: AttrSpec, v: Any, operand_dtype: str, from_text: bool) -> Any:
    v = _py(v)
    where = f"attribute {a.name} of {spec.op_type}"
    if a.kind in ("float", "bound"):
        if isinstance(v, str) or isinstance(v, bool) or not _is_number(v):
            raise ProgramError(f"{where} takes a number, got {v!r}")
        if a.kind == "bound" and operand_dtype in INT_DTYPES:
            if isinstance(v, float) and math.isinf(v):
                return v
            return _normalize_int(v, operand_dtype, where, from_text)
        return float(v)
    if not isinstance(v, str):
        raise ProgramError(f"{where} takes a word, got {v!r}")
    if a.kind == "dtype":
        if v not in DTYPES:
            raise ProgramError(f"{where} must be a dtype ({', '.join(DTYPES)}), got {v!r}")
        return v
    if v not in a.choices:
        raise ProgramError(f"{where} must be one of {', '.join(a.choices)}, got {v!r}")
    return v


def result_dtype(op_type: str, arg_dtypes: Sequence[str], attrs: Mapping[str, Any] | None = None) -> str:
    """The dtype ONNX gives ``op_type`` applied to operands of ``arg_dtypes`` (validated).

    Raises ProgramError (without a line) for an unknown op, bad arity or operand dtypes.
    """
    spec = OP_TABLE.get(op_type)
    if spec is None:
        raise ProgramError(f"unknown op {op_type!r}")
    if len(arg_dtypes) != spec.arity:
        raise ProgramError(f"{op_type} takes {spec.arity} argument{'s' * (spec.arity > 1)}, "
                           f"got {len(arg_dtypes)}")
    data = list(arg_dtypes)
    if spec.cond_first:
        if data[0] != "bool":
            raise ProgramError(f"{op_type} condition must be bool, got {data[0]}")
        data = data[1:]
    for d in data:
        if d not in DTYPES:
            raise ProgramError(f"unknown dtype {d!r}")
    if len(set(data)) > 1:
        raise ProgramError(f"{op_type} operands must share one dtype, got {', '.join(data)}")
    if data[0] not in spec.dtypes:
        allowed = ", ".join(d for d in DTYPES if d in spec.dtypes)
        raise ProgramError(f"{op_type} does not take {data[0]} (takes {allowed})")
    if spec.result == "same":
        return data[0]
    if spec.result == "bool":
        return "bool"
    to = (attrs or {}).get("to")
    if to not in DTYPES:
        raise ProgramError(f"{op_type} needs attribute to=<dtype>")
    return to


# --------------------------------------------------------------------------------------------------
# Data model
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Const:
    """A scalar constant. ``value`` is a Python float (float dtypes, exactly as written; rounded to
    the dtype when used), int (int dtypes) or bool."""

    name: str
    dtype: str
    value: Any

    def _key(self):
        return (self.name, self.dtype, _value_key(self.value))

    def __eq__(self, other):
        return isinstance(other, Const) and self._key() == other._key()

    def __hash__(self):
        return hash(self._key())


@dataclass(frozen=True, eq=False)
class Op:
    """``name: dtype = op_type[attrs](args)``. ``attrs`` always holds every attribute of the op
    (defaults filled in), in :data:`OP_TABLE` order."""

    name: str
    op_type: str
    dtype: str
    args: tuple[str, ...]
    attrs: Mapping[str, Any] = field(default_factory=dict)

    def _key(self):
        return (self.name, self.op_type, self.dtype, tuple(self.args),
                tuple(sorted((k, _value_key(v)) for k, v in self.attrs.items())))

    def __eq__(self, other):
        return isinstance(other, Op) and self._key() == other._key()

    def __hash__(self):
        return hash(self._key())

    def to_text(self) -> str:
        attrs = ""
        if self.attrs:
            spec = OP_TABLE.get(self.op_type)
            order = [a.name for a in spec.attrs] if spec else sorted(self.attrs)
            parts = []
            for k in order:
                v = self.attrs[k]
                parts.append(f"{k}={v if isinstance(v, str) else _fmt_number(v)}")
            attrs = "[" + ", ".join(parts) + "]"
        return f"{self.name}: {self.dtype} = {self.op_type}{attrs}({', '.join(self.args)})"


@dataclass(frozen=True, eq=False)
class Program:
    """A validated program. Build one with :func:`parse` or :class:`ProgramBuilder`; a Program made
    by hand can be checked with :meth:`validate`.

    Equality is structural, with constants compared exactly (``-0.0 != 0.0``, ``nan == nan``).
    """

    version: int
    inputs: tuple[tuple[str, str], ...]
    consts: tuple[Const, ...]
    ops: tuple[Op, ...]
    outputs: tuple[str, ...]

    def __post_init__(self):
        # Accept lists from callers, keep tuples (hashable, immutable).
        object.__setattr__(self, "inputs", tuple(tuple(i) for i in self.inputs))
        object.__setattr__(self, "consts", tuple(self.consts))
        object.__setattr__(self, "ops", tuple(self.ops))
        object.__setattr__(self, "outputs", tuple(self.outputs))

    def _key(self):
        return (self.version, self.inputs, tuple(c._key() for c in self.consts),
                tuple(o._key() for o in self.ops), self.outputs)

    def __eq__(self, other):
        return isinstance(other, Program) and self._key() == other._key()

    def __hash__(self):
        return hash(self._key())

    @property
    def input_names(self) -> list[str]:
        return [n for n, _ in self.inputs]

    def dtypes(self) -> dict[str, str]:
        """Name -> dtype of every value."""
        d = {n: t for n, t in self.inputs}
        d.update({c.name: c.dtype for c in self.consts})
        d.update({o.name: o.dtype for o in self.ops})
        return d

    def output_dtypes(self) -> list[str]:
        d = self.dtypes()
        return [d[n] for n in self.outputs]

    def to_text(self) -> str:
        """Canonical text: header, inputs, constants, ops, outputs; one statement per line; every
        attribute written explicitly; numbers as :func:`repr` of a float or as integers."""
        lines = [f"{HEADER} {self.version}"]
        lines += [f"input {n}: {t}" for n, t in self.inputs]
        lines += [f"const {c.name}: {c.dtype} = {_fmt_number(c.value)}" for c in self.consts]
        lines += [o.to_text() for o in self.ops]
        lines += [f"output {n}" for n in self.outputs]
        return "\n".join(lines) + "\n"

    __str__ = to_text

    def validate(self) -> Program:
        """Re-check everything :func:`parse` checks; returns the normalised program."""
        if self.version != LANGUAGE_VERSION:
            raise ProgramError(f"unsupported language version {self.version!r}")
        s = _Scope()
        for n, t in self.inputs:
            s.add_input(n, t)
        for c in self.consts:
            s.add_const(c.name, c.dtype, c.value)
        for o in self.ops:
            s.add_op(o.name, o.op_type, o.dtype, o.args, dict(o.attrs))
        for n in self.outputs:
            s.add_output(n)
        return s.finish()


def print_program(p: Program) -> str:
    """Canonical text of ``p`` (same as ``p.to_text()``)."""
    return p.to_text()


# --------------------------------------------------------------------------------------------------
# Semantic checks, shared by parse(), Program.validate() and ProgramBuilder
# --------------------------------------------------------------------------------------------------

_IDENT_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
# Words that can never be value names: statement keywords, and inf/nan (they lex as numbers).
RESERVED = frozenset(("input", "const", "output", "inf", "nan"))


class _Scope:
    """Accumulates a program statement by statement, raising ProgramError (with ``line`` when
    given) at the first problem. Order rules: inputs before any op, outputs last."""

    def __init__(self):
        self.dtypes: dict[str, str] = {}
        self.inputs: list[tuple[str, str]] = []
        self.consts: list[Const] = []
        self.ops: list[Op] = []
        self.outputs: list[str] = []

    @staticmethod
    def _err(msg: str, line: int | None):
        return ProgramError(msg, line)

    def _define(self, name: str, dtype: str, line: int | None):
        if not isinstance(name, str) or not _IDENT_RE.match(name):
            raise self._err(f"invalid name {name!r} (names match [A-Za-z_][A-Za-z0-9_]*)", line)
        if name in RESERVED:
            raise self._err(f"{name!r} is a reserved word and cannot name a value", line)
        if name in self.dtypes:
            raise self._err(f"{name!r} is already defined", line)
        if dtype not in DTYPES:
            raise self._err(f"unknown dtype {dtype!r} (dtypes: {', '.join(DTYPES)})", line)
        self.dtypes[name] = dtype

    def _no_outputs_yet(self, what: str, line: int | None):
        if self.outputs:
            raise self._err(f"{what} after an output line (output lines come last)", line)

    def add_input(self, name: str, dtype: str, line: int | None = None):
        self._no_outputs_yet("input", line)
        if self.ops:
            raise self._err("input after an operation (input lines come before operations)", line)
        self._define(name, dtype, line)
        self.inputs.append((name, dtype))

    def add_const(self, name: str, dtype: str, value: Any, line: int | None = None,
                  from_text: bool = False) -> Const:
        self._no_outputs_yet("const", line)
        self._define(name, dtype, line)
        try:
            value = _normalize_const(value, dtype, from_text)
        except ProgramError as e:
            raise self._err(e.problem, line) from None
        c = Const(name, dtype, value)
        self.consts.append(c)
        return c

    def add_op(self, name: str, op_type: str, dtype: str | None, args: Sequence[str],
               attrs: Mapping[str, Any], line: int | None = None, from_text: bool = False) -> Op:
        self._no_outputs_yet("operation", line)
        if not self.inputs:
            raise self._err("operation before any input (a program starts with its inputs)", line)
        spec = OP_TABLE.get(op_type)
        if spec is None:
            raise self._err(f"unknown op {op_type!r}", line)
        args = tuple(args)
        for a in args:
            if a not in self.dtypes:
                raise self._err(f"{op_type} argument {a!r} is not defined", line)
        arg_dtypes = [self.dtypes[a] for a in args]
        for k in attrs:
            if spec.attr(k) is None:
                known = ", ".join(a.name for a in spec.attrs) or "none"
                raise self._err(f"{op_type} has no attribute {k!r} (attributes: {known})", line)
        try:
            if len(args) != spec.arity:
                result_dtype(op_type, arg_dtypes)  # raises the arity message
            operand = arg_dtypes[1] if spec.cond_first else arg_dtypes[0]
            norm: dict[str, Any] = {}
            for a in spec.attrs:
                if a.name in attrs:
                    norm[a.name] = _normalize_attr(spec, a, attrs[a.name], operand, from_text)
                elif a.required:
                    raise ProgramError(f"{op_type} needs attribute {a.name}")
                else:
                    norm[a.name] = a.default
            want = result_dtype(op_type, arg_dtypes, norm)
        except ProgramError as e:
            raise self._err(e.problem, line) from None
        if dtype is None:
            dtype = want
        elif dtype not in DTYPES:
            raise self._err(f"unknown dtype {dtype!r} (dtypes: {', '.join(DTYPES)})", line)
        elif dtype != want:
            raise self._err(f"{op_type} of {', '.join(arg_dtypes)} gives {want}, declared {dtype}", line)
        self._define(name, dtype, line)
        op = Op(name, op_type, dtype, args, norm)
        self.ops.append(op)
        return op

    def add_output(self, name: str, line: int | None = None):
        if name not in self.dtypes:
            raise self._err(f"output {name!r} is not defined", line)
        self.outputs.append(name)

    def finish(self, line: int | None = None) -> Program:
        if not self.inputs:
            raise self._err("program has no input", line)
        if not self.outputs:
            raise self._err("program has no output", line)
        return Program(LANGUAGE_VERSION, self.inputs, self.consts, self.ops, self.outputs)


# --------------------------------------------------------------------------------------------------
# Parser
# --------------------------------------------------------------------------------------------------

_NUM_SRC = (
    r"[+-]?(?:"
    r"0[xX](?:[0-9a-fA-F]+(?:\.[0-9a-fA-F]*)?|\.[0-9a-fA-F]+)[pP][+-]?[0-9]+"
    r"|(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?"
    r"|(?:inf|nan)(?![A-Za-z0-9_])"
    r")"
)
_TOKEN_RE = re.compile(
    rf"[ \t]*(?:(?P<num>{_NUM_SRC})|(?P<word>[A-Za-z_][A-Za-z0-9_]*)|(?P<punct>[:=()\[\],])|(?P<bad>\S))"
)
_INT_RE = re.compile(r"[+-]?[0-9]+\Z")
_HEADER_RE = re.compile(r"onnxfuse\.elementwise(?:[ \t]+(?P<v>\S+))?(?P<rest>.*)\Z")


def _number(text: str) -> int | float:
    """Literal -> Python int (integer literal) or float (everything else, exactly like strtod)."""
    if _INT_RE.match(text):
        return int(text)
    body = text.lstrip("+-")
    if body[:2] in ("0x", "0X"):
        v = float.fromhex(body)
        return -v if text.startswith("-") else v
    return float(text)


class _Tokens:
    def __init__(self, text: str, line: int):
        self.line = line
        self.toks: list[tuple[str, str]] = []
        pos = 0
        text = text.rstrip(" \t")
        while pos < len(text):
            m = _TOKEN_RE.match(text, pos)
            if m is None:  # only trailing whitespace can fail to match
                break
            kind = m.lastgroup
            val = m.group(kind)
            if kind == "bad":
                raise ProgramError(f"unexpected character {val!r}", line)
            # A number glued to a word (``1x``, ``x1.5``) is two tokens; the grammar rejects them.
            self.toks.append((kind, val))
            pos = m.end()
        self.i = 0

    def peek(self, k: int = 0) -> tuple[str, str] | None:
        j = self.i + k
        return self.toks[j] if j < len(self.toks) else None

    def _desc(self, t):
        return "end of line" if t is None else repr(t[1])

    def expect(self, kind: str, value: str | None = None, what: str | None = None) -> str:
        t = self.peek()
        if t is None or t[0] != kind or (value is not None and t[1] != value):
            want = what or (repr(value) if value else kind)
            raise ProgramError(f"expected {want}, got {self._desc(t)}", self.line)
        self.i += 1
        return t[1]

    def accept(self, value: str) -> bool:
        t = self.peek()
        if t is not None and t[0] == "punct" and t[1] == value:
            self.i += 1
            return True
        return False

    def end(self):
        t = self.peek()
        if t is not None:
            raise ProgramError(f"unexpected {self._desc(t)} at end of statement", self.line)

    def name(self, what: str = "a name") -> str:
        return self.expect("word", what=what)

    def number(self, what: str = "a number") -> int | float:
        return _number(self.expect("num", what=what))


def parse(text: str) -> Program:
    """Parse program text (see docs/program-language.md) into a validated :class:`Program`.

    Raises :class:`ProgramError` whose message starts with ``line N:`` (1-based, counting every
    physical line, blank and comment lines included).
    """
    if not isinstance(text, str):
        raise TypeError("parse() takes a str")
    lines = text.split("\n")
    scope = _Scope()
    seen_header = False
    last = 1
    for lineno, raw in enumerate(lines, start=1):
        body = raw.split("#", 1)[0].strip(" \t\r\f\v")
        if not body:
            continue
        last = lineno
        if not seen_header:
            m = _HEADER_RE.match(body)
            if m is None:
                raise ProgramError(f"expected header '{HEADER} {LANGUAGE_VERSION}', got {body!r}", lineno)
            v = m.group("v")
            if v is None or m.group("rest").strip():
                raise ProgramError(f"malformed header {body!r} (expected '{HEADER} {LANGUAGE_VERSION}')",
                                   lineno)
            if not _INT_RE.match(v) or int(v) != LANGUAGE_VERSION:
                raise ProgramError(f"unsupported language version {v!r} (this parser knows "
                                   f"{LANGUAGE_VERSION})", lineno)
            seen_header = True
            continue
        _parse_statement(_Tokens(body, lineno), scope)
    if not seen_header:
        raise ProgramError(f"empty program (expected header '{HEADER} {LANGUAGE_VERSION}')", 1)
    return scope.finish(last)


def _parse_statement(t: _Tokens, scope: _Scope) -> None:
    line = t.line
    first = t.peek()
    if first is None:  # pragma: no cover - blank lines are skipped before
        return
    second = t.peek(1)
    if first[0] == "word" and first[1] in ("input", "const", "output") and not (
        second is not None and second == ("punct", ":")
    ):
        kw = first[1]
        t.i += 1
        name = t.name(f"a name after '{kw}'")
        if kw == "output":
            t.end()
            scope.add_output(name, line)
            return
        t.expect("punct", ":")
        dtype = t.name("a dtype")
        if kw == "input":
            t.end()
            scope.add_input(name, dtype, line)
            return
        t.expect("punct", "=")
        value = t.number("a number")
        t.end()
        if dtype not in DTYPES:  # report the dtype before the value
            raise ProgramError(f"unknown dtype {dtype!r} (dtypes: {', '.join(DTYPES)})", line)
        scope.add_const(name, dtype, value, line, from_text=True)
        return
    # NAME: DTYPE = OP[attrs](args)
    name = t.name("a statement (input, const, output or NAME: DTYPE = OP(...))")
    t.expect("punct", ":")
    dtype = t.name("a dtype")
    t.expect("punct", "=")
    op_type = t.name("an op name")
    attrs: dict[str, Any] = {}
    if t.accept("["):
        while True:
            key = t.name("an attribute name")
            t.expect("punct", "=")
            tok = t.peek()
            if tok is None or tok[0] not in ("num", "word"):
                raise ProgramError(f"expected a number or a word as value of {key}, got {t._desc(tok)}",
                                   line)
            t.i += 1
            if key in attrs:
                raise ProgramError(f"attribute {key!r} given twice", line)
            attrs[key] = _number(tok[1]) if tok[0] == "num" else tok[1]
            if t.accept("]"):
                break
            t.expect("punct", ",", "',' or ']'")
    t.expect("punct", "(")
    args: list[str] = []
    if not t.accept(")"):
        while True:
            args.append(t.name("an argument name"))
            if t.accept(")"):
                break
            t.expect("punct", ",", "',' or ')'")
    t.end()
    if dtype not in DTYPES:
        raise ProgramError(f"unknown dtype {dtype!r} (dtypes: {', '.join(DTYPES)})", line)
    scope.add_op(name, op_type, dtype, args, attrs, line, from_text=True)


# --------------------------------------------------------------------------------------------------
# Builder
# --------------------------------------------------------------------------------------------------


def _pretty_float(value: float, dtype: str) -> float:
    """The float64 with the shortest text that still rounds to the same ``dtype`` value, so that
    builder-made programs read ``0.1`` rather than ``0.10000000149011612`` for a float32 0.1."""
    stored = round_to_dtype(np.float64(value), dtype)
    exact = float(stored.astype(np.float64))
    if not math.isfinite(exact):
        return exact
    if math.isfinite(value) and value != exact:
        return value  # caller gave a value that is not a dtype value; keep it exactly
    short = float(str(stored[()]))
    if round_to_dtype(np.float64(short), dtype).tobytes() == stored.tobytes():
        return short
    return exact


class ProgramBuilder:
    """Builds a :class:`Program` op by op, validating each step (errors raise ProgramError at the
    offending call, without a line number).

    Names are generated (``x0, x1`` inputs, ``c0`` constants, ``t0`` ops) unless given. Equal
    constants (same dtype and bits; NaN equals NaN, -0.0 differs from 0.0) are shared.

    >>> b = ProgramBuilder()
    >>> x = b.input("float32")
    >>> y = b.op("Mul", [x, b.op("Sigmoid", [x])])
    >>> b.output(b.op("Add", [y, 1.0]))  # numbers become constants of the operands' dtype
    >>> print(b.build().to_text())  # doctest: +SKIP
    """

    def __init__(self):
        self._scope = _Scope()
        self._counters = {"x": 0, "c": 0, "t": 0}
        self._const_cache: dict[tuple, str] = {}
        self._outputs: list[str] = []

    def _fresh(self, prefix: str) -> str:
        while True:
            n = f"{prefix}{self._counters[prefix]}"
            self._counters[prefix] += 1
            if n not in self._scope.dtypes:
                return n

    def dtype_of(self, name: str) -> str:
        return self._scope.dtypes[name]

    def input(self, dtype: str, name: str | None = None) -> str:
        name = name if name is not None else self._fresh("x")
        self._scope.add_input(name, dtype)
        return name

    def const(self, value: Any, dtype: str, name: str | None = None) -> str:
        """A scalar constant; float values are stored as the dtype would hold them (shortest text)."""
        v = _normalize_const(value, dtype, from_text=False)
        if dtype in _FLOATS:
            v = _pretty_float(v, dtype)
        key = (dtype, _value_key(float(round_to_dtype(np.float64(v), dtype).astype(np.float64)))
               if dtype in _FLOATS else _value_key(v))
        if name is None and key in self._const_cache:
            return self._const_cache[key]
        name = name if name is not None else self._fresh("c")
        self._scope.add_const(name, dtype, v)
        self._const_cache.setdefault(key, name)
        return name

    def op(self, op_type: str, args: Sequence[Any], dtype: str | None = None, *,
           name: str | None = None, **attrs: Any) -> str:
        """Append ``op_type(args)``; ``dtype`` is inferred when None. Non-string args are numbers
        turned into constants of the dtype of the op's (other) data operands."""
        args = list(args)
        if any(not isinstance(a, str) for a in args):
            spec = OP_TABLE.get(op_type)
            start = 1 if spec is not None and spec.cond_first else 0
            named = [self._scope.dtypes.get(a) for a in args[start:] if isinstance(a, str)]
            if not named or named[0] is None:
                raise ProgramError(f"{op_type}: cannot infer the dtype of constant arguments")
            args = [a if isinstance(a, str) else
                    self.const(a, "bool" if (i < start) else named[0]) for i, a in enumerate(args)]
        name = name if name is not None else self._fresh("t")
        self._scope.add_op(name, op_type, dtype, args, attrs)
        return name

    def output(self, name: str) -> None:
        """Mark ``name`` as the next output. Outputs may be declared while ops are still being
        added (the rewriter often knows an output before its consumers); they print last."""
        if name not in self._scope.dtypes:
            raise ProgramError(f"output {name!r} is not defined")
        self._outputs.append(name)

    def build(self) -> Program:
        """The finished program (the builder can keep going and build again)."""
        s = self._scope
        return Program(LANGUAGE_VERSION, s.inputs, s.consts, s.ops, self._outputs).validate()


# --------------------------------------------------------------------------------------------------
# Numpy reference evaluator
# --------------------------------------------------------------------------------------------------


def _const_array(c: Const) -> np.ndarray:
    if c.dtype in _FLOATS:
        return round_to_dtype(np.float64(c.value), c.dtype)
    return np.asarray(c.value, dtype=numpy_dtype(c.dtype))


def evaluate(program: Program, inputs: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Run ``program`` on numpy arrays with ONNX semantics; the reference for the kernels.

    Each op is computed exactly (float64 for float operands) and rounded to its declared dtype, as a
    chain of separate ONNX nodes would be. Inputs broadcast together (numpy/ONNX rules) and every
    output has the broadcast shape of *all* inputs. Input dtypes must equal the declared ones.
    """
    if len(inputs) != len(program.inputs):
        raise ValueError(f"program takes {len(program.inputs)} inputs, got {len(inputs)}")
    env: dict[str, np.ndarray] = {}
    arrays = []
    for i, ((name, dtype), x) in enumerate(zip(program.inputs, inputs)):
        a = np.asarray(x)
        if a.dtype != numpy_dtype(dtype):
            raise ValueError(f"input {i} ({name!r}) is declared {dtype} but has numpy dtype {a.dtype}")
        env[name] = a
        arrays.append(a)
    try:
        full = np.broadcast_shapes(*[a.shape for a in arrays])
    except ValueError:
        raise ValueError("input shapes do not broadcast together: "
                         + ", ".join(str(a.shape) for a in arrays)) from None
    for c in program.consts:
        env[c.name] = _const_array(c)
    with np.errstate(all="ignore"):
        for op in program.ops:
            spec = OP_TABLE[op.op_type]
            args = [env[a] for a in op.args]
            args = [a.astype(np.float64) if (a.dtype.kind == "f" or a.dtype == _NP_DTYPES.get("bfloat16"))
                    else a for a in args]
            env[op.name] = round_to_dtype(spec.compute(*args, op.attrs, op.dtype), op.dtype)
    return [np.array(np.broadcast_to(env[n], full)) for n in program.outputs]


# --------------------------------------------------------------------------------------------------
# The equivalent unfused ONNX model
# --------------------------------------------------------------------------------------------------


def _broadcast(*shapes: tuple) -> tuple:
    return tuple(np.broadcast_shapes(*shapes)) if shapes else ()


def onnx_equivalent_model(program: Program, shapes: Sequence[Sequence[int]], *, opset: int = 20,
                          half_compute: str = "float32", bfloat16_io: str = "native",
                          ir_version: int = 10):
    """The program as an unfused ONNX model of standard ops (default domain, ``opset`` >= 20).

    Graph inputs are the program inputs (names and dtypes as declared, ``shapes`` static). Graph
    output *i* is program output *i*, named ``out:i`` (program names may repeat among outputs or be
    inputs), expanded (``Expand``) to the broadcast shape of all inputs when its own shape is smaller.

    ``half_compute="float32"`` (default) computes every float16/bfloat16 op as Cast->op(float32)->Cast,
    the same per-op rounding as native half ops but runnable on ONNX Runtime's CPU provider, which
    lacks most half kernels; ``"native"`` emits the ops in their own dtype (Celu, float32-only in
    ONNX, is always computed in float32). ``bfloat16_io="float32"`` makes bfloat16 graph inputs and
    outputs float32 (exact Casts inside), because onnxruntime's Python API cannot feed bfloat16.
    Integer Relu is emitted as Max(x, 0) and bool Where as And/Or/Not (ONNX Runtime CPU has no
    kernels for those types); the values are the same.
    """
    # start-up: it loads numpy, onnx, which importing this module does not
    import onnx
    from onnx import helper, numpy_helper

    if half_compute not in ("float32", "native"):
        raise ValueError("half_compute must be 'float32' or 'native'")
    if bfloat16_io not in ("native", "float32"):
        raise ValueError("bfloat16_io must be 'native' or 'float32'")
    if len(shapes) != len(program.inputs):
        raise ValueError(f"program takes {len(program.inputs)} inputs, got {len(shapes)} shapes")
    shapes = [tuple(int(d) for d in s) for s in shapes]
    full = _broadcast(*shapes)

    nodes: list = []
    inits: list = []
    counter = [0]

    def fresh(hint: str) -> str:  # ':' never occurs in program names, so these cannot collide
        counter[0] += 1
        return f"{hint}:{counter[0]}"

    def node(op_type: str, ins: list[str], hint: str, out: str | None = None, **attrs) -> str:
        out = out or fresh(hint)
        nodes.append(helper.make_node(op_type, ins, [out], name=fresh("n"), **attrs))
        return out

    def init(value: np.ndarray, dtype: str, hint: str) -> str:
        name = fresh(hint)
        arr = np.asarray(value)
        inits.append(numpy_helper.from_array(arr.astype(numpy_dtype(dtype)), name))
        return name

    def cast(v: str, to: str) -> str:
        return node("Cast", [v], "cast", to=ONNX_DTYPE[to])

    graph_inputs = []
    dtypes: dict[str, str] = {}
    vshape: dict[str, tuple] = {}
    for (name, dtype), shp in zip(program.inputs, shapes):
        dtypes[name], vshape[name] = dtype, shp
        if dtype == "bfloat16" and bfloat16_io == "float32":
            graph_inputs.append(helper.make_tensor_value_info(f"{name}:io", ONNX_DTYPE["float32"], shp))
            node("Cast", [f"{name}:io"], "cast", out=name, to=ONNX_DTYPE["bfloat16"])
        else:
            graph_inputs.append(helper.make_tensor_value_info(name, ONNX_DTYPE[dtype], shp))
    for c in program.consts:
        dtypes[c.name], vshape[c.name] = c.dtype, ()
        inits.append(numpy_helper.from_array(_const_array(c), c.name))

    for op in program.ops:
        spec = OP_TABLE[op.op_type]
        operand = dtypes[op.args[1] if spec.cond_first else op.args[0]]
        ins = list(op.args)
        vshape[op.name] = _broadcast(*[vshape[a] for a in op.args])
        dtypes[op.name] = op.dtype
        if op.op_type == "Cast":
            node("Cast", ins, "cast", out=op.name, to=ONNX_DTYPE[op.attrs["to"]])
            continue
        compute = operand
        if operand in ("float16", "bfloat16") and half_compute == "float32":
            compute = "float32"
        if spec.onnx_dtypes is not None and compute not in spec.onnx_dtypes:
            compute = "float32"
        if compute != operand:
            ins = [cast(a, compute) if dtypes[a] == operand else a for a in ins]
        out = op.name if (compute == operand or op.dtype != operand) else fresh(op.name)
        attrs: dict[str, Any] = {}
        if op.op_type == "Clip":
            bounds = []
            for k in ("min", "max"):
                b = op.attrs[k]
                if operand in INT_DTYPES:
                    info = np.iinfo(numpy_dtype(operand))
                    b = (info.min if b < 0 else info.max) if isinstance(b, float) else b
                    bounds.append(init(np.asarray(b, numpy_dtype(operand)), operand, f"clip_{k}"))
                else:
                    v = round_to_dtype(np.float64(b), operand)
                    bounds.append(init(round_to_dtype(v.astype(np.float64), compute), compute,
                                       f"clip_{k}"))
            ins = ins + bounds
        else:
            for a in spec.attrs:
                attrs[a.name] = op.attrs[a.name]
        if op.op_type == "Relu" and operand in INT_DTYPES:
            zero = init(np.asarray(0, numpy_dtype(operand)), operand, "zero")
            node("Max", ins + [zero], op.name, out=out)
        elif op.op_type == "Where" and operand == "bool":
            c, a, b = ins
            t1 = node("And", [c, a], "where")
            t2 = node("And", [node("Not", [c], "where"), b], "where")
            node("Or", [t1, t2], op.name, out=out)
        else:
            node(op.op_type, ins, op.name, out=out, **attrs)
        if out != op.name:
            node("Cast", [out], "cast", out=op.name, to=ONNX_DTYPE[op.dtype])

    graph_outputs = []
    shape_name = None
    for i, n in enumerate(program.outputs):
        out = f"out:{i}"
        dtype = dtypes[n]
        src = n
        if dtype == "bfloat16" and bfloat16_io == "float32":
            src = cast(src, "float32")  # before Expand: ORT's CPU Expand has no bfloat16 kernel
            dtype = "float32"
        if vshape[n] != full:
            if shape_name is None:
                shape_name = fresh("full_shape")
                inits.append(numpy_helper.from_array(np.asarray(full, dtype=np.int64), shape_name))
            src = node("Expand", [src, shape_name], "expand")
        node("Identity", [src], "out", out=out)
        graph_outputs.append(helper.make_tensor_value_info(out, ONNX_DTYPE[dtype], full))

    graph = helper.make_graph(nodes, "fused_elementwise_reference", graph_inputs, graph_outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)],
                              producer_name="onnxfuse.expr")
    model.ir_version = ir_version
    onnx.checker.check_model(model)
    return model
