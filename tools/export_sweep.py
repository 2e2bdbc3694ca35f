#!/usr/bin/env python3
"""Export tiny random-weight transformers models several ways and run onnxfuse.optimize on each (CPU).

Coverage, not timing: for each ``ARCH:EXPORTER:OPSET:ATTN[:fp16]`` case (exporter ``legacy`` =
TorchScript, ``dynamo`` = torch.onnx.export's default since torch 2.9; attention ``eager`` or ``sdpa``;
``fp16``: the model exported after ``.half()``, float inputs too) one JSON line:
nodes before and after, Softmax before and after, the attention ops written, validation's verdict, or
the export's / optimizer's error. Needs torch and transformers (test data only, never onnxfuse's
dependencies); the dynamo exporter needs onnxscript. docs/benchmarks.md 5.13 quotes a run.

    python tools/export_sweep.py                      # every architecture, three ways
    python tools/export_sweep.py bert:dynamo:18:sdpa gpt2:dynamo:18:sdpa llama:dynamo:18:sdpa:fp16
"""

import argparse
import collections
import contextlib
import json
import os
import sys
import time
import warnings

warnings.filterwarnings("ignore")
import torch  # noqa: E402
from transformers import AutoConfig, AutoModel  # noqa: E402

import onnx  # noqa: E402

OUT = "/tmp/export-sweep"

TEXT = dict(vocab_size=500, max_position_embeddings=64)


def txt(mt, **kw):
    base = dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        **TEXT,
    )
    base.update(kw)
    return (mt, base, "text")


ARCHS = {
    "bert": txt("bert"),
    "roberta": txt("roberta"),
    "xlm-roberta": txt("xlm-roberta"),
    "electra": txt("electra", embedding_size=32),
    "albert": txt("albert", embedding_size=32),
    "distilbert": (
        "distilbert",
        dict(dim=64, n_layers=2, n_heads=4, hidden_dim=128, **TEXT),
        "text",
    ),
    "mpnet": txt("mpnet"),
    "deberta-v2": txt("deberta-v2"),
    "camembert": txt("camembert"),
    "gpt2": (
        "gpt2",
        dict(n_embd=64, n_layer=2, n_head=4, vocab_size=500, n_positions=64),
        "causal",
    ),
    "gpt_neo": (
        "gpt_neo",
        dict(
            hidden_size=64,
            num_layers=2,
            num_heads=4,
            attention_types=[[["global", "local"], 1]],
            window_size=16,
            vocab_size=500,
            max_position_embeddings=64,
        ),
        "causal",
    ),
    "opt": (
        "opt",
        dict(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            ffn_dim=128,
            word_embed_proj_dim=64,
            vocab_size=500,
            max_position_embeddings=64,
        ),
        "causal",
    ),
    "llama": (
        "llama",
        dict(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=128,
            vocab_size=500,
            max_position_embeddings=64,
        ),
        "causal",
    ),
    "qwen2": (
        "qwen2",
        dict(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=128,
            vocab_size=500,
            max_position_embeddings=64,
        ),
        "causal",
    ),
    "mistral": (
        "mistral",
        dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128, vocab_size=500, max_position_embeddings=64, sliding_window=None),
        "causal",
    ),
    "qwen3": (
        "qwen3",
        dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             intermediate_size=128, vocab_size=500, max_position_embeddings=64),
        "causal",
    ),
    "phi3": (
        "phi3",
        dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
             intermediate_size=128, vocab_size=500, max_position_embeddings=64, pad_token_id=0),
        "causal",
    ),
    "gemma": (
        "gemma",
        dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
             intermediate_size=128, vocab_size=500, max_position_embeddings=64),
        "causal",
    ),
    "bloom": (
        "bloom",
        dict(hidden_size=64, n_layer=2, n_head=4, vocab_size=500),
        "causal",
    ),
    "vit": (
        "vit",
        dict(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=128,
            image_size=32,
            patch_size=8,
        ),
        "image",
    ),
    "deit": (
        "deit",
        dict(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=128,
            image_size=32,
            patch_size=8,
        ),
        "image",
    ),
    "clip_vision_model": (
        "clip_vision_model",
        dict(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=128,
            image_size=32,
            patch_size=8,
        ),
        "image",
    ),
    "clip_text_model": (
        "clip_text_model",
        dict(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=128,
            vocab_size=500,
            max_position_embeddings=64,
        ),
        "text",
    ),
    "whisper": (
        "whisper",
        dict(
            d_model=64,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=128,
            decoder_ffn_dim=128,
            num_mel_bins=16,
            max_source_positions=16,
            max_target_positions=16,
            vocab_size=500,
            pad_token_id=1,
            bos_token_id=2,
            eos_token_id=2,
            decoder_start_token_id=2,
        ),
        "audio",
    ),
    "t5": (
        "t5",
        dict(d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, vocab_size=500),
        "encoder",
    ),
    "bart": (
        "bart",
        dict(
            d_model=64,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=128,
            decoder_ffn_dim=128,
            vocab_size=500,
            max_position_embeddings=64,
        ),
        "encoder",
    ),
    "resnet": ("resnet", dict(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], layer_type="bottleneck"), "image"),
    "convnext": ("convnext", dict(num_stages=2, hidden_sizes=[16, 32], depths=[1, 1], image_size=32), "image"),
    "mobilenet_v2": ("mobilenet_v2", dict(image_size=32, depth_multiplier=0.35), "image"),
    "swin": ("swin", dict(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=4), "image"),
    "segformer": ("segformer", dict(num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[16, 32], num_attention_heads=[1, 2], image_size=32), "image"),
    "wav2vec2": (
        "wav2vec2",
        dict(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=128,
            conv_dim=(32, 32),
            conv_stride=(5, 2),
            conv_kernel=(10, 3),
            num_conv_pos_embeddings=16,
            num_conv_pos_embedding_groups=4,
        ),
        "wave",
    ),
}


class Wrap(torch.nn.Module):
    def __init__(s, m, kind):
        super().__init__()
        s.m, s.kind = m, kind

    def forward(s, x, y=None):
        a = (x, y)
        k = s.kind
        if k in ("text", "causal"):
            return s.m(
                input_ids=a[0],
                attention_mask=a[1],
                **({"use_cache": False} if k == "causal" else {}),
            ).last_hidden_state
        if k == "image":
            return s.m(pixel_values=a[0]).last_hidden_state
        if k == "audio":
            return s.m.encoder(input_features=a[0]).last_hidden_state
        if k == "encoder":
            return s.m.get_encoder()(
                input_ids=a[0], attention_mask=a[1]
            ).last_hidden_state
        if k == "wave":
            return s.m(input_values=a[0]).last_hidden_state


def export(name, exporter, opset, attn, path, half=False):
    mt, cfg, kind = ARCHS[name]
    torch.manual_seed(0)
    config = AutoConfig.for_model(mt, **cfg)
    try:
        config._attn_implementation = attn
    except Exception:
        pass
    try:
        model = AutoModel.from_config(config, attn_implementation=attn).eval()
    except ValueError:  # a model without that attention implementation (CNNs, Swin, ...): eager
        config._attn_implementation = "eager"
        model = AutoModel.from_config(config).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(
                    torch.randn(p.shape, generator=g) * 0.1
                    + (1.0 if "norm" in n.lower() and "weight" in n else 0.0)
                )
    if kind in ("text", "causal", "encoder"):
        ids = torch.randint(0, 500, (2, 12))
        mask = torch.ones(2, 12, dtype=torch.int64)
        mask[1, 9:] = 0
        args, names, dyn = (
            (ids, mask),
            ["input_ids", "attention_mask"],
            {
                "input_ids": {0: "batch", 1: "sequence"},
                "attention_mask": {0: "batch", 1: "sequence"},
            },
        )
    elif kind == "image":
        args, names, dyn = (
            (torch.randn(2, 3, 32, 32),),
            ["pixel_values"],
            {"pixel_values": {0: "batch"}},
        )
    elif kind == "audio":
        args, names, dyn = (
            (torch.randn(2, 16, 32),),
            ["input_features"],
            {"input_features": {0: "batch"}},
        )
    else:
        args, names, dyn = (
            (torch.randn(2, 400),),
            ["input_values"],
            {"input_values": {0: "batch", 1: "samples"}},
        )
    w = Wrap(model, kind).eval()
    if half:
        w = w.half()
        args = tuple(a.half() if a.is_floating_point() else a for a in args)
    if exporter == "legacy":
        torch.onnx.export(
            w,
            args,
            path,
            dynamo=False,
            opset_version=opset,
            input_names=names,
            output_names=["out"],
            dynamic_axes=dyn,
            do_constant_folding=True,
        )
    else:
        dshapes = tuple({a: torch.export.Dim.AUTO for a in d} for d in dyn.values())
        torch.onnx.export(
            w,
            args,
            path,
            dynamo=True,
            opset_version=opset,
            input_names=names,
            output_names=["out"],
            dynamic_shapes=dshapes,
        )


def run(case):
    name, exporter, opset, attn, *dtype = case.split(":")
    path = os.path.join(OUT, f"{case.replace(':', '_')}.onnx")
    os.makedirs(OUT, exist_ok=True)
    rec = {"case": case}
    t = time.time()
    try:
        export(name, exporter, int(opset), attn, path, half=dtype == ["fp16"])
    except Exception as e:
        rec["export_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        return rec
    rec["export_s"] = round(time.time() - t, 1)
    import onnxfuse

    m = onnx.load(path)
    rec["nodes_in"] = len(m.graph.node)
    rec["softmax_in"] = sum(n.op_type == "Softmax" for n in m.graph.node)
    t = time.time()
    try:
        shapes = {
            i.name: [2, 12] if i.name in ("input_ids", "attention_mask") else None
            for i in m.graph.input
        }
        shapes = {k: v for k, v in shapes.items() if v}
        r = onnxfuse.optimize(path, provider="cpu", shapes=shapes)
        out = r.model
        rec["nodes_out"] = len(out.graph.node)
        c = collections.Counter(n.op_type for n in out.graph.node)
        rec["softmax_out"] = c.get("Softmax", 0)
        rec["attn_ops"] = {k: v for k, v in c.items() if "Attention" in k}
        rec["validation"] = str(getattr(r, "validation", None))[:300]
        rec["ok"] = True
    except Exception as e:
        rec["error"] = f"{type(e).__name__}: {str(e)[:400]}"
    rec["opt_s"] = round(time.time() - t, 1)
    return rec


def main() -> None:
    global OUT
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "cases",
        nargs="*",
        help="ARCH:EXPORTER:OPSET:ATTN[:fp16] (default: every arch, three ways)",
    )
    ap.add_argument(
        "--out", default="/tmp/export-sweep", help="folder for the exported models"
    )
    args = ap.parse_args()
    OUT = args.out
    cases = args.cases or [
        f"{a}:{v}"
        for a in ARCHS
        for v in ("legacy:14:eager", "legacy:17:sdpa", "dynamo:18:sdpa")
    ]
    for case in cases:
        with contextlib.redirect_stdout(
            sys.stderr
        ):  # the dynamo exporter prints its progress
            rec = run(case)
        print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
