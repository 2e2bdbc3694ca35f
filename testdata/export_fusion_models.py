"""Export the small real-architecture models used by tests/rewrites/test_fusion_real_models.py.

Run with a Python that has torch and torchvision (not needed by the package or its tests):

    /work/torchenv/bin/python testdata/export_fusion_models.py

Weights are random (seeded) and BatchNorm statistics are randomised, so nothing is downloaded; every
model is exported with the TorchScript exporter (``dynamo=False``) at a fixed opset, in eval mode (the
exporter folds BatchNorm into Conv), with a dynamic batch dimension named ``batch``:

* ``mobilenet_v3_small_w025_opset13.onnx``: torchvision mobilenet_v3_small, width 0.25, 10 classes,
  64x64 input. At opset 13 HardSwish becomes ``HardSigmoid`` + ``Mul`` (HardSwish is opset 14), and
  the squeeze-excite gate is ``HardSigmoid`` on an [N,C,1,1] tensor multiplied into [N,C,H,W].
* ``efficientnet_blocks_opset13.onnx``: MBConv blocks with SiLU written as ``x * sigmoid(x)``,
  squeeze-excite and residual adds.
* ``yolo_conv_bn_silu_opset13.onnx``: a YOLO-style backbone/neck: Conv-BN-SiLU (``nn.SiLU`` exports
  as ``Sigmoid`` + ``Mul`` at opset 13), C2f-like split/concat bottlenecks, an upsample path.
* ``yolo_decode_head_opset13.onnx``: two detection levels and a YOLOv8 export's box decoding
  (distribution softmax read by a fixed 1x1 Conv, ``chunk``, anchors, strides, class sigmoid), whose
  dynamic batch makes the head read its sizes from ``Shape``.
* ``timm_vit_blocks_opset17.onnx``: two timm ViT blocks whose attention cuts q, k and v from one packed
  [B, N, 3, H, D] projection (by indexing in the first block, ``unbind`` in the second).
* ``convnext_blocks_opset13.onnx``: ConvNeXt blocks: depthwise 7x7 conv, channels-last LayerNorm
  (decomposed at opset 13: ReduceMean, Sub, Pow, Add, Sqrt, Div, Mul, Add), Linear, exact GELU
  (decomposed: Div, Erf, Add, Mul, Mul), Linear, layer-scale Mul and the residual Add.
* ``vit_blocks_opset14.onnx``: torchvision's VisionTransformer block structure, small: patch conv,
  class token, position embedding, ``nn.MultiheadAttention`` (whose export computes the attention
  scale ``sqrt(1/sqrt(head_dim))`` from ``Shape(q)`` behind a computed Reshape), decomposed
  LayerNorm and exact GELU, residual adds. Opset 14.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent


def _randomize_bn(model: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, (nn.BatchNorm2d, nn.BatchNorm1d)):
            n = m.num_features
            m.running_mean.copy_(torch.randn(n, generator=g) * 0.1)
            m.running_var.copy_(torch.rand(n, generator=g) * 0.5 + 0.75)
            m.weight.data.copy_(torch.rand(n, generator=g) * 0.5 + 0.75)
            m.bias.data.copy_(torch.randn(n, generator=g) * 0.1)


# ---- EfficientNet-like --------------------------------------------------------------------------


class SiLU(nn.Module):  # written out, as EfficientNet ports often do
    def forward(self, x):
        return x * torch.sigmoid(x)


class ConvBNAct(nn.Sequential):
    def __init__(self, cin, cout, k=1, s=1, groups=1, act=True):
        layers = [nn.Conv2d(cin, cout, k, s, k // 2, groups=groups, bias=False), nn.BatchNorm2d(cout)]
        if act:
            layers.append(SiLU())
        super().__init__(*layers)


class SqueezeExcite(nn.Module):
    def __init__(self, c, r):
        super().__init__()
        self.fc1 = nn.Conv2d(c, r, 1)
        self.fc2 = nn.Conv2d(r, c, 1)
        self.act = SiLU()

    def forward(self, x):
        s = F.adaptive_avg_pool2d(x, 1)
        s = torch.sigmoid(self.fc2(self.act(self.fc1(s))))
        return x * s


class MBConv(nn.Module):
    def __init__(self, cin, cout, expand, stride):
        super().__init__()
        mid = cin * expand
        self.use_res = stride == 1 and cin == cout
        self.expand = ConvBNAct(cin, mid, 1) if expand != 1 else nn.Identity()
        self.dw = ConvBNAct(mid, mid, 3, stride, groups=mid)
        self.se = SqueezeExcite(mid, max(1, cin // 4))
        self.project = ConvBNAct(mid, cout, 1, act=False)

    def forward(self, x):
        y = self.project(self.se(self.dw(self.expand(x))))
        return x + y if self.use_res else y


class EfficientNetBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = ConvBNAct(3, 16, 3, 2)
        self.blocks = nn.Sequential(MBConv(16, 16, 1, 1), MBConv(16, 24, 4, 2), MBConv(24, 24, 4, 1),
                                    MBConv(24, 40, 4, 2), MBConv(40, 40, 4, 1))
        self.head = ConvBNAct(40, 96, 1)
        self.fc = nn.Linear(96, 10)

    def forward(self, x):
        x = self.head(self.blocks(self.stem(x)))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


# ---- YOLO-style ---------------------------------------------------------------------------------


class YConv(nn.Module):
    def __init__(self, cin, cout, k=1, s=1):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, k, s, k // 2, bias=False)
        self.bn = nn.BatchNorm2d(cout)
        self.act = nn.SiLU()

    def forward(self, x):
        return self.act(self.bn(self.conv(x)))


class Bottleneck(nn.Module):
    def __init__(self, c, shortcut=True):
        super().__init__()
        self.cv1 = YConv(c, c, 3)
        self.cv2 = YConv(c, c, 3)
        self.add = shortcut

    def forward(self, x):
        y = self.cv2(self.cv1(x))
        return x + y if self.add else y


class C2f(nn.Module):
    def __init__(self, cin, cout, n=1, shortcut=True):
        super().__init__()
        self.c = cout // 2
        self.cv1 = YConv(cin, 2 * self.c, 1)
        self.cv2 = YConv((2 + n) * self.c, cout, 1)
        self.m = nn.ModuleList(Bottleneck(self.c, shortcut) for _ in range(n))

    def forward(self, x):
        y = list(self.cv1(x).chunk(2, 1))
        y.extend(m(y[-1]) for m in self.m)
        return self.cv2(torch.cat(y, 1))


class YoloNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.b0 = YConv(3, 8, 3, 2)
        self.b1 = YConv(8, 16, 3, 2)
        self.c1 = C2f(16, 16, 1)
        self.b2 = YConv(16, 32, 3, 2)
        self.c2 = C2f(32, 32, 2)
        self.b3 = YConv(32, 48, 3, 2)
        self.c3 = C2f(48, 48, 1)
        self.up = nn.Upsample(scale_factor=2, mode="nearest")
        self.n1 = C2f(48 + 32, 32, 1, shortcut=False)
        self.head = nn.Conv2d(32, 3 * 9, 1)

    def forward(self, x):
        p3 = self.c2(self.b2(self.c1(self.b1(self.b0(x)))))
        p4 = self.c3(self.b3(p3))
        y = self.n1(torch.cat([self.up(p4), p3], 1))
        return self.head(y)


class YoloDecodeHead(nn.Module):
    """Two detection levels and the decoding an exported YOLOv8 carries (ultralytics' ``Detect`` in
    export mode), small: each level's head flattened to [N, 4 * reg + nc, anchors] and concatenated,
    the box part read as a softmax over ``reg`` bins per side by a fixed 1x1 Conv (0..reg-1), split
    into left-top and right-bottom distances (``chunk``), turned into centre and size around constant
    anchor points, scaled by each level's stride, concatenated with the class sigmoid. Exported with a
    dynamic batch, the head reads its sizes from ``Shape`` (``view(b, 4, reg, a)``, ``chunk``)."""

    def __init__(self, reg=4, nc=3, image=64):
        super().__init__()
        self.reg, self.nc = reg, nc
        self.b0, self.b1, self.b2 = YConv(3, 8, 3, 2), YConv(8, 16, 3, 2), YConv(16, 16, 3, 2)
        self.b3 = YConv(16, 16, 3, 2)
        self.heads = nn.ModuleList(nn.Sequential(YConv(16, 16, 3), nn.Conv2d(16, 4 * reg + nc, 1)) for _ in range(2))
        self.dfl = nn.Conv2d(reg, 1, 1, bias=False).requires_grad_(False)
        self.dfl.weight.data[:] = torch.arange(reg, dtype=torch.float).view(1, reg, 1, 1)
        points, strides = [], []
        for stride in (8, 16):
            size = image // stride
            ys, xs = torch.meshgrid(torch.arange(size) + 0.5, torch.arange(size) + 0.5, indexing="ij")
            points.append(torch.stack((xs, ys), -1).reshape(-1, 2))
            strides.append(torch.full((size * size, 1), float(stride)))
        self.register_buffer("anchors", torch.cat(points).transpose(0, 1).unsqueeze(0))
        self.register_buffer("strides", torch.cat(strides).transpose(0, 1))

    def forward(self, x):
        p3 = self.b2(self.b1(self.b0(x)))
        p4 = self.b3(p3)
        y = torch.cat([h(f).flatten(2) for h, f in zip(self.heads, (p3, p4))], 2)
        return yolo_decode(y, self.reg, self.nc, self.dfl, self.anchors, self.strides)


def yolo_decode(y, reg, nc, dfl, anchors, strides):
    """A YOLOv8 export's decoding of its concatenated head output y [B, 4 * reg + nc, anchors]: the box
    part a softmax over ``reg`` bins per side read out by ``dfl`` (a fixed 1x1 Conv holding 0..reg-1),
    split into left-top and right-bottom distances, boxes around the anchor points scaled by each
    anchor's stride, concatenated with the class sigmoid. Shared with benchmarks/zoo.py's detector."""
    box, cls = y.split((4 * reg, nc), 1)
    b, _, a = box.shape
    dist = dfl(box.view(b, 4, reg, a).transpose(2, 1).softmax(1)).view(b, 4, a)
    lt, rb = dist.chunk(2, 1)
    x1y1, x2y2 = anchors - lt, anchors + rb
    xywh = torch.cat(((x1y1 + x2y2) / 2, x2y2 - x1y1), 1) * strides
    return torch.cat((xywh, cls.sigmoid()), 1)


class TimmAttention(nn.Module):
    """timm's ``Attention``: one qkv Linear, ``reshape(B, N, 3, H, D).permute(2, 0, 3, 1, 4)``, then q, k,
    v by indexing (older timm) or ``unbind(0)`` (newer). Shared with benchmarks/zoo.py's timm-style ViT."""

    def __init__(self, dim, heads, unbind):
        super().__init__()
        self.heads, self.size, self.unbind = heads, dim // heads, unbind
        self.scale = self.size ** -0.5
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x):
        b, n, c = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.heads, self.size).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0) if self.unbind else (qkv[0], qkv[1], qkv[2])
        a = ((q @ k.transpose(-2, -1)) * self.scale).softmax(-1)
        return self.proj((a @ v).transpose(1, 2).reshape(b, n, c))


class TimmBlocks(nn.Module):
    """Two pre-norm timm ViT blocks (LayerNorm, the attention above, LayerNorm, GELU MLP, residuals) on
    [batch, 17, 32] tokens: the first cuts q, k, v by indexing, the second by ``unbind``."""

    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.attn = nn.ModuleList(TimmAttention(dim, heads, unbind) for unbind in (False, True))
        self.n1 = nn.ModuleList(nn.LayerNorm(dim) for _ in range(2))
        self.n2 = nn.ModuleList(nn.LayerNorm(dim) for _ in range(2))
        self.mlp = nn.ModuleList(nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
                                 for _ in range(2))

    def forward(self, x):
        for attn, n1, n2, mlp in zip(self.attn, self.n1, self.n2, self.mlp):
            x = x + attn(n1(x))
            x = x + mlp(n2(x))
        return x


# ---- ConvNeXt -----------------------------------------------------------------------------------


class ConvNeXtBlock(nn.Module):
    def __init__(self, dim, layer_scale=1e-1):
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.act = nn.GELU()
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(layer_scale * (1 + torch.rand(dim)))

    def forward(self, x):
        y = self.dwconv(x).permute(0, 2, 3, 1)
        y = self.pwconv2(self.act(self.pwconv1(self.norm(y))))
        y = (self.gamma * y).permute(0, 3, 1, 2)
        return x + y


class ConvNeXtBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 32, 4, 4)
        self.blocks = nn.Sequential(ConvNeXtBlock(32), ConvNeXtBlock(32), ConvNeXtBlock(32))
        self.norm = nn.LayerNorm(32)
        self.fc = nn.Linear(32, 10)

    def forward(self, x):
        x = self.blocks(self.stem(x))
        return self.fc(self.norm(x.mean((-2, -1))))


# ---- ViT ----------------------------------------------------------------------------------------


class ViTBlock(nn.Module):
    """torchvision.models.vision_transformer.EncoderBlock, written out."""

    def __init__(self, dim, heads, mlp):
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim, eps=1e-6)
        self.self_attention = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.ln_2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(dim, mlp), nn.GELU(), nn.Linear(mlp, dim))

    def forward(self, x):
        y = self.ln_1(x)
        y, _ = self.self_attention(y, y, y, need_weights=False)
        x = x + y
        return x + self.mlp(self.ln_2(x))


class ViTBlocks(nn.Module):
    def __init__(self, image=32, patch=8, dim=64, heads=4, mlp=128, layers=2, classes=10):
        super().__init__()
        self.dim = dim
        self.conv_proj = nn.Conv2d(3, dim, patch, patch)
        tokens = (image // patch) ** 2 + 1
        self.class_token = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.pos_embedding = nn.Parameter(torch.randn(1, tokens, dim) * 0.02)
        self.layers = nn.Sequential(*[ViTBlock(dim, heads, mlp) for _ in range(layers)])
        self.ln = nn.LayerNorm(dim, eps=1e-6)
        self.head = nn.Linear(dim, classes)

    def forward(self, x):
        n = x.shape[0]
        x = self.conv_proj(x).reshape(n, self.dim, -1).permute(0, 2, 1)
        x = torch.cat([self.class_token.expand(n, -1, -1), x], dim=1) + self.pos_embedding
        return self.head(self.ln(self.layers(x))[:, 0])


def _mobilenet_v3():
    import torchvision

    return torchvision.models.mobilenet_v3_small(width_mult=0.25, num_classes=10)


MODELS = {
    "mobilenet_v3_small_w025_opset13": (_mobilenet_v3, (1, 3, 64, 64)),
    "efficientnet_blocks_opset13": (EfficientNetBlocks, (1, 3, 64, 64)),
    "yolo_conv_bn_silu_opset13": (YoloNet, (1, 3, 64, 64)),
    "convnext_blocks_opset13": (ConvNeXtBlocks, (1, 3, 32, 32)),
    "vit_blocks_opset14": (ViTBlocks, (1, 3, 32, 32)),
    "yolo_decode_head_opset13": (YoloDecodeHead, (1, 3, 64, 64)),
    "timm_vit_blocks_opset17": (TimmBlocks, (1, 17, 32)),
}


def export(name: str, seed: int = 0) -> Path:
    make, shape = MODELS[name]
    torch.manual_seed(seed)
    model = make().eval()
    _randomize_bn(model, seed + 1)
    x = torch.randn(*shape)
    path = HERE / f"{name}.onnx"
    opset = int(name.rsplit("opset", 1)[1])
    torch.onnx.export(model, (x,), str(path), opset_version=opset, dynamo=False, input_names=["input"],
                      output_names=["output"], dynamic_axes={"input": {0: "batch"}, "output": {0: "batch"}})
    return path


def main(names=None) -> None:
    for name in names or MODELS:
        path = export(name, seed=list(MODELS).index(name))  # each model's seed is fixed
        print(f"{path.name}: {path.stat().st_size / 1024:.0f} KiB")


if __name__ == "__main__":
    main(sys.argv[1:] or None)
