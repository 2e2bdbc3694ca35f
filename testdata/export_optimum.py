#!/usr/bin/env python3
"""Export a tiny random Llama with its KV cache through optimum: ``optimum_llama_kv.onnx`` (float32) and
``optimum_llama_kv_fp16.onnx`` (float16), the exports behind tests/rewrites/test_optimum_kv_cache.py.

The committed models were made with optimum 2.1.0, optimum-onnx 0.1.0, transformers 4.57.6, torch
2.13.0 (CPU) and onnx 1.23.2, in a venv of their own (optimum is not a dependency of onnxfuse), which
also needs onnxruntime (1.32.0 for the float16 seq2seq decoders: optimum's export runs it to fix the
dynamic axes, and fails without it):

    python testdata/export_optimum.py                    # writes both into testdata/
    python testdata/export_optimum.py --folder /tmp/x    # elsewhere

What it runs is ``optimum-cli export onnx --task text-generation-with-past [--dtype fp16]`` (optimum's
``main_export``) on a folder holding a seeded ``LlamaForCausalLM``: vocabulary 128, hidden 64,
intermediate 128, 2 layers, 4 query heads sharing 2 key/value heads, head size 16, 64 positions,
``initializer_range`` 0.1 (5x the default: the attention weights differ and the padding mask moves the
logits by 0.8 relative, while float16 validation keeps its margin; at 0.2 the float16 export fails
validation on main) and every RMSNorm weight randomized around 1. Default (sdpa) attention, torch's
legacy exporter at opset 18 as optimum calls it. Inputs ``input_ids``, ``attention_mask`` [batch, past + sequence],
``position_ids`` and ``past_key_values.{0,1}.{key,value}`` [batch, 2, past, 16]; outputs ``logits`` and
``present.{0,1}.{key,value}``.

What the exports hold that onnxfuse's own KV-cache exports do not (transformers 4.57's ``sdpa_mask``
through the legacy exporter): the causal-and-padding mask built as a bool tensor from index grids
(``Range(past, past + S)``, ``Range(0, past + S)``, the padding mask looked up by key index), expanded
to ``[B, 1, S, past + S]`` and cut to the key's length by a ``Slice`` whose end is read from
``Shape(key)``; ``Where(keep, 0, -inf)`` added to the scores and a ``Where(IsNaN(p), 0, p)`` guard after
the Softmax. The float16 export computes the masked scores, the Softmax and P·V in float32 (torch's
symbolic casts the float16 scores and values up to the float32 mask constants' type) and keeps the
residual stream after the attention in float32.

``--family gemma`` (``phi3``, ``qwen2``, ``mistral``) writes ``optimum_gemma_kv.onnx`` and
``optimum_gemma_kv_fp16.onnx`` the same way from a seeded ``GemmaForCausalLM`` of the same sizes
(GELU-tanh MLP, norm weights randomized around 0: Gemma scales by 1 + w), the exports behind
tests/rewrites/contrib/test_optimum_kv_cache.py as the Llama's. transformers computes Gemma's
positions as [1, S] (rotary caches of batch 1) and, in float16, rotates every layer after the first in
float32 (its cos/sin caches cast up to the float32 query's type).

``--t5`` writes instead ``optimum_t5_decoder.onnx`` and ``optimum_t5_decoder_with_past.onnx`` (float32),
the exports behind tests/rewrites/contrib/test_t5_kv_cache.py (issue 31 item 2), with the same versions:
``optimum-cli export onnx --task text2text-generation-with-past`` of a seeded ``T5ForConditionalGeneration``
(vocabulary 128, d_model 64, d_ff 128, 2 encoder and 2 decoder layers, 4 heads of 16, 8 relative-position
buckets up to distance 16, ReLU feed-forward, T5's tied embeddings). optimum writes three
decoders; all three are kept for T5 (the third, ``optimum_t5_decoder_merged.onnx``, holds both in an
``If`` whose branches write tensors of the same names), the first two for BART:

    python testdata/export_optimum.py --t5

* ``decoder_model`` (the first step): inputs ``encoder_attention_mask``, ``input_ids``,
  ``encoder_hidden_states``; outputs ``logits`` and ``present.N.{decoder,encoder}.{key,value}``, the
  keys and values it computed, [B, 4, ·, 16]: the head-split K and V of every attention are also outputs;
* ``decoder_with_past_model`` (every later step): ``past_key_values.N.decoder.{key,value}`` joined to the
  new ones by ``Concat`` along the sequence axis (outputs ``present.N.decoder.*``), and
  ``past_key_values.N.encoder.{key,value}`` read directly as the cross-attention's K and V.

``--bart`` writes ``optimum_bart_decoder[_with_past].onnx`` the same way from a seeded
``BartForConditionalGeneration`` of the same sizes (learned positions up to 64, GELU, ``init_std`` 0.1),
the same inputs and outputs; its q projection is scaled by 1/√16 and its projections have biases.

``--whisper`` writes ``optimum_whisper_decoder[_with_past].onnx`` the same way (task
``automatic-speech-recognition-with-past``) from a seeded ``WhisperForConditionalGeneration`` of the same
sizes (16 mel bins; Whisper's 1500 encoder positions, the length optimum's dummy audio needs): inputs
``input_ids`` and ``encoder_hidden_states`` at the first step, ``input_ids`` and the decoder and encoder
caches after it (no encoder mask: Whisper attends to every frame).

``--fp16`` with ``--t5`` and/or ``--bart`` writes the same decoders in float16 instead, ``_fp16`` before
the suffix (``optimum_bart_decoder[_with_past]_fp16.onnx``, ``optimum_t5_decoder[_with_past,_merged]_fp16.onnx``),
the exports behind tests/rewrites/contrib/test_seq2seq_fp16_kv_cache.py: optimum's own ``--dtype fp16``
(``main_export(..., dtype="fp16", device="cpu")``, as the Llama's float16 export; torch 2.13 runs the float16
model on the CPU, no CUDA needed) of the same seeded model, so their weights are the float32 exports' rounded
to float16 and the float32 files are their reference. optimum's own check of the export against the
float16 PyTorch model warns (differences up to 4e-3 against its 1e-5 tolerance; its log line for the
encoder prints the file's path where it means the error) and the export completes. Float16 inputs and
outputs (``encoder_hidden_states``, ``past_key_values.*``, ``logits``, ``present.*``); T5's float16 blocks
also clamp the residual stream (``IsInf``, ``Clip``: transformers' float16 overflow guard). Which
decoders are kept follows the float32 pattern (T5's merged one too, BART's not). Every file is
byte-reproducible except the merged decoders (float32 and float16): optimum's merge names the
initializers it deduplicates in an order that changes from run to run (same size, same graph):

    python testdata/export_optimum.py --t5 --bart --fp16

T5 scales no score by 1/√d and adds, before the Softmax, its relative position bias (computed in the
first layer, reused by the second) plus the causal-and-padding mask (self-attention) or the encoder
padding mask (cross-attention): ``(1 - m)·finfo(float32).min`` terms.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

import onnx
import torch


def build(folder: Path, seed: int, family: str = "llama") -> None:
    """A tiny random decoder of ``family`` (:data:`FAMILIES`) saved as a transformers folder (config and
    safetensors weights): Llama's sizes for every family, each with its own layer code (Gemma: GELU-tanh
    MLP, RMSNorm scaling by 1 + w, embeddings scaled by √hidden; Phi-3: packed qkv and gate/up projections;
    Qwen2: biases on q, k and v; Mistral: Llama's layers under its own class)."""
    import transformers

    torch.manual_seed(seed)
    sizes = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.1,
                 rms_norm_eps=1e-6, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    config_class, model_class, extra = FAMILIES[family]
    if family != "phi3":  # Phi-3 takes its head size from hidden / heads (16 here too)
        sizes["head_dim"] = 16
    config = getattr(transformers, config_class)(**sizes, **extra)
    model = getattr(transformers, model_class)(config).eval()
    norm_centre = 0.0 if family == "gemma" else 1.0  # Gemma's norm multiplies by 1 + w
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1 and "norm" in name:
                p.copy_(norm_centre + 0.1 * torch.randn(p.shape, generator=g))
    model.save_pretrained(folder)


#: family → (config class, model class, config options beside the shared sizes)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": False}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"hidden_activation": "gelu_pytorch_tanh"}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"tie_word_embeddings": False}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": False}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"tie_word_embeddings": False}),
}


def export(out_folder: Path, seed: int, family: str = "llama") -> None:
    from optimum.exporters.onnx import main_export

    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / f"tiny-{family}"
        build(source, seed, family)
        for dtype, name in ((None, f"optimum_{family}_kv.onnx"), ("fp16", f"optimum_{family}_kv_fp16.onnx")):
            folder = Path(tmp) / (dtype or "fp32")
            main_export(str(source), folder, task="text-generation-with-past", dtype=dtype, device="cpu",
                        library_name="transformers")
            out = out_folder / name
            model = onnx.load(str(folder / "model.onnx"))  # weights inline (no external data at this size)
            onnx.checker.check_model(model)
            onnx.save(model, str(out))
            shutil.rmtree(folder)
            print(f"wrote {out} ({out.stat().st_size / 1e6:.2f} MB, {len(model.graph.node)} nodes)")


def build_t5(folder: Path, seed: int) -> None:
    """A tiny random T5 saved as a transformers folder (config and safetensors weights)."""
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(seed)
    config = T5Config(vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2,
                      num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=16,
                      feed_forward_proj="relu", dropout_rate=0.0, pad_token_id=0, eos_token_id=1,
                      decoder_start_token_id=0)
    T5ForConditionalGeneration(config).eval().save_pretrained(folder)


def build_bart(folder: Path, seed: int) -> None:
    """A tiny random BART saved as a transformers folder: T5's sizes, ``init_std`` 0.1 (5x the default,
    so that the attention weights differ from uniform)."""
    from transformers import BartConfig, BartForConditionalGeneration

    torch.manual_seed(seed)
    config = BartConfig(vocab_size=128, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
                        max_position_embeddings=64, init_std=0.1, dropout=0.0, attention_dropout=0.0,
                        pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2)
    BartForConditionalGeneration(config).eval().save_pretrained(folder)


def build_whisper(folder: Path, seed: int) -> None:
    """A tiny random Whisper saved as a transformers folder: T5's sizes, 16 mel bins, Whisper's 1500 encoder
    positions (optimum's dummy audio is 3000 frames long), ``init_std`` 0.1."""
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    torch.manual_seed(seed)
    config = WhisperConfig(vocab_size=128, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                           decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, num_mel_bins=16,
                           max_source_positions=1500, max_target_positions=64, init_std=0.1, dropout=0.0,
                           attention_dropout=0.0, pad_token_id=1, bos_token_id=0, eos_token_id=2,
                           decoder_start_token_id=3, suppress_tokens=[], begin_suppress_tokens=[])
    WhisperForConditionalGeneration(config).eval().save_pretrained(folder)


#: kind → (the folder builder, optimum's task)
SEQ2SEQ = {"t5": (build_t5, "text2text-generation-with-past"), "bart": (build_bart, "text2text-generation-with-past"),
           "whisper": (build_whisper, "automatic-speech-recognition-with-past")}


def export_seq2seq(out_folder: Path, seed: int, kind: str, dtype: str | None = None) -> None:
    """optimum's first-step and with-past decoders of the tiny ``kind`` ("t5", "bart" or "whisper"):
    float32, or float16 with ``dtype`` "fp16" (optimum's ``--dtype fp16``; the files named ``…_fp16.onnx``)."""
    from optimum.exporters.onnx import main_export

    with tempfile.TemporaryDirectory() as tmp:
        source, folder = Path(tmp) / f"tiny-{kind}", Path(tmp) / "onnx"
        build, task = SEQ2SEQ[kind]
        build(source, seed)
        main_export(str(source), folder, task=task, dtype=dtype, device="cpu",
                    library_name="transformers")  # dtype None: optimum's default, float32
        suffix = "_fp16" if dtype == "fp16" else ""
        kept = [("decoder_model.onnx", f"optimum_{kind}_decoder{suffix}.onnx"),
                ("decoder_with_past_model.onnx", f"optimum_{kind}_decoder_with_past{suffix}.onnx")]
        if kind == "t5":  # both in an If, tensor names shared by the branches (tests/test_subgraph_names.py)
            kept.append(("decoder_model_merged.onnx", f"optimum_t5_decoder_merged{suffix}.onnx"))
        for exported, name in kept:
            out = out_folder / name
            model = onnx.load(str(folder / exported))
            onnx.checker.check_model(model)
            onnx.save(model, str(out))
            print(f"wrote {out} ({out.stat().st_size / 1e6:.2f} MB, {len(model.graph.node)} nodes)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--folder", type=Path, default=Path(__file__).resolve().parent)
    ap.add_argument("--seed", type=int, default=31)
    ap.add_argument("--t5", action="store_true", help="export the tiny T5 decoders instead of the Llama")
    ap.add_argument("--bart", action="store_true", help="export the tiny BART decoders instead of the Llama")
    ap.add_argument("--whisper", action="store_true", help="export the tiny Whisper decoders instead of the Llama")
    ap.add_argument("--family", choices=sorted(FAMILIES), default="llama",
                    help="the decoder family of the text-generation export (optimum_FAMILY_kv[_fp16].onnx)")
    ap.add_argument("--fp16", action="store_true",
                    help="with --t5/--bart: export their decoders in float16 (optimum's --dtype fp16), *_fp16.onnx")
    args = ap.parse_args()
    if args.fp16 and not (args.t5 or args.bart or args.whisper):
        ap.error("--fp16 goes with --t5, --bart or --whisper (the Llama export writes its float16 model already)")
    if args.t5 or args.bart or args.whisper:
        for kind in ("t5",) * args.t5 + ("bart",) * args.bart + ("whisper",) * args.whisper:
            export_seq2seq(args.folder, args.seed, kind, "fp16" if args.fp16 else None)
    else:
        export(args.folder, args.seed, args.family)


if __name__ == "__main__":
    main()
