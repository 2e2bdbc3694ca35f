#!/usr/bin/env python3
"""Export a torchvision CNN with random weights *and its BatchNormalization nodes kept* to ONNX.

The committed model is made with (needs torch + torchvision, e.g. /work/torchenv/bin/python):

    python testdata/export_torchvision.py --arch mobilenet_v2 --width-mult 0.35 \\
        --out testdata/mobilenet_v2_w035.onnx

mobilenet_v2 at width 0.35 with a 10-class head has 52 Conv→BatchNormalization pairs (17 of them depthwise),
ReLU6 (Clip), residual Adds, and Gemm; about 1.7 MB. A large model for timing, not committed:

    python testdata/export_torchvision.py --arch resnet50 --out /tmp/resnet50.onnx

How BatchNormalization survives the export: the legacy TorchScript exporter (``dynamo=False``) fuses
Conv+BN itself when ``training`` is EVAL (its eval peephole pass). With ``training=TrainingMode.PRESERVE``
and the module in ``eval()`` mode, it keeps every BatchNormalization in inference form (no training_mode,
one output); ``do_constant_folding=False`` keeps the graph as written. The script verifies that on the
exported file. Running statistics and affine parameters are randomized (seeded) so that folding them is
really tested, since the defaults (mean 0, var 1, γ 1, β 0) would make a wrong fold invisible.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import onnx
import torch
import torchvision


def build(arch: str, width_mult: float | None, num_classes: int) -> torch.nn.Module:
    kwargs = {"weights": None, "num_classes": num_classes}
    if width_mult is not None:
        kwargs["width_mult"] = width_mult
    return torchvision.models.get_model(arch, **kwargs)


@torch.no_grad()
def randomize_batchnorm(model: torch.nn.Module, seed: int) -> int:
    """Give every BatchNorm random, well-conditioned statistics and affine parameters; return how many."""
    g = torch.Generator().manual_seed(seed)
    count = 0
    for m in model.modules():
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
            c = m.num_features
            m.running_mean.copy_(torch.randn(c, generator=g) * 0.1)
            m.running_var.copy_(torch.rand(c, generator=g) + 0.5)
            m.weight.copy_(torch.rand(c, generator=g) + 0.5)
            m.bias.copy_(torch.randn(c, generator=g) * 0.1)
            count += 1
    return count


def verify(path: Path) -> int:
    """Every BatchNormalization is in inference form; return how many there are."""
    model = onnx.load(str(path))
    onnx.checker.check_model(model)
    bns = [n for n in model.graph.node if n.op_type == "BatchNormalization"]
    for n in bns:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
        if attrs.get("training_mode", 0) != 0 or len([o for o in n.output if o]) != 1:
            raise SystemExit(f"{path}: {n.name} was exported in training form ({attrs}, outputs {list(n.output)})")
    if not bns:
        raise SystemExit(f"{path}: the exporter removed every BatchNormalization")
    return len(bns)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="mobilenet_v2", help="a torchvision.models name (default mobilenet_v2)")
    ap.add_argument("--width-mult", type=float, default=None, help="width multiplier, for architectures that take one")
    ap.add_argument("--num-classes", type=int, default=10)
    ap.add_argument("--size", type=int, default=96, help="input height and width used for tracing (default 96)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--opset", type=int, default=13)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)

    torch.manual_seed(args.seed)
    model = build(args.arch, args.width_mult, args.num_classes)
    n_bn = randomize_batchnorm(model, args.seed + 1)
    model.eval()
    x = torch.randn(1, 3, args.size, args.size)
    torch.onnx.export(
        model,
        (x,),
        str(args.out),
        dynamo=False,
        export_params=True,
        do_constant_folding=False,
        training=torch.onnx.TrainingMode.PRESERVE,
        opset_version=args.opset,
        input_names=["input"],
        output_names=["logits"],
        dynamic_axes={"input": {0: "N"}, "logits": {0: "N"}},
    )
    n_onnx = verify(args.out)
    size = args.out.stat().st_size
    print(f"{args.out}: {args.arch} width={args.width_mult} BatchNorm modules={n_bn} "
          f"BatchNormalization nodes={n_onnx} size={size:,} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
