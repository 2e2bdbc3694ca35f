"""Conv regions in channels-last layout: Conv → com.microsoft ``NhwcConv``, the ops between them on
NHWC tensors, one ``Transpose`` at each region boundary (issue 34; CUDA only, opt-in).

Why: cuDNN's tensor-core convolutions work in NHWC. On NCHW tensors ONNX Runtime's CUDA Conv has cuDNN
transpose around each kernel (or pick slower NCHW kernels); torch.compile converts conv nets to
channels-last for that reason, and ONNX Runtime's own ``prefer_nhwc`` session option does it for the
original graph (+17% on ResNet-50 at batch 16) but puts two transposes around every FusedElementwise
region, which it cannot see through (-19% on our output). Here the layout is decided in the graph, so
the elementwise regions between convolutions are fused on NHWC tensors with no transpose at all.

The maths: with ``T = Transpose(perm=[0, 2, 3, 1])`` (NCHW → NHWC) and ``T⁻¹ = Transpose(perm=[0, 3, 1,
2])``, every op of a region commutes with the layout change:

* ``NhwcConv(T(x), T(W), B) = T(Conv(x, W, B))``: the same convolution, ONNX Runtime's kernel reads and
  writes NHWC. Its weight is channels-last too, [M, kH, kW, C/group]: the com.microsoft op marks a
  constant weight "already NHWC" when it pre-packs (``conv.cc``: only its internal NHWC domain transposes
  W itself), and reads W's dims that way (the ContribOperators.md text, copied from Conv, says otherwise;
  with W as [M, C/group, kH, kW] it fails "Input channels C is not equal to kernel channels * group",
  measured on onnxruntime-gpu 1.31.1). ONNX Runtime's transformers optimizer transposes the weights of
  the NhwcConv it writes for the same reason;
* a pointwise op ``f(T(a), P(c))`` = ``T(f(a, c))`` where ``P(c)`` is a constant ``c`` broadcast to rank 4
  (leading 1s, as broadcasting aligns on the right) and permuted like the data; a one-element operand
  broadcasts the same in either layout and is left as it is;
* an op over named axes (``Concat``, ``Split``, ``Slice`` with constant axes) takes the same axes renumbered
  (NCHW axis 1 is NHWC axis 3, 2 is 1, 3 is 2); a nearest-mode ``Resize`` takes its constant scales or
  sizes permuted like the data (:func:`_nearest_resize_scales`); ``GlobalAveragePool`` becomes our
  ``ChannelsLastMean`` (the mean over H and W of [N, H, W, C] as [N, 1, 1, C] = T([N, C, 1, 1]); contract in
  docs/custom-ops.md) and ``GlobalMaxPool`` ``ReduceMax`` over axes [1, 2] with ``keepdims=1``. Why not
  ``ReduceMean`` over [1, 2]: ONNX Runtime's CUDA provider hands that to cuDNN's generic reduction, whose
  eight squeeze-excitation pools in a DB text detector at batch 16 took 1.08 ms, 4.5 times the
  original's NCHW ``GlobalAveragePool`` (docs/benchmarks.md 5.69).

So the rewrite is exact up to the order of additions inside ONNX Runtime's kernels (the same convolution
in another memory order; a mean computed by another reduction), which validation bounds.

Regions: the convertible nodes (:func:`_role`) of the main graph connected producer to reader; a region
with fewer than :data:`MIN_CONVS` convolutions is refused (its two boundary transposes would cost as
much as one convolution gains). Every tensor a region writes gets an NHWC twin; the original name is
written again by ``T⁻¹`` only where something outside the region reads it (a node, a graph output, a
subgraph): readers outside never see a layout change. Data entering a region from outside goes through
one ``T`` per tensor. A ``T⁻¹`` the graph already has before a region, or a ``T`` after it, cancels
with the boundary's instead of adding to it.

Refusals: a Conv that is not 2-D, whose weight is not a constant, or not float32/float16 (the CUDA
kernel's types); a pointwise op whose output rank is not known to be 4 or with an operand that is neither
region data, a rank-4 tensor, a constant of rank at most 4, nor one element.

**For the CUDA provider, opt-in** (``--only +contrib-channels-last``): ONNX Runtime has ``NhwcConv``
kernels for the CUDA provider only, so the model it writes needs that provider (target ``cuda`` only).
Validated on a machine without a GPU, the CPU provider runs each NhwcConv as its definition
(:mod:`onnxfuse.runtime.stand_ins`). Measured faster on ConvNeXt-T, ResNet-50 and a YOLO-style detector at
batch 1 and 16, fp32 and fp16 (docs/benchmarks.md 5.26), not yet on depthwise nets (MobileNet,
EfficientNet). So it is a measured choice (``selection.MEASURED``): where optimize times the model on a
GPU, it is tried on top of the output and kept when faster; otherwise it runs only when asked for; and
the never-slower ladder's first rung leaves it out.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from onnxfuse.custom_ops import DOMAIN
from onnxfuse.rewrites.engine.edit import append_axes_op, new_constant, replace_reads, unique_name
from onnxfuse.rewrites.engine.rule import Refuse, Rule
from onnxfuse.rewrites.facts.graph import (
    FP16, FP32, MS_DOMAIN, POINTWISE, constant_value, first_known_dtype, is_default_domain, is_graph_output, is_op,
    perm_of, producer_of, rank_of, shape_of,
)

#: NCHW → NHWC, and back.
TO_NHWC, TO_NCHW = [0, 2, 3, 1], [0, 3, 1, 2]

#: Our op for a GlobalAveragePool inside a region (csrc/channels_last_mean.cc).
MEAN_OP = "ChannelsLastMean"

#: Fewest convolutions a region needs: with one, the two boundary transposes cost as much as the
#: layout gains.
MIN_CONVS = 2


def _rank4(graph, tensor) -> bool:
    return rank_of(graph, tensor) == 4


def _one_element(graph, tensor) -> bool:
    shape = shape_of(graph, tensor)
    return shape is not None and all(isinstance(d, (int, np.integer)) and int(d) == 1 for d in shape)


def _nhwc_axis(axis: int) -> int:
    """Where NCHW axis ``axis`` (negative counts from the end of 4) is in NHWC."""
    return TO_NHWC.index(int(axis) % 4)


def _slice_axes(graph, node) -> list[int] | None:
    """The constant axes of a ``Slice`` (opset 10 on: inputs), all four when absent; None if computed."""
    if len(node.inputs) < 3 or any(constant_value(graph, t) is None for t in node.inputs[1:] if t.name):
        return None
    if len(node.inputs) < 4 or not node.inputs[3].name:
        return list(range(len(constant_value(graph, node.inputs[1]))))
    return [int(a) for a in constant_value(graph, node.inputs[3]).reshape(-1)]


def _role(graph, node) -> str | None:
    """What ``node`` is in a region: "conv", "pointwise", "pool", "axis" (an op over one or more named
    axes, renumbered); None when it stays NCHW. The inputs of a pointwise op are judged later
    (:func:`_operand_problem`), against the region."""
    if not is_default_domain(node) or not node.outputs:
        return None
    if node.op == "Split" and all(_rank4(graph, t) for t in (node.inputs[0], *node.outputs)):
        return "axis"
    if len(node.outputs) != 1:
        return None
    if node.op == "Conv":
        weight = constant_value(graph, node.inputs[1]) if len(node.inputs) >= 2 else None
        dtype = first_known_dtype(graph, node.inputs[0], node.outputs[0])
        if weight is None or weight.ndim != 4 or dtype not in (FP32, FP16) or len(node.inputs) > 3:
            return None
        if len(node.inputs) == 3 and node.inputs[2].name and constant_value(graph, node.inputs[2]) is None:
            return None
        return "conv"
    if not _rank4(graph, node.outputs[0]):
        return None
    if node.op in POINTWISE:
        return "pointwise"
    if node.op in ("GlobalAveragePool", "GlobalMaxPool") and _rank4(graph, node.inputs[0]):
        return "pool"
    if node.op == "Concat" and all(_rank4(graph, t) for t in node.inputs):
        return "axis"
    if node.op == "Slice" and _rank4(graph, node.inputs[0]) and _slice_axes(graph, node) is not None:
        return "axis"
    if node.op == "Resize" and _rank4(graph, node.inputs[0]) and _nearest_resize_scales(graph, node) is not None:
        return "axis"
    return None


#: Resize attributes that act on all axes alike (or not at all for mode nearest); any other value, or an
#: attribute not listed (opset 18's ``axes``), keeps the Resize NCHW.
_RESIZE_PER_AXIS = {"mode": {"nearest"}, "coordinate_transformation_mode": {
    "half_pixel", "half_pixel_symmetric", "pytorch_half_pixel", "align_corners", "asymmetric"},
    "nearest_mode": {"round_prefer_floor", "round_prefer_ceil", "floor", "ceil"}, "exclude_outside": {0},
    "extrapolation_value": None, "cubic_coeff_a": None, "antialias": {0},
    "keep_aspect_ratio_policy": {"stretch"}}


def _nearest_resize_scales(graph, node) -> tuple[int, np.ndarray] | None:
    """(input index, value) of a nearest-mode ``Resize``'s constant scales (input 2) or sizes (input 3),
    four of them; None when the Resize cannot take the NHWC layout.

    Why exact: nearest resizing maps each output coordinate along an axis from that axis's input and
    output lengths and its scale alone (ONNX's coordinate transformation and nearest rounding are per
    axis; ``tf_crop_and_resize`` also reads the roi, refused), so the same Resize with its scales or
    sizes permuted like the data computes ``T(Resize(x))``. Measured on an H200: a nearest 2x Resize of
    [16, 512, 20, 20] took 0.065 ms in NHWC against 0.063 ms in NCHW (docs/benchmarks.md 5.27), and
    each of the two boundary transposes it saves costs about as much."""
    for name, value in node.attrs.items():
        allowed = _RESIZE_PER_AXIS.get(name, ())
        value = value.decode() if isinstance(value, bytes) else value
        if allowed is not None and value not in allowed:
            return None  # mode absent is nearest, ONNX's default
    for index in (3, 2):  # sizes win when both are given (ONNX: exactly one may be)
        if len(node.inputs) > index and node.inputs[index].name:
            value = constant_value(graph, node.inputs[index])
            if value is None or value.size != 4:
                return None
            return index, value.reshape(-1)
    return None


def _operand_problem(graph, node, tensor, inside: set[int]) -> Refuse | None:
    """Why ``tensor`` cannot be an operand of pointwise ``node`` in a region (None: it can)."""
    if not tensor.name:
        return None  # an absent optional input
    if id(tensor) in inside or _rank4(graph, tensor) or _one_element(graph, tensor):
        return None
    value = constant_value(graph, tensor)
    if value is not None and value.ndim <= 4:
        return None
    return Refuse(f"{node.op} operand {tensor.name!r} is neither rank 4, a constant of rank <= 4, nor one element", node)


class Region:
    """Nodes of one channels-last region, in graph order, and their roles."""

    def __init__(self, nodes, roles):
        self.nodes, self.roles = nodes, roles

    @property
    def convs(self) -> int:
        return sum(1 for n in self.nodes if self.roles[id(n)] == "conv")


def regions(graph) -> list[Region]:
    """The connected groups of convertible nodes (producer to reader) that hold a convolution; a
    pointwise node with an operand no region can take (:func:`_operand_problem`) is left out first."""
    roles = {id(n): r for n in graph.nodes if (r := _role(graph, n)) is not None}
    changed = True
    while changed:  # leaving one node out can make a neighbour's operand an outside tensor: still fine
        changed = False
        produced = {id(t) for n in graph.nodes if id(n) in roles for t in n.outputs}
        for n in graph.nodes:
            if roles.get(id(n)) == "pointwise" and any(
                    _operand_problem(graph, n, t, produced) for t in n.inputs):
                del roles[id(n)]
                changed = True
    parent = {k: k for k in roles}

    def find(k):
        while parent[k] != k:
            parent[k] = parent[parent[k]]
            k = parent[k]
        return k

    for n in graph.nodes:
        if id(n) not in roles:
            continue
        for out in n.outputs:
            for reader in out.outputs:
                if id(reader) in roles:
                    parent[find(id(reader))] = find(id(n))
    groups: dict[int, list] = {}
    for n in graph.nodes:
        if id(n) in roles:
            groups.setdefault(find(id(n)), []).append(n)
    found = [Region(nodes, roles) for nodes in groups.values()]
    return [r for r in found if r.convs]


def _permuted_constant(graph, value: np.ndarray, base: str) -> gs.Constant:
    full = value.reshape((1,) * (4 - value.ndim) + value.shape)
    return new_constant(graph, f"{base}/nhwc", np.ascontiguousarray(full.transpose(TO_NHWC)))


def _nhwc_shape(shape):
    return None if shape is None or len(shape) != 4 else [shape[i] for i in TO_NHWC]


class ContribChannelsLast(Rule):
    name = "contrib-channels-last"
    description = ("Conv regions channels-last: Conv → com.microsoft NhwcConv, the ops between on NHWC tensors, "
                   "one Transpose per boundary (for CUDA; opt-in, and tried by timing where optimize times on "
                   "a GPU)")
    opt_in = True
    targets = frozenset({"cuda"})

    def match(self, graph):
        return regions(graph)

    def anchor(self, match):
        return match.nodes[0]

    def check(self, graph, region):
        if region.convs < MIN_CONVS:
            return Refuse(f"a region of {region.convs} Conv: its two boundary transposes would cost what the "
                          f"layout gains (fewer than {MIN_CONVS} convolutions)")
        return region

    def rewrite(self, graph, region):
        twins: dict[int, gs.Variable] = {}  # NCHW tensor written inside → its NHWC twin
        entries: dict[int, gs.Variable] = {}  # NCHW tensor from outside → T(tensor), one per tensor
        permuted: dict[int, gs.Constant] = {}
        for node in region.nodes:
            for out in node.outputs:
                twins[id(out)] = gs.Variable(unique_name(graph, f"{out.name}/nhwc"), dtype=out.dtype,
                                             shape=_nhwc_shape(shape_of(graph, out)))
        entered, exits = 0, []
        for node in region.nodes:
            role = region.roles[id(node)]
            one_data_input = role == "conv" or node.op in ("Slice", "Split", "Resize")
            data_inputs = range(1) if one_data_input else range(len(node.inputs))
            for i in data_inputs:
                t = node.inputs[i]
                if not t.name:
                    continue
                if id(t) in twins:
                    node.inputs[i] = twins[id(t)]
                    continue
                value = constant_value(graph, t)
                if value is not None and value.size == 1 and role == "pointwise":
                    continue  # broadcasts the same way in either layout
                if value is not None and role == "pointwise":
                    if id(t) not in permuted:
                        permuted[id(t)] = _permuted_constant(graph, value, t.name)
                    node.inputs[i] = permuted[id(t)]
                    continue
                if role == "pointwise" and not _rank4(graph, t):
                    continue  # one element, not constant: broadcasts the same way
                undone = producer_of(t)
                if is_op(undone, "Transpose") and perm_of(undone) == TO_NCHW:  # T(T⁻¹(z)) = z
                    node.inputs[i] = undone.inputs[0]
                    continue
                if id(t) not in entries:
                    entry = gs.Variable(unique_name(graph, f"{t.name}/nhwc"), dtype=t.dtype,
                                        shape=_nhwc_shape(shape_of(graph, t)))
                    graph.nodes.append(gs.Node("Transpose", unique_name(graph, f"{t.name}/to_nhwc"),
                                               {"perm": TO_NHWC}, inputs=[t], outputs=[entry]))
                    entries[id(t)] = entry
                    entered += 1
                node.inputs[i] = entries[id(t)]
            if role == "conv":
                node.op, node.domain = "NhwcConv", MS_DOMAIN
                weight = constant_value(graph, node.inputs[1])
                node.inputs[1] = new_constant(graph, f"{node.inputs[1].name}/nhwc",
                                              np.ascontiguousarray(weight.transpose(TO_NHWC)))
            elif node.op in ("Concat", "Split"):
                node.attrs["axis"] = _nhwc_axis(node.attrs.get("axis", 0))
            elif node.op == "Resize":
                index, value = _nearest_resize_scales(graph, node)
                node.inputs[index] = new_constant(graph, f"{node.inputs[index].name}/nhwc",
                                                  np.ascontiguousarray(value[TO_NHWC]))
            elif node.op == "Slice":
                axes = np.array([_nhwc_axis(a) for a in _slice_axes(graph, node)], np.int64)
                while len(node.inputs) < 4:
                    node.inputs.append(gs.Variable.empty())
                node.inputs[3] = new_constant(graph, f"{node.name or node.outputs[0].name}/nhwc_axes", axes)
            elif role == "pool":
                out = node.outputs[0]
                twin = twins[id(out)]
                source = node.inputs[0]
                node.outputs.clear()
                node.inputs.clear()
                if node.op == "GlobalAveragePool":
                    graph.nodes.append(gs.Node(MEAN_OP, unique_name(graph, f"{node.name or out.name}/{MEAN_OP}"),
                                               inputs=[source], outputs=[twin], domain=DOMAIN))
                else:
                    append_axes_op(graph, "ReduceMax", unique_name(graph, f"{node.name or out.name}/ReduceMax"),
                                   source, [1, 2], twin, {"keepdims": 1})
                exits.append((out, twin))
                continue
            for k, out in enumerate(list(node.outputs)):
                node.outputs[k] = twins[id(out)]
                exits.append((out, twins[id(out)]))
        transposed_out = sum(self._exit(graph, out, twin) for out, twin in exits)  # readers inside rewired by now
        return {"convs": region.convs, "nodes": len(region.nodes), "transposes_in": entered,
                "transposes_out": transposed_out}

    @staticmethod
    def _exit(graph, out, twin) -> int:
        """``out = T⁻¹(twin)`` when a reader outside the region (a node, a subgraph, a graph output) still
        reads ``out``; 1 if written, else 0 (``out`` is then dropped by cleanup). A reader that is
        ``T`` itself (ConvNeXt permutes to channels-last for its LayerNorm) reads ``twin``: its readers
        read ``twin`` instead, ``T(T⁻¹(twin)) = twin``."""
        for reader in list(out.outputs):
            if is_op(reader, "Transpose") and perm_of(reader) == TO_NHWC and not is_graph_output(
                    graph, reader.outputs[0]):
                replace_reads(reader.outputs[0], twin)
                reader.inputs.clear()
                reader.outputs.clear()
        if not out.outputs and not is_graph_output(graph, out):
            return 0
        graph.nodes.append(gs.Node("Transpose", unique_name(graph, f"{out.name}/to_nchw"), {"perm": TO_NCHW},
                                   inputs=[twin], outputs=[out]))
        return 1
