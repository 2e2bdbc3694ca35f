"""Random attention graphs for the idempotence and equality fuzzer (``tools/fuzz_optimize.py
--attention``): the decomposed forms of ``tests/rewrites/test_contrib_attention.attention_model`` under
random options, with the additive mask replaced, at random, by a constant of a random broadcastable
shape (the case issue 29 found not idempotent: contrib-attention expanded it after fold-constants ran).

``check_attention_seed(seed)`` returns what ``fuzz_graphs.check_seed`` returns, for the same verdicts."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parent / "rewrites" / "contrib"))

from test_contrib_attention import S, attention_model, feeds_for  # noqa: E402

MASKS = (None, "padding", "causal", "full", "where", "where_swapped", "where_add", "constant")
CONSTANT_SHAPES = ((S,), (1, S), (1, 1, S), (1, 1, 1, S), (S, S), (1, 1, S, S), (1, S, S))


def random_attention_model(seed: int) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    mask = MASKS[rng.integers(len(MASKS))]
    dtype = np.float16 if rng.random() < 0.3 else np.float32
    options = dict(kt=str(rng.choice(["one", "two"])), scale=str(rng.choice(["scores", "qk"])),
                   bias=bool(rng.random() < 0.7), casts=bool(rng.random() < 0.2),
                   shape_reads=bool(rng.random() < 0.2), q_prescale=bool(rng.random() < 0.2),
                   k_bias=bool(rng.random() < 0.8), dtype=dtype, seed=seed)
    if mask == "constant":
        model = attention_model(mask="causal", **options)
        shape = CONSTANT_SHAPES[rng.integers(len(CONSTANT_SHAPES))]
        values = np.where(rng.random(shape) < 0.3, -10000.0, 0.0).astype(dtype)
        values[..., 0] = 0  # keep a key in every row
        i = next(k for k, t in enumerate(model.graph.initializer) if t.name == "madd")
        model.graph.initializer[i].CopyFrom(numpy_helper.from_array(values, "madd"))
        del model.graph.value_info[:]
        return model
    cross = mask not in ("causal",) and rng.random() < 0.3
    return attention_model(mask=mask, cross=cross, **options)


def check_attention_seed(seed: int, target: str | None = None) -> tuple[str, str]:
    import fuzz_graphs

    return fuzz_graphs.check_seed(seed, target, make=random_attention_model, inputs=feeds_for)
