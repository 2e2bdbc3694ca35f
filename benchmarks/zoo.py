#!/usr/bin/env python3
"""Model-zoo benchmark: onnxfuse-optimized vs original under ONNX Runtime, and torch.compile, on one GPU.

For each model (random weights; nothing is downloaded):

1. build it in PyTorch (eval mode) and export it with the legacy TorchScript exporter (``dynamo=False``,
   ``do_constant_folding=False``, dynamic batch, opset 14 by default) so BatchNormalization stays in the
   graph (checked to be inference-mode) and LayerNorm/GELU stay decomposed;
2. ``onnxfuse.pipeline.optimize_model`` with validation on;
3. for every batch size and with/without CUDA graphs, in one process: the original and the optimized
   model under ONNX Runtime ``ORT_ENABLE_ALL`` (IOBinding on the GPU, interleaved rounds), PyTorch eager,
   and ``torch.compile`` (CUDA graphs: ``mode="reduce-overhead"``); failures are recorded, not fatal;
4. an fp16 variant (the module in ``.half()`` with fp32 inputs/outputs cast inside the graph), original
   and optimized, timed, with its drift against the fp32 model's outputs, and (``--torch compile``)
   torch.compile of that same ``.half()`` module (the "Against torch.compile" table);
5. transformer rows (BERT-base, ViT-B/16, GPT-2 small without KV cache, a Whisper-base encoder), fp32 and
   fp16: two more columns, timed in the same rounds: onnxfuse with the opt-in ``contrib-attention`` rule,
   and the anchor, ONNX Runtime's transformers optimizer (``optimize_model`` given the model type, head
   count and hidden size it needs). Its output is checked (ONNX checker, a session, the original's
   outputs at 1e-3 / 1e-2); an invalid model is recorded as that cell's result, not hidden. Not a default
   row: ``qwen2_0_5b`` (Qwen2-0.5B's decoder shape, the Llama family's rotary and grouped-KV attention;
   ``--exporter dynamo`` only: torch's TorchScript exporter fails on it). Not default rows either, the
   held-out-style models issue 34 names: ``yolo_decode`` (the YOLO-style detector with a YOLOv8 export's
   box decoding: distribution softmax, anchors, strides, class sigmoid) and ``dbnet_mbv3`` (a DB text
   detector, PP-OCR's shape: MobileNetV3 backbone, FPN with nearest upsampling, DB head with
   ConvTransposes), ``fpn_resnet50`` (torchvision's detection backbone, ResNet-50 with its feature
   pyramid, the finest level as output); and ``vit_timm_b16``, ViT-B/16 as timm writes it (q, k, v cut from one packed
   projection), the form of most vision transformers users export.

Each model runs in its own child process (``--no-isolate`` to turn that off), so a crash, a CUDA error
or a hang in one model costs only that model; results are written after every measurement, so a run
stopped by ``--deadline`` or killed still leaves JSON, Markdown and an SVG chart behind. ``--deadline``
is a hard limit: a model still running 30 s after it is stopped, its cells so far kept (on the full grid
with ``--tune-shapes`` a model takes 2-5 minutes of an H200: 5.43). ``--gpus N`` runs up to N models at
once, each child on its own GPU; ``NAME@eager`` / ``NAME@sdpa`` in ``--models`` exports a transformer
with that attention, so one run holds both exports. ``results.md``'s "Never slower" table is issue 32's
grid: per model, the configured cells measured, the lowest speed-up and its cell, the cells the original
could not be timed in, the cells not measured (cut, failed), and the optimize calls' seconds.

Usage (repo root, onnxruntime-gpu importable, torch/torchvision/transformers installed)::

    python benchmarks/zoo.py --quick --out /tmp/zoo                # ~2 minutes per model (H200, 2026-11-28)
    python benchmarks/zoo.py --models resnet50,bert_base --out DIR --time-budget 1
    python benchmarks/zoo.py --report-only --out DIR --merge A/results.json B/results.json
    python benchmarks/zoo.py --gpus 2 --models bert_base@eager,bert_base@sdpa,resnet50 --out DIR

Never imported by the package.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
import traceback
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

DEFAULT_MODELS = ["resnet50", "mobilenet_v3_large", "efficientnet_b0", "convnext_tiny", "yolo_silu",
                  "bert_base", "vit_b_16", "gpt2_small", "whisper_base_encoder"]
BERT_SEQ = 128


def _raise_opset_for_layernorm(model) -> int | None:
    """ONNX Runtime's transformers optimizer (1.31) writes ``LayerNormalization`` in the default domain into
    models of opset < 17, where ONNX has no such op (the checker and ONNX Runtime refuse: "No Op registered
    for LayerNormalization with domain_version of 14"). LayerNormalization-17 is the op it means (axis,
    epsilon, stash_type), and opsets 15-17 changed no op of these exports' inference graphs in meaning, so
    raising the default opset import to 17 is the smallest change that loads the peer's output. Returns 17
    when it raised it, else None."""
    uses = any(n.op_type == "LayerNormalization" and n.domain in ("", "ai.onnx") for n in model.graph.node)
    for imp in model.opset_import:
        if imp.domain in ("", "ai.onnx") and imp.version < 17 and uses:
            imp.version = 17
            return 17
    return None


def _drop_device_copies(model) -> int:
    """ONNX Runtime's transformers optimizer with ``use_gpu=True`` saves the graph of an ONNX Runtime
    session that placed some nodes on the CPU (the sdpa exports' shape arithmetic), with the
    ``MemcpyFromHost``/``MemcpyToHost`` nodes that session inserted (its own code says so: "use_gpu=True
    might cause extra memory copy nodes"). Those are ONNX Runtime's internal ops, which ONNX's checker
    refuses ("No Op registered for MemcpyFromHost": the ViT and sdpa BERT anchors, 2026-11-28). Each is a copy between devices, the identity on values, and a new session inserts
    the copies it needs, so the anchor runs with each one's readers reading its input. Returns the count
    removed."""
    copies = [n for n in model.graph.node if n.op_type in ("MemcpyFromHost", "MemcpyToHost")]
    outputs = {o.name for o in model.graph.output}
    for node in copies:
        src, dst = node.input[0], node.output[0]
        if dst in outputs:  # a graph output keeps its name: the copy becomes an Identity where it stands
            node.op_type, node.domain = "Identity", ""
            del node.attribute[:]
            continue
        model.graph.node.remove(node)
        for other in model.graph.node:
            for i, name in enumerate(other.input):
                if name == dst:
                    other.input[i] = src
    return len(copies)


def log(msg: str) -> None:
    # ZOO_LOG_TAG: the model a child runs, set by a parent that runs several at once (--gpus)
    tag = os.environ.get("ZOO_LOG_TAG")
    print(f"[zoo {time.strftime('%H:%M:%S')}{' ' + tag if tag else ''}] {msg}", flush=True)


def complete_part(part: Path) -> bool:
    """Whether ``part`` (a model's results) is complete: it exists, reads, holds timings, and records no
    error of the run as a whole (skipped, a child stopped or crashed, no results) nor a stage the deadline
    cut; ``--resume`` runs such a model again. A cell that failed for good (ONNX Runtime refusing to capture
    BERT's original in a CUDA graph) does not make it incomplete: it would fail again."""
    try:
        data = json.loads(part.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    cut = [e for e in data.get("errors", []) if e.get("stage") == "run" or "deadline" in str(e.get("error", ""))]
    return bool(data.get("timings")) and not cut


def gpu_slots(count: int, visible: str | None) -> list[str | None]:
    """The ``CUDA_VISIBLE_DEVICES`` of each of ``count`` child slots: one each of the GPUs the parent may
    use (``visible``: the parent's ``CUDA_VISIBLE_DEVICES``), else ``0 .. count-1``; ``[None]`` for one
    slot (the child then inherits the parent's environment). Fewer GPUs visible than ``count``: ValueError."""
    if count == 1:
        return [None]
    ids = [v.strip() for v in visible.split(",") if v.strip()] if visible else [str(i) for i in range(count)]
    if len(ids) < count:
        raise ValueError(f"--gpus {count}, but CUDA_VISIBLE_DEVICES={visible} names {len(ids)}")
    return ids[:count]


def run_children(names: list[str], slots: list, deadline_at: float | None, start, on_done,
                 poll: float = 0.2, clock=time.time) -> dict:
    """One child per name, at most ``len(slots)`` at a time, each on a slot of its own: ``start(name,
    slot)`` returns a running ``subprocess.Popen``-like object (``poll``, ``kill``, ``wait``). Why: a model
    on the zoo's full grid takes 2-5 minutes of one GPU (5.43), and a machine of several GPUs times one
    model on each at once; each GPU still times one model at a time.

    A name not started by 20 s before ``deadline_at`` is skipped; a child still running 30 s after it is
    killed ("timeout"), as the one-at-a-time loop always did. ``on_done(name, outcome, seconds)`` is
    called as each child ends, in the order they end; returns name -> outcome (the return code,
    "timeout" or "skipped")."""
    pending, running, free, outcomes = list(names), {}, list(range(len(slots))), {}
    while pending or running:
        while pending and free:
            name = pending.pop(0)
            if deadline_at and clock() > deadline_at - 20:
                outcomes[name] = "skipped"
                on_done(name, "skipped", 0.0)
                continue
            slot = free.pop(0)
            running[slot] = (name, start(name, slots[slot]), clock())
        for slot, (name, proc, t0) in list(running.items()):
            outcome = proc.poll()
            if outcome is None and deadline_at and clock() > deadline_at + 30:
                proc.kill()
                proc.wait()
                outcome = "timeout"
            if outcome is not None:
                del running[slot]
                free = sorted(free + [slot])
                outcomes[name] = outcome
                on_done(name, outcome, clock() - t0)
        if running:
            time.sleep(poll)
    return outcomes


# --------------------------------------------------------------------------------------------- models


def _yolo_module():
    import torch
    from torch import nn

    class ConvBNSiLU(nn.Module):
        def __init__(self, c_in, c_out, k=1, s=1):
            super().__init__()
            self.conv = nn.Conv2d(c_in, c_out, k, s, k // 2, bias=False)
            self.bn = nn.BatchNorm2d(c_out, eps=1e-3, momentum=0.03)
            self.act = nn.SiLU()

        def forward(self, x):
            return self.act(self.bn(self.conv(x)))

    class Bottleneck(nn.Module):
        def __init__(self, c, shortcut=True):
            super().__init__()
            self.cv1, self.cv2, self.add = ConvBNSiLU(c, c, 3), ConvBNSiLU(c, c, 3), shortcut

        def forward(self, x):
            y = self.cv2(self.cv1(x))
            return x + y if self.add else y

    class C2f(nn.Module):  # CSP-style: split, bottlenecks on one half, concat everything, 1x1
        def __init__(self, c_in, c_out, n=1, shortcut=True):
            super().__init__()
            self.c = c_out // 2
            self.cv1 = ConvBNSiLU(c_in, 2 * self.c, 1)
            self.cv2 = ConvBNSiLU((2 + n) * self.c, c_out, 1)
            self.m = nn.ModuleList(Bottleneck(self.c, shortcut) for _ in range(n))

        def forward(self, x):
            y = list(self.cv1(x).chunk(2, 1))
            for m in self.m:
                y.append(m(y[-1]))
            return self.cv2(torch.cat(y, 1))

    class SPPF(nn.Module):
        def __init__(self, c_in, c_out):
            super().__init__()
            self.cv1, self.cv2 = ConvBNSiLU(c_in, c_in // 2), ConvBNSiLU(c_in * 2, c_out)
            self.pool = nn.MaxPool2d(5, 1, 2)

        def forward(self, x):
            x = self.cv1(x)
            y1 = self.pool(x)
            y2 = self.pool(y1)
            return self.cv2(torch.cat([x, y1, y2, self.pool(y2)], 1))

    class Detector(nn.Module):  # ~YOLOv8-s shaped: backbone, FPN/PAN neck, 3 heads
        def __init__(self, nc=80, reg=16):
            super().__init__()
            self.stem = nn.Sequential(ConvBNSiLU(3, 32, 3, 2), ConvBNSiLU(32, 64, 3, 2), C2f(64, 64, 1))
            self.p3 = nn.Sequential(ConvBNSiLU(64, 128, 3, 2), C2f(128, 128, 2))
            self.p4 = nn.Sequential(ConvBNSiLU(128, 256, 3, 2), C2f(256, 256, 2))
            self.p5 = nn.Sequential(ConvBNSiLU(256, 512, 3, 2), C2f(512, 512, 1), SPPF(512, 512))
            self.up = nn.Upsample(scale_factor=2, mode="nearest")
            self.n4 = C2f(512 + 256, 256, 1, False)
            self.n3 = C2f(256 + 128, 128, 1, False)
            self.d3 = ConvBNSiLU(128, 128, 3, 2)
            self.m4 = C2f(128 + 256, 256, 1, False)
            self.d4 = ConvBNSiLU(256, 256, 3, 2)
            self.m5 = C2f(256 + 512, 512, 1, False)
            no = nc + 4 * reg
            self.heads = nn.ModuleList(
                nn.Sequential(ConvBNSiLU(c, 128, 3), ConvBNSiLU(128, 128, 3), nn.Conv2d(128, no, 1))
                for c in (128, 256, 512)
            )

        def forward(self, x):
            p3 = self.p3(self.stem(x))
            p4 = self.p4(p3)
            p5 = self.p5(p4)
            n4 = self.n4(torch.cat([self.up(p5), p4], 1))
            n3 = self.n3(torch.cat([self.up(n4), p3], 1))
            o4 = self.m4(torch.cat([self.d3(n3), n4], 1))
            o5 = self.m5(torch.cat([self.d4(o4), p5], 1))
            outs = [h(f).flatten(2) for h, f in zip(self.heads, (n3, o4, o5))]
            return torch.cat(outs, 2)

    return Detector()


def _yolo_decode_module(image: int = 640, nc: int = 80, reg: int = 16):
    """The detector above with the decoding an exported YOLOv8 carries (ultralytics' ``Detect`` in
    export mode): the distribution focal loss (a softmax over ``reg`` bins per box side, read out by a
    1x1 Conv holding 0..reg-1), distances to boxes around the anchor points, scaled by each level's
    stride, and the class sigmoid, concatenated to [B, 4 + nc, anchors]: the shape of a real detector's
    export, its head's Split, Softmax, Conv and elementwise tail included. The decoding is the testdata
    exporter's (``testdata/export_fusion_models.py: yolo_decode``), as its small head uses it."""
    import torch
    from torch import nn

    from testdata.export_fusion_models import yolo_decode

    body = _yolo_module()
    points, strides = [], []
    for stride in (8, 16, 32):
        size = image // stride
        ys, xs = torch.meshgrid(torch.arange(size) + 0.5, torch.arange(size) + 0.5, indexing="ij")
        points.append(torch.stack((xs, ys), -1).reshape(-1, 2))
        strides.append(torch.full((size * size, 1), float(stride)))

    class Decoded(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = body
            self.dfl = nn.Conv2d(reg, 1, 1, bias=False).requires_grad_(False)
            self.dfl.weight.data[:] = torch.arange(reg, dtype=torch.float).view(1, reg, 1, 1)
            self.register_buffer("anchors", torch.cat(points).transpose(0, 1).unsqueeze(0))
            self.register_buffer("strides", torch.cat(strides).transpose(0, 1))

        def forward(self, x):
            return yolo_decode(self.body(x), reg, nc, self.dfl, self.anchors, self.strides)

    return Decoded()


def _dbnet_module():
    """A DB text detector (PaddleOCR's PP-OCR det: MobileNetV3 backbone, FPN, DB head), random weights:
    the OCR detector issue 34 names. torchvision's MobileNetV3-Large features at strides 4, 8, 16 and 32;
    each 1x1 to 256 channels, top-down nearest upsampling and adds, a 3x3 to 64 channels per level,
    upsampled to stride 4 and concatenated; the head a 3x3 Conv-BN-ReLU, two 2x2 ConvTransposes (the
    first with BN-ReLU) and a sigmoid: the probability map at the input's size."""
    import torch
    import torchvision
    from torch import nn

    class DBNet(nn.Module):
        def __init__(self):
            super().__init__()
            features = torchvision.models.mobilenet_v3_large(weights=None).features
            self.stages = nn.ModuleList([features[:4], features[4:7], features[7:13], features[13:]])
            self.ins = nn.ModuleList(nn.Conv2d(c, 256, 1, bias=False) for c in (24, 40, 112, 960))
            self.outs = nn.ModuleList(nn.Conv2d(256, 64, 3, padding=1, bias=False) for _ in range(4))
            self.head = nn.Sequential(
                nn.Conv2d(256, 64, 3, padding=1, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
                nn.ConvTranspose2d(64, 64, 2, 2), nn.BatchNorm2d(64), nn.ReLU(),
                nn.ConvTranspose2d(64, 1, 2, 2), nn.Sigmoid())

        def forward(self, x):
            feats = []
            for stage in self.stages:
                x = stage(x)
                feats.append(x)
            c2, c3, c4, c5 = (conv(f) for conv, f in zip(self.ins, feats))
            up = nn.functional.interpolate
            p4 = c4 + up(c5, scale_factor=2.0, mode="nearest")
            p3 = c3 + up(p4, scale_factor=2.0, mode="nearest")
            p2 = c2 + up(p3, scale_factor=2.0, mode="nearest")
            maps = [conv(p) for conv, p in zip(self.outs, (p2, p3, p4, c5))]
            fused = torch.cat([maps[0]] + [up(m, scale_factor=float(2 ** i), mode="nearest")
                                           for i, m in enumerate(maps[1:], 1)], 1)
            return self.head(fused)

    return DBNet()


def _fpn_resnet50_module():
    """torchvision's feature pyramid on ResNet-50 (``resnet_fpn_backbone``, the backbone of its Faster,
    Mask and Keypoint R-CNN and RetinaNet: frozen BatchNorm, lateral 1x1 Convs, top-down nearest
    upsampling by ``F.interpolate(size=...)`` added to each lateral map, 3x3 output Convs), random weights;
    its finest level [N, 256, H/4, W/4] as the output, which reads every top-down Add. A held-out-style
    model for issue 34's FPN path beside the DB detector's."""
    import torch
    from torchvision.models.detection.backbone_utils import resnet_fpn_backbone

    class FPN(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = resnet_fpn_backbone(backbone_name="resnet50", weights=None, trainable_layers=5)

        def forward(self, x):
            return self.body(x)["0"]

    return FPN()


def _timm_vit_module(dim: int = 768, depth: int = 12, heads: int = 12, patch: int = 16, image: int = 224):
    """A ViT-B/16 written as timm writes it (timm is not needed): patch Conv, class token, position
    embedding, pre-norm blocks whose attention computes q, k and v with one Linear and cuts them from a
    packed ``reshape(B, N, 3, H, D).permute(2, 0, 3, 1, 4)`` by ``unbind`` (DeiT, BEiT, EVA and PP-OCR's
    SVTR share the module), exact GELU MLP, final LayerNorm and the class token's head. The attention is
    the testdata exporter's ``TimmAttention`` (``testdata/export_fusion_models.py``), by ``unbind``."""
    import torch
    from torch import nn

    from testdata.export_fusion_models import TimmAttention

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1 = nn.LayerNorm(dim, eps=1e-6)
            self.attn = TimmAttention(dim, heads, unbind=True)
            self.norm2 = nn.LayerNorm(dim, eps=1e-6)
            self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

        def forward(self, x):
            x = x + self.attn(self.norm1(x))
            return x + self.mlp(self.norm2(x))

    class ViT(nn.Module):
        def __init__(self):
            super().__init__()
            self.patch = nn.Conv2d(3, dim, patch, patch)
            self.cls = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
            self.pos = nn.Parameter(torch.randn(1, (image // patch) ** 2 + 1, dim) * 0.02)
            self.blocks = nn.Sequential(*(Block() for _ in range(depth)))
            self.norm, self.head = nn.LayerNorm(dim, eps=1e-6), nn.Linear(dim, 1000)

        def forward(self, x):
            x = self.patch(x).flatten(2).transpose(1, 2)
            x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], 1) + self.pos
            return self.head(self.norm(self.blocks(x))[:, 0])

    return ViT()


class Spec:
    """How to build, export and feed one model."""

    def __init__(self, name, build, input_names, image=None, seq=None, features=None, transformer=None):
        self.name, self.build, self.input_names, self.image, self.seq = name, build, input_names, image, seq
        #: (channels, frames) of an audio encoder's log-mel input
        self.features = features
        #: (model_type, num_heads, hidden_size) for ONNX Runtime's transformers optimizer (the anchor column)
        self.transformer = transformer

    def example(self, batch: int, device="cpu"):
        import torch

        g = torch.Generator().manual_seed(batch)
        if self.features:
            return (torch.randn(batch, *self.features, generator=g).to(device),)
        if self.seq:
            ids = torch.randint(0, 30522, (batch, self.seq), generator=g)
            return (ids.to(device), torch.ones(batch, self.seq, dtype=torch.int64, device=device))
        return (torch.randn(batch, 3, self.image, self.image, generator=g).to(device),)

    def feeds(self, batch: int) -> dict:
        return {n: t.numpy() for n, t in zip(self.input_names, self.example(batch))}


def _torchvision(name):
    def build():
        import torchvision

        return getattr(torchvision.models, name)(weights=None)

    return build


def _bert(attn: str = "eager"):
    import torch
    import transformers

    cfg = transformers.BertConfig()  # bert-base-uncased's shape: 12 layers, 768 hidden, 12 heads
    try:
        bert = transformers.BertModel(cfg, add_pooling_layer=False, attn_implementation=attn)
    except TypeError:
        cfg._attn_implementation = attn
        bert = transformers.BertModel(cfg, add_pooling_layer=False)

    class Bert(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bert = bert

        def forward(self, input_ids, attention_mask):
            return self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    return Bert()


def causal_padding_bias(input_ids, attention_mask):
    """The causal and padding mask as one additive [B, 1, S, S] float32 tensor (0 kept, finfo(float32).min
    masked), as transformers' eager attention adds it; transformers passes a 4-D mask through unchanged to
    either attention (its own mask builder uses vmap, which the TorchScript exporter cannot trace)."""
    import torch

    s = input_ids.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=input_ids.device).tril()
    keep = causal[None, None] & attention_mask[:, None, None, :].bool()
    return torch.zeros(keep.shape, device=input_ids.device).masked_fill(~keep, torch.finfo(torch.float32).min)


def _gpt2(attn: str = "eager"):
    import torch
    import transformers

    cfg = transformers.GPT2Config(use_cache=False)  # gpt2 (small): 12 layers, 768 hidden, 12 heads
    cfg._attn_implementation = attn
    gpt2 = transformers.GPT2Model(cfg)

    class Gpt2(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gpt2 = gpt2

        def forward(self, input_ids, attention_mask):
            if attn == "sdpa" and not torch.jit.is_tracing():  # dynamo traces transformers' own mask builder
                return self.gpt2(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
            bias = causal_padding_bias(input_ids, attention_mask)  # (traced: no vmap)
            return self.gpt2(input_ids=input_ids, attention_mask=bias, use_cache=False).last_hidden_state

    return Gpt2()


def _qwen2(attn: str = "sdpa"):
    """Qwen2-0.5B's decoder shape (24 layers, hidden 896, 14 query heads sharing 2 key/value heads of 64,
    FFN 4864, rotary embeddings), its vocabulary cut to 32000 so the float32 export stays under 2 GiB; no
    KV cache. The Llama family's attention form: rotary on q and k after the head split, repeat_kv."""
    import torch
    import transformers

    cfg = transformers.Qwen2Config(vocab_size=32000, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                   num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=4096,
                                   use_cache=False)
    cfg._attn_implementation = attn
    model = transformers.Qwen2Model(cfg)

    class Qwen2(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask):
            return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state

    return Qwen2()


def _whisper_encoder(attn: str = "eager"):
    import torch
    import transformers

    cfg = transformers.WhisperConfig(d_model=512, encoder_layers=6, encoder_attention_heads=8,
                                     decoder_layers=1, decoder_attention_heads=8, encoder_ffn_dim=2048)  # base
    cfg._attn_implementation = attn
    encoder = transformers.WhisperModel(cfg).get_encoder()

    class Encoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder = encoder

        def forward(self, input_features):
            return self.encoder(input_features=input_features).last_hidden_state

    return Encoder()


SPECS = {s.name: s for s in [
    Spec("resnet50", _torchvision("resnet50"), ["input"], image=224),
    Spec("mobilenet_v3_large", _torchvision("mobilenet_v3_large"), ["input"], image=224),
    Spec("efficientnet_b0", _torchvision("efficientnet_b0"), ["input"], image=224),
    Spec("convnext_tiny", _torchvision("convnext_tiny"), ["input"], image=224),
    Spec("yolo_silu", _yolo_module, ["images"], image=640),
    Spec("yolo_decode", _yolo_decode_module, ["images"], image=640),
    Spec("dbnet_mbv3", _dbnet_module, ["x"], image=640),
    Spec("fpn_resnet50", _fpn_resnet50_module, ["images"], image=640),
    Spec("bert_base", _bert, ["input_ids", "attention_mask"], seq=BERT_SEQ, transformer=("bert", 12, 768)),
    Spec("vit_b_16", _torchvision("vit_b_16"), ["input"], image=224, transformer=("vit", 12, 768)),
    Spec("vit_timm_b16", _timm_vit_module, ["input"], image=224, transformer=("vit", 12, 768)),
    Spec("gpt2_small", _gpt2, ["input_ids", "attention_mask"], seq=BERT_SEQ, transformer=("gpt2", 12, 768)),
    Spec("whisper_base_encoder", _whisper_encoder, ["input_features"], features=(80, 3000),
         transformer=("bart", 8, 512)),
    Spec("qwen2_0_5b", _qwen2, ["input_ids", "attention_mask"], seq=BERT_SEQ),
]}


#: models whose builder takes transformers' attention implementation: sdpa (transformers' default) for the
#: dynamo exporter, as a user's ``torch.onnx.export`` of the model would write it; eager for the legacy one
ATTN_BUILDERS = ("bert_base", "gpt2_small", "qwen2_0_5b", "whisper_base_encoder")
#: transformers' attention implementations a model of ATTN_BUILDERS can be exported with
ATTENTIONS = ("eager", "sdpa")


def split_variant(name: str) -> tuple[str, str | None]:
    """``bert_base@sdpa`` -> (``bert_base``, ``sdpa``): a model of ATTN_BUILDERS exported with that
    attention whatever ``--attention`` says, so one run can time both exports (issue 32 asks for the eager
    and the sdpa export of BERT, GPT-2 and Whisper); a plain name -> (name, None)."""
    base, _, attention = name.partition("@")
    return base, attention or None


def variant_problem(name: str) -> str | None:
    """Why ``name`` is not a model ``--models`` accepts, or None."""
    base, attention = split_variant(name)
    if base not in SPECS:
        return f"unknown model {base}"
    if attention is not None and (base not in ATTN_BUILDERS or attention not in ATTENTIONS):
        return (f"{name}: @{attention} needs a model of {', '.join(ATTN_BUILDERS)} and one of "
                f"{', '.join(ATTENTIONS)}")
    return None


def build_module(spec: Spec, seed: int = 0, exporter: str = "legacy", attention: str | None = None):
    """``attention``: transformers' ``attn_implementation`` for the models that take one (None: sdpa for
    the dynamo exporter, eager for the legacy one; ``--attention sdpa`` with the legacy exporter is what a
    user who never sets it exports, issue 30)."""
    import torch

    torch.manual_seed(seed)
    if spec.name in ATTN_BUILDERS:
        module = spec.build(attention or ("sdpa" if exporter == "dynamo" else "eager")).eval()
    else:
        module = spec.build().eval()
    # Random weights leave BatchNorm's running statistics at 0/1; make them non-trivial so folding them
    # is really tested (a fold that ignored mean/var would still pass with identity statistics).
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
                m.running_mean.copy_(torch.randn(m.running_mean.shape, generator=g) * 0.1)
                m.running_var.copy_(torch.rand(m.running_var.shape, generator=g) * 0.5 + 0.75)
        # Some initialisers zero whole tensors (torchvision's ViT zeroes its classifier head): the
        # outputs would then be all zeros and validation would compare nothing. Give every all-zero
        # parameter small random values instead.
        for p in module.parameters():
            if p.numel() > 1 and not p.detach().abs().sum():
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return module


class HalfIO:
    """Wrap a module: cast floating inputs to fp16, run the .half() module, cast outputs back to fp32."""

    def __new__(cls, module):
        import torch

        class _Half(torch.nn.Module):
            def __init__(self, m):
                super().__init__()
                self.m = m.half()

            def forward(self, *args):
                args = [a.half() if a.is_floating_point() else a for a in args]
                return self.m(*args).float()

        return _Half(module)


# --------------------------------------------------------------------------------------------- export


def export(spec: Spec, module, path: Path, opset: int, device: str = "cpu", dynamic_seq: bool = False,
           exporter: str = "legacy") -> dict:
    """``dynamic_seq``: token models get a dynamic sequence axis too (``sequence``), as exports meant for
    variable-length inputs have (optimum's, for one); the zoo's timing still feeds ``spec.seq`` tokens.
    ``exporter="dynamo"``: ``torch.onnx.export(dynamo=True)``, torch's default since 2.9, at opset 18 or
    more, traced at batch 2 (torch.export specializes a size of 1), weights in ``path``.data beside it."""
    import torch

    torch.backends.mha.set_fastpath_enabled(False)  # nn.MultiheadAttention's fused path has no ONNX export
    t0 = time.perf_counter()
    if exporter == "dynamo":
        opset = max(opset, 18)
        dims = {0: torch.export.Dim.AUTO, 1: torch.export.Dim.AUTO} if dynamic_seq and spec.seq else {
            0: torch.export.Dim.AUTO}
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(module.to(device), spec.example(2, device), str(path), dynamo=True, opset_version=opset,
                              input_names=spec.input_names, output_names=["output"],
                              dynamic_shapes=_dynamic_shapes(module, [dict(dims) for _ in spec.input_names]),
                              external_data=True)
        module.to("cpu")
        return {"seconds": round(time.perf_counter() - t0, 2), "opset": opset, "exporter": "dynamo",
                **check_export(path)}
    args = spec.example(1, device)
    axes = {0: "batch", 1: "sequence"} if dynamic_seq and spec.seq else {0: "batch"}
    dynamic = {n: dict(axes) for n in spec.input_names}
    dynamic["output"] = dict(axes)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the legacy exporter's deprecation and tracer warnings
        kwargs = dict(opset_version=opset, do_constant_folding=False, input_names=spec.input_names,
                      output_names=["output"], dynamic_axes=dynamic)
        try:
            torch.onnx.export(module.to(device), args, str(path), dynamo=False, **kwargs)
        except TypeError:  # torch older than 2.5: no dynamo argument, the legacy exporter is the default
            torch.onnx.export(module.to(device), args, str(path), **kwargs)
    module.to("cpu")
    return {"seconds": round(time.perf_counter() - t0, 2), "opset": opset, **check_export(path)}


def _dynamic_shapes(module, per_input: list):
    """torch.export's ``dynamic_shapes`` for ``module``'s inputs: one entry per parameter, so a
    ``forward(*args)`` (HalfIO's wrapper) takes them all as its one tuple."""
    import inspect

    params = inspect.signature(module.forward).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params):
        return (tuple(per_input),)
    return tuple(per_input)


def check_export(path: Path) -> dict:
    """Op counts of interest and the BatchNormalization nodes' mode (must be inference)."""
    import collections

    import onnx

    model = onnx.load(str(path), load_external_data=False)
    ops = collections.Counter(n.op_type for n in model.graph.node)
    training = []
    for n in model.graph.node:
        if n.op_type == "BatchNormalization":
            mode = next((onnx.helper.get_attribute_value(a) for a in n.attribute if a.name == "training_mode"), 0)
            if mode or len([o for o in n.output if o]) > 1:
                training.append(n.name)
    if training:
        raise RuntimeError(f"export has training-mode BatchNormalization nodes: {training[:3]}")
    interesting = ("BatchNormalization", "LayerNormalization", "Gelu", "Erf", "HardSwish", "HardSigmoid",
                   "Sigmoid", "ReduceMean", "Softmax", "MatMul", "Conv")
    return {"nodes": len(model.graph.node), "ops": {k: ops[k] for k in interesting if ops[k]},
            "batchnorm_inference_mode": True}


# --------------------------------------------------------------------------------------------- timing


def time_torch(fn, args, warmup: int, budget: float, min_iters: int, device: str, before=None) -> dict:
    """Latency of ``fn(*args)``: CUDA events around each call, and host wall time like ONNX Runtime's."""
    import torch

    from onnxfuse.timing.stats import should_stop, summarize

    cuda = device == "cuda"
    with torch.inference_mode():
        for _ in range(warmup):
            if before:
                before()
            fn(*args)
        if cuda:
            torch.cuda.synchronize()
        events, wall = [], []
        start = time.perf_counter()
        while not should_stop(len(wall), time.perf_counter() - start, iterations=None, time_budget_s=budget,
                              min_iterations=min_iters):
            if before:
                before()
            t0 = time.perf_counter_ns()
            if cuda:
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                fn(*args)
                e.record()
                e.synchronize()
                events.append(s.elapsed_time(e))
            else:
                fn(*args)
            wall.append((time.perf_counter_ns() - t0) / 1e6)
    out = {"latency_ms": summarize(wall).to_dict()}
    if events:
        out["cuda_event_ms"] = summarize(events).to_dict()
    return out


# --------------------------------------------------------------------------------------------- one model


class Recorder:
    """Accumulates one model's results and rewrites its part file after every change."""

    def __init__(self, path: Path, name: str):
        self.path = path
        self.data = {"model": name, "info": {}, "timings": [], "errors": []}
        self.save()

    def info(self, key, value):
        self.data["info"][key] = value
        self.save()

    def timing(self, **record):
        self.data["timings"].append(record)
        self.save()

    def error(self, stage: str, exc: BaseException):
        text = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
        log(f"  {stage} FAILED: {text}")
        if os.environ.get("ZOO_DEBUG"):
            traceback.print_exc()
        self.data["errors"].append({"stage": stage, "error": text[:500]})
        self.save()

    def save(self):
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        tmp.replace(self.path)


def run_model(name: str, args, part: Path) -> None:
    import torch  # before onnxruntime, so both use the CUDA libraries torch loaded
    import onnx

    from onnxfuse.timing import BenchConfig, time_models
    from onnxfuse.pipeline import OptimizeOptions, op_counts, optimize_model
    from onnxfuse.runtime.compare import compare_arrays
    from onnxfuse.runtime.session import run_model as ort_outputs
    from onnxfuse.runtime.inputs import Inputs

    rec = Recorder(part, name)
    base_name, attention = split_variant(name)
    spec = SPECS[base_name]
    args.attention = attention or args.attention
    device = args.device
    deadline = args.deadline_at or float("inf")
    work = Path(args.out) / "models"
    work.mkdir(parents=True, exist_ok=True)

    def late(stage: str) -> bool:
        if time.time() > deadline:
            rec.data["errors"].append({"stage": stage, "error": "skipped: deadline reached"})
            rec.save()
            log(f"  {stage}: skipped (deadline)")
            return True
        return False

    torch.backends.cudnn.benchmark = True
    log(f"{name}: export (opset {args.opset})")
    module = build_module(spec, exporter=args.exporter, attention=args.attention)
    path = work / f"{name}.onnx"
    rec.info("export", export(spec, module, path, args.opset, dynamic_seq=args.dynamic_seq, exporter=args.exporter))
    original = onnx.load(str(path))

    def inputs_for(batch: int) -> Inputs:
        return Inputs(feeds=spec.feeds(batch), seed=batch, source="zoo")

    def optimize(model, label: str, rtol=None, atol=None, only=None, precision="fp32", right_padded=(),
                 tune_sizes=True):
        """onnxfuse with validation on. Image and audio models are validated on the zoo's own inputs; token
        models on onnxfuse's own draws (ids in the embedding's range, random 0/1 masks, two sizes), as a
        user's run would be: the zoo's masks are all ones, which hides a mask form wrong for padding
        (5.10: GPT-2 under --precision fp16 passed on them and fails on padded masks)."""
        import numpy as np

        npz = None
        if not spec.seq:
            npz = work / f"{name}.{label}.inputs.npz"
            np.savez(npz, **spec.feeds(1))
        # The batches timed below, as --tune-shape sizes (the first timing is at batch 1 for image and
        # audio models, at onnxfuse's own draw for token models): decisions hold at every size timed.
        tune = [b for b in sorted(set(args.batches) | set(args.fp16_batches or [])) if spec.seq or b != 1]
        tune_shapes = [{k: list(v.shape) for k, v in spec.feeds(b).items()} for b in tune] \
            if args.tune_shapes and tune_sizes else []
        opts = OptimizeOptions(target=args.target, validate=True, inputs_path=npz and str(npz), provider="auto",
                               rtol=rtol, atol=atol, only=only, precision=precision, right_padded=list(right_padded),
                               tune_shapes=tune_shapes)
        t0 = time.perf_counter()
        try:
            result = optimize_model(model, opts, source=label)
            out = result.model
            info = {"validation": "pass", "worst_max_rel": max((c.max_rel for c in result.validation.outputs),
                                                              default=0.0)}
        except Exception as exc:  # ValidationFailed carries the result: time it anyway, flagged
            report = getattr(exc, "report", None)
            if report is None or report.model is None:
                raise
            result, out = report, report.model
            info = {"validation": f"FAILED: {exc}"}
        # where the optimize's time went (issue 32: tuning time in docs/benchmarks.md); timing_s holds the
        # first timing, the never-slower ladder and the measured choices
        info["stage_seconds"] = {k: round(getattr(result, f"{k}_seconds", 0.0), 2)
                                 for k in ("rewrite", "validation", "timing")}
        info.update(seconds=round(time.perf_counter() - t0, 2), nodes_before=result.nodes_before,
                    nodes_after=result.nodes_after, rewrites=result.applied.counts,
                    custom_library=result.custom_library, ops_after=op_counts(out))
        selection = result.extra.get("selection") if hasattr(result, "extra") else None
        if selection:  # the never-slower ladder ran: what it tried and kept (onnxfuse/selection.py)
            info["selection"] = selection
        measured = result.extra.get("measured") if hasattr(result, "extra") else None
        if measured:  # the measured choices, with the statistic and size that refused one (refused_detail)
            info["measured"] = measured
        timing = getattr(result, "timing", None)
        if timing is not None and timing.notes:  # the measured choices and the other sizes, as decided
            info["timing_notes"] = list(timing.notes)
        return out, info

    def log_optimize(info: dict) -> None:
        stages = ", ".join(f"{k} {v:.0f} s" for k, v in info.get("stage_seconds", {}).items())
        log(f"  {info['nodes_before']} → {info['nodes_after']} nodes, validation {info['validation']}, attention ops "
            f"{sum(v for k, v in info['ops_after'].items() if k.endswith('Attention'))}; {info['seconds']:.0f} s "
            f"({stages})")
        for note in info.get("timing_notes", []):
            if note.startswith(("measured choice", "the optimized model measured")):
                log(f"  {note}")

    log(f"{name}: optimize + validate")
    optimized, info = optimize(original, "fp32")
    rec.info("optimize", info)
    log_optimize(info)

    def anchors(model, src: Path, label: str, rtol: float) -> list:
        """For a transformer row: ONNX Runtime's transformers optimizer (given the model type, head count
        and hidden size it needs), its output checked against the original's on ``device``. A failure is
        recorded as the row's result, not hidden. (contrib-attention is a default rule: the optimized
        column has it.)"""
        if not spec.transformer or not args.anchors:
            return []
        extra = []
        try:
            from onnxruntime.transformers.optimizer import optimize_model as ort_transformers

            model_type, heads, hidden = spec.transformer
            out = work / f"{name}.{label}.ort-transformers.onnx"
            t0 = time.perf_counter()
            tx = ort_transformers(str(src), model_type=model_type, num_heads=heads, hidden_size=hidden,
                                  use_gpu=device == "cuda")
            tx.save_model_to_file(str(out))
            seconds = time.perf_counter() - t0
            tx_model = onnx.load(str(out))
            record = {"seconds": round(seconds, 2), "nodes": len(tx_model.graph.node), "ops": op_counts(tx_model)}
            raised = _raise_opset_for_layernorm(tx_model)
            if raised:  # recorded: the anchor ran on its own output with only the opset import changed
                record["opset_raised_to"] = raised
            copies = _drop_device_copies(tx_model)
            if copies:  # recorded likewise: its output less the session's device copies
                record["device_copies_removed"] = copies
            try:
                onnx.checker.check_model(tx_model)
                ref = ort_outputs(model, inputs_for(1), device, name=f"{label} original")
                got = ort_outputs(tx_model, inputs_for(1), device, name=f"{label} ORT transformers")
                c = compare_arrays("output", ref["output"], got["output"], rtol=rtol, atol=rtol)
                record.update(valid=True, max_abs=c.max_abs, max_rel=c.max_rel, within_tolerance=c.passed)
                extra.append(("tx", tx_model))
            except Exception as exc:  # e.g. LayerNormalization written at opset 14: an invalid model
                record.update(valid=False, error=" ".join(str(exc).split())[:300])
            rec.info(f"ort_transformers_{label}", record)
            log(f"  ORT transformers optimizer: {'valid' if record['valid'] else 'INVALID: ' + record['error'][:120]}")
        except Exception as exc:
            rec.error(f"ort_transformers_{label}", exc)
        return extra

    def ort_cells(variant: str, models: list, batches) -> None:
        for batch in batches:
            inputs = inputs_for(batch)
            specs: dict = {}
            for graph in args.graph_modes:
                if late(f"{variant} b{batch} graph={graph}"):
                    return
                cfg = BenchConfig(device=device, warmup=args.warmup, time_budget_s=args.time_budget,
                                  min_iterations=args.min_iterations, cuda_graph=graph, sessions=args.sessions)
                jobs = [(label, m, inputs, specs.get(label)) for label, m in models]
                try:
                    results = list(zip(models, time_models(jobs, cfg, rounds=args.rounds)))
                except Exception as exc:
                    rec.error(f"{variant} b{batch} graph={graph}", exc)
                    # one model that cannot run (ONNX Runtime refuses to capture a CUDA graph of an
                    # original with CPU shape nodes) should not hide the others: each alone, failures kept
                    results = []
                    for (label, m), job in zip(models, jobs):
                        try:
                            results.append(((label, m), time_models([job], cfg, rounds=args.rounds)[0]))
                        except Exception as alone:
                            rec.timing(variant=f"{variant}-{label}", batch=batch, cuda_graph=graph, status="failed",
                                       error=str(alone)[:300])
                            log(f"  {variant} b{batch}{' graph' if graph else ''}: {label} failed: {str(alone)[:120]}")
                for (label, _), r in results:
                    specs[label] = r.output_specs
                    rec.timing(variant=f"{variant}-{label}", batch=batch, cuda_graph=graph, status="ok",
                               latency_ms=r.stats.to_dict(), nodes=r.nodes)
                msg = ", ".join(f"{label} {r.stats.median_ms:.3f} ms" for (label, _), r in results)
                log(f"  {variant} b{batch}{' graph' if graph else ''}: {msg}")
                gc.collect()

    def right_padded_column(model, label: str, **tolerances) -> list:
        """With ``--right-padded``, for a model fed an ``attention_mask``: onnxfuse under the promise that
        the mask is right-padded (``optimize --right-padded attention_mask``), a column of its own."""
        if not args.right_padded or "attention_mask" not in spec.input_names:
            return []
        promised, info_rp = optimize(model, label, right_padded=["attention_mask"], **tolerances)
        rec.info(f"optimize_{label}", info_rp)
        used = info_rp["rewrites"].get("contrib-mask-lengths", 0)
        log(f"  --right-padded attention_mask: {info_rp['nodes_after']} nodes, validation {info_rp['validation']}, "
            f"{used} masks as lengths" + ("" if used else " (the same graph as optimized: not timed)"))
        return [("right-padded", promised)] if used else []

    def with_rules_column(model, label: str, **tolerances) -> list:
        """With ``--with-rules R,...``: onnxfuse with those (opt-in) rules added (``--only +R``), a column
        of its own ("with-rules"); not timed where they changed nothing."""
        if not args.with_rules:
            return []
        added, info_w = optimize(model, label, only=",".join(f"+{r}" for r in args.with_rules), **tolerances)
        rec.info(f"optimize_{label}", info_w)
        used = sum(info_w["rewrites"].get(r, 0) for r in args.with_rules)
        log(f"  +{',+'.join(args.with_rules)}: {info_w['nodes_after']} nodes, validation {info_w['validation']}, "
            f"applied {used}" + ("" if used else " (the same graph as optimized: not timed)"))
        return [("with-rules", added)] if used else []

    def first_size_column(model, label: str, reference, **tolerances) -> list:
        """With ``--first-size-choice``: onnxfuse with its measured choices decided at the first timed size
        alone (no --tune-shape: batch 1 for image and audio models), a column of its own ("first-size"),
        so the output decided at every batch can be checked against it at each batch (issue 34: "never
        slower than at batch 1's choice"); not timed where it made the same choices (same op counts as
        ``reference``)."""
        if not args.first_size_choice:
            return []
        first, info_f = optimize(model, label, tune_sizes=False, **tolerances)
        rec.info(f"optimize_{label}", info_f)
        same = info_f["ops_after"] == op_counts(reference)
        log(f"  first size's choice: {info_f['nodes_after']} nodes, validation {info_f['validation']}"
            + (" (the same choices as optimized: not timed)" if same else ""))
        for note in info_f.get("timing_notes", []):
            if note.startswith("measured choice"):
                log(f"    {note}")
        return [] if same else [("first-size", first)]

    fp32_anchors = (anchors(original, path, "fp32", 1e-3) + right_padded_column(original, "fp32-right-padded")
                    + with_rules_column(original, "fp32-with-rules") + first_size_column(original, "fp32-first-size",
                                                                                        optimized))
    ort_cells("ort", [("original", original), ("optimized", optimized)] + fp32_anchors, args.batches)
    del fp32_anchors

    def torch_cells(module, prefix: str, batches: list[int], with_eager: bool = True) -> None:
        """PyTorch on the same module: eager and torch.compile, each batch timed after its first call.
        ``prefix`` is "" for the float32 module and "fp16-" for its .half() twin (variant names
        torch-compile / torch-fp16-compile, ...)."""
        tdev = torch.device(device)
        module = module.to(tdev)
        variants = []
        if args.torch in ("eager", "all") and with_eager:
            variants.append((f"torch-{prefix}eager", None))
        if args.torch in ("compile", "all") and device == "cuda":
            variants += [(v, m) for v, m in ((f"torch-{prefix}compile", "default"),
                                             (f"torch-{prefix}compile-cudagraphs", "reduce-overhead"))
                         if m in args.compile_modes]
        for variant, mode in variants:
            graph = mode == "reduce-overhead"
            if graph and True not in args.graph_modes or not graph and False not in args.graph_modes:
                continue
            fn = module
            before = None
            if mode:
                torch._dynamo.reset()
                fn = torch.compile(module, mode=mode, dynamic=False)
                if graph:
                    before = torch.compiler.cudagraph_mark_step_begin
            for batch in batches if mode is None else (args.compile_batches or batches):
                if late(f"{variant} b{batch}"):
                    break
                example = spec.example(batch, device)
                try:
                    t0 = time.perf_counter()
                    with torch.inference_mode():
                        if before:
                            before()
                        fn(*example)
                        if device == "cuda":
                            torch.cuda.synchronize()
                    first = time.perf_counter() - t0
                    r = time_torch(fn, example, args.warmup, args.time_budget, args.min_iterations, device, before)
                    rec.timing(variant=variant, batch=batch, cuda_graph=graph, status="ok",
                               first_call_s=round(first, 2), **r)
                    log(f"  {variant} b{batch}: {r['latency_ms']['median_ms']:.3f} ms (first call {first:.1f} s)")
                except Exception as exc:
                    rec.error(f"{variant} b{batch}", exc)
                    rec.timing(variant=variant, batch=batch, cuda_graph=graph, status="failed", error=str(exc)[:300])
            del fn
            gc.collect()
        module.to("cpu")
        if device == "cuda":
            torch.cuda.empty_cache()

    # ---- PyTorch: eager and torch.compile on the same module
    if args.torch != "none" and not late("torch"):
        rec.info("torch_tf32", {"cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
                                "matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32})
        torch_cells(module, "", args.batches)

    # ---- fp16: the module in .half(), fp32 inputs/outputs cast inside the graph
    if args.fp16 and device == "cuda" and not late("fp16"):
        try:
            log(f"{name}: fp16 export")
            path16 = work / f"{name}.fp16.onnx"
            half = HalfIO(build_module(spec, exporter=args.exporter, attention=args.attention))
            rec.info("export_fp16", export(spec, half, path16, args.opset, device="cuda", dynamic_seq=args.dynamic_seq,
                                                 exporter=args.exporter))
            del half
            torch.cuda.empty_cache()
            original16 = onnx.load(str(path16))
            optimized16, info16 = optimize(original16, "fp16", rtol=1e-2, atol=1e-2)
            rec.info("optimize_fp16", info16)
            log_optimize(info16)
            batch = args.batches[0]
            ref = ort_outputs(original, inputs_for(batch), "cuda", name="fp32 original")
            drift = {}
            for label, m in (("original", original16), ("optimized", optimized16)):
                got = ort_outputs(m, inputs_for(batch), "cuda", name=f"fp16 {label}")
                c = compare_arrays("output", ref["output"], got["output"], rtol=1e-2, atol=1e-2)
                drift[label] = {"batch": batch, "max_abs": c.max_abs, "max_rel": c.max_rel, "cosine": c.cosine,
                                "mean_abs": c.mean_abs, "within_1e-2": c.passed}
            rec.info("fp16_drift_vs_fp32", drift)
            log(f"  fp16 drift vs fp32: max_abs {drift['optimized']['max_abs']:.3g}, "
                f"cosine {drift['optimized']['cosine']:.6f}")
            extra16 = anchors(original16, path16, "fp16", 1e-2) + right_padded_column(
                original16, "fp16-right-padded", rtol=1e-2, atol=1e-2) + with_rules_column(
                original16, "fp16-with-rules", rtol=1e-2, atol=1e-2) + first_size_column(
                original16, "fp16-first-size", optimized16, rtol=1e-2, atol=1e-2)
            # `optimize --precision fp16` on the fp32 export (fp32 I/O, fp16 compute): what a user
            # without a half-precision export gets (issue 33: every zoo model, CNNs included); with
            # --right-padded, the same under the promise too (transformers 4's (1 - m)·c mask fuses only
            # then, 5.48)
            # (promised inputs, cell variant, optimize label and info key, log suffix, precision); --bf16 adds
            # `optimize --precision bf16` (bfloat16 compute, float32 I/O), timed beside the float16 cells
            runs = [((), "precision", "precision-fp16", "", "fp16")]
            if args.right_padded and "attention_mask" in spec.input_names:
                runs.append((["attention_mask"], "precision-right-padded", "precision-fp16-right-padded",
                             " --right-padded attention_mask", "fp16"))
            if args.bf16:
                runs.append(((), "precision-bf16", "precision-bf16", "", "bf16"))
                if args.right_padded and "attention_mask" in spec.input_names:  # (1 - m)·c masks fuse only so
                    runs.append((["attention_mask"], "precision-bf16-right-padded", "precision-bf16-right-padded",
                                 " --right-padded attention_mask", "bf16"))
            for right_padded, variant, label, flag, precision in runs if args.precision_cells else []:
                key = "optimize_" + label.replace("-", "_")
                try:
                    converted, info_p = optimize(original, label, precision=precision, right_padded=right_padded)
                    rec.info(key, info_p)
                    log(f"  --precision {precision}{flag}: {info_p['nodes_after']} nodes, "
                        f"validation {info_p['validation']}")
                    extra16.append((variant, converted))
                except Exception as exc:
                    rec.error(key, exc)
            keep = args.graph_modes
            args.graph_modes = args.fp16_graph_modes or args.graph_modes
            try:
                ort_cells("ort-fp16", [("original", original16), ("optimized", optimized16)] + extra16,
                          args.fp16_batches or args.batches)
            finally:
                args.graph_modes = keep
            if args.torch in ("compile", "all") and not late("torch fp16"):
                # torch.compile of the same .half() module the fp16 export came from (issue 34's column)
                torch_cells(HalfIO(build_module(spec, exporter=args.exporter, attention=args.attention)), "fp16-",
                            args.fp16_batches or args.batches, with_eager=False)
        except Exception as exc:
            rec.error("fp16", exc)
    log(f"{name}: done")


# --------------------------------------------------------------------------------------------- report


def environment() -> dict:
    env = {}
    try:
        from onnxfuse.runtime.env import environment as ort_env

        env.update(ort_env("cuda"))
    except Exception as exc:  # pragma: no cover
        env["error"] = str(exc)
    try:
        import torch

        env["torch"] = torch.__version__
        env["cuda_torch"] = torch.version.cuda
        if torch.cuda.is_available():
            env["gpu_torch"] = torch.cuda.get_device_name(0)
    except Exception:
        pass
    for mod in ("torchvision", "transformers"):
        try:
            env[mod] = __import__(mod).__version__
        except Exception:
            pass
    env["date"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    return env


def _median(records, variant, batch, graph):
    for r in records:
        if r["variant"] == variant and r["batch"] == batch and r["cuda_graph"] == graph:
            return r["latency_ms"]["median_ms"] if r.get("status") == "ok" else None
    return None


def _cells(models: dict):
    """Rows for the table and the chart: one per (model, batch, CUDA graph) that has any timing."""
    rows = []
    for name, data in models.items():
        t = data.get("timings", [])
        keys = sorted({(r["batch"], r["cuda_graph"]) for r in t})
        for batch, graph in keys:
            m = lambda v: _median(t, v, batch, graph)  # noqa: E731
            tc = m("torch-compile-cudagraphs") if graph else m("torch-compile")
            rows.append(dict(model=name, batch=batch, graph=graph, orig=m("ort-original"), opt=m("ort-optimized"),
                             eager=m("torch-eager") if not graph else None, compile=tc,
                             fp16_orig=m("ort-fp16-original"), fp16_opt=m("ort-fp16-optimized"),
                             att=m("ort-attention"), tx=m("ort-tx"),
                             fp16_att=m("ort-fp16-attention"), fp16_tx=m("ort-fp16-tx"),
                             fp16_prec=m("ort-fp16-precision"), with_rules=m("ort-with-rules"),
                             fp16_prec_rp=m("ort-fp16-precision-right-padded"),
                             bf16_prec=m("ort-fp16-precision-bf16"),
                             bf16_prec_rp=m("ort-fp16-precision-bf16-right-padded"),
                             fp16_with_rules=m("ort-fp16-with-rules"),
                             first=m("ort-first-size"), fp16_first=m("ort-fp16-first-size"),
                             fp16_compile=m("torch-fp16-compile-cudagraphs") if graph else m("torch-fp16-compile")))
    return rows


def _f(x, digits=3):
    return "–" if x is None else f"{x:.{digits}f}"


def _ratio(a, b):
    return None if not a or not b else a / b


def never_slower_rows(results: dict) -> list[dict]:
    """Issue 32's grid, one row per model: every cell the run was configured to time (``batches`` x
    ``graph_modes`` in float32, ``fp16_batches`` x ``fp16_graph_modes`` for the ``.half()`` export) is
    ``measured`` (original and optimized both timed: their ratio), ``optimized only`` (ONNX Runtime could not
    time the original there, e.g. it cannot capture it in a CUDA graph) or ``missing`` (cut by the deadline,
    failed, or not run); with the lowest ratio, the cell it is in, and the optimize calls' seconds (the
    tuning time: validation, timing at the sizes, the measured choices)."""
    config = results.get("config", {})
    fp32 = [(b, g) for b in config.get("batches") or [] for g in config.get("graph_modes") or [False]]
    fp16 = ([(b, g) for b in config.get("fp16_batches") or [] for g in config.get("fp16_graph_modes") or [False]]
            if config.get("fp16", True) else [])
    rows = []
    for name, data in results.get("models", {}).items():
        t = data.get("timings", [])
        row = {"model": name, "measured": 0, "optimized_only": [], "missing": [], "lowest": None, "lowest_cell": None}
        for prefix, label, cells in (("ort-", "", fp32), ("ort-fp16-", "fp16 ", fp16)):
            for batch, graph in cells:
                cell = f"{label}b{batch}{' graph' if graph else ''}"
                orig, opt = _median(t, prefix + "original", batch, graph), _median(t, prefix + "optimized", batch, graph)
                if orig and opt:
                    row["measured"] += 1
                    if row["lowest"] is None or orig / opt < row["lowest"]:
                        row["lowest"], row["lowest_cell"] = orig / opt, cell
                elif opt:
                    row["optimized_only"].append(cell)
                else:
                    row["missing"].append(cell)
        info = data.get("info", {})
        row["optimize_s"] = [(info.get(k) or {}).get("seconds") for k in
                             ("optimize", "optimize_fp16", "optimize_precision_fp16")]
        rows.append(row)
    return rows


def markdown(results: dict) -> str:
    env = results.get("environment", {})
    lines = [
        "# onnxfuse model-zoo benchmark", "",
        f"GPU: {env.get('gpu_torch') or ', '.join(env.get('gpus', [])) or '?'}; onnxruntime {env.get('onnxruntime')}, "
        f"torch {env.get('torch')}, onnx {env.get('onnx')}; {env.get('date', '')}", "",
        f"Command: `{results.get('command', '')}`", "",
        *(["**CPU smoke test (--device cpu): these numbers say nothing about GPU speed.**", ""]
          if results.get("config", {}).get("device") == "cpu" else []),
        "Median latency in ms (host wall clock per run, IOBinding on GPU memory, after warm-up; ONNX Runtime "
        "at ORT_ENABLE_ALL for both models; torch.compile with mode=default, or reduce-overhead for the CUDA "
        "graph rows). Speed-up = original / optimized. fp16: the module in .half() with fp32 I/O.", "",
        "| model | batch | CUDA graph | nodes orig → opt | ORT orig | ORT onnxfuse | speed-up | torch eager "
        "| torch.compile | fp16 orig | fp16 onnxfuse | fp16 speed-up |",
        "|---|---:|:---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in _cells(results["models"]):
        info = results["models"][row["model"]].get("info", {})
        opt = info.get("optimize", {})
        nodes = f"{opt.get('nodes_before', '?')} → {opt.get('nodes_after', '?')}" if opt else "–"
        sp = _ratio(row["orig"], row["opt"])
        sp16 = _ratio(row["fp16_orig"], row["fp16_opt"])
        lines.append(
            f"| {row['model']} | {row['batch']} | {'yes' if row['graph'] else 'no'} | {nodes} | {_f(row['orig'])} "
            f"| {_f(row['opt'])} | {_f(sp, 2) + '×' if sp else '–'} | {_f(row['eager'])} | {_f(row['compile'])} "
            f"| {_f(row['fp16_orig'])} | {_f(row['fp16_opt'])} | {_f(sp16, 2) + '×' if sp16 else '–'} |"
        )
    def speedup(a, b):
        r = _ratio(a, b)
        return _f(r, 2) + "×" if r else "–"

    added = results.get("config", {}).get("with_rules") or []
    extra_rows = [r for r in _cells(results["models"])
                  if any(r[k] for k in ("fp16_prec", "with_rules", "fp16_with_rules", "bf16_prec"))]
    promised = any(r["fp16_prec_rp"] for r in extra_rows)  # zoo --right-padded: --precision fp16 under the promise
    bf16 = any(r["bf16_prec"] for r in extra_rows)  # zoo --bf16: --precision bf16's cells
    bf16_promised = any(r["bf16_prec_rp"] for r in extra_rows)  # zoo --bf16 --right-padded: the same promised
    if extra_rows:
        lines += ["", "## Every model: --precision fp16" + (f" and +{', +'.join(added)}" if added else ""), "",
                  "Speed-up over the original of the same precision. fp16 half(): the module exported in "
                  "float16 and optimized; --precision fp16: `optimize --precision fp16` on the float32 export "
                  "(float32 I/O), timed against the float16 original; its ratio to half() is the cost of not "
                  "exporting in float16 (issue 33: within 5%)."
                  + (f" +rules: onnxfuse with `--only +{',+'.join(added)}`." if added else "")
                  + (" --precision bf16: `optimize --precision bf16` on the float32 export, its speed-up over the "
                     "float32 original, and its time over the optimized half() export." if bf16 else ""), "",
                  "| model | batch | CUDA graph | onnxfuse | +rules | fp16 half() | fp16 half() +rules "
                  "| --precision fp16 | --precision fp16 / half() |" + (" --right-padded / half() |" if promised else "")
                  + (" --precision bf16 | bf16 / half() |" if bf16 else "")
                  + (" bf16 --right-padded | bf16 --right-padded / half() |" if bf16_promised else ""),
                  "|---|---:|:---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if promised else "")
                  + ("---:|---:|" if bf16 else "") + ("---:|---:|" if bf16_promised else "")]
        for r in extra_rows:
            vs_half = _ratio(r["fp16_prec"], r["fp16_opt"])
            rp_half = _ratio(r["fp16_prec_rp"], r["fp16_opt"])
            bf_half = _ratio(r["bf16_prec"], r["fp16_opt"])  # bfloat16 against the float16 export optimized
            bf_rp_half = _ratio(r["bf16_prec_rp"], r["fp16_opt"])
            lines.append(f"| {r['model']} | {r['batch']} | {'yes' if r['graph'] else 'no'} "
                         f"| {speedup(r['orig'], r['opt'])} | {speedup(r['orig'], r['with_rules'])} "
                         f"| {speedup(r['fp16_orig'], r['fp16_opt'])} | {speedup(r['fp16_orig'], r['fp16_with_rules'])} "
                         f"| {speedup(r['fp16_orig'], r['fp16_prec'])} | {_f(vs_half, 3) if vs_half else '–'} |"
                         + (f" {_f(rp_half, 3) if rp_half else '–'} |" if promised else "")
                         + (f" {speedup(r['orig'], r['bf16_prec'])} | {_f(bf_half, 3) if bf_half else '–'} |"
                            if bf16 else "")
                         + (f" {speedup(r['orig'], r['bf16_prec_rp'])} | {_f(bf_rp_half, 3) if bf_rp_half else '–'} |"
                            if bf16_promised else ""))
    transformer_rows = [r for r in _cells(results["models"]) if any(r[k] for k in ("att", "tx", "fp16_att", "fp16_tx", "fp16_prec"))]
    if transformer_rows:
        lines += ["", "## Transformers: against ONNX Runtime's transformers optimizer", "",
                  "Speed-up over the original under ORT_ENABLE_ALL. tx-opt: "
                  "`onnxruntime.transformers.optimizer.optimize_model` given the model type, head count and hidden "
                  "size (– where it wrote an invalid model: see Per model); +attention: onnxfuse with the then "
                  "opt-in contrib-attention rule (runs before it became a default rule; now in onnxfuse); "
                  "--precision fp16: `optimize --precision fp16` on the fp32 export, "
                  "timed against the fp16 original.", "",
                  "| model | batch | CUDA graph | tx-opt | onnxfuse | onnxfuse +attention | fp16 tx-opt "
                  "| fp16 onnxfuse | fp16 +attention | --precision fp16 |",
                  "|---|---:|:---:|---:|---:|---:|---:|---:|---:|---:|"]

        def sp(a, b):
            r = _ratio(a, b)
            return _f(r, 2) + "×" if r else "–"

        for r in transformer_rows:
            lines.append(f"| {r['model']} | {r['batch']} | {'yes' if r['graph'] else 'no'} | {sp(r['orig'], r['tx'])} "
                         f"| {sp(r['orig'], r['opt'])} | {sp(r['orig'], r['att'])} | {sp(r['fp16_orig'], r['fp16_tx'])} "
                         f"| {sp(r['fp16_orig'], r['fp16_opt'])} | {sp(r['fp16_orig'], r['fp16_att'])} "
                         f"| {sp(r['fp16_orig'], r['fp16_prec'])} |")
    grid = never_slower_rows(results)
    if grid:
        everything = [r["lowest"] for r in grid if r["lowest"] is not None]
        lines += ["", "## Never slower: every cell of the grid (issue 32)", "",
                  "Each model's cells as configured (float32 and the .half() export; batches x CUDA graphs): how many "
                  "were measured, the lowest speed-up among them and where; optimized only: the original could "
                  "not be timed there (ONNX Runtime cannot capture it in a CUDA graph); not measured: cut by the "
                  "deadline, failed or not run. optimize s: the optimize calls of the float32 export, the half() "
                  "export and --precision fp16, each with its validation, timing and measured choices (the "
                  "tuning time)."
                  + (f" Lowest of the run: {min(everything):.2f}×." if everything else ""), "",
                  "| model | cells measured | lowest speed-up | optimized only | not measured | optimize s (fp32 / half() "
                  "/ --precision fp16) |", "|---|---:|---:|---|---|---|"]
        for r in grid:
            low = f"{r['lowest']:.2f}× ({r['lowest_cell']})" if r["lowest"] is not None else "–"
            secs = " / ".join("–" if v is None else f"{v:.0f}" for v in r["optimize_s"])
            lines.append(f"| {r['model']} | {r['measured']} | {low} | {', '.join(r['optimized_only']) or '–'} "
                         f"| {', '.join(r['missing']) or '–'} | {secs} |")
    compile_rows = [r for r in _cells(results["models"]) if r["compile"] or r["fp16_compile"]]
    if compile_rows:
        lines += ["", "## Against torch.compile", "",
                  "Median ms. onnxfuse best: the faster of the default output and +rules (where measured). "
                  "ratio = torch.compile / onnxfuse best (above 1: onnxfuse is faster). fp16: the same "
                  ".half() module, exported and optimized, or compiled.", "",
                  "| model | batch | CUDA graph | torch.compile | onnxfuse best | ratio | fp16 torch.compile "
                  "| fp16 onnxfuse best | fp16 ratio |",
                  "|---|---:|:---:|---:|---:|---:|---:|---:|---:|"]
        for r in compile_rows:
            best = min([v for v in (r["opt"], r["with_rules"]) if v], default=None)
            best16 = min([v for v in (r["fp16_opt"], r["fp16_with_rules"]) if v], default=None)
            lines.append(f"| {r['model']} | {r['batch']} | {'yes' if r['graph'] else 'no'} | {_f(r['compile'])} "
                         f"| {_f(best)} | {_f(_ratio(r['compile'], best), 2)} | {_f(r['fp16_compile'])} "
                         f"| {_f(best16)} | {_f(_ratio(r['fp16_compile'], best16), 2)} |")
    first_rows = [r for r in _cells(results["models"]) if r["first"] or r["fp16_first"]]
    if first_rows:  # zoo --first-size-choice, where the first size alone chose differently
        lines += ["", "## Against the first size's choice", "",
                  "Median ms. onnxfuse: the output whose measured choices were timed at the first size and at "
                  "every batch (--tune-shape); first size's choice: the same decided at the first size alone. "
                  "ratio = first size's choice / onnxfuse (at least 1: never slower than that choice).", "",
                  "| model | batch | CUDA graph | onnxfuse | first size's choice | ratio | fp16 onnxfuse "
                  "| fp16 first size's choice | fp16 ratio |",
                  "|---|---:|:---:|---:|---:|---:|---:|---:|---:|"]
        for r in first_rows:
            lines.append(f"| {r['model']} | {r['batch']} | {'yes' if r['graph'] else 'no'} | {_f(r['opt'])} "
                         f"| {_f(r['first'])} | {_f(_ratio(r['first'], r['opt']), 2)} | {_f(r['fp16_opt'])} "
                         f"| {_f(r['fp16_first'])} | {_f(_ratio(r['fp16_first'], r['fp16_opt']), 2)} |")
    lines += ["", "## Per model", ""]
    for name, data in results["models"].items():
        info = data.get("info", {})
        opt, exp = info.get("optimize", {}), info.get("export", {})
        lines.append(f"- **{name}**: export {exp.get('nodes', '?')} nodes, ops {exp.get('ops', {})}; "
                     f"validation {opt.get('validation', '–')}; rewrites "
                     f"{ {k: v for k, v in (opt.get('rewrites') or {}).items() if v} }")
        for label in ("fp32", "fp16"):
            tx = info.get(f"ort_transformers_{label}")
            if tx:
                lines.append(f"  - ORT transformers optimizer ({label}): " + (
                    f"{tx['nodes']} nodes, max rel vs original {tx.get('max_rel', 0):.3g}" if tx.get("valid")
                    else f"invalid model: {tx.get('error')}"))
            att = info.get(f"optimize_attention_{label}")
            if att:
                lines.append(f"  - onnxfuse +attention ({label}): {att.get('nodes_after')} nodes, validation "
                             f"{att.get('validation')}, MultiHeadAttention "
                             f"{(att.get('ops_after') or {}).get('com.microsoft::MultiHeadAttention', 0)}")
        prec = info.get("optimize_precision_fp16")
        if prec:
            lines.append(f"  - --precision fp16: {prec.get('nodes_after')} nodes, validation "
                         f"{prec.get('validation')}")
        drift = info.get("fp16_drift_vs_fp32")
        if drift:
            d = drift.get("optimized", {})
            lines.append(f"  - fp16 (onnxfuse) vs fp32 at batch {d.get('batch')}: max abs {d.get('max_abs', 0):.3g}, "
                         f"max rel {d.get('max_rel', 0):.3g}, cosine {d.get('cosine', 0):.6f}")
        for err in data.get("errors", []):
            lines.append(f"  - {err['stage']}: {err['error']}")
    return "\n".join(lines) + "\n"


def svg_chart(results: dict) -> str:
    """Grouped horizontal bars: speed-up over ONNX Runtime on the original model, per (model, batch, graph)."""
    series = [("onnxfuse (ORT)", "opt", "#2b8a3e"), ("torch.compile", "compile", "#e67700"),
              ("onnxfuse fp16", "fp16_opt", "#1c7ed6")]
    rows = [r for r in _cells(results["models"]) if r["orig"]]
    bar_h, gap, left, width = 12, 10, 230, 420
    vals = [r["orig"] / r[k] for r in rows for _, k, _ in series if r.get(k)]
    vmax = max([1.0] + vals) * 1.1
    height = 60 + len(rows) * (len(series) * bar_h + gap)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{left + width + 80}" height="{height}" '
           'font-family="sans-serif" font-size="11">',
           '<text x="10" y="18" font-size="14">Speed-up over ONNX Runtime (ORT_ENABLE_ALL) on the original '
           'model, median latency</text>']
    for i, (label, _, color) in enumerate(series):
        out.append(f'<rect x="{left + i * 140}" y="28" width="10" height="10" fill="{color}"/>'
                   f'<text x="{left + i * 140 + 14}" y="37">{label}</text>')
    x1 = left + width / vmax
    out.append(f'<line x1="{x1:.1f}" y1="45" x2="{x1:.1f}" y2="{height - 5}" stroke="#888" stroke-dasharray="3,3"/>')
    y = 50
    for r in rows:
        out.append(f'<text x="{left - 6}" y="{y + bar_h * 1.8:.0f}" text-anchor="end">{r["model"]} b{r["batch"]}'
                   f'{" graph" if r["graph"] else ""}</text>')
        for _, key, color in series:
            v = r["orig"] / r[key] if r.get(key) else None
            if v is not None:
                w = width * v / vmax
                out.append(f'<rect x="{left}" y="{y}" width="{w:.1f}" height="{bar_h - 2}" fill="{color}"/>'
                           f'<text x="{left + w + 4:.1f}" y="{y + bar_h - 3}">{v:.2f}×</text>')
            y += bar_h
        y += gap
    out.append("</svg>")
    return "\n".join(out) + "\n"


def write_reports(out: Path, results: dict) -> None:
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    (out / "results.md").write_text(markdown(results))
    (out / "speedup.svg").write_text(svg_chart(results))


def collect(out: Path, models: list[str], base: dict) -> dict:
    results = dict(base)
    results.setdefault("models", {})
    for name in models:
        part = out / "parts" / f"{name}.json"
        if part.exists():
            try:
                results["models"][name] = json.loads(part.read_text())
            except json.JSONDecodeError as exc:
                results["models"][name] = {"model": name, "errors": [{"stage": "collect", "error": str(exc)}]}
        else:
            results["models"].setdefault(name, {"model": name, "info": {}, "timings": [],
                                                "errors": [{"stage": "run", "error": "no results"}]})
    return results


# --------------------------------------------------------------------------------------------- main


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(DEFAULT_MODELS),
                   help=f"comma list from {', '.join(SPECS)}; NAME@eager or NAME@sdpa exports {', '.join(ATTN_BUILDERS)} "
                        "with that attention whatever --attention says (both in one run: bert_base@eager,bert_base@sdpa)")
    p.add_argument("--gpus", type=int, default=1,
                   help="run up to this many models at once, each child on its own GPU (CUDA_VISIBLE_DEVICES: one "
                        "of the parent's visible GPUs, else 0..N-1); each GPU times one model at a time")
    p.add_argument("--batches", default="1,16", help="comma list of batch sizes (default 1,16)")
    p.add_argument("--graph-modes", default="off,on", help="CUDA graphs: off, on or off,on")
    p.add_argument("--out", default="benchmarks/results", help="folder for results.json/.md, speedup.svg, models/")
    p.add_argument("--time-budget", type=float, default=None, help="seconds of timed runs per model and cell (1.0)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up runs (10)")
    p.add_argument("--min-iterations", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds original/optimized")
    p.add_argument("--sessions", type=int, default=1,
                   help="fresh ONNX Runtime sessions per model and cell, samples pooled (evens out cuDNN's "
                        "per-session algorithm choice; the time budget is split between them)")
    p.add_argument("--torch", choices=["none", "eager", "compile", "all"], default=None,
                   help="PyTorch baselines (default all; --quick: eager)")
    p.add_argument("--compile-modes", default="default,reduce-overhead",
                   help="torch.compile modes: default (rows without CUDA graphs), reduce-overhead (with)")
    p.add_argument("--compile-batches", default=None, help="batches for torch.compile (default: --batches)")
    p.add_argument("--fp16", action=argparse.BooleanOptionalAction, default=True, help="fp16 variant")
    p.add_argument("--fp16-batches", default=None, help="batches for fp16 timing (default: --batches)")
    p.add_argument("--fp16-graph-modes", default=None, help="CUDA graph modes for fp16 (default: --graph-modes)")
    p.add_argument("--tune-shapes", action=argparse.BooleanOptionalAction, default=True,
                   help="optimize with --tune-shape at the batches timed, so the never-slower fallback and the "
                        "measured choices hold at each (default on)")
    p.add_argument("--opset", type=int, default=14)
    p.add_argument("--attention", choices=["eager", "sdpa"], default=None,
                   help="transformers' attn_implementation for BERT, GPT-2, Qwen2, Whisper (default: sdpa with --exporter "
                        "dynamo, eager with legacy)")
    p.add_argument("--exporter", choices=["legacy", "dynamo"], default="legacy",
                   help="legacy: TorchScript exporter, eager attention (default); dynamo: torch.onnx.export's default "
                        "since torch 2.9, sdpa attention, opset >= 18")
    p.add_argument("--target", default="cuda", help="onnxfuse optimize --target")
    p.add_argument("--dynamic-seq", action="store_true",
                   help="export token models with a dynamic sequence axis too (timed at their usual length)")
    p.add_argument("--with-rules", type=lambda v: [r for r in v.split(",") if r], default=[],
                   help="comma list of opt-in rules: also time onnxfuse with them added (--only +RULE), "
                        "fp32 and fp16, column +rules")
    p.add_argument("--first-size-choice", action="store_true",
                   help="also optimize with the measured choices decided at the first timed size alone (no "
                        "--tune-shape) and time that output beside the default one (issue 34: never slower "
                        "than at batch 1's choice), fp32 and fp16, where its choices differ")
    p.add_argument("--right-padded", action="store_true",
                   help="models fed an attention_mask: also time onnxfuse under --right-padded attention_mask "
                        "(column right-padded; the zoo's masks are all ones, which keeps that promise), and "
                        "--precision fp16 under it (variant ort-fp16-precision-right-padded)")
    p.add_argument("--bf16", action="store_true",
                   help="with the fp16 cells: also time `optimize --precision bf16` on the float32 export (variant "
                        "ort-fp16-precision-bf16, timed with the float16 cells; its columns: speed-up over the "
                        "float32 original, and time over the optimized half() export); with --right-padded also under that "
                        "promise (ort-fp16-precision-bf16-right-padded)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: a smoke test only")
    p.add_argument("--deadline", type=float, default=None,
                   help="stop starting new work after this many seconds (results so far are kept)")
    p.add_argument("--resume", action="store_true",
                   help="skip the models --out already holds complete results of (a part with no run error), so "
                        "one run can span several calls of a time-limited machine with the same --out")
    p.add_argument("--anchors", action=argparse.BooleanOptionalAction, default=True,
                   help="transformer rows: also run ONNX Runtime's transformers optimizer (the anchor column); "
                        "--no-anchors saves its optimize and timing (issue 32's grid does not need it)")
    p.add_argument("--precision-cells", action=argparse.BooleanOptionalAction, default=True,
                   help="with the fp16 cells: also `optimize --precision fp16` the float32 export and time it "
                        "beside the half() export (issue 33); --no-precision-cells saves that optimize call "
                        "(30-140 s a model on an H200, 5.63) where only issue 32's grid is wanted")
    p.add_argument("--quick", action="store_true",
                   help="every model, batches 1 and 16, 0.2 s per cell, eager torch only, fp16 at batch 16 "
                        "without CUDA graphs, deadline 420 s: under 8 minutes")
    p.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=True,
                   help="one child process per model (a crash costs one model)")
    p.add_argument("--report-only", action="store_true", help="only rebuild the reports from --merge/--out")
    p.add_argument("--merge", nargs="*", default=[], help="results.json files to merge into --out's report")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--deadline-at", type=float, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    def ints(s):
        return [int(x) for x in s.split(",") if x.strip()] if s else None

    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    problems = [problem for problem in map(variant_problem, args.models) if problem]
    if problems:
        p.error(f"{'; '.join(problems)}; choose from {', '.join(SPECS)} (NAME@eager or NAME@sdpa for "
                f"{', '.join(ATTN_BUILDERS)})")
    if args.gpus < 1:
        p.error("--gpus must be at least 1")
    if args.gpus > 1 and not args.isolate:
        p.error("--gpus needs --isolate (one child process per model, each on its own GPU)")
    args.batches = ints(args.batches)

    def modes(s):
        if s is None:
            return None
        table = {"off": False, "on": True}
        return [table[m.strip()] for m in s.split(",") if m.strip()]

    args.graph_modes = modes(args.graph_modes)
    args.fp16_graph_modes = modes(args.fp16_graph_modes)
    if args.quick:
        args.time_budget = 0.2 if args.time_budget is None else args.time_budget
        args.warmup = 3 if args.warmup is None else args.warmup
        args.torch = args.torch or "eager"
        args.fp16_batches = args.fp16_batches or str(max(args.batches))
        args.fp16_graph_modes = args.fp16_graph_modes or [False]
        args.deadline = 420 if args.deadline is None else args.deadline
        args.rounds = min(args.rounds, 2)
    args.time_budget = 1.0 if args.time_budget is None else args.time_budget
    args.warmup = 10 if args.warmup is None else args.warmup
    args.torch = args.torch or "all"
    args.compile_batches = ints(args.compile_batches)
    args.compile_modes = [m.strip() for m in args.compile_modes.split(",") if m.strip()]
    bad = set(args.compile_modes) - {"default", "reduce-overhead"}
    if bad:
        p.error(f"unknown --compile-modes {', '.join(sorted(bad))}; choose default, reduce-overhead")
    args.fp16_batches = ints(args.fp16_batches) if isinstance(args.fp16_batches, str) else args.fp16_batches
    if args.device == "cpu":
        args.graph_modes = [False]
        args.fp16 = False
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    (out / "parts").mkdir(parents=True, exist_ok=True)

    if args.child:  # one model, in this process
        try:
            run_model(args.child, args, out / "parts" / f"{args.child}.json")
        except Exception as exc:
            part = out / "parts" / f"{args.child}.json"
            data = json.loads(part.read_text()) if part.exists() else {"model": args.child, "info": {},
                                                                       "timings": [], "errors": []}
            data["errors"].append({"stage": "run", "error": f"{type(exc).__name__}: {exc}"[:500]})
            part.write_text(json.dumps(data, indent=1, default=str))
            log(f"{args.child}: FAILED: {type(exc).__name__}: {exc}")
            traceback.print_exc()
            return 1
        return 0

    base = {"command": "python " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
            "config": {k: v for k, v in vars(args).items() if k not in ("child", "merge", "report_only")}}
    if args.report_only:
        merged = {"models": {}}
        for f in args.merge or [out / "results.json"]:
            data = json.loads(Path(f).read_text())
            merged["models"].update(data.get("models", {}))
            merged.setdefault("environment", data.get("environment", {}))
            merged.setdefault("command", data.get("command", ""))
            merged.setdefault("config", data.get("config", {}))
        write_reports(out, merged)
        log(f"wrote {out}/results.md, results.json, speedup.svg ({len(merged['models'])} models)")
        return 0

    t_start = time.time()
    deadline_at = t_start + args.deadline if args.deadline else None
    if args.device == "cuda":
        from onnxfuse.timing import gpu_unavailable_reason

        reason = gpu_unavailable_reason()
        if reason:
            log(f"{reason}; nothing to do (use --device cpu for a smoke test)")
            return 1
    base["environment"] = environment() if args.isolate else {}
    log(f"models: {', '.join(args.models)}; batches {args.batches}; CUDA graphs {args.graph_modes}; "
        f"{args.time_budget} s per cell; torch {args.torch}; fp16 {args.fp16}; deadline {args.deadline or 'none'}")
    finished = []

    def model_done(name: str, outcome, seconds: float) -> None:
        part = out / "parts" / f"{name}.json"
        if outcome == "skipped":
            log(f"{name}: skipped (deadline)")
            part.write_text(json.dumps({"model": name, "info": {}, "timings": [],
                                        "errors": [{"stage": "run", "error": "skipped: deadline"}]}))
        else:
            if outcome != 0:
                log(f"{name}: child exited with {outcome}")
                if part.exists() and outcome in ("timeout", -11, -6, 139, 134):
                    data = json.loads(part.read_text())
                    data["errors"].append({"stage": "run", "error": f"child process ended: {outcome}"})
                    part.write_text(json.dumps(data, indent=1, default=str))
            log(f"{name}: {seconds:.0f} s")
        finished.append(name)
        write_reports(out, collect(out, [m for m in args.models if m in finished or m not in todo], base))

    todo = [m for m in args.models if not (args.resume and complete_part(out / "parts" / f"{m}.json"))]
    if len(todo) < len(args.models):
        log(f"--resume: {', '.join(m for m in args.models if m not in todo)} already done in {out}")
    if args.isolate:
        try:
            slots = gpu_slots(args.gpus, os.environ.get("CUDA_VISIBLE_DEVICES"))
        except ValueError as exc:
            log(str(exc))
            return 2

        def start(name: str, gpu: str | None):
            cmd = [sys.executable, str(Path(__file__).resolve()), "--child", name,
                   *_forward(argv if argv is not None else sys.argv[1:])]
            if deadline_at:
                cmd += ["--deadline-at", str(deadline_at)]
            env = None if gpu is None else {**os.environ, "CUDA_VISIBLE_DEVICES": gpu, "ZOO_LOG_TAG": f"{name} gpu{gpu}"}
            return subprocess.Popen(cmd, env=env)

        run_children(todo, slots, deadline_at, start, model_done)
    else:
        args.deadline_at = deadline_at
        for name in todo:
            if deadline_at and time.time() > deadline_at - 20:
                model_done(name, "skipped", 0.0)
                continue
            t0 = time.time()
            try:
                run_model(name, args, out / "parts" / f"{name}.json")
            except Exception as exc:
                log(f"{name}: FAILED: {type(exc).__name__}: {exc}")
            if not base.get("environment"):
                base["environment"] = environment()
            model_done(name, 0, time.time() - t0)
    results = collect(out, args.models, base)
    write_reports(out, results)
    log(f"done in {time.time() - t_start:.0f} s: {out}/results.md, results.json, speedup.svg")
    return 0


def _forward(argv: list[str]) -> list[str]:
    """The parent's arguments for a child, without --models (the child gets --child NAME instead)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == "--models":
            skip = True
            continue
        if a.startswith("--models="):
            continue
        out.append(a)
    return out


if __name__ == "__main__":
    sys.exit(main())
