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

``--attention`` instead writes the attention-coverage models of tests/rewrites/test_attention_exports.py
(same exporter, opset 14, eager attention, hidden 64, 2 heads, 2 layers, random weights with every bias
and LayerNorm parameter randomized so a dropped or misplaced bias shows):

* ``gpt2_tiny_opset14.onnx``: ``GPT2Model`` without KV cache (``use_cache=False``): Conv1D projections,
  packed QKV cut by ``Split``, causal mask ``Where(causal, scores, finfo.min)`` plus the padding mask;
* ``distilbert_tiny_opset14.onnx``: ``DistilBertModel``: mask by ``masked_fill`` (``Where``, finfo.min);
* ``roberta_tiny_opset14.onnx``: ``RobertaModel`` (no pooler): the BERT form with ``[0, -1, H, D]`` targets;
* ``whisper_encoder_tiny_opset14.onnx``: ``WhisperModel``'s encoder only (16 mel bins, 32 frames in, 16
  positions): q scaled before the heads split, ``k_proj`` without bias, no mask.

transformers >= 4.5x builds its masks with ``torch.vmap``, which the TorchScript exporter cannot trace;
the script swaps in transformers' own pre-vmap mask builder (``sdpa_mask_older_torch``, same values).
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


def _randomize(model, seed: int):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or (p.ndim == 1 and "norm" in name.lower()):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1 + (1.0 if name.endswith("weight") else 0.0))
    return model


class _Encoder(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask):
        return self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


class _Decoder(_Encoder):
    """GPT-2 gets its padding mask as the additive [B, 1, 1, L] ``(1 - mask)·finfo.min`` (older transformers'
    own form): transformers 4.5x's mask builder bakes the traced sequence length into the export."""

    def forward(self, input_ids, attention_mask):
        padding = (1.0 - attention_mask[:, None, None, :].to(torch.float32)) * torch.finfo(torch.float32).min
        return self.model(input_ids=input_ids, attention_mask=padding).last_hidden_state


class _Audio(torch.nn.Module):
    def __init__(self, encoder):
        super().__init__()
        self.encoder = encoder

    def forward(self, input_features):
        return self.encoder(input_features).last_hidden_state


def export_attention_models(folder: Path, seed: int) -> None:
    import transformers.masking_utils as masking
    from transformers import (DistilBertConfig, DistilBertModel, GPT2Config, GPT2Model, RobertaConfig,
                              RobertaModel, WhisperConfig, WhisperModel)

    masking.sdpa_mask = masking.sdpa_mask_older_torch  # no vmap: traceable by the TorchScript exporter
    torch.manual_seed(seed)
    text = {
        "gpt2_tiny_opset14": GPT2Model(GPT2Config(vocab_size=1000, n_positions=64, n_embd=64, n_layer=2, n_head=2,
                                                  attn_implementation="eager", use_cache=False)),
        "distilbert_tiny_opset14": DistilBertModel(DistilBertConfig(
            vocab_size=1000, max_position_embeddings=64, dim=64, n_layers=2, n_heads=2, hidden_dim=128,
            attn_implementation="eager")),
        "roberta_tiny_opset14": RobertaModel(RobertaConfig(
            vocab_size=1000, max_position_embeddings=66, hidden_size=64, num_hidden_layers=2,
            num_attention_heads=2, intermediate_size=128, attn_implementation="eager"), add_pooling_layer=False),
    }
    ids = torch.randint(0, 1000, (2, 8), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones(2, 8, dtype=torch.int64)
    axes = {"input_ids": {0: "batch", 1: "sequence"}, "attention_mask": {0: "batch", 1: "sequence"},
            "last_hidden_state": {0: "batch", 1: "sequence"}}
    for name, model in text.items():
        out = folder / f"{name}.onnx"
        wrapper = _Decoder if name.startswith("gpt2") else _Encoder
        torch.onnx.export(wrapper(_randomize(model.eval(), seed + 1)).eval(), (ids, mask), str(out),
                          input_names=["input_ids", "attention_mask"], output_names=["last_hidden_state"],
                          dynamic_axes=axes, opset_version=14, dynamo=False, do_constant_folding=True)
        print(f"wrote {out} ({out.stat().st_size / 1e6:.2f} MB)")
    config = WhisperConfig(vocab_size=1000, num_mel_bins=16, encoder_layers=2, encoder_attention_heads=2,
                           decoder_layers=1, decoder_attention_heads=2, d_model=64, encoder_ffn_dim=128,
                           decoder_ffn_dim=128, max_source_positions=16, max_target_positions=16, pad_token_id=1,
                           bos_token_id=2, eos_token_id=2, decoder_start_token_id=2, attn_implementation="eager")
    encoder = _randomize(WhisperModel(config).eval(), seed + 1).get_encoder()
    out = folder / "whisper_encoder_tiny_opset14.onnx"
    torch.onnx.export(_Audio(encoder).eval(), (torch.randn(2, 16, 32),), str(out), input_names=["input_features"],
                      output_names=["last_hidden_state"],
                      dynamic_axes={"input_features": {0: "batch"}, "last_hidden_state": {0: "batch"}},
                      opset_version=14, dynamo=False, do_constant_folding=True)
    print(f"wrote {out} ({out.stat().st_size / 1e6:.2f} MB)")


def export_distilbert_unfolded(folder: Path, seed: int) -> None:
    """``distilbert_tiny_unfolded_opset14.onnx`` and ``distilbert_tiny_sdpa_unfolded_opset14.onnx``:
    ``distilbert_tiny_opset14``'s model, with eager and with sdpa attention, exported with constant folding
    off (``do_constant_folding=False``) and a fixed sequence length (only the batch dynamic), as the zoo and
    many pipelines export, in a venv with transformers 4.57.6. Eager attention keeps
    ``mask.view(bs, 1, 1, k_length).expand_as(scores)`` ahead of the masked_fill (in float16, -65504: not
    absorbing), which expand-by-broadcast writes as ``Or(mask, never)``; sdpa attention adds transformers 4's
    ``_prepare_4d_attention_mask_for_sdpa`` mask, the inverted ``1 - m`` masked_filled with finfo(float32).min
    where nonzero, which ``--precision fp16`` keeps in a float32 softmax island. Before their keep masks were
    found, neither fused its attention under ``--precision fp16`` (DistilBERT-base: 137 and 144 nodes).
    Behind ``tests/test_precision_drift.py::test_transformers_4_distilbert_under_fp16_fuses_its_attention``."""
    from transformers import DistilBertConfig, DistilBertModel

    ids = torch.randint(0, 1000, (2, 8), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones(2, 8, dtype=torch.int64)
    axes = {"input_ids": {0: "batch"}, "attention_mask": {0: "batch"}, "last_hidden_state": {0: "batch"}}
    for suffix, attention in (("", "eager"), ("_sdpa", "sdpa")):
        torch.manual_seed(seed)
        model = DistilBertModel(DistilBertConfig(vocab_size=1000, max_position_embeddings=64, dim=64, n_layers=2,
                                                 n_heads=2, hidden_dim=128, attn_implementation=attention))
        out = folder / f"distilbert_tiny{suffix}_unfolded_opset14.onnx"
        torch.onnx.export(_Encoder(_randomize(model.eval(), seed + 1)).eval(), (ids, mask), str(out),
                          input_names=["input_ids", "attention_mask"], output_names=["last_hidden_state"],
                          dynamic_axes=axes, opset_version=14, dynamo=False, do_constant_folding=False)
        print(f"wrote {out} ({out.stat().st_size / 1e6:.2f} MB)")


def export_sdpa_models(folder: Path, seed: int) -> None:
    """``{bert,roberta,distilbert,gpt2,vit,whisper_encoder}_tiny_sdpa_opset{14,17}.onnx``: the same tiny
    architectures as :func:`export_attention_models` (plus BERT and ViT) with transformers' *default*
    attention (``attn_implementation="sdpa"``, what most users export) through the legacy exporter, which
    writes torch's ``scaled_dot_product_attention`` as MatMul/Softmax/MatMul with a ``Where(IsNaN(p), 0, p)``
    guard after the Softmax and the mask as ``Where(keep, 0, -inf)`` (issue 30). Padding in one mask row
    is left to the tests; the export uses all-ones masks."""
    import transformers.masking_utils as masking
    from transformers import (BertConfig, BertModel, DistilBertConfig, DistilBertModel, GPT2Config, GPT2Model,
                              RobertaConfig, RobertaModel, ViTConfig, ViTModel)

    if hasattr(masking, "sdpa_mask_older_torch"):  # transformers < 5.2x: no vmap, traceable
        masking.sdpa_mask = masking.sdpa_mask_older_torch
    small = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128)
    ids = torch.randint(0, 1000, (2, 8), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones(2, 8, dtype=torch.int64)
    axes = {"input_ids": {0: "batch", 1: "sequence"}, "attention_mask": {0: "batch", 1: "sequence"},
            "last_hidden_state": {0: "batch", 1: "sequence"}}
    for opset in (14, 17):
        torch.manual_seed(seed)
        text = {
            "bert": BertModel(BertConfig(vocab_size=1000, max_position_embeddings=64, attn_implementation="sdpa",
                                         **small), add_pooling_layer=False),
            "roberta": RobertaModel(RobertaConfig(vocab_size=1000, max_position_embeddings=66,
                                                  attn_implementation="sdpa", **small), add_pooling_layer=False),
            "distilbert": DistilBertModel(DistilBertConfig(
                vocab_size=1000, max_position_embeddings=64, dim=64, n_layers=2, n_heads=2, hidden_dim=128,
                attn_implementation="sdpa")),
            "gpt2": GPT2Model(GPT2Config(vocab_size=1000, n_positions=64, n_embd=64, n_layer=2, n_head=2,
                                         attn_implementation="sdpa", use_cache=False)),
        }
        for name, model in text.items():
            out = folder / f"{name}_tiny_sdpa_opset{opset}.onnx"
            wrapper = _Decoder if name == "gpt2" else _Encoder
            torch.onnx.export(wrapper(_randomize(model.eval(), seed + 1)).eval(), (ids, mask), str(out),
                              input_names=["input_ids", "attention_mask"], output_names=["last_hidden_state"],
                              dynamic_axes=axes, opset_version=opset, dynamo=False, do_constant_folding=True)
            print(f"wrote {out} ({out.stat().st_size / 1e6:.2f} MB)")
        vit = ViTModel(ViTConfig(image_size=32, patch_size=8, attn_implementation="sdpa", **small),
                       add_pooling_layer=False)
        out = folder / f"vit_tiny_sdpa_opset{opset}.onnx"
        torch.onnx.export(_Vision(_randomize(vit.eval(), seed + 1)).eval(), (torch.randn(2, 3, 32, 32),), str(out),
                          input_names=["pixel_values"], output_names=["last_hidden_state"],
                          dynamic_axes={"pixel_values": {0: "batch"}, "last_hidden_state": {0: "batch"}},
                          opset_version=opset, dynamo=False, do_constant_folding=True)
        print(f"wrote {out} ({out.stat().st_size / 1e6:.2f} MB)")
        encoder = _whisper_tiny_sdpa_encoder(seed)
        out = folder / f"whisper_encoder_tiny_sdpa_opset{opset}.onnx"
        torch.onnx.export(_Audio(encoder).eval(), (torch.randn(2, 16, 32),), str(out), input_names=["input_features"],
                          output_names=["last_hidden_state"],
                          dynamic_axes={"input_features": {0: "batch"}, "last_hidden_state": {0: "batch"}},
                          opset_version=opset, dynamo=False, do_constant_folding=True)
        print(f"wrote {out} ({out.stat().st_size / 1e6:.2f} MB)")



def _whisper_tiny_sdpa_encoder(seed: int):
    """The tiny Whisper encoder of the sdpa and dynamo exports (d_model 64, 2 layers of 2 heads, 16 mel bins,
    16 source positions), sdpa attention, weights randomized."""
    from transformers import WhisperConfig, WhisperModel

    config = WhisperConfig(vocab_size=1000, num_mel_bins=16, encoder_layers=2, encoder_attention_heads=2,
                           decoder_layers=1, decoder_attention_heads=2, d_model=64, encoder_ffn_dim=128,
                           decoder_ffn_dim=128, max_source_positions=16, max_target_positions=16,
                           pad_token_id=1, bos_token_id=2, eos_token_id=2, decoder_start_token_id=2,
                           attn_implementation="sdpa")
    return _randomize(WhisperModel(config).eval(), seed + 1).get_encoder()

class _Vision(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, pixel_values):
        return self.model(pixel_values=pixel_values).last_hidden_state


def _inline(path: Path) -> None:
    """The dynamo exporter writes the weights beside the model (``.onnx.data``); one file is kept."""
    model = onnx.load(str(path))
    onnx.save(model, str(path))
    path.with_name(path.name + ".data").unlink(missing_ok=True)


def export_dynamo_models(folder: Path, seed: int) -> None:
    """The attention-coverage models as ``torch.onnx.export``'s default exporter (dynamo, torch >= 2.9)
    writes them: opset 18, sdpa attention (onnxscript's scaled_dot_product_attention: Kᵀ through rank 3,
    ``allowzero=1`` Reshapes, a ``Where(IsNaN(p), 0, p)`` guard after a masked Softmax), LayerNormalization
    as one op, sizes read from one layer's tensors for every layer. Dynamic batch and sequence."""
    from transformers import (BertConfig, DistilBertConfig, DistilBertModel, GPT2Config, GPT2Model, RobertaConfig,
                              RobertaModel, ViTConfig, ViTModel)

    torch.manual_seed(seed)
    small = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128)
    text = {
        "bert_tiny_dynamo": BertModel(BertConfig(vocab_size=1000, max_position_embeddings=64,
                                                 attn_implementation="sdpa", **small), add_pooling_layer=False),
        "gpt2_tiny_dynamo": GPT2Model(GPT2Config(vocab_size=1000, n_positions=64, n_embd=64, n_layer=2, n_head=2,
                                                 attn_implementation="sdpa", use_cache=False)),
        "roberta_tiny_dynamo": RobertaModel(RobertaConfig(vocab_size=1000, max_position_embeddings=66,
                                                          attn_implementation="sdpa", **small),
                                            add_pooling_layer=False),
        "distilbert_tiny_dynamo": DistilBertModel(DistilBertConfig(
            vocab_size=1000, max_position_embeddings=64, dim=64, n_layers=2, n_heads=2, hidden_dim=128,
            attn_implementation="sdpa")),
    }
    ids = torch.randint(0, 1000, (2, 8), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones(2, 8, dtype=torch.int64)
    mask[1, 6:] = 0
    dims = {0: torch.export.Dim.AUTO, 1: torch.export.Dim.AUTO}
    for name, model in text.items():
        out = folder / f"{name}.onnx"
        torch.onnx.export(_Encoder(_randomize(model.eval(), seed + 1)).eval(), (ids, mask), str(out), dynamo=True,
                          input_names=["input_ids", "attention_mask"], output_names=["last_hidden_state"],
                          dynamic_shapes=(dims, dims), opset_version=18)
        _inline(out)
        print(f"wrote {out} ({out.stat().st_size / 1e6:.2f} MB)")
    vit = ViTModel(ViTConfig(image_size=32, patch_size=8, attn_implementation="sdpa", **small), add_pooling_layer=False)
    out = folder / "vit_tiny_dynamo.onnx"
    torch.onnx.export(_Vision(_randomize(vit.eval(), seed + 1)).eval(), (torch.randn(2, 3, 32, 32),), str(out),
                      dynamo=True, input_names=["pixel_values"], output_names=["last_hidden_state"],
                      dynamic_shapes=({0: torch.export.Dim.AUTO},), opset_version=18)
    _inline(out)
    print(f"wrote {out} ({out.stat().st_size / 1e6:.2f} MB)")
    encoder = _whisper_tiny_sdpa_encoder(seed)
    out = folder / "whisper_encoder_tiny_dynamo.onnx"
    torch.onnx.export(_Audio(encoder).eval(), (torch.randn(2, 16, 32),), str(out), dynamo=True,
                      input_names=["input_features"], output_names=["last_hidden_state"],
                      dynamic_shapes=({0: torch.export.Dim.AUTO},), opset_version=18)
    _inline(out)
    print(f"wrote {out} ({out.stat().st_size / 1e6:.2f} MB)")


def export_llama_fp16(folder: Path, seed: int) -> None:
    """``llama_tiny_dynamo_fp16.onnx``: a tiny Llama (hidden 64, 4 query heads, 2 key/value heads, 2 layers,
    RMSNorm weights randomized) in float16, as the dynamo exporter writes it (opset 18, sdpa): rotary
    embeddings applied to q and k after the head split, ``repeat_kv`` (Unsqueeze, Expand, Reshape) on k
    and v, a causal-and-padding mask added as ``Where(keep, 0, finfo(float16).min)``. The given-heads form
    of contrib-attention (tests/rewrites/test_attention_given_heads.py). Dynamic batch and sequence."""
    from transformers import LlamaConfig, LlamaModel

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         attn_implementation="sdpa", use_cache=False)
    model = _randomize(LlamaModel(config).eval(), seed + 1).half()
    ids = torch.randint(0, 1000, (2, 8), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones(2, 8, dtype=torch.int64)
    mask[1, :2] = 0  # left padding, as decoders are batched
    dims = {0: torch.export.Dim.AUTO, 1: torch.export.Dim.AUTO}
    out = folder / "llama_tiny_dynamo_fp16.onnx"
    torch.onnx.export(_Encoder(model).eval(), (ids, mask), str(out), dynamo=True,
                      input_names=["input_ids", "attention_mask"], output_names=["last_hidden_state"],
                      dynamic_shapes=(dims, dims), opset_version=18)
    _inline(out)
    print(f"wrote {out} ({out.stat().st_size / 1e6:.2f} MB)")


class CachedDecoder(torch.nn.Module):
    """A causal LM fed its past keys and values as plain tensors (``past_key_values.N.key``/``.value``,
    ``[B, kv_heads, P, head_dim]``), returning the logits and the grown cache (``present.N.*``,
    ``[B, kv_heads, P + S, head_dim]``): the generation-loop signature of optimum and the genai builder.
    Also used by benchmarks/decode.py (with :func:`kv_cache_signature`)."""

    def __init__(self, model, layers: int):
        super().__init__()
        self.model, self.layers = model, layers

    def forward(self, input_ids, attention_mask, position_ids, *past):
        from transformers import DynamicCache

        cache = DynamicCache()
        for i in range(self.layers):
            cache.update(past[2 * i], past[2 * i + 1], i)
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=cache, use_cache=True)
        present = [t for layer in out.past_key_values.layers for t in (layer.keys, layer.values)]
        return (out.logits, *present)


def kv_cache_signature(layers: int) -> tuple[list[str], list[str], dict]:
    """:class:`CachedDecoder`'s input names, output names and dynamic axes for ``torch.onnx.export``."""
    names = ["input_ids", "attention_mask", "position_ids"] + [
        f"past_key_values.{i}.{kv}" for i in range(layers) for kv in ("key", "value")]
    outputs = ["logits"] + [f"present.{i}.{kv}" for i in range(layers) for kv in ("key", "value")]
    axes = {"input_ids": {0: "batch", 1: "sequence"}, "attention_mask": {0: "batch", 1: "total_sequence"},
            "position_ids": {0: "batch", 1: "sequence"}, "logits": {0: "batch", 1: "sequence"},
            **{n: {0: "batch", 2: "past_sequence"} for n in names[3:]},
            **{n: {0: "batch", 2: "total_sequence"} for n in outputs[1:]}}
    return names, outputs, axes


#: ``--kv-cache --sdpa``: which (architecture, opset, float16) of :func:`export_kv_cache_models` are also
#: written with transformers' default sdpa attention, as ``{arch}_sdpa_kv_opset{opset}[_fp16].onnx``: both
#: architectures, both opsets and both element types, four files rather than eight.
SDPA_KV = (("llama", 14, False), ("llama", 17, True), ("qwen2", 14, True), ("qwen2", 17, False))


def export_kv_cache_models(folder: Path, seed: int, sdpa: bool = False) -> None:
    """``{llama,qwen2}_kv_opset{14,17}[_fp16].onnx``: tiny random Llama and Qwen2 causal LMs (vocabulary 128,
    hidden 64, 4 query heads sharing 2 key/value heads, 2 layers, eager attention; Qwen2 adds q/k/v
    biases) WITH their KV cache, legacy exporter, opset 14 and 17, float32 and float16 (``.half()``
    before tracing: torch 2.13 runs every op of these models in float16 on the CPU). Inputs
    ``input_ids [batch, sequence]``, ``attention_mask [batch, total_sequence]``, ``position_ids
    [batch, sequence]``, ``past_key_values.N.key/value [batch, 2, past_sequence, 16]``; outputs
    ``logits`` and ``present.N.key/value``. Traced at batch 2, 3 new tokens, 4 cached (distinct, so no
    size is mistaken for another). The mask is ``past + sequence`` long: the model the size derivation
    (onnxfuse/runtime/dim_relations.py) exists for, behind tests/runtime/test_dim_relations.py.

    ``sdpa`` (``--kv-cache --sdpa``): the :data:`SDPA_KV` ones with transformers' default sdpa attention
    instead (the same weights): torch's scaled_dot_product_attention symbolic scales q and k by √scale
    each, repeats the key/value heads itself (Unsqueeze, Expand, Reshape) and reshapes P·V to
    [B, -1, S, D] before transformers merges the heads."""
    from transformers import DynamicCache  # noqa: F401  (fails early on a transformers without it)
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    small = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64, attn_implementation="sdpa" if sdpa else "eager")
    batch, new, cached, layers = 2, 3, 4, 2
    names, outputs, axes = kv_cache_signature(layers)
    for arch, (config, cls) in {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}.items():
        for opset in (14, 17):
            for half in (False, True):
                if sdpa and (arch, opset, half) not in SDPA_KV:
                    continue
                torch.manual_seed(seed)
                model = _randomize(cls(config(**small)).eval(), seed + 1)
                wrapper = CachedDecoder(model, layers).eval()
                dtype = torch.float16 if half else torch.float32
                if half:
                    wrapper = wrapper.half()
                g = torch.Generator().manual_seed(seed)
                ids = torch.randint(0, 128, (batch, new), generator=g)
                mask = torch.ones(batch, cached + new, dtype=torch.int64)
                position = torch.arange(cached, cached + new).expand(batch, new)
                past = [torch.randn(batch, 2, cached, 16, generator=g).to(dtype) for _ in range(2 * layers)]
                out = folder / f"{arch}{'_sdpa' if sdpa else ''}_kv_opset{opset}{'_fp16' if half else ''}.onnx"
                torch.onnx.export(wrapper, (ids, mask, position, *past), str(out), input_names=names,
                                  output_names=outputs, dynamic_axes=axes, opset_version=opset, dynamo=False,
                                  do_constant_folding=True)
                onnx.checker.check_model(onnx.load(str(out)))
                print(f"wrote {out} ({out.stat().st_size / 1e6:.2f} MB)")



class _Seq2Seq(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, decoder_input_ids):
        return self.model(input_ids=input_ids, attention_mask=attention_mask,
                          decoder_input_ids=decoder_input_ids, use_cache=False).last_hidden_state


def export_t5(folder: Path, seed: int) -> None:
    """``t5_tiny_opset17.onnx``: a tiny random T5 (d_model 64, 4 heads of 16, feed-forward 128, 2 encoder
    and 2 decoder layers, relative position buckets, vocabulary 128; every norm weight randomized), the
    whole encoder-decoder without a cache, float32, legacy exporter, opset 17. Its 12 T5LayerNorms are
    RMSNorms (no mean, no bias), each after a residual Add but the first of each stack: the T5-style
    block of issue 30's RMSNorm item, behind tests/rewrites/test_t5_export.py."""
    from transformers import T5Config, T5Model

    torch.manual_seed(seed)
    config = T5Config(vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2,
                      num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=16,
                      decoder_start_token_id=0, pad_token_id=0)
    model = _randomize(T5Model(config).eval(), seed + 1)
    g = torch.Generator().manual_seed(seed)
    ids, decoder_ids = torch.randint(0, 128, (2, 7), generator=g), torch.randint(0, 128, (2, 5), generator=g)
    mask = torch.ones(2, 7, dtype=torch.int64)
    out = folder / "t5_tiny_opset17.onnx"
    axes = {"input_ids": {0: "batch", 1: "sequence"}, "attention_mask": {0: "batch", 1: "sequence"},
            "decoder_input_ids": {0: "batch", 1: "decoder_sequence"},
            "last_hidden_state": {0: "batch", 1: "decoder_sequence"}}
    torch.onnx.export(_Seq2Seq(model).eval(), (ids, mask, decoder_ids), str(out),
                      input_names=["input_ids", "attention_mask", "decoder_input_ids"],
                      output_names=["last_hidden_state"], dynamic_axes=axes, opset_version=17, dynamo=False,
                      do_constant_folding=True)
    onnx.checker.check_model(onnx.load(str(out)))
    print(f"wrote {out} ({out.stat().st_size / 1e6:.2f} MB)")

#: ``--kv-families``: the other Llama-family decoders of issue 31, as :func:`export_kv_cache_models` writes
#: Llama and Qwen2 (tiny, random, eager attention, legacy exporter, opset 17, float16, with past).
KV_FAMILIES = {
    # Mistral: Llama's graph plus the sliding-window mask (window 4096 by default, longer than any test)
    "mistral": ("MistralConfig", "MistralForCausalLM", {}),
    # Phi-3: q, k, v packed in one qkv_proj and gate/up in one gate_up_proj, cut by Slice; full rotation
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    # Phi-3 with partial_rotary_factor 0.5 (Phi-4-mini's form; 0.75 there): rotary on the first half of
    # each head only, the rest passed through by Concat
    "phi3_partial": ("Phi3Config", "Phi3ForCausalLM", dict(pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                                           partial_rotary_factor=0.5)),
    # Gemma: RMSNorm x·(1 + w), embeddings scaled by √hidden, one key/value head, tanh GELU
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(num_key_value_heads=1, head_dim=16)),
    # Qwen3: per-head RMSNorm of q and k before the rotary
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16)),
}


def export_kv_family_models(folder: Path, seed: int, families=None, half: bool = True) -> None:
    """``{mistral,phi3,phi3_partial,gemma,qwen3}_kv_opset17_fp16.onnx``: :data:`KV_FAMILIES` with past, made
    as :func:`export_kv_cache_models` makes ``*_kv_opset17_fp16`` (vocabulary 128, hidden 64, 4 query heads,
    2 key/value heads unless noted, head size 16, 2 layers, eager attention, every bias and norm weight
    randomized, ``.half()``, legacy exporter, traced at batch 2, 3 new tokens, 4 cached). ``half=False``
    (``--float32``): the same weights left float32, as ``{family}_kv_opset17.onnx``."""
    import transformers

    batch, new, cached, layers = 2, 3, 4, 2
    names, outputs, axes = kv_cache_signature(layers)
    for arch in families or KV_FAMILIES:
        config_name, cls_name, extra = KV_FAMILIES[arch]
        small = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                     attn_implementation="eager")
        small.update(extra)
        config = getattr(transformers, config_name)(**small)
        torch.manual_seed(seed)
        model = _randomize(getattr(transformers, cls_name)(config).eval(), seed + 1)
        wrapper = CachedDecoder(model, layers).eval()
        element = torch.float16 if half else torch.float32
        wrapper = wrapper.to(element)
        kv_heads, head = small["num_key_value_heads"], small.get("head_dim", 16)
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, 128, (batch, new), generator=g)
        mask = torch.ones(batch, cached + new, dtype=torch.int64)
        position = torch.arange(cached, cached + new).expand(batch, new)
        past = [torch.randn(batch, kv_heads, cached, head, generator=g).to(element) for _ in range(2 * layers)]
        out = folder / f"{arch}_kv_opset17{'_fp16' if half else ''}.onnx"
        torch.onnx.export(wrapper, (ids, mask, position, *past), str(out), input_names=names,
                          output_names=outputs, dynamic_axes=axes, opset_version=17, dynamo=False,
                          do_constant_folding=True)
        onnx.checker.check_model(onnx.load(str(out)))
        print(f"wrote {out} ({out.stat().st_size / 1e6:.2f} MB)")



def export_kv_dynamo_models(folder: Path, seed: int) -> None:
    """``llama_kv_dynamo[_fp16].onnx``: the tiny Llama of :func:`export_kv_cache_models` (4 query heads
    sharing 2 key/value heads, 2 layers, sdpa attention, transformers' default) with its KV cache, through
    torch's dynamo exporter (opset 18), float32 and float16. Dynamic batch, sequence, past and total
    lengths (``torch.export.Dim``); the exporter names the present caches ``past_sequence + sequence``
    and computes repeat_kv's Expand target as ``Shape(past)[2] + Shape(input_ids)[1]`` (issue 31's
    dynamo row, behind tests/rewrites/test_kv_cache_float64.py)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    layers, batch, new, cached = 2, 2, 3, 4
    small = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    names, outputs, _ = kv_cache_signature(layers)
    b, s, p, t = (torch.export.Dim(n) for n in ("batch", "sequence", "past_sequence", "total_sequence"))
    for half in (False, True):
        torch.manual_seed(seed)
        wrapper = CachedDecoder(_randomize(LlamaForCausalLM(LlamaConfig(**small)).eval(), seed + 1), layers).eval()
        dtype = torch.float16 if half else torch.float32
        wrapper = wrapper.to(dtype)
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, 128, (batch, new), generator=g)
        mask = torch.ones(batch, cached + new, dtype=torch.int64)
        position = torch.arange(cached, cached + new).expand(batch, new)
        past = [torch.randn(batch, 2, cached, 16, generator=g).to(dtype) for _ in range(2 * layers)]
        shapes = ({0: b, 1: s}, {0: b, 1: t}, {0: b, 1: s}, tuple({0: b, 2: p} for _ in past))
        out = folder / f"llama_kv_dynamo{'_fp16' if half else ''}.onnx"
        torch.onnx.export(wrapper, (ids, mask, position, *past), str(out), input_names=names, output_names=outputs,
                          dynamo=True, dynamic_shapes=shapes, opset_version=18)
        _inline(out)
        print(f"wrote {out} ({out.stat().st_size / 1e6:.2f} MB)")
def export_unfolded_models(folder: Path, seed: int) -> None:
    """``gpt2_tiny_sdpa_unfolded_opset14.onnx``: the tiny sdpa GPT-2 of :func:`export_sdpa_models` exported
    with ``do_constant_folding=False``, as the zoo exports (benchmarks/zoo.py): the sdpa symbolic's scale
    stays the size arithmetic ``Sqrt(1 / Sqrt(Cast(D)))``, which ``--precision bf16`` must fold without
    ONNX Runtime's CPU kernels (onnxfuse/rewrites/fold/bfloat16_scalars.py)."""
    import transformers.masking_utils as masking
    from transformers import GPT2Config, GPT2Model

    if hasattr(masking, "sdpa_mask_older_torch"):  # transformers < 5.2x: no vmap, traceable
        masking.sdpa_mask = masking.sdpa_mask_older_torch
    torch.manual_seed(seed)
    model = GPT2Model(GPT2Config(vocab_size=1000, n_positions=64, n_embd=64, n_layer=2, n_head=2,
                                 attn_implementation="sdpa", use_cache=False))
    ids = torch.randint(0, 1000, (2, 8), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones(2, 8, dtype=torch.int64)
    axes = {"input_ids": {0: "batch", 1: "sequence"}, "attention_mask": {0: "batch", 1: "sequence"},
            "last_hidden_state": {0: "batch", 1: "sequence"}}
    out = folder / "gpt2_tiny_sdpa_unfolded_opset14.onnx"
    torch.onnx.export(_Decoder(_randomize(model.eval(), seed + 1)).eval(), (ids, mask), str(out),
                      input_names=["input_ids", "attention_mask"], output_names=["last_hidden_state"],
                      dynamic_axes=axes, opset_version=14, dynamo=False, do_constant_folding=False)
    print(f"wrote {out} ({out.stat().st_size / 1e6:.2f} MB)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).with_name("bert_tiny_opset14.onnx"))
    ap.add_argument("--opset", type=int, default=14)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--attention", action="store_true",
                    help="write the attention-coverage models (GPT-2, DistilBERT, RoBERTa, Whisper encoder) instead")
    ap.add_argument("--dynamo", action="store_true",
                    help="write the dynamo-exporter models (BERT, RoBERTa, DistilBERT, GPT-2, ViT, Whisper encoder; "
                         "opset 18, sdpa) instead")
    ap.add_argument("--llama", action="store_true",
                    help="write the float16 dynamo Llama (rotary, grouped key/value heads) instead")
    ap.add_argument("--sdpa", action="store_true",
                    help="write BERT, RoBERTa, DistilBERT, GPT-2, ViT and Whisper-encoder with transformers' default "
                         "(sdpa) attention, legacy exporter, opset 14 and 17, instead; with --kv-cache: the "
                         "decoders SDPA_KV names with sdpa attention")
    ap.add_argument("--kv-cache", action="store_true",
                    help="write the Llama and Qwen2 decoders with past_key_values (opset 14/17, fp32/fp16) instead")
    ap.add_argument("--kv-families", nargs="*", metavar="FAMILY",
                    help=f"write the float16 opset-17 decoders with past of other families ({', '.join(KV_FAMILIES)}; "
                         "all when none is named) instead")
    ap.add_argument("--float32", action="store_true", help="with --kv-families: the float32 exports")
    ap.add_argument("--t5", action="store_true", help="write the tiny float32 T5 encoder-decoder instead")
    ap.add_argument("--unfolded", action="store_true",
                    help="write the tiny sdpa GPT-2 exported with do_constant_folding=False instead")
    ap.add_argument("--kv-dynamo", action="store_true",
                    help="write the tiny Llama with its KV cache through the dynamo exporter (fp32, fp16) instead")
    ap.add_argument("--distilbert-unfolded", action="store_true",
                    help="write distilbert_tiny{,_sdpa}_unfolded_opset14.onnx (constant folding off) instead")
    ap.add_argument("--folder", type=Path, default=Path(__file__).resolve().parent,
                    help="where --kv-families, --dynamo, --t5 and --kv-dynamo write (default: testdata)")
    args = ap.parse_args()
    if args.t5:
        export_t5(args.folder, args.seed)
    elif args.distilbert_unfolded:
        export_distilbert_unfolded(args.folder, args.seed)
    elif args.unfolded:
        export_unfolded_models(args.folder, args.seed)
    elif args.kv_dynamo:
        export_kv_dynamo_models(args.folder, args.seed)
    elif args.kv_families is not None:
        export_kv_family_models(args.folder, args.seed, args.kv_families, half=not args.float32)
    elif args.kv_cache:
        export_kv_cache_models(Path(__file__).resolve().parent, args.seed, sdpa=args.sdpa)
    elif args.sdpa:
        export_sdpa_models(Path(__file__).resolve().parent, args.seed)
    elif args.llama:
        export_llama_fp16(Path(__file__).resolve().parent, args.seed)
    elif args.dynamo:
        export_dynamo_models(args.folder, args.seed)
    elif args.attention:
        export_attention_models(Path(__file__).resolve().parent, args.seed)
    else:
        export(args.out, args.opset, args.seed)


if __name__ == "__main__":
    main()
