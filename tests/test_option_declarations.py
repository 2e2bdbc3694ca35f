"""Each ``optimize`` option is declared once, in ``onnxfuse/options.py`` (issue 36): the click options,
the API's keywords and the pipeline's fields all come from (or are held to) those declarations, and
where a declaration says the report holds it, the report's schema has that key. Each
check below returns its problems, so the tests can show it finds one (an option spelled outside its
declaration) as well as that there are none."""

from __future__ import annotations

import ast
import dataclasses
import inspect

import pytest

from helpers import ROOT
from onnxfuse import api, options, pipeline
from onnxfuse.errors import UsageError

#: The command's parameters that are not options of the library: the paths, where the reports go and
#: what is printed. They never reach the API, so they have no declaration.
COMMAND_LINE_ONLY = {"paths", "out_dir", "explain", "explain_all", "json_path", "markdown_path", "junit_path",
                     "quiet", "verbose", "log_level"}
#: OptimizeOptions fields no option sets: ``inputs_path`` (an .npz path, the other spelling of ``inputs``,
#: for callers building OptimizeOptions themselves).
INTERNAL_FIELDS = {"inputs_path"}
#: api.optimize's parameters that are not options: the model, where to write it, the UI's callbacks.
API_ONLY = {"model", "output", "progress", "bench_progress"}


def optimize_command():
    from onnxfuse.cli.optimize_cmd import optimize

    return optimize


def command_problems(command) -> list[str]:
    """Every parameter of the command is a declared option (its flag, name and help as declared) or one
    of COMMAND_LINE_ONLY, and every declared option with a command-line spelling is one of them."""
    problems = []
    declared = {o.command_line.name: o for o in options.OPTIMIZE.values() if o.command_line is not None}
    seen = set()
    for param in command.params:
        if param.name in COMMAND_LINE_ONLY:
            continue
        option = declared.get(param.name)
        if option is None:
            problems.append(f"{param.opts}: not declared in onnxfuse/options.py")
            continue
        seen.add(param.name)
        if param.opts != [option.command_line.flag] or param.help != option.help:
            problems.append(f"{param.opts}: not as declared ({option.command_line.flag})")
    problems += [f"{declared[name].command_line.flag}: declared, not an option of optimize"
                 for name in sorted(set(declared) - seen)]
    return problems


def field_problems(cls) -> list[str]:
    """Every OptimizeOptions field is a declared option or one of INTERNAL_FIELDS, and every declared
    option is a field with the checked API default (or its declared ``field_default``)."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    problems = [f"OptimizeOptions.{name}: no declaration" for name in fields
                if name not in options.OPTIMIZE and name not in INTERNAL_FIELDS]
    made = cls()
    for name, option in options.OPTIMIZE.items():
        if name not in fields:
            problems.append(f"{name}: declared, not a field of OptimizeOptions")
            continue
        expected = option.field_value(option.default) if option.field_default is options.SAME else \
            option.field_default
        if getattr(made, name) != expected:
            problems.append(f"OptimizeOptions.{name}: default {getattr(made, name)!r}, declared {expected!r}")
    return problems


def signature_problems(function) -> list[str]:
    """Every keyword of ``function`` is a declared option with the declared default and type (or one of
    API_ONLY), and every declared option is a keyword."""
    problems = []
    parameters = inspect.signature(function).parameters
    for name, parameter in parameters.items():
        if name in API_ONLY:
            continue
        option = options.OPTIMIZE.get(name)
        if option is None:
            problems.append(f"{function.__name__}({name}=...): not declared in onnxfuse/options.py")
            continue
        annotation = "" if parameter.annotation is inspect.Parameter.empty else parameter.annotation
        if parameter.default != option.default or annotation != option.annotation:
            problems.append(f"{function.__name__}({name}: {annotation} = {parameter.default!r}): declared "
                            f"{option.annotation} = {option.default!r}")
    problems += [f"{name}: declared, not a keyword of {function.__name__}"
                 for name in options.OPTIMIZE if name not in parameters]
    return problems


def spelled_outside(path, flags) -> list[str]:
    """``click.option(FLAG, ...)`` calls in ``path`` for a declared FLAG (it must come from the declaration),
    and ``OptimizeOptions(...)`` calls naming a field (they pass the declarations' ``field_values``)."""
    problems = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        if name == "option" and node.args and isinstance(node.args[0], ast.Constant) and node.args[0].value in flags:
            problems.append(f"{path.name}:{node.lineno}: click.option({node.args[0].value!r}) outside its declaration")
        if name == "OptimizeOptions" and any(k.arg is not None for k in node.keywords):
            problems.append(f"{path.name}:{node.lineno}: OptimizeOptions(...) names fields outside the declarations")
    return problems


DECLARED_FLAGS = {o.command_line.flag for o in options.OPTIMIZE.values() if o.command_line is not None}
#: The modules that spelled optimize's options before: the CLI's, the API, the pipeline, many models.
SPELLERS = ["onnxfuse/cli/optimize_cmd.py", "onnxfuse/cli/common.py", "onnxfuse/api.py", "onnxfuse/pipeline.py",
            "onnxfuse/batch.py"]


def report_problems(schema: dict) -> list[str]:
    """Every declared ``report`` key is a key of optimize's report in the JSON schema."""
    def properties(node):
        if "$ref" in node:
            node = schema["$defs"][node["$ref"].rsplit("/", 1)[1]]
        merged = dict(node.get("properties", {}))
        for alternative in node.get("oneOf", []) + node.get("anyOf", []):
            merged.update(properties(alternative))
        return merged

    problems = []
    for option in options.OPTIMIZE.values():
        if option.report is None:
            continue
        node = schema["$defs"]["optimize"]
        for part in option.report.split("."):
            node = properties(node).get(part)
            if node is None:
                problems.append(f"{option.keyword}: the report has no {option.report}")
                break
    return problems


def report_schema() -> dict:
    import json

    return json.loads((ROOT / "onnxfuse/reports/schemas/report.schema.json").read_text())


def test_every_option_of_the_command_is_declared():
    assert command_problems(optimize_command()) == []


def test_every_field_of_the_pipeline_is_declared():
    assert field_problems(pipeline.OptimizeOptions) == []


@pytest.mark.parametrize("function", [api.optimize], ids=lambda f: f.__name__)
def test_every_keyword_of_the_api_is_declared(function):
    assert signature_problems(function) == []


@pytest.mark.parametrize("path", SPELLERS)
def test_no_option_is_spelled_outside_its_declaration(path):
    assert spelled_outside(ROOT / path, DECLARED_FLAGS) == []


def test_the_report_says_the_declared_options():
    assert report_problems(report_schema()) == []


def test_a_report_key_missing_from_the_report_is_found(monkeypatch):
    monkeypatch.setitem(options.OPTIMIZE, "provider",
                        dataclasses.replace(options.OPTIMIZE["provider"], report="validation.providers"))
    assert report_problems(report_schema()) == ["provider: the report has no validation.providers"]


def test_an_undeclared_command_option_is_found():
    import click

    extra = click.Command("optimize", params=[*optimize_command().params,
                                               click.Option(["--rtol2"], type=float, help="a second tolerance")])
    assert command_problems(extra) == ["['--rtol2']: not declared in onnxfuse/options.py"]
    fewer = click.Command("optimize", params=[p for p in optimize_command().params if p.name != "rtol"])
    assert command_problems(fewer) == ["--rtol: declared, not an option of optimize"]


def test_an_undeclared_field_is_found():
    @dataclasses.dataclass
    class Extra(pipeline.OptimizeOptions):
        speed: int = 3

    assert field_problems(Extra) == ["OptimizeOptions.speed: no declaration"]


def test_a_field_default_differing_from_its_declaration_is_found(monkeypatch):
    monkeypatch.setitem(options.OPTIMIZE, "samples", dataclasses.replace(options.OPTIMIZE["samples"], default=3))
    assert field_problems(pipeline.OptimizeOptions) == ["OptimizeOptions.samples: default 2, declared 3"]


def test_an_undeclared_api_keyword_and_a_drifted_default_are_found():
    def optimize(model, output=None, *, samples: int = 3, speed: int = 1, progress=None):
        """api.optimize with a default that drifted from its declaration and an undeclared keyword."""

    problems = signature_problems(optimize)
    assert problems[:2] == ["optimize(samples: int = 3): declared int = 2",
                            "optimize(speed=...): not declared in onnxfuse/options.py"]
    assert "rtol: declared, not a keyword of optimize" in problems


def test_a_click_option_spelled_outside_its_declaration_is_found(tmp_path):
    source = tmp_path / "cmd.py"
    source.write_text('import click\n\n@click.option("--rtol", type=float)\ndef f(rtol):\n    '
                      'return OptimizeOptions(rtol=rtol)\n')
    assert spelled_outside(source, DECLARED_FLAGS) == [
        "cmd.py:3: click.option('--rtol') outside its declaration",
        "cmd.py:5: OptimizeOptions(...) names fields outside the declarations",
    ]


def test_a_field_declared_again_in_the_class_is_refused():
    with pytest.raises(TypeError, match="OptimizeOptions.rtol is declared in onnxfuse/options.py"):
        @options.declared_fields
        class OptimizeOptions:
            rtol: float = 0.5


def test_the_command_line_defaults_are_the_api_keywords_the_cli_passes():
    """What ``onnxfuse optimize IN OUT`` passes to the API, from the declarations: the API's defaults,
    except that it times (``--no-bench`` not given) and passes lists where the API takes None."""
    command = optimize_command()
    context = command.make_context("optimize", ["in.onnx", "out.onnx"])
    keywords = options.from_command_line(context.params)
    assert keywords == {
        "target": None, "device": "cuda", "only": [], "skip": [], "validate": True, "shapes": {}, "inputs": None,
        "input_ranges": None, "seed": 0, "right_padded": [], "rtol": None, "atol": None, "samples": 2,
        "save_inputs": None, "strict": False, "provider": "auto", "precision": "fp32", "max_drift": None,
        "bench": True, "fail_on_slowdown": None, "never_slower": True, "tune": True, "tune_time": None,
        "tune_shapes": [], "tune_dims": {},
        "tuning_record": None, "force": False,
    }
    flipped = options.from_command_line(command.make_context("optimize", [
        "a", "b", "--no-validate", "--no-bench", "--allow-slower", "--tune", "off", "--shape", "x:1,2",
        "--input-range", "ids:0,9", "--only", "r1", "--right-padded", "mask"]).params)
    assert {k: flipped[k] for k in ("validate", "bench", "never_slower", "tune", "shapes", "input_ranges", "only",
                                    "right_padded")} == {
        "validate": False, "bench": False, "never_slower": False, "tune": False, "shapes": {"x": [1, 2]},
        "input_ranges": {"ids": (0.0, 9.0)}, "only": ["r1"], "right_padded": ["mask"]}


def test_the_api_checks_are_the_declarations():
    values = options.field_values("optimize", samples=3, save_inputs=ROOT / "x.npz", only="a,b")
    assert (values["samples"], values["save_inputs"], values["only"]) == (3, str(ROOT / "x.npz"), ["a,b"])
    with pytest.raises(UsageError, match=r"--samples 0: need an integer >= 1"):
        options.field_values("optimize", samples=0)
    with pytest.raises(UsageError, match="fail_on_slowdown needs the models timed"):
        options.field_values("optimize", fail_on_slowdown=1.0)
    with pytest.raises(TypeError, match=r"optimize_many\(\) got an unexpected keyword argument 'speed'"):
        api.optimize_many([], ROOT, speed=1)
