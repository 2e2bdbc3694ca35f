"""contrib-channel-transpose: a ``Transpose`` between NCHW and NHWC of a tensor with few channels → one
``ai.onnxfuse.ChannelTranspose`` (issue 34; CUDA only, opt-in: not yet a measured choice, below).

Why: ONNX Runtime's CUDA ``Transpose`` moves an [N, C, P] ↔ [N, P, C] transpose through 32 × 32 tiles,
of which only C rows (or columns) hold data when C is small. At the input of a channels-last region,
the [16, 3, 640, 640] image of the zoo's YOLO-style detector took 0.325 ms, about nine times a copy of its
bytes; torch.compile's conversion of the same image took 0.14 ms (H200, docs/benchmarks.md 5.27), while
the whole detector trails torch.compile by 0.59 ms in float32 (5.54).
``ChannelTranspose``'s CUDA kernel (csrc/channel_transpose.cc, contract in docs/custom-ops.md) stages a
tile of pixels × all C channels in shared memory, so it reads and writes whole consecutive runs on both
sides whatever C is.

The maths: none; the op is ONNX ``Transpose`` with perm [0, 2, 3, 1] (``to=nhwc``) or [0, 3, 1, 2]
(``to=nchw``), a copy of each element's bits. So the rewrite is exact.

Refusals: another perm or rank; an element type other than float32, float16 or bfloat16 (the kernel's);
a channel count (axis 1 going to NHWC, axis 3 coming back) unknown or at least :data:`MAX_CHANNELS`,
where ONNX Runtime's tiles are full and its kernel is the one measured.

**For the CUDA provider, opt-in**, and a measured choice (``selection.MEASURED``) tried after
``contrib-channels-last``, whose boundary transposes it takes: where optimize times the model on a GPU it
is kept only when faster. On an H200 (docs/benchmarks.md 5.57) the YOLO-style input's transpose
[16, 3, 640, 640] → NHWC took 0.057 ms against ONNX Runtime's 0.299 (a copy of its bytes: 0.040), bit-equal
(tests/gpu/test_channel_transpose_gpu.py), and the detector at batch 16 ran 4% faster in float32 and 8% in
float16; on ResNet-50 and ConvNeXt-T it changed nothing measurable.
"""

from __future__ import annotations

from onnxfuse.custom_ops import DOMAIN
from onnxfuse.rewrites.contrib.matching import ContribRule, dtype_problem
from onnxfuse.rewrites.engine.edit import fuse
from onnxfuse.rewrites.engine.rule import Refuse
from onnxfuse.rewrites.facts.graph import BF16, FP16, FP32, first_known_dtype, is_op, perm_of, shape_of

OP_TYPE = "ChannelTranspose"

#: The perms the op computes, by its spec's direction.
DIRECTIONS = {(0, 2, 3, 1): "nhwc", (0, 3, 1, 2): "nchw"}

#: From this many channels on ONNX Runtime's 32 × 32 transpose tiles are full: its kernel stays.
MAX_CHANNELS = 32

#: The op's element types.
DTYPES = (FP32, FP16) + BF16


def channels(graph, transpose, direction: str) -> int | None:
    """The channel count of ``transpose``'s input (axis 1 of NCHW, axis 3 of NHWC), None where unknown."""
    shape = shape_of(graph, transpose.inputs[0])
    if shape is None or len(shape) != 4:
        return None
    c = shape[1 if direction == "nhwc" else 3]
    return c if isinstance(c, int) and c >= 0 else None


class ContribChannelTranspose(ContribRule):
    name = "contrib-channel-transpose"
    description = ("Transpose NCHW ↔ NHWC of a tensor with fewer than 32 channels → ChannelTranspose (ai.onnxfuse; "
                   "opt-in, CUDA only)")
    targets = frozenset({"cuda"})  # an ai.onnxfuse op with a CUDA kernel: not for ONNX Runtime's CPU provider
    opt_in = True

    def match(self, graph):
        return [n for n in graph.nodes if is_op(n, "Transpose")]

    def analyze(self, graph, node):
        direction = DIRECTIONS.get(tuple(perm_of(node) or ()))
        if direction is None:
            return Refuse(f"perm {perm_of(node)} is neither NCHW → NHWC [0, 2, 3, 1] nor back [0, 3, 1, 2]")
        c = channels(graph, node, direction)
        if c is None:
            return Refuse("the channel count is not known (a rank-4 input with a static channel axis required)")
        if c >= MAX_CHANNELS:
            return Refuse(f"{c} channels: ONNX Runtime's 32 × 32 transpose tiles are full from {MAX_CHANNELS} on")
        problem = dtype_problem(first_known_dtype(graph, node.inputs[0], node.outputs[0]), DTYPES, "Transpose input")
        if problem:
            return problem
        return direction, c

    def apply(self, graph, node, found):
        direction, c = found
        fuse(graph, [node], OP_TYPE, [node.inputs[0]], node.outputs[0], attrs={"spec": f"to={direction}"},
             domain=DOMAIN, name=f"{node.name}/{OP_TYPE}" if node.name else None)
        return {"op": f"{DOMAIN}.{OP_TYPE}", "to": direction, "channels": c}
