"""One refusal type (issue 36, item 1): every "declined, because ..." in ``onnxfuse/rewrites`` is a
:class:`~onnxfuse.rewrites.engine.rule.Refuse`, whether a rule's ``check`` returns it, a contrib rule's
``analyze`` or a shared pattern helper hands it back, or the elementwise regions code records it.

Why a test: before, a refusal was a bare string in most places, and callers told it from a plan with
``isinstance(x, str)`` (54 such checks); a plan that happened to be a string, or a helper that started
returning one, would silently turn into a refusal. The layout check below reads the source (ast), so a
new ``isinstance(x, str)`` must either be about something else and be listed here with its reason, or
be a refusal check written the old way."""

from __future__ import annotations

import ast
from pathlib import Path

import onnx_graphsurgeon as gs
import pytest
from onnx import TensorProto as T
from onnx import helper as h

import onnxfuse.rewrites as rewrites
from onnxfuse.model_io import to_graph
from onnxfuse.rewrites.contrib.matching import ContribRule
from onnxfuse.rewrites.elementwise.regions import RegionAnalysis
from onnxfuse.rewrites.engine.rule import Plan, Refuse

ROOT = Path(rewrites.__file__).resolve().parent

#: ``isinstance(x, str)`` checks that are not about refusals: (module under rewrites/, function) → why.
#: Almost all are about symbolic dimensions, which ONNX and onnx-graphsurgeon spell as strings (a
#: dim_param such as "batch", or an invented "unk__3") beside ints and None.
STR_CHECKS_NOT_ABOUT_REFUSALS = {
    # the engine rejects a check that returns a bare string (the protocol before issue 36) as a broken
    # rule: a str is never a plan, and never a refusal either
    ("engine/apply.py", "_Run.rule"): "a check returning a bare str is a broken rule",
    # --only / --skip accept one name or a list of names
    ("__init__.py", "parse_rule_names"): "a rule name given alone",
    # symbolic dimensions
    ("engine/cleanup.py", "_shared_declared_names"): "dim_param names",
    ("engine/cleanup.py", "merge_duplicates"): "dim_param names",
    ("facts/graph.py", "declared_shape"): "dim_param names",
    ("facts/graph.py", "dims_equal"): "dim_param names",
    ("contrib/contrib_kv_cache_attention.py", "_sequence_lengths"): "dim_param names",
    ("facts/proven_dims.py", "_Pass.dim"): "dim_param names",
    ("facts/shape_values.py", "_shape_output"): "symbolic dims in shape arithmetic",
    ("contrib/contrib_rotary_embedding.py", "_run_time_batch"): "dim_param names",
    ("facts/proven_dims.py", "_Pass.run"): "dim_param names",
    ("facts/proven_dims.py", "_Pass.sizes"): "dim_param names",
    ("facts/proven_dims.py", "_invented"): "dim_param names",
    ("facts/proven_dims.py", "_product"): "dim_param names",
    ("facts/proven_dims.py", "_slice_length"): "dim_param names",
    ("facts/proven_dims.py", "prove_dims"): "dim_param names",
    ("facts/shape_values.py", "_add"): "symbolic dims in shape arithmetic",
    ("facts/shape_values.py", "_equal"): "symbolic dims in shape arithmetic",
    ("facts/shape_values.py", "_length"): "symbolic dims in shape arithmetic",
    ("facts/shape_values.py", "_mul"): "symbolic dims in shape arithmetic",
    ("facts/shape_values.py", "_sum_parts"): "symbolic dims in shape arithmetic",
    ("facts/shape_values.py", "known_name"): "symbolic dims in shape arithmetic",
    ("facts/shape_values.py", "same_length"): "symbolic dims in shape arithmetic",
    ("facts/shape_values.py", "tensor_dims"): "symbolic dims in shape arithmetic",
    ("facts/shapes.py", "_declared_symbols"): "dim_param names kept across shape inference",
    ("facts/shapes.py", "_identity_stand_ins"): "dim_param names kept across shape inference",
    ("facts/shapes.py", "_kept_symbols"): "dim_param names kept across shape inference",
    ("facts/shapes.py", "_merged"): "dim_param names kept across shape inference",
    ("facts/shapes.py", "dims_proven_equal"): "dim_param names kept across shape inference",
    ("facts/shapes.py", "refresh_shapes"): "dim_param names kept across shape inference",
    ("facts/shapes.py", "unify_dims"): "dim_param names kept across shape inference",
    ("facts/shapes.py", "unify_dims.resolve"): "dim_param names kept across shape inference",
    ("fold/constant_reshape_target.py", "_copies"): "a Reshape target entry copying a named dim",
    ("fold/constant_reshape_target.py", "_named_copy"): "a Reshape target entry copying a named dim",
    ("fold/expand_by_broadcast.py", "ExpandByBroadcast.check"): "an Expand target of known or named dims",
    ("fold/flat_index_gather.py", "_same_size"): "sizes named by a dim_param",
    ("fold/merged_axes_transpose.py", "MergedAxesTranspose.check"): "a Reshape target entry named by a dim_param",
}


def _str_checks() -> set[tuple[str, str]]:
    """(module path under rewrites/, enclosing function's qualified name) of every ``isinstance(x, str)``
    (``str`` alone or in a tuple of types)."""
    found = set()
    for path in sorted(ROOT.rglob("*.py")):
        module = path.relative_to(ROOT).as_posix()

        def visit(node, qualname: str):
            for child in ast.iter_child_nodes(node):
                inner = qualname
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    inner = f"{qualname}.{child.name}" if qualname else child.name
                if (isinstance(child, ast.Call) and isinstance(child.func, ast.Name) and child.func.id == "isinstance"
                        and len(child.args) == 2):
                    kinds = child.args[1].elts if isinstance(child.args[1], ast.Tuple) else [child.args[1]]
                    if any(isinstance(k, ast.Name) and k.id == "str" for k in kinds):
                        found.add((module, qualname or "<module>"))
                visit(child, inner)

        visit(ast.parse(path.read_text(), str(path)), "")
    return found


def test_no_str_check_tells_a_refusal_from_a_plan():
    found = _str_checks()
    unlisted = sorted(found - set(STR_CHECKS_NOT_ABOUT_REFUSALS))
    assert unlisted == [], (
        f"isinstance(x, str) in {unlisted}: a refusal is a Refuse (test with isinstance(x, Refuse)); if the "
        "check is about something else (a dim_param name), list it in STR_CHECKS_NOT_ABOUT_REFUSALS with why")
    stale = sorted(set(STR_CHECKS_NOT_ABOUT_REFUSALS) - found)
    assert stale == [], f"listed but no longer there (remove them): {stale}"


def test_refusal_classes_live_in_the_engine_only():
    """No module keeps its own refusal class (as the regions code's ``_Refuse`` exception was)."""
    classes = [(path.relative_to(ROOT).as_posix(), node.name)
               for path in sorted(ROOT.rglob("*.py"))
               for node in ast.walk(ast.parse(path.read_text(), str(path)))
               if isinstance(node, ast.ClassDef) and "refus" in node.name.lower()]
    assert sorted(classes) == [("engine/rule.py", "Refusal"), ("engine/rule.py", "Refuse"),
                               ("engine/rule.py", "Refused")]


def test_a_refuse_carries_its_node_but_is_equal_by_its_reason():
    node = gs.Node("Relu", "relu")
    refusal = Refuse("no", node)
    assert refusal.reason == "no" and refusal.node is node and not refusal.once_per_anchor
    assert refusal == Refuse("no") and hash(refusal) == hash(Refuse("no"))
    with pytest.raises(TypeError):
        Refuse("no", node, True)  # once_per_anchor is named, never positional


class _Analyzed(ContribRule):
    name = "analyzed"

    def __init__(self, found):
        self.found = found

    def analyze(self, graph, node):
        return self.found


@pytest.mark.parametrize("found", [None, "a string is a value like any other", ("a", "b")])
def test_a_contrib_rule_plans_whatever_analyze_found(found):
    plan = _Analyzed(found).check(None, "anchor")
    assert isinstance(plan, Plan) and plan.anchor == "anchor" and plan.found == found


def test_a_contrib_rule_hands_on_the_refuse_analyze_returned():
    refusal = Refuse("not this one")
    assert _Analyzed(refusal).check(None, "anchor") is refusal


def test_the_regions_code_refuses_with_the_node():
    """An op the FusedElementwise language lacks, and a fusible op alone: both regions carry a Refuse
    about their node."""
    g = h.make_graph([h.make_node("Relu", ["x"], ["r"], name="relu"),
                      h.make_node("Mod", ["r", "x"], ["y"], name="mod", fmod=1)], "g",
                     [h.make_tensor_value_info("x", T.FLOAT, [2, 3])], [h.make_tensor_value_info("y", T.FLOAT, [2, 3])])
    graph = to_graph(h.make_model(g, opset_imports=[h.make_opsetid("", 17)]))
    refusals = {r.nodes[0].name: r.refusal for r in RegionAnalysis(graph).regions()}
    assert set(refusals) == {"relu", "mod"}
    for name, refusal in refusals.items():
        assert isinstance(refusal, Refuse) and refusal.node.name == name
    assert refusals["relu"].reason.startswith("single op")
