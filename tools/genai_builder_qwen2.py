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

``--shape qwen2-0.5b`` writes Qwen2-0.5B's decoder shape instead (24 layers, hidden 896, 14 query heads
sharing 2 key/value heads of 64, FFN 4864, rms eps 1e-6, rope theta 1e6, 32768 positions; vocabulary cut
to 32000, embeddings not tied; random weights saved in float16), ``fp16-cuda`` only (about 1 GB).

``--skeleton DIR`` also writes the ``fp16-cuda`` model's *skeleton* there, for a machine the model
itself cannot reach (benchmarks/decode.py's ``--builder-skeleton``): ``model.onnx`` with every
initializer of more than ``--skeleton-min-bytes`` bytes removed, and ``skeleton.json`` listing them
(name, dtype, dims) with the HF config and ``genai_config.json``. :func:`load_skeleton` puts random
values of those shapes back (weights normal·0.02, norm weights 1, ``cos_cache``/``sin_cache`` the
rotary tables of the config's rope theta): the graph and every shape are the builder's; only the
values are not. Loading needs only onnx and numpy.
"""

from __future__ import annotations

import argparse
import math
import json
import subprocess
import sys
from pathlib import Path


#: Qwen2Config arguments of each ``--shape`` (benchmarks/decode.py builds its torch model from the same).
SHAPES = {
    "tiny": dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                 bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False),
    "qwen2-0.5b": dict(vocab_size=32000, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                       num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                       rms_norm_eps=1e-6, rope_theta=1000000.0, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                       tie_word_embeddings=False),
}
#: The builder's runs (precision, execution provider) for each shape.
BUILDS = {"tiny": (("fp32", "cpu"), ("fp16", "cuda")), "qwen2-0.5b": (("fp16", "cuda"),)}
SKELETON_JSON = "skeleton.json"


def write_hf_folder(folder: Path, seed: int, shape: str = "tiny") -> None:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config = Qwen2Config(**SHAPES[shape])
    model = Qwen2ForCausalLM(config).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # norms and biases away from their 1 / 0 defaults, so a dropped one shows
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1 + (1.0 if "norm" in name else 0.0))
    if shape != "tiny":
        model = model.half()  # the builder casts to float16 anyway; half the file
    model.save_pretrained(folder, safe_serialization=True)
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{f"w{i}": i for i in range(4, config.vocab_size)}}
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


def write_skeleton(model_path: Path, hf: Path, out: Path, min_bytes: int) -> Path:
    """``out/model.onnx`` (the builder's graph without its initializers over ``min_bytes``) and
    ``out/skeleton.json`` (those initializers' name, dtype and dims; the HF and genai configs)."""
    import onnx
    from onnx import helper

    model = onnx.load(str(model_path))  # external data read in
    kept, removed = [], []
    for t in model.graph.initializer:
        dtype = helper.tensor_dtype_to_np_dtype(t.data_type)
        size = int(dtype.itemsize) * math.prod(t.dims)
        if size > min_bytes:
            removed.append({"name": t.name, "dtype": dtype.name, "dims": [int(d) for d in t.dims]})
        else:
            kept.append(t)
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)
    out.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(out / "model.onnx"))
    genai = model_path.with_name("genai_config.json")
    (out / SKELETON_JSON).write_text(json.dumps({
        "source": str(model_path), "min_bytes": min_bytes,
        "config": json.loads((hf / "config.json").read_text()),
        "genai_config": json.loads(genai.read_text()) if genai.is_file() else None,
        "initializers": removed}, indent=1))
    total = sum(p.stat().st_size for p in out.iterdir())
    print(f"wrote skeleton {out} ({len(removed)} initializers left out, {total / 1e6:.2f} MB)")
    return out


def load_skeleton(folder: Path, seed: int = 0):
    """The skeleton's model with its left-out initializers back, random: ``(onnx.ModelProto, skeleton.json's
    dict)``. Timing depends on shapes only, so random values serve as well as the builder's."""
    import numpy as np
    import onnx
    from onnx import numpy_helper

    meta = json.loads((folder / SKELETON_JSON).read_text())
    model = onnx.load(str(folder / "model.onnx"))
    config = meta["config"]
    theta = float(config.get("rope_theta") or (config.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    rng = np.random.default_rng(seed)
    pool = (rng.standard_normal(1 << 20, dtype=np.float32) * 0.02)
    for i, spec in enumerate(meta["initializers"]):
        name, dtype, dims = spec["name"], np.dtype(spec["dtype"]), spec["dims"]
        n = int(np.prod(dims, dtype=np.int64))
        if name in ("cos_cache", "sin_cache"):  # [positions, rotary_dim / 2]: cos/sin(position · inv_freq)
            half = dims[1]
            inv_freq = 1.0 / theta ** (np.arange(0, 2 * half, 2, dtype=np.float64) / (2 * half))
            angles = np.outer(np.arange(dims[0], dtype=np.float64), inv_freq)
            value = (np.cos(angles) if name == "cos_cache" else np.sin(angles)).astype(dtype)
        elif not np.issubdtype(dtype, np.floating):
            raise SystemExit(f"{folder}: left-out initializer {name} is {dtype}; only float ones can be made up")
        elif "norm" in name.lower() and len(dims) == 1:
            value = np.ones(dims, dtype)
        else:  # weights and biases: normal·0.02, from a shifted pool (fast; values do not matter for timing)
            value = np.resize(np.roll(pool, 7919 * i), n).astype(dtype).reshape(dims)
        model.graph.initializer.append(numpy_helper.from_array(value, name))
    return model, meta


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("/tmp/genai-qwen2"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--skeleton", type=Path, default=None,
                    help="also write the fp16-cuda model's skeleton (graph, big initializers listed) there")
    ap.add_argument("--skeleton-min-bytes", type=int, default=512,
                    help="initializers larger than this are left out of the skeleton (default 512)")
    ap.add_argument("--testdata", type=Path, default=None,
                    help="also write qwen2_genai_builder_{fp32,fp16}.onnx there, weights inlined (one file each)")
    args = ap.parse_args()
    if args.testdata is not None and args.shape != "tiny":
        ap.error("--testdata is for the tiny shape only")
    hf = args.out / "HF"
    write_hf_folder(hf, args.seed, args.shape)
    for precision, provider in BUILDS[args.shape]:
        path = build(hf, args.out / f"{precision}-{provider}", precision, provider)
        print(f"wrote {path} ({path.stat().st_size / 1e6:.2f} MB)")
        if args.skeleton is not None and (precision, provider) == ("fp16", "cuda"):
            write_skeleton(path, hf, args.skeleton, args.skeleton_min_bytes)
        if args.testdata is not None:
            import onnx

            inlined = args.testdata / f"qwen2_genai_builder_{precision}.onnx"
            onnx.save(onnx.load(str(path)), str(inlined))  # the builder's .onnx.data read and written inline
            print(f"wrote {inlined} ({inlined.stat().st_size / 1e6:.2f} MB)")


if __name__ == "__main__":
    main()
