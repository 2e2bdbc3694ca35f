#!/usr/bin/env python3
"""LLM decode benchmark (issue 31): per-token latency of a Qwen2-0.5B-shaped decoder with a KV cache, fp16
(``--dtype fp32`` for the float32 export),
the plain torch export against onnxfuse's output of it and onnxruntime-genai's hand-built model.

Why: decode latency (time per output token) is launch-bound and is where hand-built graphs (the genai
model builder: one GroupQueryAttention per layer with rotary inside, SkipSimplifiedLayerNormalization,
SwiGLU as Sigmoid/Mul/Mul) beat a generic export by about 2×; this is the table that says how far
onnxfuse has closed that gap.

Model: ``Qwen2ForCausalLM`` with tools/genai_builder_qwen2.py's ``SHAPES["qwen2-0.5b"]`` (24 layers, hidden
896, 14 query heads sharing 2 key/value heads of 64, FFN 4864, vocabulary cut to 32000, rms eps 1e-6,
rope theta 1e6, embeddings not tied), **random weights**: latency depends on shapes only, so random values
time the same as trained ones. ``--tiny``: that script's tiny shape (vocabulary 128, hidden 64, 4/2 heads
of 16, 2 layers), to check the whole flow on a CPU machine. Three columns, timed in one process:

1. ``original``: the model in ``.half()`` (``--dtype fp32``: as created) exported by the legacy exporter (``dynamo=False``, opset 17,
   eager attention; ``--attention sdpa``: transformers' default) through testdata/export_transformers.py's ``CachedDecoder``: inputs ``input_ids``,
   ``attention_mask [B, P + S]``, ``position_ids``, ``past_key_values.N.key/value [B, 2, P, 64]``;
   outputs ``logits``, ``present.N.key/value``;
2. ``onnxfuse``: that export through ``onnxfuse.optimize`` (target cuda, validation on); its node count,
   validation verdict and fused-op counts are recorded (a failed validation is recorded and the model
   is still timed, marked so);
3. ``genai-builder``: the builder's ``-p fp16 -e cuda`` model of the same shape. The builder needs
   onnxruntime-genai, which the GPU machine does not have, and its ~1 GB model cannot travel there, so
   it comes as a *skeleton* written on a CPU machine (graph and small initializers; the big ones
   listed by name, dtype and dims), and ``tools/genai_builder_qwen2.load_skeleton`` re-creates those here
   (weights normal·0.02, norm weights 1, ``cos_cache``/``sin_cache`` the real rotary tables of the
   config's rope theta). Its inputs are its own (no ``position_ids``; the mask gives ``seqlens_k``):
   feeds are built from each model's input list. Without ``--builder-skeleton`` (or with
   ``--skip-builder``) the column is left out.

``--with-rules RULE,...`` adds a fourth column: onnxfuse's output with those opt-in rules besides the
defaults (``--only +RULE``), e.g. ``contrib-grouped-queries`` (docs/benchmarks.md 5.17).

Cells: a decode step (S = 1) at each past length P (``--past``) and batch (``--batches``), and a prefill of
``--prefill`` tokens (P = 0) at each ``--prefill-batches`` size; inputs: all-ones mask, positions P … P+S-1,
random past. Per cell the three models run in interleaved rounds (``--rounds``, each ``--time-budget``
seconds split over them; warm-up first), ONNX Runtime ``ORT_ENABLE_ALL``, CUDAExecutionProvider, IOBinding
with every input and output a GPU-resident OrtValue (``onnxfuse.timing.runner.Timer``); one session per
model serves every cell. Reported: median ms per model, tokens/s (decode: B / step time; prefill:
B·S / time), graph nodes per model; and once, at the cell ``--profile-cell`` names (default decode
B=1 P=1024), ONNX Runtime's profiler per model: nodes run per step on the CUDA provider (after ONNX Runtime's own fusions) and, where the trace
has kernel records, GPU kernels per step ("kernels per token") and the kernels taking the most GPU
time (``--no-profile`` skips it).

``--deadline`` (seconds from start) stops before a cell (or the profile) that would not finish in time;
results are written after every cell, so a cut run still leaves its tables. ``--cache DIR`` keeps the
export and onnxfuse's output (with its report) and reuses them in a later run: export and optimization
in one command, timing in the next, where one would not fit the time limit.

Usage (repo root; onnxruntime-gpu, torch, transformers importable)::

    # CPU machine, once (onnxruntime-genai's own venv; see tools/genai_builder_qwen2.py):
    /tmp/genai/bin/python tools/genai_builder_qwen2.py --shape qwen2-0.5b --out /tmp/genai-big \\
        --skeleton .bench-skeleton
    # GPU machine (.bench-skeleton carried along, ~0.2 MB):
    python benchmarks/decode.py --out /tmp/decode --builder-skeleton .bench-skeleton
    # the whole flow on a CPU machine:
    python benchmarks/decode.py --out /tmp/decode-tiny --tiny --device cpu --builder-skeleton SKEL_TINY

Writes ``decode.json`` and ``decode.md`` under ``--out``. Never imported by the package.
"""

from __future__ import annotations

import gc
import json
import sys
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
for _p in (REPO, REPO / "benchmarks", REPO / "testdata", REPO / "tools"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from genai_builder_qwen2 import SHAPES, load_skeleton  # noqa: E402
from micro import parse_args, write_results  # noqa: E402

MODELS = ["original", "onnxfuse", "genai-builder"]
START = time.perf_counter()


def log(msg: str) -> None:
    print(f"[decode {time.perf_counter() - START:6.1f}s] {msg}", flush=True)


def options(p) -> None:
    p.add_argument("--builder-skeleton", type=Path, default=None,
                   help="folder from tools/genai_builder_qwen2.py --skeleton (same --shape)")
    p.add_argument("--skip-builder", action="store_true", help="leave the genai-builder column out")
    p.add_argument("--tiny", action="store_true", help="the tiny Qwen2 shape (a CPU check of the flow)")
    p.add_argument("--past", default=None, help="past lengths of the decode cells (default 128,1024,4096; tiny 4,16)")
    p.add_argument("--prefill", type=int, default=None, help="prefill length, 0: none (default 512; tiny 8)")
    p.add_argument("--prefill-batches", default="1,8",
                   help="batch sizes of the prefill cells (default 1,8; each after its batch's decode cells)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--deadline", type=float, default=480.0,
                   help="seconds from start; no cell starts that would end later (default 480)")
    p.add_argument("--opset", type=int, default=17)
    p.add_argument("--dtype", choices=("fp16", "fp32"), default="fp16",
                   help="the export's element type (default fp16; fp32: give the builder column an fp32 skeleton, "
                        "or --skip-builder)")
    p.add_argument("--precision", choices=("fp32", "fp16"), default="fp32",
                   help="onnxfuse's --precision for its columns (fp16 with --dtype fp32: the float32 export computed in "
                        "float16, issue 33; time it against a default run's onnxfuse column, the float16 export's)")
    p.add_argument("--attention", choices=("eager", "sdpa"), default="eager",
                   help="transformers' attention implementation for the export (default eager; sdpa: transformers' "
                        "default, through torch's scaled_dot_product_attention symbolic)")
    p.add_argument("--exporter", choices=("legacy", "dynamo"), default="legacy",
                   help="torch's exporter for the original (default legacy; dynamo: opset 18 at least)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--with-rules", default="",
                   help="rules (comma list): a fourth column, onnxfuse's output with these opt-in rules besides the "
                        "defaults, and without those written -NAME (e.g. -contrib-grouped-attention-inputs)")
    p.add_argument("--extras-unvalidated", action="store_true",
                   help="optimize the --with-rules column without validation (a rule whose op serves only some "
                        "shapes, e.g. contrib-kv-cache-attention: timed at the cells it serves)")
    p.add_argument("--no-profile", action="store_true", help="skip the per-model profile (kernels per token)")
    p.add_argument("--profile-cell", default="decode:1:1024",
                   help="the cell profiled: decode:B:P or prefill:B (default decode:1:1024; the first decode "
                        "cell where that one is not timed)")
    p.add_argument("--cache", type=Path, default=None,
                   help="keep the export and onnxfuse's output (and its report) here, and reuse them when present "
                        "(~1 GB each: splits export + optimize and timing over two runs)")


# --------------------------------------------------------------------------------------------- models


def export_original(shape: str, opset: int, seed: int, folder: Path, dtype: str = "fp16", attention: str = "eager",
                    exporter: str = "legacy"):
    """The model in ``dtype`` exported with past by the legacy exporter, as testdata's KV-cache models are
    (``attention``: transformers' attention implementation); ``exporter="dynamo"``: by torch's dynamo
    exporter instead (opset 18 at least, dynamic batch, sequence, past and total lengths), as testdata's
    ``llama_kv_dynamo`` is."""
    import onnx
    import torch
    from export_transformers import CachedDecoder, kv_cache_signature
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(**SHAPES[shape], attn_implementation=attention)
    layers, kv, d = config.num_hidden_layers, config.num_key_value_heads, config.hidden_size // config.num_attention_heads
    wrapper = CachedDecoder(Qwen2ForCausalLM(config).eval(), layers).eval()
    element = torch.float16 if dtype == "fp16" else torch.float32
    wrapper = wrapper.to(element)
    names, outputs, axes = kv_cache_signature(layers)
    batch, new, cached = 2, 3, 4  # distinct, so no size is mistaken for another
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, config.vocab_size, (batch, new), generator=g)
    mask = torch.ones(batch, cached + new, dtype=torch.int64)
    position = torch.arange(cached, cached + new).expand(batch, new)
    past = [torch.randn(batch, kv, cached, d, generator=g).to(element) for _ in range(2 * layers)]
    path = folder / "original.onnx"
    with torch.no_grad():
        if exporter == "dynamo":
            b, s, p, t = (torch.export.Dim(n) for n in ("batch", "sequence", "past_sequence", "total_sequence"))
            shapes = ({0: b, 1: s}, {0: b, 1: t}, {0: b, 1: s}, tuple({0: b, 2: p} for _ in past))
            torch.onnx.export(wrapper, (ids, mask, position, *past), str(path), input_names=names,
                              output_names=outputs, dynamo=True, dynamic_shapes=shapes, opset_version=max(opset, 18))
        else:
            torch.onnx.export(wrapper, (ids, mask, position, *past), str(path), input_names=names,
                              output_names=outputs, dynamic_axes=axes, opset_version=opset, dynamo=False,
                              do_constant_folding=True)
    del wrapper
    gc.collect()
    return onnx.load(str(path))


def optimize(model, device: str, with_rules: list[str] | None = None, validate: bool = True,
             precision: str = "fp32") -> tuple[object, dict]:
    """onnxfuse's output of ``model`` (validation on unless ``validate`` is false) and what to report about
    it; ``with_rules``: opt-in rules to run besides the default ones, and (written -NAME) default rules
    to leave out; ``precision``: optimize's ``--precision``."""
    import onnxfuse
    from onnxfuse.errors import ValidationFailed
    added = [f"+{r}" for r in with_rules or [] if not r.startswith("-")]
    skip = [r[1:] for r in with_rules or [] if r.startswith("-")] or None
    t0 = time.perf_counter()
    try:
        res = onnxfuse.optimize(model, target="cuda", validate=validate, provider=device, only=added or None,
                                skip=skip, precision=precision)
        verdict = "passed" if validate else "off (--extras-unvalidated)"
    except ValidationFailed as exc:  # still timed: the table marks it
        res, verdict = exc.report, f"FAILED ({exc}; culprit {exc.culprit})"
    every = Counter(res.ops_after) + Counter(res.body_ops_after)  # the If branches' ops too
    fused = {k: v for k, v in sorted(every.items()) if "::" in k}  # com.microsoft and ai.onnxfuse ops
    info = {"nodes_before": res.nodes_before, "nodes_after": res.nodes_after, "validation": verdict,
            "fused_ops": fused, "ops_after": res.ops_after, "seconds": round(time.perf_counter() - t0, 2),
            "rewrite_s": round(res.rewrite_seconds, 2), "validation_s": round(res.validation_seconds, 2),
            "validation_report": res.validation.to_dict() if res.validation else None}
    return res.model, info


# --------------------------------------------------------------------------------------------- feeds


class Feeds:
    """Per-cell inputs of any of the three models, from each model's own input list. Arrays of one shape
    are drawn once and shared (every layer's past is the same array: values do not change the timing)."""

    def __init__(self, config: dict, seed: int):
        self.vocab = config["vocab_size"]
        self.kv = config["num_key_value_heads"]
        self.head = config["hidden_size"] // config["num_attention_heads"]
        self.rng = np.random.default_rng(seed)
        self.cache: dict = {}

    def _past(self, shape, dtype):
        key = ("past", tuple(shape), np.dtype(dtype).str)
        if key not in self.cache:
            self.cache[key] = self.rng.standard_normal(shape, dtype=np.float32).astype(dtype)
        return self.cache[key]

    def inputs(self, model, name: str, batch: int, seq: int, past: int):
        from onnxfuse.runtime.inputs import Inputs, input_specs

        feeds = {}
        for spec in input_specs(model):
            n, dt = spec.name, spec.dtype
            if n == "input_ids":
                arr = ((np.arange(batch * seq).reshape(batch, seq) * 7919 + past) % self.vocab).astype(dt)
            elif n == "attention_mask":
                arr = np.ones((batch, past + seq), dt)
            elif n == "position_ids":
                arr = np.broadcast_to(np.arange(past, past + seq, dtype=dt), (batch, seq)).copy()
            elif n.startswith("past_key_values.") or n.startswith("past_"):
                arr = self._past((batch, self.kv, past, self.head), dt)
            else:
                raise SystemExit(f"{name}: input {n} {spec.shape} is not one this benchmark knows how to feed")
            for want, got in zip(spec.shape, arr.shape):
                if isinstance(want, int) and want != got:
                    raise SystemExit(f"{name}: input {n} is declared {spec.shape}; the benchmark made {list(arr.shape)}")
            feeds[n] = arr
        return Inputs(feeds=feeds, seed=None, source="decode.py")

    def clear(self) -> None:
        self.cache.clear()


# --------------------------------------------------------------------------------------------- timing


def check_outputs(timer, want: dict) -> None:
    """After a run: ``logits`` and every ``present.*`` have the shapes of the cell (a wrong feed shows)."""
    for spec in timer.current_output_specs():
        key = "logits" if spec.name == "logits" else "present" if spec.name.startswith("present") else None
        if key and list(spec.shape) != want[key]:
            raise RuntimeError(f"{timer.name}: output {spec.name} is {spec.shape}, expected {want[key]}")


def time_cell(models: dict, sessions: dict, feeds: dict, cfg, rounds: int, want: dict) -> tuple[dict, dict]:
    """Interleaved rounds over the models of one cell (each warmed up and its outputs checked by ``want``
    first); ``({name: BenchResult}, {name: error})``: a model that fails is left out of the rounds."""
    from onnxfuse.timing.runner import Timer

    timers, errors = [], {}
    try:
        for name, model in models.items():
            try:
                t = Timer(model, feeds[name], cfg, name=name, session_factory=lambda *_a, _s=sessions[name], **_k: _s)
                timers.append(t)
                t.warmup(max(1, cfg.warmup))
                check_outputs(t, want)
            except Exception as exc:
                errors[name] = f"{type(exc).__name__}: {exc}"
                if timers and timers[-1].name == name:
                    timers.pop().close()
        floor = max(1, -(-cfg.min_iterations // rounds))
        for _ in range(rounds):
            for t in timers:
                t.sample(None, cfg.time_budget_s / rounds, min_iterations=floor)
        return {t.name: t.result() for t in timers}, errors
    finally:
        for t in timers:
            t.close()


def profile_models(models: dict, feeds: dict, cfg, sessions: dict | None = None) -> dict:
    from onnxfuse.timing.profile import profile

    out = {}
    for name, model in models.items():
        try:
            s = profile(model, feeds[name], cfg, name=name, runs=10).summary
            out[name] = {"nodes_per_run": round(s.nodes_per_run, 1), "kernels_per_run": s.kernels_per_run,
                         "nodes_by_provider": {k: round(v, 1) for k, v in s.nodes_by_provider.items()},
                         "top_by_count": [o.to_dict() for o in s.top_by_count(8)]}
        except Exception as exc:  # recorded, never fatal
            out[name] = {"error": f"{type(exc).__name__}: {exc}"}
        if sessions is not None and cfg.device == "cuda":
            out[name].update(gpu_kernels(model, feeds[name], cfg, sessions[name], name))
        gc.collect()
    return out


def profiled_cell(spec: str, cells: list) -> tuple:
    """The cell ``--profile-cell`` names (``decode:B:P`` or ``prefill:B``) among the timed ``cells``
    (kind, batch, seq, past); the first decode cell (else the first cell) where it is not among them."""
    parts = spec.split(":")
    kind, nums = parts[0], [int(x) for x in parts[1:]]
    for c in cells:
        if c[0] == kind and c[1] == nums[0] and (kind != "decode" or len(nums) < 2 or c[3] == nums[1]):
            return c
    return next((c for c in cells if c[0] == "decode"), cells[0])


def gpu_kernels(model, inputs, cfg, session, name: str, steps: int = 20) -> dict:
    """Kernels per step and GPU busy time per step, read by CUPTI through torch's profiler around the
    IOBinding runs of the timing session (onnxruntime-gpu's own trace has no kernel records):
    ``kernels_per_run`` counts every kernel and memcpy/memset the device ran; ``gpu_busy_ms`` sums their
    durations. Busy time near the wall time per step: the GPU bounds the step; far below: the host
    (launches) does. Left out, with the reason, where torch or CUPTI is unavailable."""
    from onnxfuse.timing.runner import Timer

    try:
        import torch
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile
    except ImportError as exc:
        return {"kernels_error": f"torch profiler unavailable: {exc}"}
    timer = Timer(model, inputs, cfg, name=name, session_factory=lambda *_a, **_k: session)
    try:
        timer.warmup(3)
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                timer.run_once()
            torch.cuda.synchronize()
        events = [e for e in prof.events() if getattr(e, "device_type", None) is not None
                  and "cuda" in str(e.device_type).lower()]
        def took(e):
            return getattr(e, "device_time", None) or getattr(e, "cuda_time", 0) or 0

        busy_us = sum(took(e) for e in events)
        by_name: dict[str, list] = {}
        for e in events:
            entry = by_name.setdefault(e.name[:90], [0, 0.0])
            entry[0] += 1
            entry[1] += took(e)
        def rows(key):
            return [{"name": k, "per_run": round(c / steps, 2), "us_per_run": round(t / steps, 2)}
                    for k, (c, t) in sorted(by_name.items(), key=key)[:30]]

        return {"kernels_per_run": round(len(events) / steps, 1), "gpu_busy_ms": round(busy_us / steps / 1000.0, 3),
                "kernels_by_name": rows(lambda kv: -kv[1][0]), "kernels_by_time": rows(lambda kv: -kv[1][1])}
    except Exception as exc:  # recorded, never fatal
        return {"kernels_error": f"{type(exc).__name__}: {exc}"}
    finally:
        timer.close()


# --------------------------------------------------------------------------------------------- report


def _ms(row, name):
    r = row["models"].get(name)
    return None if not r or "median_ms" not in r else r["median_ms"]


def _fmt(x, spec=".3f"):
    return "—" if x is None else format(x, spec)


def table(report: dict) -> list[str]:
    names = report["models"]
    lines = [f"Decode benchmark ({report['shape']}, {report.get('dtype', 'fp16')}"
             f"{'' if report.get('precision', 'fp32') == 'fp32' else ', onnxfuse --precision ' + report['precision']}, "
             f"{report.get('attention', 'eager')} attention, {report.get('exporter', 'legacy')} exporter, {report['device']}, ORT {report['ort_version']}); "
             f"median ms per step, interleaved rounds; tokens/s = B / step (prefill: B·S / time).", "",
             "| cell | original ms | onnxfuse ms | builder ms | onnxfuse/builder | speed-up over original "
             "| tok/s original | tok/s onnxfuse | tok/s builder |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    extras = [n for n in names if n not in MODELS]
    if extras:
        lines[2] += "".join(f" {n} ms |" for n in extras)
        lines[3] += "---:|" * len(extras)
    for row in report["cells"]:
        o, f, b = (_ms(row, n) for n in MODELS)
        tps = [row["models"].get(n, {}).get("tokens_per_s") for n in MODELS]
        lines.append(f"| {row['cell']} | {_fmt(o)} | {_fmt(f)} | {_fmt(b)} | "
                     f"{_fmt(None if f is None or b is None else f / b, '.2f')} | "
                     f"{_fmt(None if f is None or o is None else o / f, '.2f')}× | "
                     + " | ".join(_fmt(t, ",.0f") for t in tps) + " |"
                     + "".join(f" {_fmt(_ms(row, n))} |" for n in extras))
    lines += ["", "| model | graph nodes | nodes run on the provider per step | kernels per step | GPU busy ms per step |",
              "|---|---:|---:|---:|---:|"]
    prof = report.get("profile") or {}
    provider = "CUDAExecutionProvider" if report["device"] == "cuda" else "CPUExecutionProvider"
    for n in names:
        p = prof.get("models", {}).get(n, {})
        lines.append(f"| {n} | {report['nodes'].get(n, '—')} | {_fmt(p.get('nodes_by_provider', {}).get(provider), ',.0f')} "
                     f"| {_fmt(p.get('kernels_per_run'), ',.0f')} | {_fmt(p.get('gpu_busy_ms'))} |")
    if prof:
        lines.append(f"\nProfile at {prof.get('cell')}: nodes from ONNX Runtime's profiler (after its own fusions); "
                     "kernels (with memcpy/memset) and GPU busy time from CUPTI through torch's profiler (— where unavailable).")
        for n in names:
            top = prof.get("models", {}).get(n, {}).get("kernels_by_time") or []
            if top:
                lines.append(f"\n{n}: GPU time per step by kernel (top 8, µs, calls)")
                lines += [f"- {k['us_per_run']:.1f} µs, {k['per_run']:g}× {k['name'][:70]}" for k in top[:8]]
    fx = report.get("onnxfuse")
    if fx:
        lines.append(f"\nonnxfuse: {fx['nodes_before']} → {fx['nodes_after']} nodes, validation {fx['validation']}, "
                     f"fused ops {fx['fused_ops']}, {fx['seconds']} s.")
    for k in report.get("skipped", []):
        lines.append(f"- skipped: {k}")
    for k in report.get("errors", []):
        lines.append(f"- error: {k}")
    return lines


def save(out: Path, report: dict, final: bool = False) -> None:
    """``decode.json`` and ``decode.md``; the table printed only at the end."""
    if final:
        write_results(out, "decode", [report], table(report))
    else:
        write_results(out, "decode", [report])
        (out / "decode.md").write_text("\n".join(table(report)) + "\n")


# --------------------------------------------------------------------------------------------- main


def main(argv=None, variants=None) -> int:
    """The benchmark; ``variants`` (for probes): called with the models once they are made, returns more
    columns ``{name: model}`` (variants of onnxfuse's output, say), timed and profiled like the others."""
    args, out, batches = parse_args(__doc__, 0.3, argv, batches="1,8", extra=options)
    import onnx
    import onnxruntime as ort

    from onnxfuse.pipeline import op_counts
    from onnxfuse.runtime.session import make_session
    from onnxfuse.timing.runner import BenchConfig

    shape = "tiny" if args.tiny else "qwen2-0.5b"
    config = dict(SHAPES[shape])
    pasts = [int(x) for x in (args.past or ("4,16" if args.tiny else "128,1024,4096")).split(",") if x]
    prefill = args.prefill if args.prefill is not None else (8 if args.tiny else 512)
    prefill_batches = [int(x) for x in args.prefill_batches.split(",") if x] if prefill else []
    deadline = args.deadline
    report = {"shape": shape, "dtype": args.dtype, "precision": args.precision, "attention": args.attention,
              "exporter": args.exporter,
              "config": config, "device": args.device, "ort_version": ort.__version__,
              "time_budget_s": args.time_budget, "rounds": args.rounds, "warmup": args.warmup,
              "models": [], "nodes": {}, "ops": {}, "cells": [], "skipped": [], "errors": [],
              "note": "random weights: latency depends on shapes only"}

    models = {}
    stem = (f"{shape}-opset{args.opset}-seed{args.seed}" + ("" if args.dtype == "fp16" else f"-{args.dtype}")
            + ("" if args.attention == "eager" else f"-{args.attention}")
            + ("" if args.exporter == "legacy" else f"-{args.exporter}"))
    cached = args.cache / f"{stem}-original.onnx" if args.cache else None
    if cached and cached.is_file():
        log(f"original: loading {cached}")
        models["original"] = onnx.load(str(cached))
    else:
        with tempfile.TemporaryDirectory(prefix="decode-export-") as tmp:
            log(f"exporting {shape} ({args.exporter} exporter, opset {args.opset}, {args.dtype}, {args.attention} attention)")
            models["original"] = export_original(shape, args.opset, args.seed, Path(tmp), args.dtype, args.attention,
                                                 args.exporter)
        if cached:
            args.cache.mkdir(parents=True, exist_ok=True)
            onnx.save(models["original"], str(cached))
    log(f"original: {len(models['original'].graph.node)} nodes ({time.perf_counter() - START:.0f} s)")
    fused = (args.cache / f"{stem}-onnxfuse{'' if args.precision == 'fp32' else '-' + args.precision}.onnx"
             if args.cache else None)
    if fused and fused.is_file() and fused.with_suffix(".json").is_file():
        log(f"onnxfuse: loading {fused} (optimized by an earlier run; see its report)")
        models["onnxfuse"] = onnx.load(str(fused))
        report["onnxfuse"] = {**json.loads(fused.with_suffix(".json").read_text()), "cached": str(fused)}
    else:
        log("optimizing with onnxfuse (validation on)")
        try:
            models["onnxfuse"], report["onnxfuse"] = optimize(models["original"], args.device, precision=args.precision)
            log(f"onnxfuse: {report['onnxfuse']['nodes_after']} nodes, validation {report['onnxfuse']['validation']}, "
                f"{report['onnxfuse']['seconds']} s")
            if fused:
                onnx.save(models["onnxfuse"], str(fused))
                fused.with_suffix(".json").write_text(json.dumps(report["onnxfuse"], indent=1, default=str))
        except Exception as exc:
            report["errors"].append(f"onnxfuse: {type(exc).__name__}: {exc}")
            traceback.print_exc()
    extra = [r for r in args.with_rules.split(",") if r]
    if extra and "onnxfuse" in models:
        name = "onnxfuse" + "".join(r if r.startswith("-") else f"+{r}" for r in extra)
        log(f"optimizing with onnxfuse and {', '.join(extra)}")
        try:
            models[name], report[name] = optimize(models["original"], args.device, extra, precision=args.precision,
                                                  validate=not args.extras_unvalidated)
            log(f"{name}: {report[name]['nodes_after']} nodes, validation {report[name]['validation']}")
        except Exception as exc:
            report["errors"].append(f"{name}: {type(exc).__name__}: {exc}")
            traceback.print_exc()
    if args.builder_skeleton is not None and not args.skip_builder:
        model, meta = load_skeleton(args.builder_skeleton, args.seed)
        got = {k: meta["config"][k] for k in SHAPES[shape] if meta["config"].get(k) is not None}
        if any(got[k] != v for k, v in SHAPES[shape].items() if k in got):
            raise SystemExit(f"{args.builder_skeleton}: the skeleton's config {got} is not the {shape} shape")
        models["genai-builder"] = model
        report["builder"] = {"skeleton": str(args.builder_skeleton), "source": meta.get("source"),
                             "made_up_initializers": len(meta["initializers"])}
        log(f"genai-builder: {len(model.graph.node)} nodes (skeleton, {len(meta['initializers'])} initializers made up)")
    else:
        report["skipped"].append("genai-builder column (no --builder-skeleton, or --skip-builder)")
    if variants is not None:
        for name, model in variants(models).items():
            models[name] = model
            log(f"{name}: {len(model.graph.node)} nodes (a probe's variant)")
    report["models"] = list(models)
    report["nodes"] = {n: len(m.graph.node) for n, m in models.items()}
    report["ops"] = {n: op_counts(m) for n, m in models.items()}
    save(out, report)

    cfg = BenchConfig(device=args.device, warmup=args.warmup, time_budget_s=args.time_budget, min_iterations=10)
    provider_options = {"device_id": "0"} if args.device == "cuda" else None
    sessions = {}
    for name, model in list(models.items()):
        t0 = time.perf_counter()
        try:
            sessions[name] = make_session(model, provider=args.device, optimization="all", name=name,
                                          provider_options=provider_options, tf32=True)
            log(f"{name}: session in {time.perf_counter() - t0:.1f} s, providers {sessions[name].get_providers()}")
        except Exception as exc:
            report["errors"].append(f"{name}: session: {exc}")
            del models[name]

    limit = config.get("max_position_embeddings", 1 << 30)
    cells = []  # batch by batch, each batch's prefill after its decode cells: batch 1 first under --deadline
    for b in sorted(set(batches) | set(prefill_batches)):
        cells += [("decode", b, 1, p) for p in pasts if b in batches] + [("prefill", b, prefill, 0)] * (b in prefill_batches)
    feeds = Feeds(config, args.seed)
    spent: list[float] = []
    for kind, batch, seq, past in cells:
        label = f"{kind} B={batch} P={past}" + (f" S={seq}" if kind == "prefill" else "")
        if past + seq > limit:
            report["skipped"].append(f"{label}: past + sequence > {limit} positions")
            continue
        elapsed = time.perf_counter() - START
        guess = max(spent) if spent else 0.0
        if elapsed + guess > deadline:
            report["skipped"].append(f"{label}: deadline ({elapsed:.0f} s spent, a cell takes ~{guess:.0f} s)")
            continue
        t0 = time.perf_counter()
        row = {"cell": label, "kind": kind, "batch": batch, "sequence": seq, "past": past, "models": {}}
        try:
            cell_feeds = {n: feeds.inputs(m, n, batch, seq, past) for n, m in models.items()}
            want = {"logits": [batch, seq, config["vocab_size"]],
                    "present": [batch, feeds.kv, past + seq, feeds.head]}
            results, failed = time_cell(models, sessions, cell_feeds, cfg, args.rounds, want)
            for n, err in failed.items():
                row["models"][n] = {"error": err}
                report["errors"].append(f"{label}: {n}: {err}")
                log(f"{label}: {n}: {err}")
            tokens = batch * seq
            for n, r in results.items():
                med = r.stats.median_ms
                row["models"][n] = {"median_ms": round(med, 4), "tokens_per_s": round(tokens / (med / 1e3), 1),
                                    "runs": len(r.samples_ms), "stats": r.stats.to_dict()}
            log(f"{label}: " + ", ".join(f"{n} {row['models'][n]['median_ms']:.3f} ms" for n in results))
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"
            report["errors"].append(f"{label}: {row['error']}")
            log(f"{label}: {row['error']}")
        feeds.clear()
        report["cells"].append(row)
        spent.append(time.perf_counter() - t0)
        save(out, report)

    timed = [c for c in cells if c[3] + c[2] <= limit]
    if not args.no_profile and timed:
        kind, batch, seq, past = profiled_cell(args.profile_cell, timed)
        guess = 3 * (max(spent) if spent else 10.0) + 5 * len(models)
        if time.perf_counter() - START + guess > deadline:
            report["skipped"].append("profile: deadline")
        else:
            label = f"decode B={batch} P={past}" if kind == "decode" else f"prefill B={batch} S={seq}"
            log(f"profiling at {label}")
            pcfg = BenchConfig(device=args.device, warmup=args.warmup, time_budget_s=None, iterations=10)
            report["profile"] = {"cell": label, "models": profile_models(
                models, {n: feeds.inputs(m, n, batch, seq, past) for n, m in models.items()}, pcfg, sessions)}
    sessions.clear()
    save(out, report, final=True)
    log(f"wrote {out / 'decode.json'} and {out / 'decode.md'}")
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
