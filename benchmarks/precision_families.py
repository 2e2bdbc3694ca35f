#!/usr/bin/env python3
"""Issue 33's first done-when, the part a CPU can check: ``onnxfuse optimize --precision fp16`` exits 0 on
each family the issue names, and the optimized model's drift from the float32 original, measured here
(outside optimize's own judge), stays within float16's default budget: normalized max error
(max |got - ref| / max |ref|, per output) at most 2e-2 and cosine at least 0.999, on a full and a padded
sample. (The GPU half of that done-when, latency against the ``.half()`` export, is
``benchmarks/probes/precision_cells.py`` and the zoo's ``--fp16`` columns.)

Families: BERT-base with its pooler, RoBERTa-base, DistilBERT, GPT-2 small, the Whisper-base encoder and a
float32 Llama-family decoder (GQA, rotary, RMSNorm; 8 layers of 1024, so that a CPU can validate it), each
exported with eager and with sdpa attention; ViT-B/16, ResNet-50, ConvNeXt-T and the zoo's YOLO-style
detector. Random weights (seeded), torch's TorchScript exporter at opset 14 with constant folding off, as
the zoo exports (``benchmarks/zoo.py``, whose builders this reuses); torch, torchvision and transformers
make the models, never onnxfuse.

Each model goes through the CLI a user runs, ``python -m onnxfuse optimize M.onnx OUT.onnx --precision fp16
--no-bench --provider cpu --json R.json`` (validation on ONNX Runtime's CPU provider), then both models
run here on the CPU provider, graph optimizations off, on batch 2 × 128 tokens (the padded sample masks
the second row's last 48) or two random images / spectrograms.

    python benchmarks/precision_families.py --out /tmp/families            # every family
    python benchmarks/precision_families.py --models bert_pooler@sdpa,llama@eager --out /tmp/families

Writes ``families.json`` (rewritten after every model) and ``families.md`` in --out.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

SEQ = 128
#: float16's default drift budget (onnxfuse/validate/drift_budget.py), restated: this script checks it
BUDGET_ERROR, BUDGET_COSINE = 2e-2, 0.999


def _hf_encoder(kind: str, attn: str):
    """transformers encoders with random weights: BERT-base with its pooler (two outputs), RoBERTa-base,
    DistilBERT-base."""
    import torch
    import transformers

    cfg = {"bert_pooler": transformers.BertConfig, "roberta": transformers.RobertaConfig,
           "distilbert": transformers.DistilBertConfig}[kind]()
    cfg._attn_implementation = attn  # (the models' own attn_implementation argument is newer than some releases)
    if kind == "bert_pooler":
        model = transformers.BertModel(cfg, add_pooling_layer=True)
    elif kind == "roberta":
        model = transformers.RobertaModel(cfg, add_pooling_layer=False)
    else:
        model = transformers.DistilBertModel(cfg)

    class Encoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask):
            out = self.model(input_ids=input_ids, attention_mask=attention_mask)
            if kind == "bert_pooler":
                return out.last_hidden_state, out.pooler_output
            return out.last_hidden_state

    return Encoder()


def _llama(attn: str):
    """A float32 Llama-family decoder without a cache: grouped key/value heads (16 query heads on 4), rotary
    embeddings, RMSNorm, SwiGLU; 8 layers of 1024 (TinyLlama's form at a size a CPU validates in minutes).
    The causal and padding mask goes in as one additive [B, 1, S, S] tensor, as the zoo's GPT-2 does
    (``zoo.causal_padding_bias``)."""
    import torch
    import transformers
    import zoo

    cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                                   num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=2048,
                                   use_cache=False)
    cfg._attn_implementation = attn
    model = transformers.LlamaModel(cfg)

    class Decoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask):
            bias = zoo.causal_padding_bias(input_ids, attention_mask)
            return self.model(input_ids=input_ids, attention_mask=bias, use_cache=False).last_hidden_state

    return Decoder()


def families() -> dict:
    """name -> (build(), input kind, output names). Input kinds: tokens, image224, image640, audio."""
    import zoo

    out = {}
    for attn in ("eager", "sdpa"):
        for kind in ("bert_pooler", "roberta", "distilbert"):
            outputs = ["last_hidden_state", "pooler_output"] if kind == "bert_pooler" else ["output"]
            out[f"{kind}@{attn}"] = (lambda k=kind, a=attn: _hf_encoder(k, a), "tokens", outputs)
        out[f"gpt2_small@{attn}"] = (lambda a=attn: zoo._gpt2(a), "tokens", ["output"])
        out[f"whisper_base_encoder@{attn}"] = (lambda a=attn: zoo._whisper_encoder(a), "audio", ["output"])
        out[f"llama@{attn}"] = (lambda a=attn: _llama(a), "tokens", ["output"])
    for name, kind in (("vit_b_16", "image224"), ("resnet50", "image224"), ("convnext_tiny", "image224"),
                       ("yolo_silu", "image640")):
        # (zoo.build_module: seeded, BatchNorm statistics made non-trivial, and no all-zero parameter, such as
        # torchvision ViT's zeroed classifier, which would make the output all zeros)
        out[name] = (lambda n=name: zoo.build_module(zoo.SPECS[n]), kind, ["output"])
    return out


def samples(kind: str) -> tuple[list[str], list[dict]]:
    """Input names and two samples (batch 2): tokens full and padded; images or spectrograms, two seeds."""
    rng = np.random.default_rng(0)
    if kind == "tokens":
        ids = rng.integers(0, 30000, size=(2, SEQ), dtype=np.int64)
        full = np.ones((2, SEQ), dtype=np.int64)
        padded = full.copy()
        padded[1, SEQ - 48:] = 0
        return ["input_ids", "attention_mask"], [{"input_ids": ids, "attention_mask": full},
                                                 {"input_ids": ids, "attention_mask": padded}]
    shape = {"image224": (2, 3, 224, 224), "image640": (2, 3, 640, 640), "audio": (2, 80, 3000)}[kind]
    name = "input_features" if kind == "audio" else "input"
    return [name], [{name: rng.standard_normal(shape, dtype=np.float32)} for _ in range(2)]


def export(module, path: Path, input_names: list[str], output_names: list[str], example: dict) -> None:
    import torch
    import warnings

    torch.manual_seed(0)
    torch.backends.mha.set_fastpath_enabled(False)  # nn.MultiheadAttention's fused path has no ONNX export (ViT)
    args = tuple(torch.from_numpy(example[n][:1]) for n in input_names)
    axes = {n: {0: "batch"} for n in input_names + output_names}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module.eval(), args, str(path), dynamo=False, opset_version=14, do_constant_folding=False,
                          input_names=input_names, output_names=output_names, dynamic_axes=axes)


def drift(ref: np.ndarray, got: np.ndarray) -> tuple[float, float]:
    """(normalized max error, cosine) of ``got`` against ``ref``, both in float64."""
    r, g = ref.astype(np.float64).ravel(), got.astype(np.float64).ravel()
    scale = float(np.max(np.abs(r))) or 1.0
    norms = np.linalg.norm(r) * np.linalg.norm(g)
    cos = float(r @ g / norms) if norms else float(np.array_equal(r, g))  # two zero vectors agree
    return float(np.max(np.abs(g - r))) / scale, cos


def check(name: str, build, kind: str, output_names: list[str], work: Path, log) -> dict:
    import onnx
    import torch

    from onnxfuse.runtime.session import run_samples

    torch.manual_seed(0)
    inputs, feeds = samples(kind)
    src, dst, report = work / f"{name}.onnx", work / f"{name}.fp16.onnx", work / f"{name}.json"
    t0 = time.perf_counter()
    export(build(), src, inputs, output_names, feeds[0])
    row = {"export_s": round(time.perf_counter() - t0, 1)}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "onnxfuse", "optimize", str(src), str(dst), "--precision", "fp16",
                           "--no-bench", "--provider", "cpu", "-q", "--json", str(report)],
                          capture_output=True, text=True)
    row.update(exit=proc.returncode, optimize_s=round(time.perf_counter() - t0, 1))
    if proc.returncode:
        row["message"] = (proc.stdout + proc.stderr).strip()[-600:]
        log(f"{name}: exit {proc.returncode}: {row['message'][-200:]}")
        return row
    result = json.loads(report.read_text())["result"]
    row.update(nodes=result["nodes"], fused={k: v for k, v in result["ops_after"].items() if "::" in k},
               float32_nodes=len((result.get("precision") or {}).get("float32_nodes") or {}))
    original, optimized = onnx.load(str(src)), onnx.load(str(dst))
    refs = run_samples(original, feeds, "cpu", name="float32 original")
    gots = run_samples(optimized, feeds, "cpu", name="optimized")
    worst = {}
    for sample, (ref, got) in enumerate(zip(refs, gots)):
        for out in ref:
            err, cos = drift(ref[out], got[out])
            w = worst.setdefault(out, {"error": 0.0, "cosine": 1.0})
            w["error"], w["cosine"] = max(w["error"], err), min(w["cosine"], cos)
    row["drift"] = worst
    row["within_budget"] = all(w["error"] <= BUDGET_ERROR and w["cosine"] >= BUDGET_COSINE for w in worst.values())
    log(f"{name}: exit 0 in {row['optimize_s']} s, {result['nodes']['before']} -> {result['nodes']['after']} nodes, "
        + ", ".join(f"{o} {w['error']:.2e} / {w['cosine']:.6f}" for o, w in worst.items())
        + ("" if row["within_budget"] else "  BEYOND THE BUDGET"))
    return row


def markdown(record: dict) -> str:
    rows = ["| model | exit | nodes | float32 nodes | fused ops | output | normalized max error | cosine | "
            "within 2e-2, 0.999 |", "|---|---:|---|---:|---|---|---:|---:|:---:|"]
    for name, row in record.items():
        if row.get("exit") != 0:
            msg = (row.get("message") or row.get("error") or "").splitlines()[-1:] or [""]
            rows.append(f"| {name} | {row.get('exit', '–')} | | | | {msg[0][:80]} | | | no |")
            continue
        fused = ", ".join(f"{k.split('::')[1]} {v}" for k, v in sorted(row["fused"].items()))
        for i, (out, w) in enumerate(row["drift"].items()):
            lead = (f"| {name} | 0 | {row['nodes']['before']} → {row['nodes']['after']} | {row['float32_nodes']} | "
                    f"{fused} " if i == 0 else "| | | | | ")
            rows.append(f"{lead}| {out} | {w['error']:.2e} | {w['cosine']:.6f} | "
                        f"{'yes' if w['error'] <= BUDGET_ERROR and w['cosine'] >= BUDGET_COSINE else '**no**'} |")
    return "\n".join(rows) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=None, help="comma list (default: every family); see --list")
    ap.add_argument("--list", action="store_true", help="print the family names and exit")
    ap.add_argument("--out", type=Path, default=Path("precision-families"))
    args = ap.parse_args(argv)
    table = families()
    if args.list:
        print("\n".join(table))
        return 0
    names = args.models.split(",") if args.models else list(table)
    unknown = [n for n in names if n not in table]
    if unknown:
        ap.error(f"unknown model(s) {', '.join(unknown)}; --list names them")
    work = args.out / "models"
    work.mkdir(parents=True, exist_ok=True)
    record: dict = {}

    def log(msg: str) -> None:
        print(f"[families {time.strftime('%H:%M:%S')}] {msg}", flush=True)

    for name in names:
        build, kind, outputs = table[name]
        try:
            record[name] = check(name, build, kind, outputs, work, log)
        except Exception as exc:  # an export the exporter refuses should not hide the other families
            record[name] = {"error": repr(exc)[:500]}
            log(f"{name}: failed: {exc!r}"[:300])
        for f in work.glob(f"{name}*.onnx*"):
            f.unlink()  # exports of a few hundred MB each: keep the disk free
        (args.out / "families.json").write_text(json.dumps(record, indent=1))
        (args.out / "families.md").write_text(markdown(record))
    bad = [n for n, r in record.items() if r.get("exit") != 0 or not r.get("within_budget")]
    log(f"{len(record) - len(bad)} of {len(record)} exit 0 within the budget" + (f"; not: {', '.join(bad)}" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
