"""Never hand back a slower model: when the optimized model times slower than the original on the device
it is for (the GPU, or the CPU with ``--device cpu``),
fall back step by step to fewer rewrites, down to the unrewritten graph, and say so.

Why: the rules decide by static patterns and thresholds measured on a few GPUs. Where one of those
decisions goes the wrong way on the user's GPU and shapes, the user used to get a slower model with exit
0 (issue 32: a Whisper-base encoder in float32 came out 0.71x the original at batch 8 on an H200, 1.08x
with its attention left unfused; the same model measures 1.10x fused on an H100, docs/benchmarks.md
5.18: no static threshold gets both right).

What: after timing, the optimized model is *slower* when both its median and its fastest run exceed
the original's by more than :data:`SLOWER_MARGIN` (host-bound runs are noisy; the two statistics must
agree, so one lucky or unlucky burst does not decide). Then each rung of :data:`LADDER` whose rules
applied is tried in order, cumulatively leaving out more rules: the kernels whose speed depends on the
GPU and shapes first (the channels-last layout, which chose cuDNN's NHWC convolutions; the
AttentionInputs kernel of a KV-cache decoder, whose float32 and bfloat16 speed was not measured; the
fused attention ops, which chose ONNX Runtime's attention kernels), then FusedConcat (its placed kernels
store through a division per element or row, measured only on the YOLO-style detector,
docs/benchmarks.md 5.65), then FusedElementwise (the generated kernels), and last every rule (the graph
as loaded, after repairs and any precision conversion). Each candidate is rewritten, validated like the first model and timed against
the original again (interleaved, same inputs); the first that is not slower is kept. The original graph
is not slower than itself by definition, so the ladder always ends. What was measured and what was
kept go in the report (``selection``) and in one note.

Off with ``never_slower=False`` (``--allow-slower``), and whenever timing did not run (``--device cuda``
without a GPU, or ``--no-bench``): nothing is measured then, so nothing is decided. With ``--device cpu``
the same ladder runs on CPU timings (the cpu rule set writes no FusedElementwise, so that rung never
applies there).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

#: Relative slowdown below which a difference counts as noise.
SLOWER_MARGIN = 0.03

#: (what the rung leaves out, the rules it adds to the skipped set), tried in order, cumulatively.
LADDER = [
    ("channels-last layout", ("contrib-channels-last",)),  # opt-in; cuDNN's NHWC kernels by GPU and shape
    ("DecodeAttention kernel", ("contrib-decode-attention",)),  # our split-K decode kernel; MultiHeadAttention stays
    ("grouped query rows", ("contrib-grouped-attention-inputs",)),  # back to repeated K/V heads
    ("AttentionInputs kernel", ("contrib-attention-inputs",)),  # our KV-cache kernel; the attention stays
    ("fused attention", ("contrib-attention", "contrib-mask-lengths")),
    ("upsampled reads", ("upsample-by-broadcast",)),  # the Resize's copy again; its readers on the full map
    ("concatenation writes", ("concat-into-elementwise",)),  # FusedConcat's placed kernels; Concat again
    ("FusedElementwise kernels", ("fuse-elementwise", "conv-bias-into-elementwise")),
    ("every rewrite", None),  # None: all rules
]


def sizes(timing) -> list:
    """The timings of one model at each size it was timed at: the first size's, then those of
    ``--tune-shape`` (``timing.other_sizes``)."""
    return [timing] + list(getattr(timing, "other_sizes", None) or [])


def _ratio(timing, stat: str) -> float | None:
    """optimized / original by one statistic (``median_ms`` or ``min_ms``) of one size's timing; None where
    that size did not time."""
    if timing is None or timing.status != "ok" or timing.original is None or timing.optimized is None:
        return None
    before = getattr(timing.original.stats, stat)
    return getattr(timing.optimized.stats, stat) / before if before > 0 else None


def _size_slowdown(timing) -> float | None:
    ratios = [_ratio(timing, stat) for stat in ("median_ms", "min_ms")]
    return None if None in ratios else min(ratios) - 1.0


def _per_size_slowdowns(timing) -> list[float] | None:
    """:func:`_size_slowdown` at each of :func:`sizes`; None when some size did not time."""
    if timing is None:
        return None
    found = [_size_slowdown(t) for t in sizes(timing)]
    return None if None in found else found


def slowdown(timing) -> float | None:
    """How much slower the optimized model is (0.05 = 5%), by the smaller of the median and minimum
    ratios, at the size where it is slowest (a model timed at several sizes, ``--tune-shape``, is never
    kept slower at any of them); None when timing did not run at every size."""
    found = _per_size_slowdowns(timing)
    return None if found is None else max(found)


def is_slower(timing) -> bool:
    found = slowdown(timing)
    return found is not None and found > SLOWER_MARGIN


@dataclass
class Candidate:
    """One rung: its model, rewrite report and validation (None when validation is off) and timing."""

    name: str
    skipped: frozenset
    model: object = None
    applied: object = None
    validation: object = None
    timing: object = None
    refused: str | None = None  # why it was not kept (failed validation, slower, timing failed)


@dataclass
class Selection:
    """What was measured and kept; ``to_dict`` is the report's ``selection``."""

    first_slowdown: float
    tried: list = field(default_factory=list)
    kept: Candidate | None = None
    device: str = "cuda"  # where the timings were taken (the note names it)

    def to_dict(self) -> dict:
        def row(c: Candidate) -> dict:
            t = c.timing
            ok = t is not None and t.status == "ok"
            return {"candidate": c.name, "skipped_rules": sorted(c.skipped),
                    "original_ms": round(t.original.stats.median_ms, 6) if ok else None,
                    "candidate_ms": round(t.optimized.stats.median_ms, 6) if ok else None,
                    "slowdown": round(slowdown(t), 4) if ok else None, "refused": c.refused}
        return {"first_slowdown": round(self.first_slowdown, 4), "tried": [row(c) for c in self.tried],
                "kept": self.kept.name if self.kept else None}

    def note(self) -> str:
        kept = self.kept
        tried = "; ".join(f"without {c.name}: " + (c.refused or "kept") for c in self.tried)
        where = "CPU" if self.device == "cpu" else "GPU"
        return (f"the optimized model measured {self.first_slowdown:+.1%} slower than the original on this {where}, "
                f"so fewer rewrites were tried ({tried}); wrote the model without {kept.name}"
                + (" (the graph as loaded)" if kept.skipped == ALL else ""))


#: marker for "every rule skipped"
ALL = frozenset({"*"})


def ladder(applied_rules) -> list[tuple[str, frozenset]]:
    """The rungs worth trying for a model whose rewrite applied ``applied_rules``: cumulative skip sets,
    a rung kept only when it leaves out a rule that applied; the last always leaves out everything."""
    applied, skipped, out = set(applied_rules), set(), []
    for name, rules in LADDER:
        if rules is None:
            out.append((name, ALL))
            break
        if applied & set(rules):
            skipped |= set(rules)
            out.append((name, frozenset(skipped)))
    return out


#: Seconds of tuning (the ladder's candidates and the measured choices, each rewritten, validated and
#: timed) after the first timing, by default: about a dozen candidates of BERT-base on a GPU. Past it no
#: new candidate starts; the ladder then goes straight to the graph as loaded (never slower), the
#: measured choices stop (``--tune-time``).
TUNE_TIME_S = 60.0


def deadline_passed(deadline: float | None) -> bool:
    """``deadline`` (``time.monotonic()``, None: none) is behind us: the one test of the tuning deadline,
    here and between the sizes of a trial's timing (:mod:`onnxfuse.tune_sizes`)."""
    return deadline is not None and time.monotonic() > deadline


class TrialCut(Exception):
    """A measured choice's timing stopped at the tuning deadline between two sizes
    (:func:`onnxfuse.tune_sizes.time_beside_at_sizes`): the trial is refused, not decided on fewer sizes
    than the user named. The message says how far it got."""


def keep_not_slower(timing, applied_rules, attempt: Callable, retime: Callable,
                    deadline: float | None = None) -> Selection | None:
    """None when the first model is not slower (or was not timed); else the :class:`Selection` whose
    ``kept`` candidate is the first rung that validated and timed not slower. ``attempt(skipped)``
    returns (model, applied, validation) or raises/returns a reason string; ``retime(model)`` times
    it against the original (a timing result). Past ``deadline`` (``time.monotonic()``) no rung but the
    graph as loaded starts."""
    if not is_slower(timing):
        return None
    selection = Selection(first_slowdown=slowdown(timing), device=getattr(timing, "device", "cuda"))
    for name, skipped in ladder(applied_rules):
        if skipped != ALL and deadline_passed(deadline):  # out of tuning time: the graph as loaded is never slower
            selection.tried.append(Candidate(name=name, skipped=skipped, refused="not tried: tuning time spent"))
            continue
        candidate = Candidate(name=name, skipped=skipped)
        selection.tried.append(candidate)
        made = attempt(skipped)
        if isinstance(made, str):
            candidate.refused = made
            continue
        candidate.model, candidate.applied, candidate.validation = made
        candidate.timing = retime(candidate.model)
        if skipped == ALL:  # the graph as loaded: not slower than itself whatever this timing says
            selection.kept = candidate
            break
        if candidate.timing is None or candidate.timing.status != "ok":
            candidate.refused = "timing failed"
            continue
        if is_slower(candidate.timing):
            candidate.refused = f"{slowdown(candidate.timing):+.1%} slower"
            continue
        selection.kept = candidate
        break
    return selection


# --- measured choices: rules a timing adds or takes away (issue 32 item 1, issue 34 item 3) ---------------

def _holds(op: str, least: int) -> Callable:
    """The output's main graph holds at least ``least`` nodes of ``op``."""
    return lambda model: [n.op_type for n in model.graph.node].count(op) >= least


#: The fused attention ops contrib-attention writes.
_ATTENTION_OPS = {"Attention", "MultiHeadAttention"}


def _float32_attention(model) -> bool:
    """The output holds a fused attention op and its weights are mostly float32 (a float32 model: most
    float initializers FLOAT). In float16 the fused kernels (flash attention) measured faster everywhere;
    in float32 they did not (Whisper-base encoder, batch 8: 0.71x the original fused, 1.08x not, one H200
    run; 1.10x fused on an H100, docs/benchmarks.md 5.18), so there a timing decides."""
    if not any(n.op_type in _ATTENTION_OPS and n.domain == "com.microsoft" for n in model.graph.node):
        return False
    kinds = [t.data_type for t in model.graph.initializer if t.data_type in (1, 10, 16)]  # FLOAT, FLOAT16, BFLOAT16
    return bool(kinds) and kinds.count(1) * 2 > len(kinds)


@dataclass(frozen=True)
class Choice:
    """A decision a timing makes where optimize times the model: ``rule`` added on top of the output (an
    opt-in rule, ``add``) or taken away from it, where ``worth(output model)`` says the output holds what
    it concerns, or, with ``after``, where the choice of that rule comes first and may write it (the
    trial then runs only when that one was kept or the model it would build on holds it already)."""

    rule: str
    add: bool
    worth: Callable
    after: str | None = None

    @property
    def change(self) -> str:
        return "add" if self.add else "remove"


def _layout_transposes(model) -> bool:
    """The model holds an NCHW ↔ NHWC Transpose (what contrib-channel-transpose takes): an exporter's (a
    converted TensorFlow model's input), or a kept contrib-channels-last's boundary."""
    layouts = {(0, 2, 3, 1), (0, 3, 1, 2)}
    return any(n.op_type == "Transpose" and any(a.name == "perm" and tuple(a.ints) in layouts for a in n.attribute)
               for n in model.graph.node)


#: Rules whose worth depends on the GPU and the shapes, tried where the device times the output.
#: contrib-channels-last (opt-in, added) measured 1.10-1.32x faster than the default output on ConvNeXt-T,
#: ResNet-50 and a YOLO-style detector (H200, fp32 and fp16, batch 1 and 16, docs/benchmarks.md 5.26), not
#: on depthwise nets. contrib-channel-transpose (opt-in, added; after it, on the transposes it writes): the
#: YOLO-style detector 4% faster in fp32 and 8% in fp16 at batch 16 (H200, 5.57). contrib-attention
#: (default, taken away) in float32 models: see _float32_attention. A measurement on the user's GPU
#: decides all three.
MEASURED = (Choice("contrib-channels-last", True, _holds("Conv", 2)),
            Choice("contrib-channel-transpose", True, _layout_transposes, after="contrib-channels-last"),
            Choice("contrib-attention", False, _float32_attention))


def measured_choices(model, selected: list[str], skipped: list[str], applied: set[str]) -> list[Choice]:
    """The choices of :data:`MEASURED` worth a trial on ``model`` (an onnx ModelProto: the run's output): an
    addition not already selected (``--only +rule``) nor skipped; a removal of a rule that applied
    (``applied``); each only where its ``worth`` holds, or its ``after`` choice is tried before it."""
    chosen: list[Choice] = []
    for c in MEASURED:
        eligible = c.rule not in selected and c.rule not in skipped if c.add else c.rule in applied
        if eligible and (c.worth(model) or any(k.rule == c.after for k in chosen)):
            chosen.append(c)
    return chosen


def speedups(timing) -> list[float] | None:
    """Per size, original / optimized by the larger of the median and the fastest run ratios (what the
    reports show; :func:`is_faster` decides on each statistic separately); None when timing did not run
    at every size."""
    found = _per_size_slowdowns(timing)
    return None if found is None else [1.0 / (1.0 + f) for f in found]


def speedup(timing) -> float | None:
    """:func:`speedups`' geometric mean (the one size's speed-up when timed at one)."""
    found = speedups(timing)
    return None if found is None else math.prod(found) ** (1.0 / len(found))


def is_faster(candidate_timing, current_timing) -> bool:
    """The candidate's speed-up over the original beats the current output's by more than
    :data:`SLOWER_MARGIN`, each measured against the original in its own interleaved run (so a drift of
    the GPU's clock between the two runs cancels out): :func:`why_not_faster` finds no reason against it."""
    return why_not_faster(candidate_timing, current_timing) is None


def why_not_faster(candidate_timing, current_timing) -> str | None:
    """None when the candidate is faster than the current output (:func:`is_faster`), else the first
    reason against it, naming the statistic and the size that refused it (the reports' speed-ups are the
    better of two statistics, so a refusal beside a larger speed-up needs saying which one lost: the zoo's
    ConvNeXt-T read "1.75x the original against 1.45x without it: not kept", docs/benchmarks.md 5.48).

    Timed at several sizes (``--tune-shape``): by the geometric mean of the per-size gains, and at no size
    more than the margin slower (so a layout faster at batch 1 and slower at batch 16 is not kept for
    both. Why: MobileNetV3-L's --precision fp16 output kept channels-last on a batch-1 timing and took
    1.18x the time, at batch 16, of the half() export's output, which had not kept it; 5.42).

    Timed in one session (no :func:`session_gains`), both statistics must agree: the gain by median
    latency and the gain by fastest run each pass on their own, as :func:`is_slower` asks of a slowdown,
    so one lucky run (or one stalled stretch) of a host-bound timing does not decide (the zoo's
    MobileNetV3-L at batch 1 measured 0.87x by median and 1.27x by fastest run in one --quick run, 1.33x
    by both in another, 5.42).

    Timed side by side in several fresh sessions (:func:`session_gains`), the median decides, pooled and
    session by session, and the candidate must be faster in every session (pooled samples can hide a
    session it lost). docs/benchmarks.md 5.59, the YOLO-style detector's channels-last in float32:

    - The fastest run does not decide there: the sessions are the replication it stood in for, and the
      fastest of some hundred pooled runs is set by one rare run of either model. The trial read +15% and
      +10% by session median at the validation shape, +17.6% and +17.8% at batch 16, and was refused "by
      fastest run over the sizes -0.6%".
    - A session's gain is its geometric mean over the sizes, not each size's: a host-bound size moves by
      more than a choice's gain from one session to the next. Asking every (size, session) cell to win
      refused +14.2% and -0.7% at 1 × 3 × 640 × 640 with +18.4% and +17.8% at batch 16, and that output
      ran 1.29× slower at batch 16 than the run that kept it.

    A size that loses beyond the margin by the pooled figures still refuses it (above)."""
    # start-up: tune_sizes loads the input samplers (numpy), which importing this module does not
    from onnxfuse.tune_sizes import shapes_text

    if candidate_timing is None or current_timing is None:
        return "not timed"
    new, old = sizes(candidate_timing), sizes(current_timing)
    if len(new) != len(old):
        return "not timed at every size"
    per_size = session_gains(candidate_timing, current_timing)
    statistics = (("median_ms", "median"),) if per_size else (("median_ms", "median"), ("min_ms", "fastest run"))
    for stat, label in statistics:
        pairs = [(_ratio(n, stat), _ratio(o, stat)) for n, o in zip(new, old)]
        if any(not r_new or r_old is None for r_new, r_old in pairs):
            return "not timed at every size"
        gains = [r_old / r_new for r_new, r_old in pairs]  # the candidate's speed-up over the output's
        mean = math.prod(gains) ** (1.0 / len(gains))
        if not mean > 1.0 + SLOWER_MARGIN:
            where = "" if len(gains) == 1 else " over the sizes"
            return f"by {label}{where} {_percent(mean)} against the output (needs more than +{SLOWER_MARGIN:.0%})"
        worst = min(range(len(gains)), key=gains.__getitem__)
        if gains[worst] < 1.0 - SLOWER_MARGIN:
            shapes = shapes_text(getattr(new[worst], "shapes", None)) or f"size {worst + 1}"
            return (f"by {label} at {shapes} {_percent(gains[worst])} against the output (may lose at most "
                    f"{SLOWER_MARGIN:.0%} at any size)")
    sessions = min(map(len, per_size)) if per_size else 0
    for s in range(sessions):
        gain = math.prod(g[s] for g in per_size) ** (1.0 / len(per_size))
        if not gain > 1.0:
            where = "over the sizes" if len(per_size) > 1 else \
                f"at {shapes_text(getattr(new[0], 'shapes', None)) or 'size 1'}"
            return (f"in session {s + 1} of {sessions} {where} {_percent(gain)} against the output "
                    "(must be faster in every session)")
    return None


def session_gains(candidate_timing, current_timing) -> list[list[float]] | None:
    """Per size, per fresh session, the candidate's gain over the incumbent (the incumbent's median over
    the candidate's, both from that session) where both were timed side by side in several sessions
    (``timing.compare_beside``: one original shared), else None. Pooled samples can hide a session in
    which the candidate lost; a choice kept on them would rest on one session's level (module docstring
    of :mod:`onnxfuse.timing.compare`, ``compare_beside``)."""
    if candidate_timing is None or current_timing is None:
        return None
    new, old = sizes(candidate_timing), sizes(current_timing)
    if len(new) != len(old):
        return None
    found = []
    for n, o in zip(new, old):
        if n.original is None or n.original is not o.original or n.optimized is None or o.optimized is None:
            return None
        ours, theirs = n.optimized.session_medians_ms, o.optimized.session_medians_ms
        if len(ours) < 2 or len(ours) != len(theirs) or min(ours) <= 0:
            return None
        found.append([t / c for c, t in zip(ours, theirs)])
    return found


def _percent(gain: float) -> str:
    """A speed gain as a signed percentage of speed: 1.05 → ``+5.0%``."""
    return f"{(gain - 1.0) * 100:+.1f}%"


@dataclass
class Trial:
    """One measured choice tried on the output: what it gave and whether it was kept."""

    choice: Choice
    model: object = None
    applied: object = None
    validation: object = None
    timing: object = None
    refused: str | None = None
    #: for ``refused == "not faster"``: which statistic at which size refused it (:func:`why_not_faster`)
    detail: str | None = None
    #: the incumbent (the output with the choices kept so far) timed in the trial's own run, beside it
    #: (:func:`try_measured`); None where the trial was judged against the incumbent's earlier timing
    without: object = None

    @property
    def rule(self) -> str:
        return self.choice.rule

    def against(self, current_timing):
        """The incumbent's timing the trial is judged against: its own run's, else ``current_timing``."""
        return current_timing if self.without is None else self.without

    def to_dict(self, current_timing) -> dict:
        new, old = speedup(self.timing), speedup(self.against(current_timing))  # None where not timed
        per_session = session_gains(self.timing, self.without)  # None unless timed side by side
        return {"rule": self.rule, "change": self.choice.change, "kept": self.refused is None,
                "speedup": None if new is None else round(new, 4),
                "without_speedup": None if old is None else round(old, 4), "refused": self.refused,
                "refused_detail": self.detail,
                "session_gains": None if per_session is None else [[round(g, 4) for g in s] for s in per_session]}

    def note(self, current_timing) -> str:
        new, old = speedup(self.timing), speedup(self.against(current_timing))
        what = self.rule if self.choice.add else f"without {self.rule}"
        measured = ("not timed" if new is None or old is None else
                    f"{new:.2f}x the original against {old:.2f}x " + ("without it" if self.choice.add else "with it"))
        why = self.refused if self.detail is None else f"{self.refused}: {self.detail}"
        return f"measured choice {what}: {measured}: " + ("kept" if self.refused is None else f"not kept ({why})")


def try_measured(current_timing, choices: list[Choice], attempt: Callable, retime: Callable,
                 deadline: float | None = None, current_model=None) -> list[Trial]:
    """Each of ``choices`` tried in turn on the output timed as ``current_timing``: ``attempt(added,
    removed)`` rewrites with the choices kept so far plus this one (rules added, rules taken away) and
    validates, returning (model, applied, validation) or a reason string; ``retime(model)`` times it
    against the original. A trial is kept when it changed the model (an added rule applied) and it
    :func:`is_faster`; the next trial builds on the kept ones. Nothing is tried when the output was not
    timed; none starts past ``deadline`` (``time.monotonic()``), nor where the longest trial so far would
    end past it (EfficientNet-B0's float16 trial took most of the 60 s on an H200, docs/benchmarks.md
    5.59), and a ``retime`` that stops a trial between two sizes at the deadline (:class:`TrialCut`: the
    pipeline's does) refuses it: ``--tune-time`` is then overrun by at most one size of one trial.

    Given ``current_model`` (the output ``current_timing`` timed), each trial is timed beside the
    incumbent, ``retime(model, beside=incumbent)`` → (trial's timing, incumbent's), in one run, and judged
    against that run's incumbent timing (``Trial.without``), not the earlier one: two runs' ratios to
    the original differ by more than a choice's gain on a host-bound size (``timing.compare_beside``)."""
    trials: list[Trial] = []
    if speedup(current_timing) is None:
        return trials
    incumbent = current_model
    added: list[str] = []
    removed: list[str] = []
    longest = 0.0  # the longest trial so far, in seconds: one that would not end before the deadline is not started
    for choice in choices:
        trial = Trial(choice=choice)
        trials.append(trial)
        if deadline_passed(deadline):
            trial.refused = "not tried: tuning time spent"
            continue
        if deadline is not None and time.monotonic() + longest > deadline:
            trial.refused = f"not tried: tuning time spent (a trial took {longest:.0f} s, less is left)"
            continue
        started = time.monotonic()
        if choice.after is not None and choice.after not in added and incumbent is not None \
                and not choice.worth(incumbent):  # saves a rewrite and a validation that would change nothing
            trial.refused = f"not tried: {choice.after} not kept"
            continue
        try:  # a trial is optional: whatever breaks in it costs the trial, never the run
            made = attempt(added + [choice.rule] * choice.add, removed + [choice.rule] * (not choice.add))
            if isinstance(made, str):
                trial.refused = made
                continue
            trial.model, trial.applied, trial.validation = made
            if choice.add and not trial.applied.counts.get(choice.rule):
                trial.refused = "does not apply"
                continue
            if incumbent is None:
                trial.timing = retime(trial.model)
            else:
                trial.timing, trial.without = retime(trial.model, beside=incumbent)
        except TrialCut as exc:
            trial.refused = f"not finished: tuning time spent ({exc})"
            continue
        except Exception as exc:  # noqa: BLE001 - reported, not raised
            trial.refused = f"failed: {type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
            continue
        longest = max(longest, time.monotonic() - started)
        trial.detail = why_not_faster(trial.timing, trial.against(current_timing))
        if trial.detail is not None:
            trial.refused = "not faster"
            continue
        (added if choice.add else removed).append(choice.rule)
        current_timing = trial.timing
        if incumbent is not None:
            incumbent = trial.model
    return trials


# --- both in an optimize run ------------------------------------------------------------------------------
# ``result`` is the run's OptimizeResult (its ``timing``, ``applied``, ``rules`` and ``extra`` read and set
# here); the pipeline passes its candidate maker ``fewer(skipped, added=())`` (rewritten, then validated
# as the first model was: (model, applied, validation) or why it cannot be kept), ``retime(model)`` (the
# candidate timed against the original) and ``adopt(model, applied, validation, added=())`` (``result``
# then describes that candidate), so this module never imports the pipeline above it.


def deadline_after(tune_time: float | None) -> float:
    """When tuning (the never-slower ladder, the measured choices) starts no new candidate: now plus
    ``tune_time`` seconds (``--tune-time``; :data:`TUNE_TIME_S` when None)."""
    return time.monotonic() + (TUNE_TIME_S if tune_time is None else tune_time)


def fall_back_if_slower(result, fewer: Callable, retime: Callable, adopt: Callable, deadline: float | None = None) -> None:
    """:func:`keep_not_slower` on the run: when the output timed slower than the original, fewer rewrites
    (``fewer(skipped)``), each validated and timed, down to the graph as loaded; ``result`` then describes
    the one kept (the report's ``selection``, one note)."""
    selection = keep_not_slower(result.timing, result.applied.applied_rules(), fewer, retime, deadline)
    if selection is None:
        return
    kept = selection.kept
    adopt(kept.model, kept.applied, kept.validation)
    if kept.timing is not None and kept.timing.status == "ok":
        result.timing = kept.timing
    result.timing.notes.append(selection.note())
    result.extra["selection"] = selection.to_dict()


def add_measured_choices(result, options, fewer: Callable, retime: Callable, adopt: Callable,
                         deadline: float | None = None) -> None:
    """:func:`try_measured` on the run: the measured choices (:data:`MEASURED`) tried on top of the output,
    each validated and timed against the original beside the output (one run: ``retime(model,
    beside=output)``); ``result`` then describes the output with those that
    were faster. Their trials go in the report (``measured``) and one note each. Not with a restricting
    ``--only`` (the user chose the rules), and only rules of the target (``--target contrib``/``onnx``,
    ``--device cpu``: channels-last is for the CUDA provider)."""
    # start-up: it loads numpy, onnx, graphsurgeon, which importing this module does not
    from onnxfuse.rewrites import parse_rule_names, select_rules

    if any(not name.startswith("+") for name in parse_rule_names(options.only)):
        return
    target_rules = {r.name for r in select_rules(options.target, [f"+{c.rule}" for c in MEASURED if c.add], None,
                                                 options.rules)}
    candidates = [c for c in measured_choices(result.model, result.rules, parse_rule_names(options.skip),
                                              set(result.applied.applied_rules()))
                  if c.rule in target_rules]
    if not candidates or result.timing is None or result.timing.status != "ok":
        return
    before = result.timing
    trials = try_measured(before, candidates,
                          lambda added, removed: fewer(frozenset(removed), added=tuple(added)), retime, deadline,
                          current_model=result.model)
    kept = [t for t in trials if t.refused is None]
    notes = [t.note(before) for t in trials]
    result.extra["measured"] = [t.to_dict(before) for t in trials]
    if kept:
        last = kept[-1]
        adopt(last.model, last.applied, last.validation, [t.rule for t in kept if t.choice.add])
        result.timing = last.timing
    result.timing.notes.extend(notes)
