# Sourced on the GPU machine (repo root) after onnxruntime-gpu was installed to /tmp/ort-site
# (../shared/gpu/README.md): makes the package, pytest and libnvrtc findable. Idempotent.
export PYTHONPATH=/tmp/ort-site:$PWD${PYTHONPATH:+:$PYTHONPATH}
if [ -z "${ONNXFUSE_NVRTC_PATH:-}" ]; then
  nvrtc=$(ls /usr/local/cuda/lib64/libnvrtc.so.1* /usr/local/cuda/targets/x86_64-linux/lib/libnvrtc.so.1* 2>/dev/null | head -1)
  [ -n "$nvrtc" ] && export ONNXFUSE_NVRTC_PATH=$nvrtc
fi
echo "python $(python3 --version 2>&1 | cut -d' ' -f2); nvrtc ${ONNXFUSE_NVRTC_PATH:-<system default>}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || true
