"""Graph rewrite rules: the registry, rule selection, and ``apply_rules``.

Adding a rule = one file defining a :class:`~onnxfuse.rewrites.base.Rule` subclass + one line in
``RULES`` below. Order matters: rules run in list order (folding first, then ONNX Runtime contrib
patterns, then generic elementwise fusion, which takes whatever is left).
"""

from __future__ import annotations

from onnxfuse.errors import OnnxfuseError, UsageError
from onnxfuse.rewrites.base import TARGETS, ApplyReport, Refusal, Rule, RuleFailed
from onnxfuse.rewrites.cleanup import cleanup

# --- the registry: one line per rule, in the order they run -------------------------------------
from onnxfuse.rewrites.fold_constants import FoldConstants
from onnxfuse.rewrites.reshape_target import ConstantReshapeTarget
from onnxfuse.rewrites.fold_batchnorm import FoldBatchNormIntoConv, FoldBatchNormIntoConvTranspose, FoldBatchNormIntoGemm
from onnxfuse.rewrites.fold_scale_bias import FoldScaleBias
from onnxfuse.rewrites.contrib_gelu import ContribBiasGelu, ContribFastGelu, ContribGelu, ContribQuickGelu
from onnxfuse.rewrites.contrib_layernorm import ContribLayerNorm, ContribSkipLayerNorm
from onnxfuse.rewrites.contrib_softmax_matmul import ContribFusedMatMulScale, ContribFusedMatMulTranspose
from onnxfuse.rewrites.contrib_fused_conv import ContribFusedConv
from onnxfuse.rewrites.conv_bias_lift import LiftConvBiasIntoElementwise
from onnxfuse.rewrites.fuse_elementwise import FuseElementwiseRegions

RULES: list[Rule] = [
    FoldConstants(),  # first: static sizes and constants let the pattern rules below match
    ConstantReshapeTarget(),
    FoldBatchNormIntoConv(),
    FoldBatchNormIntoConvTranspose(),
    FoldBatchNormIntoGemm(),
    FoldScaleBias(),
    ContribQuickGelu(),
    ContribGelu(),
    ContribFastGelu(),
    ContribBiasGelu(),
    ContribSkipLayerNorm(),
    ContribLayerNorm(),
    ContribFusedMatMulScale(),  # before the transpose rule, which also folds into the FusedMatMul it makes
    ContribFusedMatMulTranspose(),
    ContribFusedConv(),  # contrib-bias-softmax is CUDA-only (no CPU kernel): not registered by default
    LiftConvBiasIntoElementwise(),  # decides with fuse-elementwise's own region analysis
    FuseElementwiseRegions(),  # last: takes whatever elementwise ops are left
]
# ---------------------------------------------------------------------------------------------------

#: Safety net against a rule that keeps matching its own output.
MAX_PASSES_PER_RULE = 64
#: Rounds over the rule list (a later round starts at the first rule that refused something before a
#: later rule changed the graph).
MAX_ROUNDS = 4


def rule_names() -> list[str]:
    return [r.name for r in RULES]


def _parse_names(spec) -> list[str]:
    if spec is None:
        return []
    if isinstance(spec, str):
        spec = [spec]
    names: list[str] = []
    for item in spec:
        names.extend(n.strip() for n in item.split(",") if n.strip())
    return names


def select_rules(target: str = "cuda", only=None, skip=None, rules: list[Rule] | None = None) -> list[Rule]:
    """The rules to run for ``target``, restricted by ``only`` and ``skip`` (comma-separated names)."""
    if target not in TARGETS:
        raise UsageError(f"unknown target {target!r}; choose one of: {', '.join(TARGETS)}")
    pool = RULES if rules is None else rules
    known = {r.name for r in pool}
    only_names, skip_names = _parse_names(only), _parse_names(skip)
    for n in only_names + skip_names:
        if n not in known:
            raise UsageError(f"unknown rule {n!r}; `onnxfuse rules` lists them: {', '.join(sorted(known))}")
    chosen = [r for r in pool if target in r.targets and (not r.opt_in or r.name in only_names)]
    if only_names:
        chosen = [r for r in chosen if r.name in only_names]
    return [r for r in chosen if r.name not in skip_names]


def apply_rules(graph, rules: list[Rule]) -> ApplyReport:
    """Apply ``rules`` in order to ``graph`` (in place), each until it stops matching.

    Cleanup runs first, after every pass that changed something, and last. Returns a count per rule
    (every selected rule appears, zero included), the refusals (deduplicated) and rewrite details.
    """
    report = ApplyReport(counts={r.name: 0 for r in rules})
    seen: set[Refusal] = set()

    def _cleanup(count_dead: bool = False):
        # Only the first sweep's dead nodes were dead in the input; later sweeps remove what rules
        # bypassed, which the rule counts already report.
        for key, n in cleanup(graph).items():
            if key != "dead-node" or count_dead:
                report.cleanup[key] = report.cleanup.get(key, 0) + n

    _cleanup(count_dead=True)
    tail = list(rules)
    changes = 0  # rewrites made so far: a rule whose last run saw the same count sees the same graph
    seen_at: dict[str, int] = {}
    for _ in range(MAX_ROUNDS):
        applied, refused = [], set()
        for rule in tail:
            if seen_at.get(rule.name) == changes:  # nothing changed since this rule last ran
                applied.append(0)
                continue
            try:
                n, had_refusals = _apply_one(graph, rule, report, seen, _cleanup)
            except (MemoryError, RuleFailed, OnnxfuseError):  # out of memory or environment: not the rule's bug
                raise
            except Exception as e:  # a broken rule: the pipeline drops it and applies the others
                raise RuleFailed(rule.name, e) from e
            changes += n
            seen_at[rule.name] = changes
            applied.append(n)
            if had_refusals:
                refused.add(rule.name)
        # A rule that refused a candidate may accept it once a later rule has rewritten its
        # surroundings (a Transpose absorbed into a FusedMatMul exposes the scale before it): run again
        # from the first such rule, so that a second optimize finds nothing (idempotence). Rules that
        # saw no change since their last run are skipped.
        again = next((k for k, rule in enumerate(tail) if rule.name in refused and any(applied[k + 1:])), None)
        if again is None:
            break
        tail = tail[again:]
    _cleanup()
    return report


def _apply_one(graph, rule: Rule, report: ApplyReport, seen: set[Refusal], cleanup_pass) -> tuple[int, bool]:
    """One rule, pass after pass until it stops matching, with a cleanup after every changing pass.
    Returns (rewrites made, whether any candidate was refused in its last pass)."""
    total = 0
    for _ in range(MAX_PASSES_PER_RULE):
        applied = 0
        refused = False
        for match in list(rule.match(graph)):
            reason = rule.check(graph, match)
            if reason:
                refused = True
                refusal = Refusal(rule.name, rule.anchor_name(match), reason)
                if refusal not in seen:
                    seen.add(refusal)
                    report.refusals.append(refusal)
                continue
            detail = rule.rewrite(graph, match)
            applied += 1
            if detail:
                report.details.append({"rule": rule.name, **detail})
        report.counts[rule.name] += applied
        total += applied
        if not applied:
            break
        cleanup_pass()
    return total, refused


__all__ = ["RULES", "Rule", "Refusal", "RuleFailed", "ApplyReport", "TARGETS", "apply_rules", "select_rules", "rule_names"]
