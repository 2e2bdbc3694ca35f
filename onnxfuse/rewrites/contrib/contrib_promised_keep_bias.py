"""contrib-promised-keep-bias: float16 ``Attention``'s raw [B, L] ``mask_index`` → a keep
``attention_bias`` ``Where(keep, 0, -65504)`` [B, 1, S, L], under the user's promise that the mask input is
right-padded (``--right-padded NAME``).

Why
---
contrib-attention writes a keep mask as a raw ``mask_index`` wherever a float16 ``attention_bias`` would not
be exact: a row with every key masked is uniform in the original (finfo(float32).min on every key, or a
float32 softmax island), and a bias of -65504 would weigh that row's keys by their scores instead. A raw
mask takes ONNX Runtime's unfused float16 kernel (BERT-base sdpa under ``--precision fp16``: 1.20-1.29x
its optimized ``.half()`` export's time, docs/benchmarks.md 5.61). The promise rules that row out: every
row of NAME keeps n >= 1 keys. Then the bias the ``.half()`` export's model already has is exact, and it
takes ONNX Runtime's memory-efficient kernel. The other promised form, 1-D key lengths
(contrib-mask-lengths), takes its fused runner instead, measured slower on an H200 (docs/benchmarks.md
5.63: same model, same rounds).

What
----
With ``--right-padded NAME``, every float16 packed ``Attention`` whose ``mask_index`` the promise covers
(:func:`~onnxfuse.rewrites.contrib.attention.promised_masks.promised_mask`) reads no ``mask_index`` and
the ``attention_bias`` ``Where(Expand(Unsqueeze(keep, [1, 2]), [B, 1, S, L]), 0, -65504)``, keep being the
bool tensor the mask was cast from (``Cast(mask_index, bool)`` otherwise: the kernels keep a key where
the mask is nonzero), written by :func:`~onnxfuse.rewrites.contrib.attention.bias.build_keep_bias`, one
tensor for every layer that reads the same mask.

Exact under the promise: the kernel adds the bias to the scaled scores in float32 and takes the softmax
in float32, so a masked key weighs exp(s + -65504 - max), where max is at least the row's kept scores:
0 in float32 whenever the masked score is less than 65400 above the row's largest kept one, which the
scores of a float16 model (at most 65504 in magnitude, and in practice far smaller) leave only for a
masked score near float16's maximum beside a kept one near its minimum; the original weighs it 0 too
(finfo(float32).min added, or a masked_fill). Kept keys get the original's weights. A row with no key
kept, the one case where the two differ, is what the promise excludes; validation draws right-padded
rows for NAME, and fails, naming this rule, if the mask is not NAME's rows.

Without a promise the rule changes nothing: it refuses each float16 ``Attention`` whose mask derives from
one input alone and which that input's promise would change, with a reason naming it, which the output's
"not fused" line shows (the promise is the user's to give: a left-padded mask breaks it).

Refused: not float16 (float32 keeps the raw mask, measured faster there, 5.10; bfloat16 not measured:
contrib-mask-lengths gives it lengths); a mask the promise does not cover, with the reason.
"""

from __future__ import annotations

import copy

import numpy as np
import onnx_graphsurgeon as gs

from onnxfuse.rewrites.contrib.attention.bias import build_keep_bias, unsqueezed
from onnxfuse.rewrites.contrib.attention.keep_masks import KeepMask
from onnxfuse.rewrites.contrib.attention.policy import keep_bias_fill
from onnxfuse.rewrites.contrib.attention.promised_masks import bool_keep_source, promised_mask, raw_mask_attentions
from onnxfuse.rewrites.contrib.matching import ContribRule
from onnxfuse.rewrites.engine.edit import NameAllocator
from onnxfuse.rewrites.engine.rule import Refuse
from onnxfuse.rewrites.facts.graph import FP16, consumers, dims_equal, dtype_of, int_attr, is_op, shape_of, value_sources

#: Attention's input slots: (input, weights, bias, mask_index, past, attention_bias)
MASK_INDEX, ATTENTION_BIAS = 3, 5

#: The measurement the no-promise reason quotes (docs/benchmarks.md 5.61 and 5.63).
GAIN = ("BERT-base sdpa under --precision fp16 on an H200: 1.20-1.29x its .half() export's time with a raw mask; "
        "docs/benchmarks.md 5.61, 5.63")


class ContribPromisedKeepBias(ContribRule):
    name = "contrib-promised-keep-bias"
    description = ("float16 Attention's raw [B, L] mask → a keep attention_bias, when it derives from an input "
                   "promised right-padded (--right-padded NAME; without it, names the ones it would change)")
    right_padded: frozenset[str] = frozenset()

    def under(self, assumptions):
        rule = copy.copy(self)
        rule.right_padded = assumptions.right_padded
        return rule

    def match(self, graph):
        candidates = [n for n in raw_mask_attentions(graph) if dtype_of(graph, n.inputs[0]) == FP16]
        if self.right_padded:
            return candidates
        # no promise: only the ops that the promise of their mask's one input would change, each refused
        # with a reason that names the promise (the output's "not fused" line)
        return [n for n in candidates if _one_promisable_input(graph, n) is not None]

    def analyze(self, graph, node):
        if not self.right_padded:  # match kept only the ops the promise of their mask's one input changes
            (name,) = value_sources(node.inputs[MASK_INDEX])  # match proved it the one input
            return Refuse(f"no promise about input {name}: in float16 a raw mask takes ONNX Runtime's unfused attention "
                          f"kernel; if {name} holds right-padded rows (n >= 1 ones, then zeros), --right-padded {name} "
                          f"makes it an attention_bias, which the fused kernels take ({GAIN})")
        return promised_mask(graph, node, self.right_padded)

    def apply(self, graph, node, found):
        mask, promised = found
        names = NameAllocator(graph)
        base = node.name or "attention"
        keep, negate = _keep_rows(graph, bool_keep_source(mask) or _as_bool(graph, names, base, mask))
        keep4 = _rows_as_rank4(graph, keep) or unsqueezed(graph, names, base, keep, np.array([1, 2], np.int64), np.bool_)
        x = node.inputs[0]
        bias = build_keep_bias(graph, names, base, KeepMask(keep=keep4, negate=negate, fill=keep_bias_fill(FP16)),
                               x, x, 1, FP16)
        while len(node.inputs) <= ATTENTION_BIAS:
            node.inputs.append(gs.Variable.empty())
        node.inputs[MASK_INDEX] = gs.Variable.empty()
        node.inputs[ATTENTION_BIAS] = bias
        node.attrs.pop("mask_filter_value", None)  # read only with a mask_index
        return {"op": "com.microsoft.Attention", "mask_form": "keep attention_bias", "right_padded": promised}


def _one_promisable_input(graph, node) -> str | None:
    """The one input whose values ``node``'s mask derives from, where that input's promise would cover the
    mask; else None."""
    sources = value_sources(node.inputs[MASK_INDEX])
    if sources is None or len(sources) != 1:
        return None
    return None if isinstance(promised_mask(graph, node, frozenset(sources)), Refuse) else next(iter(sources))


def _as_bool(graph, names, base, mask):
    """``Cast(mask, bool)``, True where the kernels keep a key (nonzero): an earlier layer's, else a new one."""
    for node in consumers(mask):
        if is_op(node, "Cast") and int_attr(node, "to", 0) == 9 and node.inputs[0] is mask:
            return node.outputs[0]
    keep = gs.Variable(names(f"{base}/promised_keep"), dtype=np.bool_)
    graph.nodes.append(gs.Node("Cast", names(f"{base}/promised_keep"), {"to": 9}, inputs=[mask], outputs=[keep]))
    return keep


def _keep_rows(graph, keep) -> tuple[gs.Tensor, bool]:
    """(tensor, negate): ``keep`` itself, or y with ``negate`` when ``keep`` is ``Not(y)`` (what
    contrib-attention writes for a mask that drops where its condition is True): the bias's Where then
    reads y with its branches swapped, one op fewer."""
    producer = keep.inputs[0] if keep.inputs else None
    if is_op(producer, "Not"):
        return producer.inputs[0], True
    return keep, False


def _rows_as_rank4(graph, rows) -> gs.Tensor | None:
    """The [B, 1, 1, L] tensor ``t`` when ``rows`` is ``Flatten(t, axis=1)`` of it (what contrib-attention
    writes for a key padding mask): Unsqueeze(rows, [1, 2]) would give ``t`` back. Else None."""
    flatten = rows.inputs[0] if rows.inputs else None
    if not is_op(flatten, "Flatten") or int_attr(flatten, "axis", 1) != 1:
        return None
    source = flatten.inputs[0]
    shape = shape_of(graph, source)
    if shape is None or len(shape) != 4 or not (dims_equal(shape[1], 1) and dims_equal(shape[2], 1)):
        return None
    return source
