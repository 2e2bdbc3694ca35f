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

``--latency`` (on a GPU machine) is the done-when's other half, for the same families: optimize and
the drift check run on CUDA, each family is also exported as its ``.half()`` twin (float32 I/O, the
zoo's ``HalfIO``) and optimized as a user would (``optimize half.onnx --no-bench``), and ``onnxfuse bench
HALF_OPT FP16`` times the two outputs in one interleaved run (two fresh sessions, all-ones masks) at
each ``--batches`` size with CUDA graphs off and on; the ratio --precision fp16 / half() is the
issue's "within 5%". ``--right-padded NAMES`` optimizes both under ``--right-padded attention_mask``
(transformers 4's eager BERT fuses its attention only so, docs/benchmarks.md 5.48). ``--jobs N``
prepares N families at once (export, optimize, drift), then times them one after another, so no
timing shares the GPU. ``--bf16 NAMES`` (or ``all``) also optimizes those with ``--precision bf16`` and
times that output against the same half() model (issue 33's bf16 rows):

    python benchmarks/precision_families.py --latency --jobs 6 --bf16 bert_pooler@sdpa,gpt2_small@sdpa --out $OUT/families

``--also-skip RULES`` also optimizes each family with ``--precision fp16 --skip RULES`` and times that output
against the same half() model (the "fp16-skip" rows): what those rules buy, in the same session
(docs/benchmarks.md 5.63 timed a float16 keep bias, rule contrib-promised-keep-bias of `48e9b96`, since
backed out, against the 1-D lengths so).

Writes ``families.json`` (rewritten after every model) and ``families.md`` in --out.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
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


def export(module, path: Path, input_names: list[str], output_names: list[str], example: dict,
           device: str = "cpu") -> None:
    """Traced on ``device`` (a ``.half()`` module on the GPU: the CPU lacks some float16 kernels)."""
    import torch
    import warnings

    torch.manual_seed(0)
    torch.backends.mha.set_fastpath_enabled(False)  # nn.MultiheadAttention's fused path has no ONNX export (ViT)
    args = tuple(torch.from_numpy(example[n][:1]).to(device) for n in input_names)
    axes = {n: {0: "batch"} for n in input_names + output_names}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module.eval().to(device), args, str(path), dynamo=False, opset_version=14,
                          do_constant_folding=False, input_names=input_names, output_names=output_names,
                          dynamic_axes=axes)
    module.to("cpu")


def half_io(module):
    """``module.half()`` behind float32 inputs and outputs, as the zoo's ``HalfIO`` (float inputs cast to
    float16 going in, every output cast to float32 coming out), for one output or several."""
    import torch

    class Half(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = module.half()

        def forward(self, *args):
            out = self.m(*[a.half() if a.is_floating_point() else a for a in args])
            return tuple(o.float() for o in out) if isinstance(out, tuple) else out.float()

    return Half()


def drift(ref: np.ndarray, got: np.ndarray) -> tuple[float, float]:
    """(normalized max error, cosine) of ``got`` against ``ref``, both in float64."""
    r, g = ref.astype(np.float64).ravel(), got.astype(np.float64).ravel()
    scale = float(np.max(np.abs(r))) or 1.0
    norms = np.linalg.norm(r) * np.linalg.norm(g)
    cos = float(r @ g / norms) if norms else float(np.array_equal(r, g))  # two zero vectors agree
    return float(np.max(np.abs(g - r))) / scale, cos


def optimize_cli(src: Path, dst: Path, report: Path, *args: str) -> tuple[dict, dict | None]:
    """``python -m onnxfuse optimize SRC DST --no-bench -q --json REPORT ARGS``, as a user runs it: (a record of
    its exit code and seconds, with the output's node counts and fused ops when it wrote one, else the
    message's tail; the report's ``result``, None when it failed)."""
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "onnxfuse", "optimize", str(src), str(dst), "--no-bench", *args,
                           "-q", "--json", str(report)], capture_output=True, text=True)
    record = {"exit": proc.returncode, "optimize_s": round(time.perf_counter() - t0, 1)}
    if proc.returncode:
        record["message"] = (proc.stdout + proc.stderr).strip()[-600:]
        return record, None
    result = json.loads(report.read_text())["result"]
    record.update(nodes=result["nodes"], fused={k: v for k, v in result["ops_after"].items() if "::" in k})
    return record, result


def check(name: str, build, kind: str, output_names: list[str], work: Path, log, device: str = "cpu",
          promise: tuple = ()) -> dict:
    """Export ``name``, ``optimize --precision fp16`` it through the CLI (validated on ``device``'s provider,
    under ``promise``, extra optimize arguments) and measure the output's drift from the float32 original
    on ``device``."""
    import onnx
    import torch

    from onnxfuse.runtime.session import run_samples

    torch.manual_seed(0)
    inputs, feeds = samples(kind)
    src, dst, report = work / f"{name}.onnx", work / f"{name}.fp16.onnx", work / f"{name}.json"
    t0 = time.perf_counter()
    export(build(), src, inputs, output_names, feeds[0])
    row = {"export_s": round(time.perf_counter() - t0, 1)}
    record, result = optimize_cli(src, dst, report, "--precision", "fp16", "--provider", device, *promise)
    row.update(record)
    if result is None:
        log(f"{name}: exit {row['exit']}: {row['message'][-200:]}")
        return row
    kept = result.get("precision") or {}
    row["float32_nodes"] = len(kept.get("float32_nodes_left", kept.get("float32_nodes")) or {})  # in the output
    original, optimized = onnx.load(str(src)), onnx.load(str(dst))
    refs = run_samples(original, feeds, device, name="float32 original")
    gots = run_samples(optimized, feeds, device, name="optimized")
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


def bench_shapes(kind: str, batch: int) -> list[str]:
    """``--shape`` arguments of one family's inputs at ``batch``."""
    names, feeds = samples(kind)
    dims = {n: (batch,) + feeds[0][n].shape[1:] for n in names}
    return [arg for n in names for arg in ("--shape", f"{n}:{','.join(str(d) for d in dims[n])}")]


def prepare(name: str, out: str, latency: bool, promise: tuple, device: str = "cuda", bf16: bool = False,
            skip: str = "") -> dict:
    """One family, in a worker process of its own under ``--jobs``: :func:`check` (on CUDA with
    ``--latency``), then the ``.half()`` export and its optimization for the latency pair. The row holds
    the models' paths for :func:`time_pair`. ``bf16``: ``optimize --precision bf16`` of the float32 export
    too (validated on CUDA; unvalidated in a ``--device cpu`` smoke test), timed against half() as well.
    ``skip``: ``optimize --precision fp16 --skip SKIP`` too, the "fp16-skip" variant, timed against half() in
    its own pairs: what those rules buy on the GPU, same export, same session."""
    import torch

    work = Path(out) / "models"
    build, kind, outputs = families()[name]

    def log(msg: str) -> None:
        print(f"[families {time.strftime('%H:%M:%S')}] {msg}", flush=True)

    device = device if latency else "cpu"
    row = check(name, build, kind, outputs, work, log, device, promise)
    if not latency or row.get("exit") != 0:
        return row
    row["right_padded"] = bool(promise)
    half, half_opt, report = work / f"{name}.half.onnx", work / f"{name}.half-opt.onnx", work / f"{name}.half.json"
    torch.manual_seed(0)
    export(half_io(build()), half, *samples(kind)[:1], outputs, samples(kind)[1][0], device=device)
    row["half_opt"], result = optimize_cli(half, half_opt, report, "--provider", device, *promise)
    log(f"{name}: half() export optimized, exit {row['half_opt']['exit']}")
    if result is not None:
        row["paths"] = {"half_opt": str(half_opt), "fp16": str(work / f"{name}.fp16.onnx")}
    if bf16 and "paths" in row:
        made, report = work / f"{name}.bf16.onnx", work / f"{name}.bf16.json"
        unchecked = ["--no-validate"] if device == "cpu" else []  # bfloat16 validates on CUDA only
        row["bf16"], result = optimize_cli(work / f"{name}.onnx", made, report, "--precision", "bf16", "--provider",
                                           device, *promise, *unchecked)
        if result is not None:
            row["paths"]["bf16"] = str(made)
        log(f"{name}: --precision bf16 exit {row['bf16']['exit']}")
    if skip and "paths" in row:
        made, report = work / f"{name}.fp16-skip.onnx", work / f"{name}.fp16-skip.json"
        row["fp16-skip"], result = optimize_cli(work / f"{name}.onnx", made, report, "--precision", "fp16", "--provider",
                                                device, *promise, "--skip", skip)
        if result is not None:
            row["paths"]["fp16-skip"] = str(made)
        log(f"{name}: --precision fp16 --skip {skip} exit {row['fp16-skip']['exit']}")
    for done in (work / f"{name}.onnx", half):
        done.unlink(missing_ok=True)  # only the optimized models are timed: keep the disk free
    return row


#: the models timed against the optimized half() export: (variant, its latency key in a row)
VARIANTS = (("fp16", "latency"), ("bf16", "latency_bf16"), ("fp16-skip", "latency_fp16-skip"))


def time_pair(name: str, row: dict, kind: str, batches: list[int], graph_modes: list[bool], budget: float,
              out: Path, log, device: str = "cuda") -> None:
    """``onnxfuse bench HALF_OPT FP16`` (and ``HALF_OPT BF16``, ``HALF_OPT FP16-SKIP`` where made) at each batch
    and CUDA-graph mode, into ``row["latency"]`` (``row["latency_bf16"]``, ``row["latency_fp16-skip"]``):
    {"b16 graph=False": {"exit", "ms": [half() optimized, --precision fp16], "ratio"}}."""
    paths = row.get("paths")
    if not paths:
        return
    ranges = ["--input-range", "attention_mask:1,1"] if kind == "tokens" else []  # all ones keeps any promise
    for variant, key in VARIANTS:
        if variant in paths:
            _time_variant(name, row, paths, variant, key, ranges, kind, batches, graph_modes, budget, out, log, device)


def _time_variant(name, row, paths, variant, key, ranges, kind, batches, graph_modes, budget, out, log, device):
    for batch in batches:
        for graph in graph_modes:
            js = out / f"bench-{name}-{variant}-b{batch}-{int(graph)}.json"
            proc = subprocess.run([sys.executable, "-m", "onnxfuse", "bench", paths["half_opt"], paths[variant],
                                   *bench_shapes(kind, batch), *ranges, "--time-budget", str(budget),
                                   "--sessions", "2", *(["--cuda-graph"] if graph else []), "--device", device,
                                   "-q", "--json", str(js)], capture_output=True, text=True)
            try:
                result = json.loads(js.read_text()).get("result") or {}
            except (OSError, ValueError):
                result = {}
            ms = [m["latency_ms"]["median_ms"] for m in result.get("models", [])]
            cell = {"exit": proc.returncode, "ms": ms}
            if proc.returncode == 0 and len(ms) == 2:
                cell["ratio"] = ms[1] / ms[0]
            else:
                cell["message"] = (proc.stdout + proc.stderr).strip()[-400:]
            row.setdefault(key, {})[f"b{batch} graph={graph}"] = cell
            log(f"{name}: b{batch}{' graph' if graph else ''}: half() optimized, --precision {variant}: {ms}"
                + (f" ({cell['ratio']:.3f})" if "ratio" in cell else f" exit {proc.returncode}"))


def attention_ops(fused: dict | None) -> int:
    """How many fused attention ops (Attention, MultiHeadAttention, GroupQueryAttention) an output holds."""
    return sum(v for k, v in (fused or {}).items() if k.endswith("Attention"))


def latency_markdown(record: dict, variant: str = "fp16") -> str:
    key = "latency" if variant == "fp16" else f"latency_{variant}"
    label = "fp16 --skip (--also-skip)" if variant == "fp16-skip" else variant
    rows = [f"| model | batch | CUDA graph | half() optimized | --precision {label} | {variant} / half() | within 5% | "
            f"attention ops (half() / {variant}) |", "|---|---:|:---:|---:|---:|---:|:---:|---:|"]
    for name, row in record.items():
        mine = row.get("fused") if variant == "fp16" else (row.get(variant) or {}).get("fused")
        attention = f"{attention_ops((row.get('half_opt') or {}).get('fused'))} / {attention_ops(mine)}"
        for cell_key, cell in (row.get(key) or {}).items():
            batch, graph = cell_key.split(" ")
            ms = cell.get("ms") or []
            ratio = cell.get("ratio")
            rows.append(f"| {name}{' (right-padded)' if row.get('right_padded') else ''} | {batch[1:]} | "
                        f"{'yes' if graph.endswith('True') else 'no'} | "
                        + (f"{ms[0]:.3f} | {ms[1]:.3f} | {ratio:.3f} | {'yes' if ratio <= 1.05 else '**no**'} | "
                           if ratio is not None else f"exit {cell.get('exit')} | | | | ") + f"{attention} |")
    return (f"\n## Latency: --precision {label} against the half() export, both optimized\n\nMedian ms, each pair "
            "timed in one interleaved `onnxfuse bench` run of two fresh sessions.\n\n" + "\n".join(rows) + "\n")


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
    tables = "".join(latency_markdown(record, variant) for variant, key in VARIANTS
                     if any(row.get(key) for row in record.values()))
    return "\n".join(rows) + "\n" + tables


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=None, help="comma list (default: every family); see --list")
    ap.add_argument("--list", action="store_true", help="print the family names and exit")
    ap.add_argument("--out", type=Path, default=Path("precision-families"))
    ap.add_argument("--latency", action="store_true",
                    help="on a GPU: optimize and check on CUDA, and time --precision fp16 against the optimized "
                         ".half() export (onnxfuse bench)")
    ap.add_argument("--batches", default="1,16", help="--latency: batch sizes (default 1,16)")
    ap.add_argument("--graph-modes", default="off,on", help="--latency: CUDA graphs off, on or off,on")
    ap.add_argument("--time-budget", type=float, default=0.5, help="--latency: seconds per model and session")
    ap.add_argument("--right-padded", default="",
                    help="families (comma list) optimized under --right-padded attention_mask")
    ap.add_argument("--keep-models", action="store_true",
                    help="keep the optimized models under OUT/models (for ncu: benchmarks/kernel_times.py)")
    ap.add_argument("--jobs", type=int, default=1, help="families prepared at once (timing is one at a time)")
    ap.add_argument("--also-skip", default="", metavar="RULES",
                    help="--latency: also time --precision fp16 with --skip RULES (comma list) against half(), "
                         "the 'fp16-skip' rows: what those rules buy")
    ap.add_argument("--bf16", default="",
                    help="--latency: families (comma list, or 'all') also optimized with --precision bf16 and timed "
                         "against half() (issue 33's bf16 rows, for the transformers)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                    help="--latency on the CPU provider: a smoke test of the script (times mean nothing there)")
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

    promised = set(filter(None, args.right_padded.split(",")))
    batches = [int(b) for b in args.batches.split(",")]
    graph_modes = [{"off": False, "on": True}[m] for m in args.graph_modes.split(",")]

    def save() -> None:
        (args.out / "families.json").write_text(json.dumps(record, indent=1))
        (args.out / "families.md").write_text(markdown(record))

    def finish(name: str, row: dict) -> None:
        record[name] = row
        if args.latency:
            time_pair(name, row, table[name][1], batches, [g for g in graph_modes if args.device == "cuda" or not g],
                      args.time_budget, args.out, log, args.device)
        for f in work.glob(f"{name}.*") if not args.keep_models else ():
            f.unlink()  # exports of a few hundred MB each: keep the disk free
        save()

    def prepared(name: str, row: dict) -> None:
        record[name] = row
        save()

    def failed(name: str, exc: BaseException) -> dict:  # an export the exporter refuses should not hide the others
        log(f"{name}: failed: {exc!r}"[:300])
        return {"error": repr(exc)[:500]}

    promise = lambda n: ("--right-padded", "attention_mask") if n in promised else ()  # noqa: E731
    with_bf16 = set(filter(None, args.bf16.split(",")))
    bf16 = lambda n: "all" in with_bf16 or n in with_bf16  # noqa: E731
    if args.jobs > 1:
        # workers prepare every family first; the timings follow one at a time, with nothing else on the GPU
        spawn = multiprocessing.get_context("spawn")  # CUDA in forked workers fails
        with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=spawn) as pool:
            futures = {pool.submit(prepare, n, str(args.out), args.latency, promise(n), args.device, bf16(n),
                                   args.also_skip): n
                       for n in names}
            for future in concurrent.futures.as_completed(futures):
                name = futures[future]
                try:
                    prepared(name, future.result())
                except Exception as exc:
                    prepared(name, failed(name, exc))
        for name in names:
            finish(name, record[name])
    else:
        for name in names:
            try:
                row = prepare(name, str(args.out), args.latency, promise(name), args.device, bf16(name),
                              args.also_skip)
            except Exception as exc:
                row = failed(name, exc)
            finish(name, row)
    bad = [n for n, r in record.items() if r.get("exit") != 0 or not r.get("within_budget")]
    log(f"{len(record) - len(bad)} of {len(record)} exit 0 within the budget" + (f"; not: {', '.join(bad)}" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
