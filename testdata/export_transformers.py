#!/usr/bin/env python3
"""Export a tiny BERT (random weights) to ONNX with GELU and LayerNorm left *decomposed*.

The committed model is made with (needs torch + transformers, e.g. /work/torchenv/bin/python):

    python testdata/export_transformers.py --out testdata/bert_tiny_opset14.onnx

BertConfig: 2 layers, hidden 64, 2 heads, intermediate 128, vocabulary 1000, 64 positions; eager
attention. Inputs ``input_ids`` and ``attention_mask`` (int64, dynamic batch and sequence axes); outputs
``last_hidden_state`` and ``pooler_output``. About 0.5 MB.

Why opset 14 and the legacy exporter (``dynamo=False``): below opset 17 there is no ONNX
LayerNormalization, so the TorchScript exporter writes every LayerNorm as
ReduceMean/Sub/Pow/ReduceMean/Add/Sqrt/Div/Mul/Add, and GELU (erf form) as Div(√2)/Erf/Add(1)/Mul/Mul(0.5):
exactly the patterns onnxfuse's contrib rules must recognise in the wild. LayerNorm γ/β are randomized
(seeded) because the defaults (1, 0) would hide a rule that dropped or swapped them. The script checks
the exported file still contains the decomposed forms.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

import onnx
import torch
from transformers import BertConfig, BertModel


def build(seed: int) -> BertModel:
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=1000,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
        max_position_embeddings=64,
        hidden_act="gelu",
        attn_implementation="eager",
    )
    model = BertModel(config, add_pooling_layer=True).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.LayerNorm):
                m.weight.copy_(torch.rand(m.weight.shape, generator=g) + 0.5)
                m.bias.copy_(torch.randn(m.bias.shape, generator=g) * 0.1)
    return model


class Wrapper(torch.nn.Module):
    def __init__(self, bert: BertModel):
        super().__init__()
        self.bert = bert

    def forward(self, input_ids, attention_mask):
        out = self.bert(input_ids=input_ids, attention_mask=attention_mask, return_dict=True)
        return out.last_hidden_state, out.pooler_output


def export(out: Path, opset: int, seed: int) -> None:
    model = Wrapper(build(seed)).eval()
    ids = torch.randint(0, 1000, (2, 8), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones(2, 8, dtype=torch.int64)
    torch.onnx.export(
        model,
        (ids, mask),
        str(out),
        input_names=["input_ids", "attention_mask"],
        output_names=["last_hidden_state", "pooler_output"],
        dynamic_axes={
            "input_ids": {0: "batch", 1: "sequence"},
            "attention_mask": {0: "batch", 1: "sequence"},
            "last_hidden_state": {0: "batch", 1: "sequence"},
            "pooler_output": {0: "batch"},
        },
        opset_version=opset,
        dynamo=False,
        do_constant_folding=True,
    )
    m = onnx.load(str(out))
    onnx.checker.check_model(m)
    ops = Counter(n.op_type for n in m.graph.node)
    if ops["Erf"] != 2 or ops["LayerNormalization"] != 0 or ops["ReduceMean"] != 2 * 5:
        sys.exit(f"unexpected export (GELU/LayerNorm not decomposed as expected): {dict(ops)}")
    print(f"wrote {out} ({out.stat().st_size / 1e6:.2f} MB, {len(m.graph.node)} nodes, opset {opset})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).with_name("bert_tiny_opset14.onnx"))
    ap.add_argument("--opset", type=int, default=14)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    export(args.out, args.opset, args.seed)


if __name__ == "__main__":
    main()
