"""The fixed CUDA sources of the library's other ops (AttentionInputs, DecodeAttention, MixedRMSNorm,
ChannelTranspose, ChannelsLastMean),
checked without a GPU: each one's raw-string source, behind the shared typed loads and stores
(``kCudaTypedIo`` in attention_common.h) as ``fixed_kernels`` compiles it, compiles to PTX with NVRTC
(the nvidia-cuda-nvrtc wheel runs on the CPU) and defines every kernel the op's ``init_cuda`` asks for, for
a Turing GPU (where DecodeAttention's tensor-core kernels are empty stubs) as for a Hopper one.
A source that does not compile would otherwise fail only when a CUDA session is created."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from onnxfuse.custom_ops import native
from test_cuda_codegen import ARCHS, needs_nvrtc

CSRC = Path(native.__file__).resolve().parent / "csrc"
RAW = re.compile(r'R"CUDA\((.*?)\)CUDA"', re.S)


def cuda_strings(file: str) -> list[str]:
    return RAW.findall((CSRC / file).read_text())


#: op source file → the kernels its init_cuda looks up by name
KERNELS = {
    "attention_inputs.cc": [f"ofx_attention_inputs_{t}" for t in ("f32", "f16", "bf16")],
    "decode_attention.cc": [f"ofx_decode_attention_{t}_d{w}{v}" for t in ("f32", "f16", "bf16") for w in (64, 128, 256)
                            for v in ("_v", "_e")] + [f"ofx_decode_attention_{t}_combine" for t in ("f32", "f16", "bf16")]
                           + [f"ofx_decode_attention_{t}_d{w}_m" for t in ("f16", "bf16") for w in (64, 128)],
    "channel_transpose.cc": [f"ofx_to_{d}_{b}" for d in ("nhwc", "nchw") for b in ("b16", "b32")],
    "channels_last_mean.cc": [f"ofx_channels_last_mean_{t}" for t in ("f32", "f16", "bf16")],
    "mixed_rmsnorm.cc": [f"ofx_mixed_rmsnorm_{x}_{g}" for x in ("f32", "f16", "bf16") for g in ("f32", "f16", "bf16")],
}


@needs_nvrtc
@pytest.mark.parametrize("arch", ARCHS)  # Turing (no mma.m16n8k16, no cp.async), Hopper
@pytest.mark.parametrize("file", sorted(KERNELS))
def test_fixed_source_compiles_and_defines_its_kernels(file, arch):
    (typed_io,) = cuda_strings("attention_common.h")
    (source,) = cuda_strings(file)
    ptx = native.compile_ptx(typed_io + source, arch)
    assert sorted(re.findall(r"\.entry\s+(\w+)", ptx)) == sorted(KERNELS[file])
    assert "ld.local" not in ptx and "st.local" not in ptx  # accumulators and loaded tiles stay in registers
