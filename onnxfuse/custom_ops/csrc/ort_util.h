// Small helpers over ONNX Runtime's C API shared by the library's ops (custom_op.cc and the attention ops).
#ifndef ONNXFUSE_ORT_UTIL_H_
#define ONNXFUSE_ORT_UTIL_H_

#include <string>

#include "ort_abi.h"

namespace onnxfuse {

// "<op> node '<name>': ", the start of every error line an op of the library writes ("<op> node: "
// when the name is unknown).
inline std::string node_prefix(const char* op, const std::string& node) {
  return std::string(op) + " node" + (node.empty() ? "" : " '" + node + "'") + ": ";
}

// The node's name ("" when ONNX Runtime cannot say), for error messages.
inline std::string node_label(const onnxfuse_ort::OrtApi* api, const onnxfuse_ort::OrtKernelInfo* info) {
  using namespace onnxfuse_ort;
  size_t size = 0;
  if (OrtStatus* st = api->KernelInfo_GetNodeName(info, nullptr, &size)) {
    api->ReleaseStatus(st);
    return "";
  }
  std::string name(size, '\0');
  if (OrtStatus* st = api->KernelInfo_GetNodeName(info, &name[0], &size)) {
    api->ReleaseStatus(st);
    return "";
  }
  while (!name.empty() && name.back() == '\0') name.pop_back();
  return name;
}

// The device id of the kernel's default allocator (0 when ONNX Runtime cannot say).
inline int device_of(const onnxfuse_ort::OrtApi* api, const onnxfuse_ort::OrtKernelInfo* info) {
  using namespace onnxfuse_ort;
  OrtAllocator* alloc = nullptr;
  int id = 0;
  if (OrtStatus* st = api->KernelInfoGetAllocator(info, OrtMemTypeDefault, &alloc)) {
    api->ReleaseStatus(st);
    return 0;
  }
  const OrtMemoryInfo* mi = nullptr;
  if (OrtStatus* st = api->AllocatorGetInfo(alloc, &mi)) {
    api->ReleaseStatus(st);
  } else if (OrtStatus* st2 = api->MemoryInfoGetId(mi, &id)) {
    api->ReleaseStatus(st2);
    id = 0;
  }
  api->ReleaseAllocator(alloc);
  return id;
}

}  // namespace onnxfuse

#endif  // ONNXFUSE_ORT_UTIL_H_
