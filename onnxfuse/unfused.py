"""What stayed unfused: the decomposed patterns that have a fused form left in the output, counted, with
the reason given most often (issue 30: BERT-base exported with transformers' default attention kept all
12 Softmax and the default output did not say so).

A rule that turns a decomposed pattern into one fused op anchors each candidate at the pattern's core op
(contrib-attention at the Softmax, contrib-gelu at the Erf, ...). A refused candidate whose anchor is
still in the output graph, still of that op type, is a pattern that stayed decomposed: a later rule did
not take it either (fuse-elementwise absorbing an Erf into a FusedElementwise makes it gone, and fused,
so it is not counted). :data:`LEFT_BEHIND` names, per rule, the op types for which this holds; rules
whose refusals mostly mean "not my pattern" are left out: a Sigmoid that is SiLU is no QuickGelu, and a
Tanh is as often BERT's pooler activation as a GELU (contrib-fast-gelu's refusal of the pooler is no
fusion missed).

The result is plain data (``to_dict`` rows) for the report and the command line; the reasons are
grouped with the quoted names they mention folded (:func:`reason_pattern`), as ``--explain`` groups them.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import asdict, dataclass

#: rule → op types whose survival (as the anchor of one of the rule's refusals) means the pattern that
#: rule fuses stayed decomposed.
LEFT_BEHIND: dict[str, tuple[str, ...]] = {
    "contrib-attention": ("Softmax",),
    "contrib-gelu": ("Erf",),
    "contrib-layernorm": ("ReduceMean",),
    "contrib-rmsnorm": ("ReduceMean",),  # a lone RMSNorm (one after a residual Add is contrib-skip-rmsnorm's)
    # a fused Attention left on a raw mask: without a promise, the float16 ones --right-padded would give key
    # lengths (the reason names the input); with one, why the promise did not apply
    "contrib-mask-lengths": ("Attention",),
}

#: Quoted names inside a refusal reason ('/layers.0/Add_output_0'): replaced to group alike reasons.
_QUOTED = re.compile(r"(?<![A-Za-z])'[^']*'(?![A-Za-z])|\"[^\"]*\"")  # an apostrophe (Softmax's) is no quote


def reason_pattern(reason: str) -> str:
    """A refusal reason with the names it quotes replaced by ``<name>``, so that reasons that differ only in
    the node or tensor they name count as one."""
    return _QUOTED.sub("<name>", reason)


@dataclass
class Unfused:
    rule: str
    op: str
    count: int  # anchors of this op left in the output
    reason: str  # the most frequent reason (names folded)
    reason_count: int  # how many of the count gave it

    def to_dict(self) -> dict:
        return asdict(self)


def unfused_patterns(refusals, output_ops_by_name: dict[str, str]) -> list[Unfused]:
    """The rows for ``refusals`` (:class:`~onnxfuse.rewrites.Refusal`) against the output graph's
    ``{node name: op type}``, most frequent first. A node refused for several reasons counts once, under
    the reason it was given first."""
    first_reason: dict[tuple[str, str], str] = {}
    for r in refusals:
        ops = LEFT_BEHIND.get(r.rule)
        if ops and output_ops_by_name.get(r.node) in ops:
            first_reason.setdefault((r.rule, r.node), reason_pattern(r.reason))
    # A node two rules refused (a LayerNorm's variance ReduceMean is also an RMSNorm candidate) counts
    # once, for the rule listed first in LEFT_BEHIND.
    order = {rule: k for k, rule in enumerate(LEFT_BEHIND)}
    owner: dict[str, str] = {}
    for rule, node in sorted(first_reason, key=lambda key: order[key[0]]):
        owner.setdefault(node, rule)
    groups: dict[tuple[str, str], Counter] = {}
    for (rule, node), reason in first_reason.items():
        if owner[node] == rule:
            groups.setdefault((rule, output_ops_by_name[node]), Counter())[reason] += 1
    rows = []
    for (rule, op), reasons in groups.items():
        reason, n = reasons.most_common(1)[0]
        rows.append(Unfused(rule, op, sum(reasons.values()), reason, n))
    return sorted(rows, key=lambda u: (-u.count, u.rule))
