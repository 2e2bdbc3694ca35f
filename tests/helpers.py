"""Small helpers shared by tests: load test models, optimize, run on ONNX Runtime CPU, compare outputs."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from onnxfuse.rewrites import Rule as _Rule

ROOT = Path(__file__).resolve().parents[1]
TESTDATA = ROOT / "testdata"

_NP_DTYPES = {
    onnx.TensorProto.FLOAT: np.float32,
    onnx.TensorProto.FLOAT16: np.float16,
    onnx.TensorProto.DOUBLE: np.float64,
    onnx.TensorProto.INT64: np.int64,
    onnx.TensorProto.INT32: np.int32,
}


def module_name(path: Path) -> str:
    """The dotted name of a module file of this repository (``onnxfuse/cli/__init__.py`` → ``onnxfuse.cli``)."""
    parts = list(Path(path).resolve().relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def module_imports(path: Path) -> list[tuple[str, list[str]]]:
    """(imported module, [names]) for every import in a module file, wherever it is (top level or in a
    function), relative imports resolved: the layering tests read imports with this, never by importing."""
    import ast

    here = module_name(path)
    package = here if Path(path).name == "__init__.py" else here.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(Path(path).read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([module] if module else []))
            found.append((module, [a.name for a in node.names]))
    return found


def load_testdata(name: str) -> onnx.ModelProto:
    """A committed model from testdata/ by file name (``.onnx`` optional)."""
    return onnx.load(str(TESTDATA / (name if name.endswith(".onnx") else name + ".onnx")))


def make_models_module():
    """testdata/make_models.py as a module (its builders, ``MODELS``, ``build_all``)."""
    spec = importlib.util.spec_from_file_location("onnxfuse_testdata_make_models", TESTDATA / "make_models.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def optimize(model: onnx.ModelProto, only=None, skip=None, target: str = "cuda", right_padded=()):
    """Apply the selected rules to a copy of ``model``; return ``(optimized model, ApplyReport)``.
    ``right_padded``: inputs promised right-padded (``--right-padded``)."""
    from onnxfuse.model_io import to_graph, to_model
    from onnxfuse.rewrites import Assumptions, apply_rules, select_rules

    original = onnx.ModelProto()
    original.CopyFrom(model)
    graph = to_graph(original)
    assumptions = Assumptions(right_padded=frozenset(right_padded))
    report = apply_rules(graph, select_rules(target, only=only, skip=skip, assumptions=assumptions))
    return to_model(graph, model), report


def float_types(f32_tol: float, f16_tol: float, bf16_tol: float) -> list[tuple]:
    """(ONNX element type, numpy dtype, tolerance) for float32, float16 and, where numpy knows it
    (ml_dtypes, shipped with onnx), bfloat16: the parameters of a custom op's per-type tests."""
    out = [(onnx.TensorProto.FLOAT, np.float32, f32_tol), (onnx.TensorProto.FLOAT16, np.float16, f16_tol)]
    try:
        import ml_dtypes

        out.append((onnx.TensorProto.BFLOAT16, ml_dtypes.bfloat16, bf16_tol))
    except ImportError:  # pragma: no cover - onnx ships ml_dtypes
        pass
    return out


def op_types_within(model: onnx.ModelProto) -> list[str]:
    """Every node's op type, the nodes of If branches and Loop/Scan bodies included (depth first)."""
    out = []

    def walk(graph):
        for node in graph.node:
            out.append(node.op_type)
            for attr in node.attribute:
                for sub in [attr.g] if attr.HasField("g") else list(attr.graphs):
                    walk(sub)

    walk(model.graph)
    return out


def op_types(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node]


def random_feeds(model: onnx.ModelProto, seed: int = 0, dim: int = 2) -> dict[str, np.ndarray]:
    """Seeded standard-normal inputs for every graph input (symbolic dimensions become ``dim``)."""
    rng = np.random.default_rng(seed)
    inits = {i.name for i in model.graph.initializer}
    feeds = {}
    for inp in model.graph.input:
        if inp.name in inits:
            continue
        tt = inp.type.tensor_type
        shape = [d.dim_value if d.HasField("dim_value") else dim for d in tt.shape.dim]
        feeds[inp.name] = rng.standard_normal(shape).astype(_NP_DTYPES[tt.elem_type])
    return feeds


def run_ort(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Run ``model`` on ONNX Runtime's CPU provider with graph optimizations off; outputs by name."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    opts.log_severity_level = 3
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, feeds)))


def assert_same_outputs(original, optimized, rtol: float = 1e-5, atol: float | None = None, seed: int = 0, dim: int = 2):
    """Outputs of both models on the same seeded inputs agree: ``|a−b| ≤ atol + rtol·|a|`` elementwise.

    ``atol`` defaults to ``rtol`` times the largest output magnitude (a fold reorders roundings, so
    elements near zero carry absolute, not relative, error). Returns the outputs of ``original``.
    """
    feeds = random_feeds(original, seed=seed, dim=dim)
    want = run_ort(original, feeds)
    got = run_ort(optimized, feeds)
    assert sorted(want) == sorted(got), (sorted(want), sorted(got))
    for name, a in want.items():
        b = got[name]
        assert a.shape == b.shape and a.dtype == b.dtype, (name, a.shape, b.shape, a.dtype, b.dtype)
        a64, b64 = a.astype(np.float64), b.astype(np.float64)
        tol = rtol * float(np.max(np.abs(a64), initial=0.0)) if atol is None else atol
        np.testing.assert_allclose(b64, a64, rtol=rtol, atol=tol, err_msg=f"output {name!r}")
    return want


def make_model(nodes, inputs, outputs, inits=(), opset: int = 15) -> onnx.ModelProto:
    """A model from ``onnx.helper`` parts (IR 8, default domain at ``opset``)."""
    graph = onnx.helper.make_graph(list(nodes), "test", list(inputs), list(outputs), list(inits))
    return onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", opset)], ir_version=8)


def vi(name: str, shape, dtype=onnx.TensorProto.FLOAT):
    return onnx.helper.make_tensor_value_info(name, dtype, shape)


def snapshot(model: onnx.ModelProto):
    """What a refused rewrite must leave alone: nodes (op, inputs, outputs) and the values of the
    initializers they read (cleanup may drop unused ones)."""
    nodes = [(n.op_type, tuple(n.input), tuple(n.output)) for n in model.graph.node]
    used = {name for n in model.graph.node for name in n.input}
    inits = {i.name: onnx.numpy_helper.to_array(i).tobytes() for i in model.graph.initializer if i.name in used}
    return nodes, inits


def conv_bn_model(batch="N") -> onnx.ModelProto:
    """Conv → BatchNormalization → Relu with a dynamic batch (the CLI and API tests' model)."""
    rng = np.random.default_rng(1)
    inits = [
        numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "w"),
        numpy_helper.from_array((rng.random(4) + 0.5).astype(np.float32), "gamma"),
        numpy_helper.from_array(rng.standard_normal(4).astype(np.float32), "beta"),
        numpy_helper.from_array(rng.standard_normal(4).astype(np.float32), "mean"),
        numpy_helper.from_array((rng.random(4) + 0.5).astype(np.float32), "var"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1], name="conv"),
        helper.make_node("BatchNormalization", ["c", "gamma", "beta", "mean", "var"], ["b"], name="bn"),
        helper.make_node("Relu", ["b"], ["y"], name="relu"),
    ]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [batch, 3, 8, 8])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [batch, 4, 8, 8])], inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], producer_name="test-exporter")
    model.ir_version = 8
    helper.set_model_props(model, {"author": "tests"})
    return model


class BreakConvWeights(_Rule):
    """A deliberately wrong rule (doubles every Conv weight): validation must catch it and name it."""

    name = "test-break-conv"
    description = "test only"

    def match(self, graph):
        return [n for n in graph.nodes if n.op == "Conv" and not getattr(n, "_broken", False)]

    def rewrite(self, graph, node):
        node.inputs[1].values = node.inputs[1].values * 2
        node._broken = True
        return {"node": node.name}


def outputs_on_cuda(model: onnx.ModelProto, inputs, cuda_graph: bool = True) -> dict[str, np.ndarray]:
    """``model``'s outputs as onnxfuse's GPU timer produces them (IOBinding on the CUDA provider; with
    ``cuda_graph``, captured and replayed in a CUDA graph) after a warm-up and five timed runs. Raises
    what the timer raises: ONNX Runtime refuses to capture a graph with CPU nodes."""
    from onnxfuse.timing.runner import BenchConfig, Timer

    timer = Timer(model, inputs, BenchConfig(device="cuda", cuda_graph=cuda_graph, warmup=3, time_budget_s=0.2))
    try:
        timer.warmup()
        timer.sample(iterations=5, time_budget_s=None, min_iterations=1)
        return timer.outputs()
    finally:
        timer.close()


def kv_cache_feeds(batch, new, past, dtype, rng, layers: int = 2, kv_heads: int = 2, head: int = 16):
    """Inputs of a KV-cache decoder with the generation-loop signature (``input_ids``, ``attention_mask``
    [batch, past + new], ``position_ids``, ``past_key_values.N.key/value`` [batch, kv_heads, past, head]):
    ``new`` tokens after ``past`` cached ones, the first row left-padded (its first two positions are
    pad, so at prefill its first two queries keep no key), positions counted over the kept tokens."""
    mask = np.ones((batch, past + new), np.int64)
    mask[0, :2] = 0
    position = np.maximum(np.cumsum(mask, axis=1) - 1, 0)[:, past:]
    feeds = {"input_ids": rng.integers(0, 128, (batch, new)).astype(np.int64), "attention_mask": mask,
             "position_ids": position.astype(np.int64)}
    for i in range(layers):
        for kv in ("key", "value"):
            feeds[f"past_key_values.{i}.{kv}"] = rng.standard_normal((batch, kv_heads, past, head)).astype(dtype)
    return feeds


def run_float64(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The model's outputs computed in float64 by onnx's reference evaluator (numpy): an independent
    reference, neither ONNX Runtime nor any rewrite of ours. Every float32 tensor of the graph (inputs,
    initializers, Constant values, Cast targets) becomes float64, so the only difference from a float32
    run is float32's rounding. Rows an attention mask empties are NaN before the exporter's own
    ``Where(IsNaN)`` guard, and T5's relative-position buckets take ``Log(0)`` before a ``Where`` drops
    it, as in the original: hence the silenced warnings."""
    from onnx.reference import ReferenceEvaluator
    from onnx.reference.op_run import OpRun

    class GatherElements(OpRun):  # onnx 1.2x's own one fails on indices broadcast along other axes
        def _run(self, data, indices, axis=None):
            axis = axis or 0
            return (np.take_along_axis(data, np.where(indices < 0, indices + data.shape[axis], indices), axis=axis),)

    wide = onnx.ModelProto()
    wide.CopyFrom(model)
    f32, f64 = onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE

    def widen(graph):
        for t in graph.initializer:
            if t.data_type == f32:
                t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float64), t.name))
        for info in list(graph.input) + list(graph.output) + list(graph.value_info):
            if info.type.tensor_type.elem_type == f32:
                info.type.tensor_type.elem_type = f64
        for node in graph.node:
            for a in node.attribute:
                if a.type == onnx.AttributeProto.TENSOR and a.t.data_type == f32:
                    a.t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(a.t).astype(np.float64), a.t.name))
                elif node.op_type == "Cast" and a.name == "to" and a.i == f32:
                    a.i = f64
                elif a.type == onnx.AttributeProto.GRAPH:
                    widen(a.g)

    widen(wide.graph)
    names = [o.name for o in model.graph.output]
    wide_feeds = {k: v.astype(np.float64) if v.dtype == np.float32 else v for k, v in feeds.items()}
    with np.errstate(invalid="ignore", divide="ignore"):
        got = ReferenceEvaluator(wide, new_ops=[GatherElements]).run(None, wide_feeds)
    return dict(zip(names, got))


def residual_layernorm_stack(width: int = 64, blocks: int = 16) -> onnx.ModelProto:
    """``blocks`` blocks of x = LayerNorm(x + x·W) (float32, batch dynamic): converted to float16, its rounding
    compounds past float16's default tolerance with no rewrite (--precision fp16's floor and drift budget tests)."""
    rng = np.random.default_rng(0)
    nodes, inits, x = [], [], "x"
    for i in range(blocks):
        inits += [numpy_helper.from_array((rng.standard_normal((width, width)) * 1.3 / np.sqrt(width)).astype(np.float32),
                                          f"w{i}"),
                  numpy_helper.from_array((rng.random(width) + 0.5).astype(np.float32), f"g{i}"),
                  numpy_helper.from_array((rng.standard_normal(width) * 0.1).astype(np.float32), f"b{i}")]
        nodes += [helper.make_node("MatMul", [x, f"w{i}"], [f"m{i}"]), helper.make_node("Add", [f"m{i}", x], [f"r{i}"]),
                  helper.make_node("LayerNormalization", [f"r{i}", f"g{i}", f"b{i}"], [f"n{i}"], axis=-1, epsilon=1e-5)]
        x = f"n{i}"
    nodes.append(helper.make_node("Identity", [x], ["y"]))
    graph = helper.make_graph(nodes, "stack", [vi("x", ["B", 8, width])], [vi("y", ["B", 8, width])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
