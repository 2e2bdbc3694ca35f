#!/usr/bin/env python3
"""Write a tiny random Qwen2 with onnxruntime-genai's model builder, for checking onnxfuse on its graphs.

The builder (``python -m onnxruntime_genai.models.builder``) writes the hand-made LLM graph that
docs' ARCHITECTURE.md names as the target of the attention rewrites: GroupQueryAttention per layer,
``attention_mask`` reduced to ``seqlens_k`` and its length used as the total sequence length, past and
present as separate ``past_key_values.N.key/value`` tensors. Validation must size it on its own: the
mask is ``past + sequence`` long (GroupQueryAttention refuses anything else).

Run it in its own environment (onnxruntime-genai pins its own ONNX Runtime; onnxfuse never needs it)::

    python3 -m venv /tmp/genai && /tmp/genai/bin/pip install onnxruntime-genai onnx-ir onnx transformers torch
    /tmp/genai/bin/python tools/genai_builder_qwen2.py --out /tmp/genai-qwen2 [--testdata testdata]

It writes ``HF/`` (config, random weights with ``save_pretrained``, a ``tokenizers`` WordLevel
tokenizer: the builder needs one but nothing reads its vocabulary here), then ``fp32-cpu/model.onnx``
(``-p fp32 -e cpu``) and ``fp16-cuda/model.onnx`` (``-p fp16 -e cuda``; the builder runs on a machine
without a GPU). Same tiny shape as ``testdata/qwen2_kv_*``: vocabulary 128, hidden 64, 4 query heads
sharing 2 key/value heads, 2 layers. Then, with onnxfuse's environment::

    onnxfuse optimize /tmp/genai-qwen2/fp32-cpu/model.onnx /tmp/out.onnx
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path


def write_hf_folder(folder: Path, seed: int) -> None:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    model = Qwen2ForCausalLM(config).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # norms and biases away from their 1 / 0 defaults, so a dropped one shows
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1 + (1.0 if "norm" in name else 0.0))
    model.save_pretrained(folder, safe_serialization=True)
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{f"w{i}": i for i in range(4, 128)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<pad>")
    fast.save_pretrained(folder)
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2,
                                                                "pad_token_id": 0}))


def build(hf: Path, out: Path, precision: str, provider: str) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o", str(out),
           "-p", precision, "-e", provider, "-c", str(out / "cache")]
    subprocess.run(cmd, check=True)
    return out / "model.onnx"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("/tmp/genai-qwen2"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--testdata", type=Path, default=None,
                    help="also write qwen2_genai_builder_{fp32,fp16}.onnx there, weights inlined (one file each)")
    args = ap.parse_args()
    hf = args.out / "HF"
    write_hf_folder(hf, args.seed)
    for precision, provider in (("fp32", "cpu"), ("fp16", "cuda")):
        path = build(hf, args.out / f"{precision}-{provider}", precision, provider)
        print(f"wrote {path} ({path.stat().st_size / 1e6:.2f} MB)")
        if args.testdata is not None:
            import onnx

            inlined = args.testdata / f"qwen2_genai_builder_{precision}.onnx"
            onnx.save(onnx.load(str(path)), str(inlined))  # the builder's .onnx.data read and written inline
            print(f"wrote {inlined} ({inlined.stat().st_size / 1e6:.2f} MB)")


if __name__ == "__main__":
    main()
