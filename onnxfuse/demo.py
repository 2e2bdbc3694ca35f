"""Sample models for ``onnxfuse demo``: the quick start after a wheel install, with no checkout.

Why built here, at run time, rather than shipped as files: a wheel carries no ``testdata/``, and a user
who has just run ``pip install onnxfuse-*.whl`` should be one command away from seeing what the tool
does. The models are small (under 400 KB together), built with ``onnx.helper`` from seeded weights (the
same bytes on every run and machine, so a user's report can be compared with the README's), and
written the way exporters write them, so the default rules have something to do:

* ``conv_block.onnx``: an image classifier's stem and one residual block. Conv → BatchNormalization →
  ReLU, twice, a third Conv+BN whose output is added to the block's input, ReLU, then global pooling and
  a Gemm classifier. BatchNormalization folds into the Conv weights, and each Conv's bias with the ReLU
  or residual Add after it becomes one FusedElementwise node.
* ``mlp_block.onnx``: a transformer's feed-forward half without attention, as torch exports it:
  LayerNorm decomposed into ReduceMean/Sub/Pow/Sqrt/Div, MatMul + bias, GELU as its erf formula,
  MatMul + bias, the residual Add, and a final LayerNorm after it. These become ONNX Runtime's fused
  LayerNormalization, BiasGelu and SkipLayerNormalization.

Both have a dynamic batch (and sequence) dimension, so validation runs at two sizes.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnxfuse.errors import ModelSaveError
from onnxfuse.atomic import OutputSet

#: Opset of the samples: 17 keeps ReduceMean's axes an attribute, as most exporters still write it.
OPSET = 17
#: The seed of every sample's weights.
SEED = 0
#: Where ``onnxfuse demo`` writes by default (relative to the current folder).
DEFAULT_DIR = "onnxfuse-demo"


class _Graph:
    """Nodes and seeded initializers of one sample graph."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        self.nodes: list = []
        self.inits: list = []

    def const(self, name: str, values) -> str:
        self.inits.append(numpy_helper.from_array(np.asarray(values, dtype=np.float32), name))
        return name

    def randn(self, name: str, shape, scale: float) -> str:
        return self.const(name, self.rng.standard_normal(shape) * scale)

    def node(self, op: str, inputs, output: str, **attrs) -> str:
        self.nodes.append(helper.make_node(op, list(inputs), [output], name=output, **attrs))
        return output

    def conv_bn(self, x: str, cin: int, cout: int, name: str) -> str:
        """3x3 Conv (padded) then BatchNormalization with non-trivial statistics, as a trained model has."""
        w = self.randn(f"{name}.weight", (cout, cin, 3, 3), (cin * 9) ** -0.5)
        b = self.randn(f"{name}.bias", (cout,), 0.1)
        y = self.node("Conv", [x, w, b], f"{name}_conv", pads=[1, 1, 1, 1])
        r = self.rng
        stats = [self.const(f"{name}.bn.gamma", r.uniform(0.5, 1.5, cout)),
                 self.const(f"{name}.bn.beta", r.standard_normal(cout) * 0.2),
                 self.const(f"{name}.bn.mean", r.standard_normal(cout) * 0.2),
                 self.const(f"{name}.bn.var", r.uniform(0.5, 2.0, cout))]
        return self.node("BatchNormalization", [y, *stats], f"{name}_bn", epsilon=1e-5)

    def layernorm(self, x: str, width: int, name: str) -> str:
        """LayerNorm over the last axis, decomposed as torch's exporter writes it."""
        mean = self.node("ReduceMean", [x], f"{name}_mean", axes=[-1])
        centered = self.node("Sub", [x, mean], f"{name}_centered")
        two = self.const(f"{name}.two", 2.0)
        square = self.node("Pow", [centered, two], f"{name}_square")
        var = self.node("ReduceMean", [square], f"{name}_var", axes=[-1])
        eps = self.const(f"{name}.eps", 1e-5)
        std = self.node("Sqrt", [self.node("Add", [var, eps], f"{name}_var_eps")], f"{name}_std")
        normed = self.node("Div", [centered, std], f"{name}_normed")
        gamma = self.const(f"{name}.gamma", self.rng.uniform(0.5, 1.5, width))
        beta = self.const(f"{name}.beta", self.rng.standard_normal(width) * 0.1)
        return self.node("Add", [self.node("Mul", [normed, gamma], f"{name}_scaled"), beta], f"{name}_out")

    def linear(self, x: str, cin: int, cout: int, name: str) -> str:
        w = self.randn(f"{name}.weight", (cin, cout), cin ** -0.5)
        b = self.randn(f"{name}.bias", (cout,), 0.02)
        return self.node("Add", [self.node("MatMul", [x, w], f"{name}_matmul"), b], f"{name}_out")

    def gelu(self, x: str, name: str) -> str:
        """GELU as its erf formula: x * 0.5 * (1 + erf(x / sqrt(2)))."""
        root2 = self.const(f"{name}.sqrt2", np.float32(np.sqrt(2.0)))
        one, half = self.const(f"{name}.one", 1.0), self.const(f"{name}.half", 0.5)
        erf = self.node("Erf", [self.node("Div", [x, root2], f"{name}_div")], f"{name}_erf")
        y = self.node("Mul", [x, self.node("Add", [erf, one], f"{name}_add")], f"{name}_mul")
        return self.node("Mul", [y, half], f"{name}_out")

    def model(self, name: str, inputs, outputs) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, name, inputs, outputs, self.inits)
        m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=8,
                              producer_name="onnxfuse-demo")
        onnx.checker.check_model(m, full_check=True)
        return m


def conv_block(seed: int = SEED) -> onnx.ModelProto:
    """The image sample (see the module docstring): input ``image`` [N, 3, 32, 32], output ``logits`` [N, 10]."""
    g = _Graph(seed)
    stem = g.node("Relu", [g.conv_bn("image", 3, 16, "stem")], "stem_relu")
    y = g.node("Relu", [g.conv_bn(stem, 16, 16, "block_a")], "block_a_relu")
    y = g.conv_bn(y, 16, 16, "block_b")
    y = g.node("Relu", [g.node("Add", [y, stem], "residual")], "block_relu")
    pooled = g.node("Flatten", [g.node("GlobalAveragePool", [y], "pool")], "flat")
    w = g.randn("head.weight", (10, 16), 0.25)
    b = g.randn("head.bias", (10,), 0.1)
    g.node("Gemm", [pooled, w, b], "logits", transB=1)
    return g.model("onnxfuse_demo_conv_block",
                   [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["batch", 3, 32, 32])],
                   [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 10])])


def mlp_block(seed: int = SEED, width: int = 64, hidden: int = 256) -> onnx.ModelProto:
    """The transformer-ish sample (see the module docstring): ``hidden_states`` [N, T, 64] in and out."""
    g = _Graph(seed + 1)
    x = "hidden_states"
    h = g.layernorm(x, width, "ln_in")
    h = g.gelu(g.linear(h, width, hidden, "fc1"), "gelu")
    h = g.linear(h, hidden, width, "fc2")
    residual = g.node("Add", [x, h], "residual")
    y = g.layernorm(residual, width, "ln_out")
    g.nodes.append(helper.make_node("Identity", [y], ["output"], name="output"))
    return g.model("onnxfuse_demo_mlp_block",
                   [helper.make_tensor_value_info(x, TensorProto.FLOAT, ["batch", "sequence", width])],
                   [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", "sequence", width])])


#: The samples ``onnxfuse demo`` writes: file name → builder.
SAMPLES = {"conv_block.onnx": conv_block, "mlp_block.onnx": mlp_block}
#: What each sample is, in the words ``onnxfuse demo`` prints.
DESCRIPTIONS = {
    "conv_block.onnx": "Conv+BatchNorm+ReLU residual block and a classifier",
    "mlp_block.onnx": "LayerNorm, MatMul+GELU MLP, residual (as torch exports)",
}


def next_commands(folder: str | os.PathLike = DEFAULT_DIR) -> list[tuple[str, list[str]]]:
    """The commands to try on the samples in ``folder``, as (what it does, its words), each word quoted
    for a POSIX shell so that the command can be pasted as printed."""
    def q(p) -> str:
        return shlex.quote(os.fspath(p))

    d = Path(folder)
    # the folder form first: once the one-model command has written conv_block.opt.onnx beside the
    # samples, the folder would hold it too
    return [
        ("optimize both into one folder, with one report",
         ["onnxfuse", "optimize", q(d), "--out-dir", q(d / "optimized"), "--json", q(d / "report.json")]),
        ("optimize one model (validated against the original; timed too, with a GPU)",
         ["onnxfuse", "optimize", q(d / "conv_block.onnx"), q(d / "conv_block.opt.onnx")]),
        ("see every rewrite and every candidate refused",
         ["onnxfuse", "optimize", q(d / "mlp_block.onnx"), q(d / "mlp_block.opt.onnx"), "--explain"]),
    ]


def write_samples(folder: str | os.PathLike = DEFAULT_DIR, force: bool = False) -> list[Path]:
    """Write every sample into ``folder`` (created if missing) and return their paths.

    A file of the same name that holds something else is refused (:class:`~onnxfuse.errors.ModelSaveError`,
    exit 1, one line naming it) unless ``force``: the folder may be the user's, and ``conv_block.onnx`` is
    a name a real model could have. The samples themselves (running the demo again) are simply kept.
    The files are written atomically, together."""
    out = Path(folder)
    if out.exists() and not out.is_dir():
        raise ModelSaveError(f"{out}: is not a folder; choose another place for the demo models")
    data = {out / name: build().SerializeToString() for name, build in SAMPLES.items()}
    if not force:
        for p, content in data.items():
            if p.exists() and (not p.is_file() or p.read_bytes() != content):
                raise ModelSaveError(f"{p}: already exists and is not the demo's; choose another folder or pass "
                                     "--force to replace it")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ModelSaveError(f"{out}: cannot create the folder ({exc.strerror})") from None
    with OutputSet() as files:
        for p, content in data.items():
            files.temp_for(p, "demo model").write_bytes(content)
        files.commit()
    return list(data)


__all__ = ["DEFAULT_DIR", "DESCRIPTIONS", "SAMPLES", "conv_block", "mlp_block", "next_commands", "write_samples"]
