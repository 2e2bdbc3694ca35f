#!/usr/bin/env python3
"""Where does BERT-base float32 lose to ONNX Runtime's transformers optimizer? Variants of our graph.

Exports BERT-base (benchmarks/zoo.py's spec, the installed transformers), rewrites it with the default
rules, runs the ORT transformers optimizer (tx-opt), and builds hand-edited variants of our graph:
``+MatMul`` (every ``FusedMatMul(x, W, transB=1)`` as ``MatMul(x, Wᵀ)``), ``+simple-bias`` (the mask
prologue replaced by four nodes from ``attention_mask``), ``+mask_index`` (the mask as ``Attention``'s
raw 2-D ``mask_index`` with ``mask_filter_value`` = finfo.min). Each is checked on ``DEV`` against the
original with a mask that has a hole and right padding, then all are timed interleaved (IOBinding,
ORT_ENABLE_ALL) at batch 1 and 16. An exploration tool: the variants are graph edits made here, not
rules; what it showed became rules (contrib-attention's mask_index, fold-weight-transpose), so with
the rules since 23d44b8 ``ours`` already is ``+MatMul+mask_index``; docs/benchmarks.md 5.7 was taken at
de4eb88, before both.

Usage (repo root, onnxruntime-gpu, torch and transformers importable; DEV=cpu for a dry run)::

    OUT=/tmp/variants python benchmarks/bert_variants.py

Writes ``log.txt`` and ``res.json`` under ``$OUT``. Never imported by the package.
"""
import copy
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper, TensorProto
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import zoo
from onnxfuse.pipeline import rewrite_model
from onnxfuse.rewrites import select_rules
from onnxfuse.runtime.inputs import Inputs
from onnxfuse.runtime.session import run_model
from onnxfuse.timing import BenchConfig, time_models
import onnx_graphsurgeon as gs

DEV = os.environ.get("DEV", "cuda")
OUT = Path(os.environ.get("OUT", "/tmp/expout"))
OUT.mkdir(parents=True, exist_ok=True)
work = Path("/tmp/e"); work.mkdir(exist_ok=True)
log = open(OUT / "log.txt", "a")
def say(*a):
    s = " ".join(str(x) for x in a); print(s, flush=True); log.write(s + "\n"); log.flush()

spec = zoo.SPECS["bert_base"]
src = work / "bert.onnx"
if not src.exists():
    say("export", zoo.export(spec, zoo.build_module(spec), src, 14))
orig = onnx.load(str(src))
t0 = time.time()
ours, _ = rewrite_model(orig, select_rules("cuda"))
say("rewrite", round(time.time() - t0, 1), "s nodes", len(ours.graph.node))
from onnxruntime.transformers.optimizer import optimize_model as txo
tx = txo(str(src), model_type="bert", num_heads=12, hidden_size=768, use_gpu=DEV == "cuda")
tx.save_model_to_file(str(work / "tx.onnx")); tx = onnx.load(str(work / "tx.onnx"))
say("tx nodes", len(tx.graph.node))

def untranspose(m):
    m = copy.deepcopy(m)
    inits = {i.name: i for i in m.graph.initializer}
    n_done = 0
    for n in m.graph.node:
        if n.op_type == "FusedMatMul" and n.input[1] in inits:
            at = {a.name: helper.get_attribute_value(a) for a in n.attribute}
            if at.get("transB") == 1 and not at.get("transA") and at.get("alpha", 1.0) == 1.0:
                w = numpy_helper.to_array(inits[n.input[1]])
                inits[n.input[1]].CopyFrom(numpy_helper.from_array(np.ascontiguousarray(w.T), n.input[1]))
                n.op_type = "MatMul"; n.domain = ""; del n.attribute[:]; n_done += 1
    say("untransposed", n_done)
    return m

def clean(m):
    g = gs.import_onnx(m); g.cleanup().toposort(); return gs.export_onnx(g)

def with_mask_index(m):
    m = copy.deepcopy(m)
    nodes = [helper.make_node("Cast", ["attention_mask"], ["mi_bool"], to=TensorProto.BOOL),
             helper.make_node("Cast", ["mi_bool"], ["mask_index_2d"], to=TensorProto.INT32)]
    for n in m.graph.node:
        if n.op_type == "Attention" and len(n.input) == 6:
            n.input[3] = "mask_index_2d"; del n.input[4:]
            n.attribute.append(helper.make_attribute("mask_filter_value", float(np.finfo(np.float32).min)))
    old = list(m.graph.node); del m.graph.node[:]; m.graph.node.extend(nodes + old)
    return clean(m)

def simple_bias(m):
    m = copy.deepcopy(m)
    mn = float(np.finfo(np.float32).min)
    m.graph.initializer.extend([numpy_helper.from_array(np.array(0, np.float32), "sb_zero"),
                                numpy_helper.from_array(np.array(mn, np.float32), "sb_min"),
                                numpy_helper.from_array(np.array([1, 1, 128, 128], np.int64), "sb_shape"),
                                numpy_helper.from_array(np.array([1, 2], np.int64), "sb_axes")])
    nodes = [helper.make_node("Cast", ["attention_mask"], ["sb_bool"], to=TensorProto.BOOL),
             helper.make_node("Unsqueeze", ["sb_bool", "sb_axes"], ["sb_u"]),
             helper.make_node("Where", ["sb_u", "sb_zero", "sb_min"], ["sb_w"]),
             helper.make_node("Expand", ["sb_w", "sb_shape"], ["sb_bias"])]
    for n in m.graph.node:
        if n.op_type == "Attention" and len(n.input) == 6:
            n.input[5] = "sb_bias"
    old = list(m.graph.node); del m.graph.node[:]; m.graph.node.extend(nodes + old)
    return clean(m)

B = untranspose(ours)
variants = [("tx", tx), ("ours", ours), ("ours+MatMul", B), ("ours+MatMul+simple-bias", simple_bias(B)),
            ("ours+MatMul+mask_index", with_mask_index(B)), ("ours+mask_index", with_mask_index(ours))]
for name, m in variants:
    say(name, len(m.graph.node))

def feeds(b, holes):
    rng = np.random.default_rng(b)
    mask = np.ones((b, 128), np.int64)
    if holes:
        mask[:, 100:] = 0; mask[0, 3] = 0
    return {"input_ids": rng.integers(0, 30522, (b, 128)).astype(np.int64), "attention_mask": mask}

ref = run_model(orig, Inputs(feeds=feeds(2, True)), DEV, name="orig")["output"]
for name, m in variants:
    try:
        got = run_model(m, Inputs(feeds=feeds(2, True)), DEV, name=name)["output"]
        say("check", name, float(np.max(np.abs(got - ref))))
    except Exception as e:
        say("check", name, "ERROR", str(e)[:300])

res = {}
for b in (1, 16):
    cfg = BenchConfig(device=DEV, warmup=10, time_budget_s=float(os.environ.get("TB", "1.0")), min_iterations=int(os.environ.get("MI", "20")), sessions=int(os.environ.get("SE", "3")))
    models = [("original", orig, Inputs(feeds=feeds(b, False)))] + [(n, m, Inputs(feeds=feeds(b, False))) for n, m in variants]
    r = time_models(models, cfg, rounds=3)
    res[b] = {x.name: x.stats.median_ms for x in r}
    say("batch", b, json.dumps({k: round(v, 4) for k, v in res[b].items()}))
(OUT / "res.json").write_text(json.dumps(res, indent=1))
