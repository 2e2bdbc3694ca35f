"""--precision fp16 converts a model the same way whatever the process did before (issue found while
proving the attention refactor byte-identical: a float16 conversion's softmax-island membership was keyed
by id() of protobuf node objects that were freed and re-created, so after other models were optimized in
the same process a Cast more or fewer came out)."""

from __future__ import annotations

import gc
import hashlib

import onnxfuse
from helpers import TESTDATA


def _digest(name: str) -> str:
    result = onnxfuse.optimize(str(TESTDATA / f"{name}.onnx"), precision="fp16", validate=False, bench=False)
    return hashlib.sha256(result.model.SerializeToString()).hexdigest()


def test_float16_conversion_does_not_depend_on_process_history():
    names = ["distilbert_tiny_opset14", "gpt2_tiny_opset14", "roberta_tiny_opset14"]
    first = {n: _digest(n) for n in names}
    for other in ["bert_tiny_opset14", "vit_blocks_opset14", "whisper_encoder_tiny_opset14"]:
        _digest(other)  # churn: objects freed, ids free for reuse
    gc.collect()
    again = {n: _digest(n) for n in names}
    assert again == first
