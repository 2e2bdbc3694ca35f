#!/usr/bin/env python3
"""Would a GroupNorm rule pay? Diffusion-UNet GroupNorm (+ SiLU) as exported, against ONNX Runtime's op.

Issue 30 asks for GroupNorm "where ONNX Runtime's CUDA provider has the op and it is measured faster".
torch's legacy exporter writes ``nn.GroupNorm`` (opset < 18) as ``Reshape(x, [N, G, -1])`` →
``InstanceNormalization`` (scale 1, bias 0) → ``Reshape`` back → ``Mul(γ[C,1,1])`` → ``Add(β[C,1,1])``,
and a UNet's resnet block follows it with SiLU (``x·Sigmoid(x)``). ONNX Runtime's com.microsoft
``GroupNorm`` (the op its transformers optimizer writes for Stable Diffusion) takes NHWC input
(``channels_last``), γ, β, ``groups`` and an optional SiLU (``activation=1``). Variants, each on the same
NCHW input and NCHW output as the model has:

* ``original``: the exported form above, with SiLU;
* ``onnxfuse``: ``original`` rewritten by the default rules (today: the affine + SiLU tail in one
  FusedElementwise after the InstanceNormalization);
* ``groupnorm-nhwc``: ``Transpose`` to NHWC → ``GroupNorm(channels_last=1, activation=1)`` → ``Transpose``
  back: what a rule would write in an NCHW model;
* ``groupnorm-nchw``: ``GroupNorm(channels_last=0, activation=1)`` on the NCHW tensor (recorded as an
  error where the CUDA kernel does not take it);
* ``groupnorm-only``: ``GroupNorm`` on an NHWC tensor without the transposes (the floor: what it would
  cost inside a channels-last region, issue 34), timed but not compared.

Shapes: Stable Diffusion 1.5's UNet GroupNorms (32 groups): C 320 at 64×64, 640 at 32×32, 1280 at 16×16;
float32 and float16. Every variant is checked against ``original`` on the device first (float32 1e-3,
float16 2e-2), then all are timed interleaved under ORT_ENABLE_ALL with IOBinding.

Usage (repo root, onnxruntime-gpu importable)::

    python benchmarks/group_norm.py --out /tmp/group_norm [--batches 1,8] [--time-budget 0.3]

Writes ``group_norm.json`` and ``group_norm.md`` under ``--out``. Never imported by the package.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from onnx import TensorProto, helper, numpy_helper

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from micro import parse_args, time_variants, variant_cells, write_results  # noqa: E402

from onnxfuse.pipeline import rewrite_model  # noqa: E402
from onnxfuse.rewrites import select_rules  # noqa: E402
from onnxfuse.runtime.inputs import Inputs  # noqa: E402
from onnxfuse.runtime.session import run_model  # noqa: E402

G, EPS = 32, 1e-5
SHAPES = [(320, 64), (640, 32), (1280, 16)]  # (channels, height = width)
MS = "com.microsoft"


def _elem(dtype):
    return TensorProto.FLOAT16 if dtype == np.float16 else TensorProto.FLOAT


def _params(c, dtype):
    rng = np.random.default_rng(c)
    return (rng.random(c) + 0.5).astype(dtype), (rng.standard_normal(c) * 0.1).astype(dtype)


def _model(nodes, inits, c, hw, dtype, name, layout="nchw"):
    shape = ["B", c, hw, hw] if layout == "nchw" else ["B", hw, hw, c]
    x = helper.make_tensor_value_info("x", _elem(dtype), shape)
    y = helper.make_tensor_value_info("y", _elem(dtype), shape)
    graph = helper.make_graph(nodes, name, [x], [y], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(MS, 1)])
    model.ir_version = 8
    return model


def original(c, hw, dtype):
    gamma, beta = _params(c, dtype)
    inits = [numpy_helper.from_array(np.array([0, G, -1], np.int64), "groups_shape"),
             numpy_helper.from_array(np.ones(G, dtype), "ones"), numpy_helper.from_array(np.zeros(G, dtype), "zeros"),
             numpy_helper.from_array(gamma.reshape(c, 1, 1), "gamma"),
             numpy_helper.from_array(beta.reshape(c, 1, 1), "beta")]
    nodes = [helper.make_node("Reshape", ["x", "groups_shape"], ["g"]),
             helper.make_node("InstanceNormalization", ["g", "ones", "zeros"], ["n"], epsilon=EPS),
             helper.make_node("Shape", ["x"], ["xs"]),
             helper.make_node("Reshape", ["n", "xs"], ["n4"]),
             helper.make_node("Mul", ["n4", "gamma"], ["a"]),
             helper.make_node("Add", ["a", "beta"], ["b"]),
             helper.make_node("Sigmoid", ["b"], ["sb"]),
             helper.make_node("Mul", ["b", "sb"], ["y"])]
    return _model(nodes, inits, c, hw, dtype, "groupnorm-original")


def _group_norm_node(inp, out, channels_last):
    return helper.make_node("GroupNorm", [inp, "gamma", "beta"], [out], domain=MS, activation=1,
                            channels_last=channels_last, epsilon=EPS, groups=G)


def group_norm(c, hw, dtype, layout):
    gamma, beta = _params(c, dtype)  # the op takes γ and β in float32 whatever X is (its CUDA kernel says so)
    inits = [numpy_helper.from_array(gamma.astype(np.float32), "gamma"),
             numpy_helper.from_array(beta.astype(np.float32), "beta")]
    if layout == "nhwc":
        nodes = [helper.make_node("Transpose", ["x"], ["xt"], perm=[0, 2, 3, 1]), _group_norm_node("xt", "yt", 1),
                 helper.make_node("Transpose", ["yt"], ["y"], perm=[0, 3, 1, 2])]
        return _model(nodes, inits, c, hw, dtype, "groupnorm-nhwc")
    if layout == "nchw":
        return _model([_group_norm_node("x", "y", 0)], inits, c, hw, dtype, "groupnorm-nchw")
    return _model([_group_norm_node("x", "y", 1)], inits, c, hw, dtype, "groupnorm-only", layout="nhwc")


def variants(c, hw, dtype) -> list[tuple[str, object, bool]]:
    """(label, model, compared with the original)."""
    orig = original(c, hw, dtype)
    fused, _ = rewrite_model(orig, select_rules("cuda"))
    return [("original", orig, True), ("onnxfuse", fused, True),
            ("groupnorm-nhwc", group_norm(c, hw, dtype, "nhwc"), True),
            ("groupnorm-nchw", group_norm(c, hw, dtype, "nchw"), True),
            ("groupnorm-only", group_norm(c, hw, dtype, "only"), False)]


def feeds(batch, c, hw, dtype, layout="nchw"):
    x = np.random.default_rng(batch + c).standard_normal((batch, c, hw, hw)).astype(dtype)
    return {"x": x if layout == "nchw" else np.ascontiguousarray(x.transpose(0, 2, 3, 1))}


LABELS = ["original", "onnxfuse", "groupnorm-nhwc", "groupnorm-nchw", "groupnorm-only"]


def main(argv=None) -> int:
    args, out, batches = parse_args(__doc__, time_budget=0.3, argv=argv, batches="1,8")
    rows = []
    for dtype, tol in ((np.float32, 1e-3), (np.float16, 2e-2)):
        for c, hw in SHAPES:
            vs = variants(c, hw, dtype)
            for batch in batches:
                inputs = {label: Inputs(feeds=feeds(batch, c, hw, dtype, "nchw" if compared else "nhwc"))
                          for label, _, compared in vs}
                ref = run_model(vs[0][1], inputs["original"], args.device, name="original")["y"]
                checks = {}
                for label, model, compared in vs[1:]:
                    try:
                        got = run_model(model, inputs[label], args.device, name=label)["y"]
                        if compared:
                            err = float(np.max(np.abs(got.astype(np.float64) - ref.astype(np.float64))))
                            checks[label] = {"max_abs": err, "ok": bool(err <= tol)}
                    except Exception as exc:  # a kernel this ONNX Runtime does not have: recorded
                        checks[label] = {"error": " ".join(str(exc).split())[:300]}
                runnable = [(label, m, inputs[label]) for label, m, _ in vs if "error" not in checks.get(label, {})]
                rows.append(time_variants(runnable, args, checks, dtype=np.dtype(dtype).name, channels=c, hw=hw,
                                          batch=batch))
    md = ["| dtype | C × H × W | batch | " + " | ".join(LABELS) + " |", "|---|---|---:|" + "---:|" * len(LABELS)]
    for r in rows:
        md.append(f"| {r['dtype']} | {r['channels']} × {r['hw']} × {r['hw']} | {r['batch']} | "
                  + " | ".join(variant_cells(r, LABELS)) + " |")
    write_results(out, "group_norm", rows, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
