#!/usr/bin/env python3
"""How long `onnxfuse optimize` itself takes, and how much memory, on BERT exports of growing depth
(issue 35 item 8): wall time and peak resident memory of the whole command, and the seconds of each
stage from its JSON report (load, rewrite, validation, timing; total). CPU validation, no GPU timing.

    python benchmarks/tool_speed.py --export-python /tmp/venv-cover/bin/python --layers 2,6,12,24 \\
        [--decoder] [--models-dir /tmp/tool_speed] [--repeats 2] [--code /path/to/other/checkout ...] [--out results.json]

Models: ``transformers.BertModel(BertConfig(num_hidden_layers=L))`` (bert-base-uncased's shape: 768 hidden,
12 heads, 30522-token vocabulary; random weights, seed 0, eager attention, no pooler), exported with
torch's legacy exporter at opset 14 with constant folding, inputs ``input_ids`` and ``attention_mask``
with dynamic batch and sequence axes; L=12 is BERT-base (435 MB). ``--export-python`` names a Python that
has torch and transformers (this script re-runs itself there to export; exports are reused).

Each run is a fresh process: ``python -m onnxfuse optimize MODEL OUT --provider cpu --no-bench --json R``
with the checkout in ``--code`` first on ``PYTHONPATH`` (default: this one), measured with ``os.wait4``
(wall time; ``ru_maxrss``, the peak resident memory). Give several ``--code`` checkouts to compare code
versions in one session; runs alternate between them. Results: docs/benchmarks.md, "Tool speed".
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def export_bert(layers: int, path: Path) -> None:
    """Runs under ``--export-python`` (torch and transformers)."""
    import warnings

    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.BertConfig(num_hidden_layers=layers)
    cfg._attn_implementation = "eager"
    bert = transformers.BertModel(cfg, add_pooling_layer=False).eval()

    class Bert(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bert = bert

        def forward(self, input_ids, attention_mask):
            return self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    ids = torch.randint(0, cfg.vocab_size, (1, 128))
    mask = torch.ones(1, 128, dtype=torch.int64)
    axes = {0: "batch", 1: "sequence"}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(Bert(), (ids, mask), str(path), dynamo=False, opset_version=14, do_constant_folding=True,
                          input_names=["input_ids", "attention_mask"], output_names=["output"],
                          dynamic_axes={"input_ids": axes, "attention_mask": axes, "output": axes})


def export_decoder(path: Path) -> None:
    """A 1.1-billion-parameter Llama-shaped decoder (TinyLlama-1.1B's shape: 22 layers, hidden 2048, 32 query
    heads sharing 4 key/value heads, FFN 5632, vocabulary 32000; random weights, seed 0, sdpa attention,
    no KV cache), float32, legacy exporter at opset 14: 4.4 GB, weights in external data beside it."""
    import warnings

    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                                   num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048,
                                   use_cache=False)
    cfg._attn_implementation = "sdpa"
    llama = transformers.LlamaModel(cfg).eval()

    class Decoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = llama

        def forward(self, input_ids, attention_mask):
            return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state

    ids = torch.randint(0, cfg.vocab_size, (1, 16))
    mask = torch.ones(1, 16, dtype=torch.int64)
    axes = {0: "batch", 1: "sequence"}
    path.parent.mkdir(parents=True, exist_ok=True)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(Decoder(), (ids, mask), str(path), dynamo=False, opset_version=14, do_constant_folding=True,
                          input_names=["input_ids", "attention_mask"], output_names=["output"],
                          dynamic_axes={"input_ids": axes, "attention_mask": axes, "output": axes})


def run_once(code: Path, model: Path, work: Path) -> dict:
    out, report = work / "out.onnx", work / "report.json"
    for f in (out, report, Path(str(out) + ".data")):
        f.unlink(missing_ok=True)
    env = dict(os.environ, PYTHONPATH=str(code), NO_COLOR="1")
    cmd = [sys.executable, "-m", "onnxfuse", "optimize", str(model), str(out), "--provider", "cpu", "--no-bench",
           "--quiet", "--json", str(report)]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, cwd=code, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    err = proc.stderr.read().decode(errors="replace")
    proc.stderr.close()
    rc = os.waitstatus_to_exitcode(status)
    row = {"wall_s": round(wall, 2), "peak_rss_mb": round(usage.ru_maxrss / 1024), "rc": rc}
    if rc != 0:
        row["error"] = err.strip().splitlines()[-1:] if err.strip() else []
    if report.exists():
        result = json.loads(report.read_text())["result"]
        row.update({k: round(v, 2) for k, v in result["timings"].items()})
        row["nodes"] = f'{result["nodes"]["before"]} -> {result["nodes"]["after"]}'
        row["passed"] = (result.get("validation") or {}).get("passed")
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", default="2,6,12,24")
    ap.add_argument("--models-dir", type=Path, default=Path(tempfile.gettempdir()) / "tool_speed")
    ap.add_argument("--export-python", default=None, help="a Python with torch and transformers (exports)")
    ap.add_argument("--decoder", action="store_true", help="also the 1.1B-parameter decoder (4.4 GB, about 12 GB "
                    "of memory to export)")
    ap.add_argument("--code", type=Path, action="append", default=None,
                    help="checkout to run (repeatable; default: this one)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--out", default=None)
    ap.add_argument("--export-only", nargs=2, metavar=("LAYERS", "PATH"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.export_only:
        if args.export_only[0] == "decoder":
            export_decoder(Path(args.export_only[1]))
        else:
            export_bert(int(args.export_only[0]), Path(args.export_only[1]))
        return 0
    args.models_dir.mkdir(parents=True, exist_ok=True)
    codes = [c.resolve() for c in (args.code or [ROOT])]
    rows = []
    models = [(f"bert_L{n}", str(n), args.models_dir / f"bert_L{n}.onnx") for n in args.layers.split(",") if n]
    if args.decoder:
        models.append(("llama_1b", "decoder", args.models_dir / "llama_1b" / "model.onnx"))
    for name, what, model in models:
        if not model.exists():
            if not args.export_python:
                raise SystemExit(f"{model} is missing: give --export-python to export it")
            # -P: benchmarks/ not on sys.path (its kernels.py would shadow the package transformers probes)
            subprocess.run([args.export_python, "-P", __file__, "--export-only", what, str(model)], check=True)
        size_mb = round(sum(f.stat().st_size for f in model.parent.iterdir() if f.is_file()) / 1e6) \
            if what == "decoder" else round(model.stat().st_size / 1e6)
        for rep in range(args.repeats):
            for code in codes:
                with tempfile.TemporaryDirectory(prefix="tool-speed-") as work:
                    row = {"model": name, "model_mb": size_mb, "code": str(code), "repeat": rep,
                           **run_once(code, model, Path(work))}
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"machine": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
                       "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
