"""The ``ai.onnxfuse.AttentionInputs`` op as the rules write and read it: its type and its ``spec``
attribute (the contract: docs/custom-ops.md; the kernels: onnxfuse/custom_ops/csrc/attention_inputs.cc).
contrib-attention-inputs writes the node, contrib-grouped-attention-inputs rewrites its spec."""

from __future__ import annotations

#: The op's type (domain ``onnxfuse.custom_ops.DOMAIN``).
OP_TYPE = "AttentionInputs"

#: The keys of the op's ``spec`` attribute, in the order it is written; ``grouped`` and ``bias`` are
#: optional (0).
SPEC_KEYS = ("num_heads", "kv_num_heads", "head_size", "rotary_dim", "interleaved", "grouped", "bias")
OPTIONAL_KEYS = ("grouped", "bias")


def spec_text(num_heads, kv_num_heads, head_size, rotary_dim, interleaved, grouped=0, bias=0) -> str:
    """The op's ``spec`` attribute (docs/custom-ops.md); ``grouped`` and ``bias`` written only when 1."""
    values = (num_heads, kv_num_heads, head_size, rotary_dim, interleaved, grouped, bias)
    return " ".join(f"{k}={int(v)}" for k, v in zip(SPEC_KEYS, values) if k not in OPTIONAL_KEYS or v)


def read_spec(node) -> dict | None:
    """An AttentionInputs node's ``spec`` as {key: int}, ``grouped`` and ``bias`` 0 when absent; None when it is not
    one this module writes (unknown keys, a missing one, a value that is not an int)."""
    text = node.attrs.get("spec")
    if text is None:
        return None
    text = text.decode() if isinstance(text, bytes) else str(text)
    spec = dict.fromkeys(OPTIONAL_KEYS, 0)
    for item in text.split():
        key, _, value = item.partition("=")
        if key not in SPEC_KEYS or not value.lstrip("-").isdigit():
            return None
        spec[key] = int(value)
    return spec if all(k in spec for k in SPEC_KEYS) else None
