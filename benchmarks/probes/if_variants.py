"""Probe (issue 31; run from the repository root on the GPU machine with $OUT set): whether one ``If`` for
the whole decoder is faster than contrib-decode-attention's ``If`` per layer.

contrib-decode-attention writes, per layer, an ``If`` on the step's rows: then ``DecodeAttention``, else
the MultiHeadAttention, every layer's If reading the same condition. The variant built here from
onnxfuse's output, ``hoisted``, merges those Ifs into one over every node that depends on them, each
branch the whole rest of the decoder with its layers' then (else) branches inlined: one If per run
instead of one per layer, the same kernels. (docs/benchmarks.md 5.39 also timed a second variant,
``inside``, DecodeAttention moved from before its If into the then branch: that is what the rule writes
since, so the probe no longer builds it.)

The variant is timed as a column of ``benchmarks/decode.py`` (its options; this adds nothing to them).
Its outputs are bitwise equal to onnxfuse's on the tiny Qwen2 testdata decoder (CPU provider; prefill,
decode, and a 3-token step over a cache).

    python3 benchmarks/probes/if_variants.py --out $OUT/r/ifv --builder-skeleton .bench-skeleton \\
        --past 1024 --batches 1,8 --prefill-batches 1 --profile-cell prefill:1
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import onnx
from onnx import helper

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[2]))
sys.path.insert(0, str(HERE.parents[1]))
from onnxfuse.model_io import free_names, node_subgraphs  # noqa: E402


def _branch(node, which: str) -> onnx.GraphProto:
    return next(a.g for a in node.attribute if a.name == which)


def _outer_reads(node) -> set[str]:
    """The names ``node`` reads: its inputs and what its bodies take from enclosing graphs."""
    return set(node.input) | {name for body in node_subgraphs(node) for name in free_names(body)}


def hoisted(model: onnx.ModelProto) -> onnx.ModelProto:
    """The Ifs of the main graph sharing one condition merged into one If over everything depending on them."""
    m = copy.deepcopy(model)
    g = m.graph
    ifs = [n for n in g.node if n.op_type == "If"]
    conds = {n.input[0] for n in ifs}
    if len(conds) != 1 or len(ifs) < 2:
        raise SystemExit(f"hoisted: {len(ifs)} If nodes on {len(conds)} conditions; expected one condition")
    cond = conds.pop()
    region, produced = [], set()
    for n in g.node:  # topological order
        if n.op_type == "If" or _outer_reads(n) & produced:
            region.append(n)
            produced |= set(n.output)
    outputs = [o for o in g.output if o.name in produced]

    def branch(which: str) -> onnx.GraphProto:
        nodes, rename = [], {}
        for n in region:
            if n.op_type == "If":
                body = _branch(n, which)
                local = {}
                for bn in body.node:
                    if node_subgraphs(bn):
                        raise SystemExit("hoisted: a branch node with subgraphs")
                    ins = [local.get(i, rename.get(i, i)) if i else i for i in bn.input]
                    if bn.op_type == "Identity":
                        local[bn.output[0]] = ins[0]
                        continue
                    new = copy.deepcopy(bn)
                    new.name = f"{n.name}/{which}/{bn.name}"
                    del new.input[:]
                    new.input.extend(ins)
                    for k, o in enumerate(bn.output):
                        if o:
                            local[o] = new.output[k] = f"{n.name}/{which}/{o}"
                    nodes.append(new)
                for k, bo in enumerate(body.output):
                    rename[n.output[k]] = local.get(bo.name, rename.get(bo.name, bo.name))
            else:
                new = copy.deepcopy(n)
                new.name = f"{n.name}/{which}"
                del new.input[:]
                new.input.extend(rename.get(i, i) if i else i for i in n.input)
                for k, o in enumerate(n.output):
                    if o:
                        rename[o] = new.output[k] = f"{o}/{which}"
                nodes.append(new)
        outs = []
        for o in outputs:
            vi = copy.deepcopy(o)
            vi.name = rename[o.name]
            outs.append(vi)
        live = {o.name for o in outs}
        kept = []
        for n in reversed(nodes):  # dead nodes of this branch (the other branch's ops) dropped
            if any(o in live for o in n.output):
                kept.append(n)
                live |= set(n.input)
        return helper.make_graph(list(reversed(kept)), f"hoisted_{which}", [], outs)

    then, other = branch("then_branch"), branch("else_branch")
    for n in region:
        g.node.remove(n)
    g.node.append(helper.make_node("If", [cond], [o.name for o in outputs], name="decode_or_prefill",
                                   then_branch=then, else_branch=other))
    names = {o for n in region for o in n.output}
    keep = [vi for vi in g.value_info if vi.name not in names]
    del g.value_info[:]
    g.value_info.extend(keep)
    print(f"hoisted: {len(ifs)} Ifs → 1 over {len(region)} nodes; then {len(then.node)} nodes, else {len(other.node)}; "
          f"main graph {len(g.node)} nodes")
    onnx.checker.check_model(m, full_check=False)
    return m


def variants(models: dict) -> dict:
    base = models.get("onnxfuse")
    if base is None:
        return {}
    return {"onnxfuse-hoisted": hoisted(base)}


if __name__ == "__main__":
    import decode

    sys.exit(decode.main(variants=variants))
