"""Probe (issue 31; run from the repository root on the GPU machine with $OUT set): what the decode
``If`` costs at prefill, and whether another placement of it is faster.

contrib-decode-attention writes, per layer, ``DecodeAttention`` (empty above its row limit) and an ``If``
on the step's rows: then ``Identity`` of the op's output, else the MultiHeadAttention. At a 512-token
prefill at batch 1 that model ran 2.554 ms against 2.419 ms without the rule (H200, 2026-11-28), and
ONNX Runtime's profile put the If at 1.11 ms per run around 0.69 ms of MultiHeadAttention. Two variants
of onnxfuse's output, built here from it (same kernels, same outputs):

* ``inside``: each DecodeAttention moved into its If's then branch, so prefill launches none. (A custom
  op inside a branch once ran on ONNX Runtime's CPU provider, docs/benchmarks.md 5.32; the profile's
  placement column says where it runs now.)
* ``hoisted``: the Ifs that share one condition merged into one If over every node that depends on them,
  each branch the whole rest of the decoder with its layers' then (else) branches inlined: one If per
  run instead of one per layer.

The variants are timed as columns of ``benchmarks/decode.py`` (its options; this adds nothing to them).
Both give outputs bitwise equal to onnxfuse's on the tiny Qwen2 testdata decoder (CPU provider; prefill,
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


def _subgraphs(node):
    for a in node.attribute:
        if a.type == onnx.AttributeProto.GRAPH:
            yield a.name, a.g
        elif a.type == onnx.AttributeProto.GRAPHS:
            for g in a.graphs:
                yield a.name, g


def _reads(graph) -> dict[str, int]:
    """How many times each name is read in ``graph`` and its subgraphs (outer reads included)."""
    count: dict[str, int] = {}
    for n in graph.node:
        for i in n.input:
            count[i] = count.get(i, 0) + 1
        for _, g in _subgraphs(n):
            for k, v in _reads(g).items():
                count[k] = count.get(k, 0) + v
    for o in graph.output:
        count[o.name] = count.get(o.name, 0) + 1
    return count


def _outer_reads(node) -> set[str]:
    names = set(node.input)
    for _, g in _subgraphs(node):
        names |= set(_reads(g))
    return names


def decode_inside(model: onnx.ModelProto) -> onnx.ModelProto:
    """Each DecodeAttention whose only reader is an If's ``then: Identity`` moved into that branch."""
    m = copy.deepcopy(model)
    g = m.graph
    producers = {o: n for n in g.node for o in n.output}
    reads = _reads(g)
    moved = 0
    for node in list(g.node):
        if node.op_type != "If":
            continue
        then = next(sg for name, sg in _subgraphs(node) if name == "then_branch")
        if len(then.node) != 1 or then.node[0].op_type != "Identity":
            continue
        y = then.node[0].input[0]
        op = producers.get(y)
        if op is None or op.op_type != "DecodeAttention" or reads.get(y) != 1 or any(reads.get(o) for o in op.output[1:]):
            continue
        inner = copy.deepcopy(op)
        inner.output[0] = then.output[0].name
        for k in range(1, len(inner.output)):
            if inner.output[k]:
                inner.output[k] = f"{then.output[0].name}/unused{k}"
        del then.node[:]
        then.node.append(inner)
        g.node.remove(op)
        moved += 1
    print(f"inside: {moved} DecodeAttention moved into their If's then branch")
    return m


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
                body = next(sg for name, sg in _subgraphs(n) if name == which)
                local = {}
                for bn in body.node:
                    if any(True for _ in _subgraphs(bn)):
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
    reads = _reads(g)
    dead = [n for n in g.node if n.op_type == "DecodeAttention" and not any(reads.get(o) for o in n.output)]
    for n in dead:
        g.node.remove(n)
    print(f"hoisted: {len(ifs)} Ifs → 1 over {len(region)} nodes; then {len(then.node)} nodes, else {len(other.node)}; "
          f"main graph {len(g.node)} nodes")
    onnx.checker.check_model(m, full_check=False)
    return m


def variants(models: dict) -> dict:
    base = models.get("onnxfuse")
    if base is None:
        return {}
    return {"onnxfuse-inside": decode_inside(base), "onnxfuse-hoisted": hoisted(base)}


if __name__ == "__main__":
    import decode

    sys.exit(decode.main(variants=variants))
