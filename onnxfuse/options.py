"""Every ``onnxfuse optimize`` option, declared once (issue 36).

Why: an option used to be spelled in four places (the click option, the API keyword and its check, the
:class:`~onnxfuse.pipeline.OptimizeOptions` field, its default in each), and they drifted. Here each is
one :class:`Option`, as Polygraphy declares an option once in its argument group: its meaning (the help
text), the API keyword (which is also the pipeline's field), the API's default and type, the check that
turns the keyword's value into the field's (a :class:`~onnxfuse.errors.UsageError` otherwise: exit 2 on
the command line), how the command line spells it (:class:`CommandLine`) and where the report says it.
From them:

- ``onnxfuse/cli/common.py`` makes the click options (:func:`onnxfuse.cli.common.declared_options`),
  and :func:`from_command_line` turns the parsed command line into the API's keywords;
- :func:`onnxfuse.api.optimize` and ``optimize_many`` check their keywords with :func:`field_values`, in
  the declarations' order (so the first of several problems is the one reported);
- :func:`declared_fields` gives :class:`~onnxfuse.pipeline.OptimizeOptions` a field per option, its
  default the checked API default.

What stays elsewhere: the API's signature is written out in ``api.py`` (the public contract, read by
people and type checkers; ``tests/test_option_declarations.py`` holds it to these declarations), and the
options only the command line has (where reports go and how it prints: ``--json``, ``--explain``, ...)
are the CLI's own. ``diff`` and ``bench`` share the input options (:data:`INPUT_OPTIONS`).

This module imports nothing heavy (``import onnxfuse`` loads it): parsers of other layers load when an
option is checked.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from typing import Callable

from onnxfuse.errors import UsageError

#: "the API's default": a :class:`CommandLine` default or a field default that is not its own
SAME = object()


@dataclasses.dataclass(frozen=True)
class CommandLine:
    """How the command line spells an option; ``onnxfuse/cli/common.py`` makes it a click option.

    ``value``: ``"flag"`` (present or not), ``"text"``, ``"int"``, ``"float"`` (with ``minimum``, open
    when ``minimum_open``), ``"choice"`` (one of ``choices``: a tuple, or a function returning it when
    knowing them loads the rewrites), ``"file"`` or ``"folder"`` (a path). ``default``: the command
    line's own, when it is not the API's (``SAME``). ``to_api``: the parsed value as the API keyword takes
    it (None: the same value)."""

    flag: str
    dest: str | None = None  # the command's parameter name; None: the flag's ("--tune-time": tune_time)
    value: str = "text"
    choices: tuple | Callable[[], tuple] = ()
    multiple: bool = False
    metavar: str | None = None
    default: object = SAME
    show_default: bool = False
    minimum: float | None = None
    minimum_open: bool = False
    to_api: Callable[[object], object] | None = None

    @property
    def name(self) -> str:
        """The command's parameter name."""
        return self.dest or self.flag.lstrip("-").replace("-", "_")

    def choice_values(self) -> tuple:
        return self.choices() if callable(self.choices) else self.choices


@dataclasses.dataclass(frozen=True)
class Option:
    """One option of ``optimize``: the API keyword and pipeline field ``keyword``, what it means
    (``help``: the command line's help text), the API's ``default`` and type (``annotation``, as the
    signature writes it), ``check`` (the keyword's value → the field's; raises
    :class:`~onnxfuse.errors.UsageError`; None: taken as given), its ``command_line`` spelling (None:
    API only) and ``report``: the key of ``optimize``'s JSON report that says it (dotted, as in
    ``onnxfuse/reports/schemas/report.schema.json``; None: no key says it as given).
    ``field_default``: the pipeline field's default when it is not the checked API default (``SAME``).
    ``together``: a check of this option with the others, given every keyword the API was called with."""

    keyword: str
    help: str
    default: object = None
    annotation: str = ""
    check: Callable[[object], object] | None = None
    command_line: CommandLine | None = None
    report: str | None = None  # e.g. "validation.provider"
    field_default: object = SAME
    together: Callable[[dict], None] | None = None  # a check of it with the others (all the API's keywords)

    def field_value(self, value):
        """``value`` (the API keyword's) as the pipeline's field holds it, checked."""
        return value if self.check is None else self.check(value)


# -- checks: the API keyword's value → the pipeline field's; UsageError (exit 2) otherwise ---------------

def checked_tolerance(value, name: str):
    """A tolerance must be finite and >= 0 (``nan`` would turn every comparison into a pass)."""
    if value is not None and not (math.isfinite(value) and value >= 0):
        raise UsageError(f"--{name} {value}: a tolerance must be a finite number >= 0")
    return value


def checked_seed(seed):
    """The seed of the random inputs: a non-negative integer."""
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise UsageError(f"--seed {seed}: the seed must be an integer >= 0")
    return seed


def checked_samples(samples) -> int:
    """The number of seeded samples validation runs on: an integer >= 1."""
    if not isinstance(samples, int) or isinstance(samples, bool) or samples < 1:
        raise UsageError(f"--samples {samples}: need an integer >= 1")
    return samples


def checked_seconds(value, what: str) -> float | None:
    """A non-negative number of seconds, or None; else one line (a usage error)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or value < 0:
        raise UsageError(f"{what} must be a number of seconds >= 0, not {value!r}")
    return float(value)


def rule_names(value) -> list[str] | None:
    """Rule names as the pipeline takes them (a list of comma-separated strings), None when empty."""
    if value is None:
        return None
    items = [value] if isinstance(value, str) else list(value)
    return items or None


def input_names(value) -> list[str]:
    """Input names: one string (not split: a name may hold a comma) or a sequence of them."""
    if value is None:
        return []
    names = [value] if isinstance(value, str) else list(value)
    if not all(isinstance(n, str) and n for n in names):
        raise UsageError("right_padded: expected input names (strings)")
    return names


def checked_shapes(shapes) -> dict[str, list[int]]:
    """``{input name: [dims]}`` with integer, non-negative dimensions."""
    out = {str(k): [int(d) for d in v] for k, v in (shapes or {}).items()}
    for name, dims in out.items():
        if any(d < 0 for d in dims):
            raise UsageError(f"shapes[{name!r}]: dimensions must be non-negative, got {dims}")
    return out


def checked_tune_shapes(value) -> list[dict[str, list[int]]]:
    """``tune_shapes``: a list of sizes, each ``{input name: [dims]}`` (as ``shapes``), none empty."""
    if not value:
        return []
    if isinstance(value, Mapping):
        raise UsageError("tune_shapes: expected a list of sizes, each {input name: [dims]}")
    out = [checked_shapes(size) for size in value]
    if any(not size for size in out):
        raise UsageError("tune_shapes: a size names no input")
    return out


def checked_tune_dims(value) -> dict[str, list[int]]:
    """``tune_dims``: ``{dimension name: [sizes]}``, each size a positive integer, none empty."""
    out = {str(name): [int(v) for v in values] for name, values in (value or {}).items()}
    for name, values in out.items():
        if not values or any(v < 1 for v in values):
            raise UsageError(f"tune_dims[{name!r}]: expected one or more positive sizes, got {values}")
    return out


def checked_ranges(ranges) -> dict | None:
    """``{name: (lo, hi)}`` (inclusive) → ValueRange objects, checked like ``--input-range``."""
    if not ranges:
        return None
    # start-up: import onnxfuse does not load onnxfuse.runtime.input_ranges (nor numpy, onnx, graphsurgeon)
    from onnxfuse.runtime.input_ranges import parse_range_options

    return parse_range_options([f"{name}:{lo},{hi}" for name, (lo, hi) in ranges.items()])


def checked_max_drift(value):
    """``max_drift`` as the pipeline takes it (a DriftBudget, or None for the default), checked."""
    if value is None:
        return None
    # start-up: import onnxfuse does not load onnxfuse.validate.drift_budget (nor numpy, onnx, graphsurgeon)
    from onnxfuse.validate.drift_budget import parse_max_drift

    return parse_max_drift(value)


def _path(value) -> str | None:
    return None if value is None else os.fspath(value)


# -- command line values → the API's ----------------------------------------------------------------------

def shapes_from_command_line(values) -> dict[str, list[int]]:
    """``--shape NAME:D0,D1,...`` options as the API takes them (usage errors exit 2)."""
    # start-up: import onnxfuse does not load onnxfuse.runtime.inputs (nor numpy, onnx)
    from onnxfuse.runtime.inputs import parse_shape_options

    return parse_shape_options(values)


def tune_shapes_from_command_line(values) -> list[dict[str, list[int]]]:
    """``--tune-shape NAME:D0,D1,...[;NAME:D0,...]`` options (one size each) as the API takes them."""
    # start-up: import onnxfuse does not load onnxfuse.runtime.inputs (nor numpy, onnx)
    from onnxfuse.runtime.inputs import parse_shape_options

    return [parse_shape_options([part.strip() for part in value.split(";") if part.strip()]) for value in values or ()]


def tune_dims_from_command_line(values) -> dict[str, list[int]]:
    """``--tune-dim NAME=V[,V...]`` options as the API takes them (usage errors exit 2)."""
    out: dict[str, list[int]] = {}
    for value in values or ():
        name, sep, sizes = value.partition("=")
        try:
            parsed = [int(v) for v in sizes.split(",") if v.strip()]
        except ValueError:
            parsed = []
        if not sep or not name.strip() or not parsed:
            raise UsageError(f"--tune-dim {value!r}: expected NAME=V[,V...], e.g. batch=1,16")
        out.setdefault(name.strip(), []).extend(parsed)
    return out


def ranges_from_command_line(values) -> dict[str, tuple[float, float]] | None:
    """``--input-range NAME:LO,HI`` options as the API takes them (usage errors exit 2)."""
    # start-up: import onnxfuse does not load onnxfuse.runtime.input_ranges (nor numpy, onnx, graphsurgeon)
    from onnxfuse.runtime.input_ranges import parse_range_options

    return {k: (r.lo, r.hi) for k, r in parse_range_options(values).items()} or None


def _absent(value: bool) -> bool:
    """A ``--no-X`` flag: the keyword is on unless it is given."""
    return not value


def _on(value: str) -> bool:
    return value == "on"


def _targets() -> tuple:
    # start-up: import onnxfuse does not load onnxfuse.rewrites (nor numpy, onnx, graphsurgeon)
    from onnxfuse.rewrites import TARGETS

    return tuple(TARGETS)


def _devices() -> tuple:
    # start-up: import onnxfuse does not load onnxfuse.rewrites (nor numpy, onnx, graphsurgeon)
    from onnxfuse.rewrites import DEVICES

    return tuple(DEVICES)


def _fail_on_slowdown_needs_bench(keywords: dict) -> None:
    """``fail_on_slowdown`` without ``bench`` would never be checked: say so instead of passing."""
    if keywords.get("fail_on_slowdown") is not None and not keywords.get("bench", OPTIMIZE["bench"].default):
        raise UsageError("fail_on_slowdown needs the models timed (bench=True; on the command line, drop "
                         "--no-bench)")


def _tune_shapes_need_bench(keywords: dict) -> None:
    """``tune_shapes`` / ``tune_dims`` without ``bench`` would time nothing: say so instead of ignoring them
    (with a ``tuning_record`` they are part of the key of the decision to apply, so they mean something
    there)."""
    for keyword in ("tune_shapes", "tune_dims"):
        if (keywords.get(keyword) and not keywords.get("bench", OPTIMIZE["bench"].default)
                and not keywords.get("tuning_record")):
            raise UsageError(f"{keyword} needs the models timed (bench=True; on the command line, drop --no-bench) "
                             "or a tuning record to apply")


# -- the declarations ----------------------------------------------------------------------------------------

#: ``optimize``'s options, in the order the API checks them (the command shows them in its own order).
_OPTIMIZE = (
    Option("rtol", "Relative tolerance (default depends on dtype: fp32 1e-4, fp16 1e-2; a model that computes in "
                   "fp16 is judged as fp16 even where its outputs are fp32).",
           annotation="float | None", check=lambda value: checked_tolerance(value, "rtol"),
           command_line=CommandLine("--rtol", value="float")),
    Option("atol", "Absolute tolerance (default depends on dtype and output scale).",
           annotation="float | None", check=lambda value: checked_tolerance(value, "atol"),
           command_line=CommandLine("--atol", value="float")),
    Option("seed", "Seed for the random inputs.", default=0, annotation="int", check=checked_seed,
           command_line=CommandLine("--seed", value="int", show_default=True)),
    Option("fail_on_slowdown", "Exit 4 and write nothing when the optimized model's median latency on the device "
                               "exceeds RATIO × the original's (e.g. 1.0, or 1.05 to allow 5% noise). Where it "
                               "cannot measure (--device cuda without a GPU) one line says it was not checked and "
                               "--junit writes a skipped latency case.",
           annotation="float | None",
           command_line=CommandLine("--fail-on-slowdown", value="float", minimum=0, minimum_open=True,
                                    metavar="RATIO"),
           together=_fail_on_slowdown_needs_bench),
    Option("target", "cuda: everything (the default); contrib: only ONNX Runtime's own ops (the default with "
                     "--device cpu); onnx: standard ONNX ops only.",
           annotation="str | None", command_line=CommandLine("--target", value="choice", choices=_targets),
           report="target"),
    Option("device", "The ONNX Runtime provider the model is for. cpu: rules without FusedElementwise (--target "
                     "contrib or onnx), validated and timed on the CPU, so the never-slower fallback and "
                     "--fail-on-slowdown use CPU timings.",
           default="cuda", annotation="str",
           command_line=CommandLine("--device", value="choice", choices=_devices, show_default=True),
           report="device"),
    Option("only", "Run only these rules (see `onnxfuse rules`); +RULE adds an opt-in rule to the default ones.",
           annotation="str | Sequence[str] | None", check=rule_names,
           command_line=CommandLine("--only", multiple=True, metavar="RULE,...", to_api=list)),
    Option("skip", "Do not run these rules.", annotation="str | Sequence[str] | None", check=rule_names,
           command_line=CommandLine("--skip", multiple=True, metavar="RULE,...", to_api=list)),
    Option("validate", "Skip comparing the optimized model's outputs with the original's.", default=True,
           annotation="bool", command_line=CommandLine("--no-validate", value="flag", to_api=_absent),
           report="validation"),
    Option("shapes", "Shape of an input with dynamic dimensions (repeatable). "
                     "Unspecified dynamic dimensions default to 1.",
           annotation="Mapping[str, Sequence[int]] | None", check=checked_shapes,
           command_line=CommandLine("--shape", "shapes", multiple=True, metavar="NAME:D0,D1,...",
                                    to_api=shapes_from_command_line)),
    Option("inputs", "An .npz file with one array per model input, used instead of random data.",
           annotation="InputsLike | None",
           command_line=CommandLine("--inputs", "inputs_path", value="file")),
    Option("input_ranges", "Draw this input's random values in [LO, HI] (repeatable). Default: integer "
                           "inputs in the range the graph implies (ids into an embedding of V rows: "
                           "0..V-1; the shape of an Expand, Tile, Reshape or ConstantOfShape: values it "
                           "accepts), else 0 or 1; floats standard normal (uniform with a range).",
           annotation="Mapping[str, tuple[float, float]] | None", check=checked_ranges,
           command_line=CommandLine("--input-range", "input_ranges", multiple=True, metavar="NAME:LO,HI",
                                    to_api=ranges_from_command_line)),
    Option("right_padded", "Promise that input NAME (an attention mask) holds right-padded rows: n >= 1 "
                           "ones, then zeros, as a tokenizer that pads on the right writes (repeatable). "
                           "Attention then reads it as 1-D lengths (ReduceSum of the mask), as ONNX "
                           "Runtime's transformers optimizer writes it, and a (1 - mask)·c mask "
                           "(transformers 4's eager BERT) counts as a 0/1 keep mask, so its float32 "
                           "softmax under --precision fp16 fuses; random inputs keep the promise. "
                           "Wrong for left-padded masks.",
           annotation="str | Sequence[str] | None", check=input_names,
           command_line=CommandLine("--right-padded", "right_padded", multiple=True, metavar="NAME", to_api=list),
           report="assumptions.right_padded"),
    Option("samples", "Seeded random samples to validate on (seeds SEED, SEED+1, ...), besides one at a second "
                      "size of every dynamic dimension.",
           default=2, annotation="int", check=checked_samples,
           command_line=CommandLine("--samples", value="int", show_default=True)),
    Option("save_inputs", "Write every sample validation used to this .npz; --inputs replays it exactly.",
           annotation="str | os.PathLike | None", check=_path,
           command_line=CommandLine("--save-inputs", "save_inputs", value="file")),
    Option("strict", "Judge by tolerance alone: an output beyond tolerance fails even when its error is within "
                     "10x the original model's own noise floor (its outputs with ONNX Runtime's optimizations "
                     "off vs on).",
           default=False, annotation="bool", command_line=CommandLine("--strict", value="flag")),
    Option("provider", "ONNX Runtime provider used for validation.", default="auto", annotation="str",
           command_line=CommandLine("--provider", value="choice", choices=("auto", "cpu", "cuda"),
                                    show_default=True),
           report="validation.provider"),
    Option("precision", "fp16: compute in float16 with float32 inputs and outputs (constants and nodes float16 "
                        "cannot hold, and nodes whose float16 results break the drift budget, stay float32), validated against the float32 original at float16's "
                        "tolerances. fp16-io: the same, taking and returning float16 (for pipelines that feed "
                        "float16). bf16: compute in bfloat16 with float32 inputs and outputs, for ONNX Runtime's "
                        "CUDA provider (ops it has no bfloat16 kernel for stay float32; opset 13 or later); "
                        "validated on CUDA only.",
           default="fp32", annotation="str",
           command_line=CommandLine("--precision", value="choice", choices=("fp32", "fp16", "fp16-io", "bf16"),
                                    show_default=True),
           report="precision.precision"),
    Option("max_drift", "The drift budget of --precision fp16/fp16-io/bf16 (default 2e-2,0.999; 0.16,0.999 for bf16, "
                        "whose rounding is 8x coarser): an output beyond "
                        "tolerance also passes when its normalized max error (max |err| / max |ref|) against the "
                        "float32 original is at most ERR, its cosine at least COS, and its error within 3x the "
                        "model merely converted to float16. Nodes whose float16 results break it stay float32.",
           annotation="float | tuple[float, float] | str | None", check=checked_max_drift,
           command_line=CommandLine("--max-drift", "max_drift", metavar="ERR[,COS]")),
    # The API does not time by default (it takes seconds, and says nothing without a GPU); the command
    # line and the pipeline's own default do.
    Option("bench", "Skip timing both models (on the GPU, or the CPU with --device cpu) after validation.",
           default=False, annotation="bool", field_default=True,
           command_line=CommandLine("--no-bench", value="flag", to_api=_absent),
           report="timing"),
    Option("never_slower", "Keep the optimized model even when it times slower than the original on the device. "
                           "By default fewer rewrites are then tried (each validated and timed), down to the graph "
                           "as loaded.",
           default=True, annotation="bool",
           command_line=CommandLine("--allow-slower", value="flag", to_api=_absent),
           report="selection"),
    Option("tune", "on: with timing, also try the measured choices (channels-last added for conv nets, then its few-channel transposes as ChannelTranspose; fused attention taken away in float32 transformers) on the output, each validated and timed beside the output, and "
                   "keep what is faster. off: the rules' static choices.",
           default=True, annotation="bool",
           command_line=CommandLine("--tune", value="choice", choices=("on", "off"), default="on",
                                    show_default=True, to_api=_on),
           report="measured"),
    Option("tune_time", "Seconds of tuning after the first timing (the never-slower fallbacks and the measured "
                        "choices; default 60): past it no new candidate starts, no measured choice starts that "
                        "the longest trial so far says would end past it, one whose timing reaches it between two "
                        "sizes stops there (refused), and a slower model falls back "
                        "straight to the graph as loaded.",
           annotation="float | None", check=lambda value: checked_seconds(value, "tune_time"),
           command_line=CommandLine("--tune-time", "tune_time", value="float", minimum=0, metavar="SECONDS")),
    Option("tune_shapes", "Also time at these input shapes (repeatable, one size each: NAME:D0,D1,... of one or "
                          "more inputs joined by ';', other inputs as --shape gives them). The never-slower "
                          "fallback and the measured choices then decide on every size: a model slower at any "
                          "of them falls back, a choice is kept only when faster overall and not slower at any.",
           annotation="Sequence[Mapping[str, Sequence[int]]] | None", check=checked_tune_shapes,
           together=_tune_shapes_need_bench,
           command_line=CommandLine("--tune-shape", "tune_shapes", multiple=True, metavar="NAME:D0,...[;NAME:D0,...]",
                                    to_api=tune_shapes_from_command_line)),
    Option("tune_dims", "Also time with this named dynamic dimension at these sizes (repeatable: "
                        "NAME=V[,V...], e.g. batch=1,16; several names: every combination), in every input that "
                        "has it, other dimensions as the first timing has them. As --tune-shape, spelled by "
                        "dimension.",
           annotation="Mapping[str, Sequence[int]] | None", check=checked_tune_dims,
           together=_tune_shapes_need_bench,
           command_line=CommandLine("--tune-dim", "tune_dims", multiple=True, metavar="NAME=V[,V...]",
                                    to_api=tune_dims_from_command_line)),
    Option("tuning_record", "Read and write measured decisions here: where FILE holds one for this model, options "
                            "and shapes (measured on this GPU, or on any GPU when none is usable here, as on a CI "
                            "runner) it is applied; else what this run measures is added to FILE.",
           annotation="str | os.PathLike | None", check=_path,
           command_line=CommandLine("--tuning-record", "tuning_record", value="file", metavar="FILE"),
           report="tuning_record"),
    Option("force", "Allow OUTPUT to be the same file as INPUT.", default=False, annotation="bool",
           command_line=CommandLine("--force", value="flag")),
    Option("bench_config", "How both models are timed (an onnxfuse.timing.runner.BenchConfig; its device must be "
                           "cpu with device cpu). None: its defaults."),
    Option("rules", "A custom rule pool replacing the registry (plugins, tests).",
           annotation="list[Rule] | None"),
)

#: ``optimize``'s options by API keyword (= pipeline field).
OPTIMIZE: dict[str, Option] = {option.keyword: option for option in _OPTIMIZE}
#: How models are fed, shared by ``optimize``, ``diff`` and ``bench`` (in the command line's order).
INPUT_OPTIONS = tuple(OPTIMIZE[keyword] for keyword in ("shapes", "inputs", "input_ranges", "seed"))
#: The promise contrib-mask-lengths relies on, shared by ``optimize`` and ``diff``.
RIGHT_PADDED = OPTIMIZE["right_padded"]


def field_values(caller: str, **keywords) -> dict:
    """``optimize``'s API keywords (those not given: their defaults), each checked, as the pipeline's
    fields; a keyword no option declares is a ``TypeError``, as Python raises for ``caller``."""
    for name in keywords:
        if name not in OPTIMIZE:
            raise TypeError(f"{caller}() got an unexpected keyword argument {name!r}")
    values = {}
    for name, option in OPTIMIZE.items():  # in order: the first problem is the one reported
        values[name] = option.field_value(keywords.get(name, option.default))
        if option.together is not None:
            option.together(keywords)
    return values


def from_command_line(values: dict, keywords: list[str] | None = None) -> dict:
    """The parsed command line (click's values by parameter name) as ``optimize``'s API keywords: each
    declared option's ``to_api`` (``--no-bench`` → ``bench=False``, ``--shape`` parsed; usage errors exit
    2); the command line's own options (not declared) are left out. ``keywords``: only these."""
    converted = {}
    for option in OPTIMIZE.values():
        spelling = option.command_line
        if keywords is not None and option.keyword not in keywords:
            continue
        if spelling is not None and spelling.name in values:
            value = values[spelling.name]
            converted[option.keyword] = value if spelling.to_api is None else spelling.to_api(value)
    return converted


def declared_fields(cls):
    """Class decorator, under ``@dataclass``: a field for each of :data:`OPTIMIZE` (its annotation, its
    default the checked API default or ``field_default``), before the class's own fields (those only the
    library sets)."""
    own = dict(cls.__dict__.get("__annotations__", {}))
    annotations = {}
    for option in OPTIMIZE.values():
        if option.keyword in own:
            raise TypeError(f"{cls.__name__}.{option.keyword} is declared in onnxfuse/options.py: not here too")
        annotations[option.keyword] = option.annotation or "object"
        default = option.field_value(option.default) if option.field_default is SAME else option.field_default
        if isinstance(default, (list, dict, set)):
            setattr(cls, option.keyword, dataclasses.field(default_factory=lambda d=default: type(d)(d)))
        else:
            setattr(cls, option.keyword, default)
    cls.__annotations__ = {**annotations, **own}
    return cls


__all__ = ["INPUT_OPTIONS", "OPTIMIZE", "RIGHT_PADDED", "CommandLine", "Option", "declared_fields",
           "field_values", "from_command_line"]
