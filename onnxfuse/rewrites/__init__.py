"""Graph rewrites: the facts about a graph (``facts/``: constants, shapes, size proofs, scopes), the
engine (``engine/``) and the rules, in families (``fold/``, ``contrib/``, ``elementwise/``), one rule per
file named after the rule (``fold-batchnorm-conv`` is ``fold/fold_batchnorm_conv.py``).

Adding a rule = one file defining one :class:`~onnxfuse.rewrites.engine.rule.Rule` subclass in its
family's folder + one line in ``ORDER`` below + its tests in ``tests/rewrites/FAMILY/test_NAME.py``. A
rule imports the facts, the engine and its family's shared (non-rule) modules, never another rule.
"""

from __future__ import annotations

import importlib

from onnxfuse.errors import UsageError
from onnxfuse.rewrites.engine.apply import MAX_PASSES_PER_RULE, MAX_ROUNDS, apply_rules
from onnxfuse.rewrites.engine.assumptions import NO_ASSUMPTIONS, Assumptions
from onnxfuse.rewrites.engine.rule import TARGETS, ApplyReport, GraphPass, Plan, Refusal, Refuse, Rule, RuleFailed

# --- the registry: "family/rule-name", one line per rule, in the order they run ---------------------
#
# Why this order:
# * fold first. fold-constants evaluates constant and static-size subgraphs, so every rule after it
#   sees constants instead of Shape→Gather→… chains (the pattern rules match constants only);
#   constant-reshape-target then needs those constants to tell copied from computed sizes. The
#   BatchNorm and scale folds run before anything fuses the ops they fold into a Conv/Gemm.
# * contrib next: an ONNX Runtime contrib kernel (Gelu, LayerNorm, FusedMatMul) beats a generic
#   elementwise region, so these patterns take their nodes before fuse-elementwise can.
# * elementwise last: conv-bias-into-elementwise decides with fuse-elementwise's own region analysis,
#   so it runs right before it, after the folds gave the Conv its final bias; fuse-elementwise takes
#   whatever elementwise ops are left; concat-into-elementwise then moves the Concats of its results
#   into FusedConcat nodes (it needs fuse-elementwise's nodes).
ORDER = [
    "fold/fold-constants",  # first: static sizes and constants let the pattern rules below match
    "fold/fold-weight-upcast",  # early: the pattern rules match constant weights, not Casts of float16 ones
    "fold/reshape-allowzero",  # early: the pattern rules match allowzero=0 Reshapes (dynamo writes 1)
    "fold/cancel-cast-roundtrip",  # before contrib-attention: float16 Llama's Softmax → Cast ↑ → Cast ↓ → MatMul
    "fold/fold-weight-transpose",  # before contrib-fused-matmul-transpose would absorb it as transB
    "fold/fold-size-sentinel",  # before constant-reshape-target: the sizes it keeps can then be copies
    "fold/constant-reshape-target",
    "fold/merged-axes-transpose",  # before contrib-attention: dynamo's Kᵀ through rank 3 becomes one Transpose
    "fold/unpack-qkv-heads",  # after constant-reshape-target (its constant target), before contrib-attention: timm's packed q, k, v
    "fold/repeat-heads-gather",  # before expand-by-broadcast, which would turn repeat_kv's Expand into a Where
    "fold/expand-by-broadcast",  # like constant-reshape-target: no Shape chain left on the CPU
    "fold/gemm-rows-to-matmul",  # after constant-reshape-target: it reads the unflatten's constant [-1, S, N]
    "fold/cancel-row-transposes",  # after gemm-rows-to-matmul, whose MatMul it sees through
    "fold/concat-split-parts",  # before contrib-channels-last: fewer innermost-axis copies in NHWC
    "fold/fold-batchnorm-conv",
    "fold/fold-batchnorm-convtranspose",
    "fold/fold-batchnorm-gemm",
    "fold/fold-scale-bias",
    "contrib/contrib-channels-last",  # after the BatchNorm and scale folds (their Conv weights), before the elementwise rules fuse on NHWC tensors (opt-in, CUDA only)
    "contrib/contrib-attention",  # before the FusedMatMul rules, which would take its scale and Kᵀ (opt-in)
    "contrib/contrib-mask-lengths",  # after contrib-attention, whose raw masks it reads (--right-padded only)
    "contrib/contrib-grouped-queries",  # opt-in; after contrib-attention, whose MultiHeadAttention over repeated K/V it regroups
    "contrib/contrib-quick-gelu",
    "contrib/contrib-gelu",
    "contrib/contrib-fast-gelu",
    "contrib/contrib-bias-gelu",  # after the Gelu rules: it absorbs the Add before the Gelu they make
    "contrib/contrib-skip-layernorm",  # before contrib-layernorm, which would take the LayerNorm without its Add
    "contrib/contrib-layernorm",
    "contrib/contrib-embed-layernorm",  # after contrib-layernorm, whose LayerNormalization it takes
    "contrib/contrib-mixed-rmsnorm",  # before contrib-skip-rmsnorm, which would take the float32 part and leave the cast and γ
    "contrib/contrib-skip-rmsnorm",  # before contrib-rmsnorm, which would take the RMSNorm without its Add
    "contrib/contrib-rmsnorm",
    "contrib/contrib-rotary-embedding",  # after contrib-rmsnorm, whose ReduceMeans would block the opset raise
    "contrib/contrib-kv-cache-attention",  # opt-in; after contrib-rotary-embedding: it moves the key's RotaryEmbedding onto the op's [B, S, E] input
    "contrib/contrib-fused-matmul-scale",  # before the transpose rule, which also folds into the FusedMatMul it makes
    "contrib/contrib-fused-matmul-transpose",
    "contrib/contrib-fused-conv",  # contrib-bias-softmax is CUDA-only (no CPU kernel): not registered by default
    "fold/gathernd-index-grid",  # like flat-index-gather, for the dynamo exporter's GatherND form
    "fold/flat-index-gather",  # before range-by-cumsum, which would turn its Ranges into CumSums
    "fold/range-by-cumsum",  # after contrib-attention, which proves mask shapes through the Range's named length
    "fold/pack-sibling-matmuls",  # after the contrib rules (Attention packs BERT's q, k, v itself), before fuse-elementwise
    "contrib/contrib-attention-inputs",  # after pack-sibling-matmuls, whose Split of the packed q/k/v it reads
    "contrib/contrib-grouped-attention-inputs",  # after contrib-attention-inputs, whose node it regroups
    "contrib/contrib-decode-attention",  # after contrib-grouped-attention-inputs, whose grouped rows it reads
    "contrib/contrib-channel-transpose",  # opt-in; after contrib-channels-last, whose boundary transposes it takes
    "elementwise/conv-bias-into-elementwise",  # decides with fuse-elementwise's own region analysis
    "elementwise/upsample-by-broadcast",  # after conv-bias-into-elementwise, whose bias Add it views too; before fuse-elementwise fuses the view
    "elementwise/fuse-elementwise",  # takes whatever elementwise ops are left
    "elementwise/concat-into-elementwise",  # right after fuse-elementwise: it absorbs the FusedElementwise nodes that one writes
]
# ---------------------------------------------------------------------------------------------------


def rule_module(entry: str) -> str:
    """The module holding a rule: ``"fold/fold-batchnorm-conv"`` → ``onnxfuse.rewrites.fold.fold_batchnorm_conv``."""
    family, name = entry.split("/")
    return f"{__name__}.{family}.{name.replace('-', '_')}"


def load_rule(entry: str) -> Rule:
    """An instance of the one rule class of ``entry``'s module whose ``name`` is the entry's rule name."""
    name = entry.split("/")[1]
    module = importlib.import_module(rule_module(entry))
    found = [c for c in vars(module).values()
             if isinstance(c, type) and issubclass(c, Rule) and c.__module__ == module.__name__ and c.name == name]
    if len(found) != 1:
        raise ImportError(f"{module.__name__} defines {len(found)} rules named {name!r}; expected one")
    return found[0]()


RULES: list[Rule] = [load_rule(entry) for entry in ORDER]


def rule_names() -> list[str]:
    return [r.name for r in RULES]


def parse_rule_names(spec) -> list[str]:
    """``--only``/``--skip`` as names: a comma-separated string, or a list of them, split and stripped."""
    if spec is None:
        return []
    if isinstance(spec, str):
        spec = [spec]
    names: list[str] = []
    for item in spec:
        names.extend(n.strip() for n in item.split(",") if n.strip())
    return names


#: The devices a model can be optimized for (``optimize --device``), the default first.
DEVICES = ("cuda", "cpu")


def target_for_device(target: str | None, device: str = "cuda") -> str:
    """The rule target a run for ``device`` uses: ``target`` when given, else the device's own.

    ``cpu`` defaults to (and allows only) ``contrib`` or ``onnx``: the cuda-only rules
    (fuse-elementwise, conv-bias-into-elementwise) write FusedElementwise, whose CPU kernel is an
    interpreter meant as a correctness reference. Measured on ONNX Runtime's CPU provider
    (docs/benchmarks.md 5.22, 2 cores): the default output is slower than the original on 8 of the 59
    testdata models, the CNNs and small graphs whose elementwise ops it fuses, from 0.96x down to 0.10x
    (efficientnet blocks), while ``--device cpu`` gives 0.99x-3.22x on all 59 (0.99x: a model no rule
    applies to, within noise). Every op the contrib and standard rules wrote there has a CPU kernel and was
    validated on the CPU provider: Attention, MultiHeadAttention, SkipLayerNormalization,
    SkipSimplifiedLayerNormalization, EmbedLayerNormalization, Gelu, FastGelu, BiasGelu, QuickGelu,
    FusedMatMul, LayerNormalization, SimplifiedLayerNormalization, RMSNormalization and RotaryEmbedding
    (opset 23). ``contrib`` also maps SiLU to QuickGelu, which the cuda target leaves to FusedElementwise."""
    if device not in DEVICES:
        raise UsageError(f"unknown device {device!r}; choose one of: {', '.join(DEVICES)}")
    if target is None:
        return "contrib" if device == "cpu" else "cuda"
    if device == "cpu" and target == "cuda":
        raise UsageError("--target cuda writes FusedElementwise, whose CPU kernel is an interpreter (down to 0.1x "
                         "the original on ONNX Runtime's CPU provider, docs/benchmarks.md 5.22); with --device cpu use "
                         "--target contrib (its default) or onnx")
    return target


def select_rules(target: str = "cuda", only=None, skip=None, rules: list[Rule] | None = None,
                 assumptions: Assumptions = NO_ASSUMPTIONS) -> list[Rule]:
    """The rules to run for ``target``, restricted by ``only`` and ``skip`` (comma-separated names), each
    configured with the user's ``assumptions`` about the inputs (:meth:`Rule.under`). An ``only`` name
    written ``+name`` adds that (opt-in) rule to the default ones instead of restricting to it."""
    if target not in TARGETS:
        raise UsageError(f"unknown target {target!r}; choose one of: {', '.join(TARGETS)}")
    pool = RULES if rules is None else rules
    known = {r.name for r in pool}
    requested, skip_names = parse_rule_names(only), parse_rule_names(skip)
    added = [n[1:] for n in requested if n.startswith("+")]
    only_names = [n for n in requested if not n.startswith("+")]
    for n in only_names + added + skip_names:
        if n not in known:
            raise UsageError(f"unknown rule {n!r}; `onnxfuse rules` lists them: {', '.join(sorted(known))}")
    chosen = [r for r in pool if target in r.targets and (not r.opt_in or r.name in only_names or r.name in added)]
    if only_names:
        chosen = [r for r in chosen if r.name in only_names or r.name in added]
    return [r.under(assumptions) for r in chosen if r.name not in skip_names]


__all__ = ["Assumptions", "NO_ASSUMPTIONS", "RULES", "ORDER", "Rule", "GraphPass", "Plan", "Refuse", "Refusal", "RuleFailed", "ApplyReport", "TARGETS",
           "MAX_PASSES_PER_RULE", "MAX_ROUNDS", "apply_rules", "select_rules", "DEVICES", "target_for_device",
           "rule_names", "load_rule", "rule_module", "parse_rule_names"]
