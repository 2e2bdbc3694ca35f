// NVRTC compilation, kernel cache (memory + disk) and launches through the CUDA driver API.
// Everything CUDA is declared here and resolved with dlopen/dlsym on first use.
#include "cuda_runtime.h"

#include <dlfcn.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <sstream>
#include <type_traits>

#include "kernel_cache.h"
#include "launch_tuning.h"

namespace onnxfuse {

namespace {

// Kernels of a module, by the index launch() picks: kKernelNames[kKernel*] (op_table.gen.h).

// ------------------------------------------------------------------ driver API declarations
typedef int CUresult;
typedef int CUdevice;
typedef struct CUctx_st* CUcontext;
typedef struct CUmod_st* CUmodule;
typedef struct CUfunc_st* CUfunction;
typedef struct CUstream_st* CUstream;
typedef struct CUevent_st* CUevent;
constexpr int CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75;
constexpr int CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76;
constexpr int CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16;

struct Driver {
  bool ok = false;
  std::string error;
  CUresult (*cuInit)(unsigned int);
  CUresult (*cuDriverGetVersion)(int*);
  CUresult (*cuDeviceGet)(CUdevice*, int);
  CUresult (*cuDeviceGetAttribute)(int*, int, CUdevice);
  CUresult (*cuDevicePrimaryCtxRetain)(CUcontext*, CUdevice);
  CUresult (*cuCtxPushCurrent)(CUcontext);
  CUresult (*cuCtxPopCurrent)(CUcontext*);
  CUresult (*cuCtxGetCurrent)(CUcontext*);
  CUresult (*cuCtxSetCurrent)(CUcontext);
  CUresult (*cuModuleLoadData)(CUmodule*, const void*);
  CUresult (*cuModuleGetFunction)(CUfunction*, CUmodule, const char*);
  CUresult (*cuLaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                             CUstream, void**, void**);
  CUresult (*cuGetErrorString)(CUresult, const char**);
  // Optional (nullptr when the driver lacks it): the blocks of a kernel one multiprocessor runs at once.
  CUresult (*cuOccupancyMaxActiveBlocksPerMultiprocessor)(int*, CUfunction, int, size_t) = nullptr;
  // Optional, for launch tuning (all present or no tuning): CUDA events, and whether a stream is being
  // captured into a CUDA graph (status 0: not capturing).
  CUresult (*cuEventCreate)(CUevent*, unsigned) = nullptr;
  CUresult (*cuEventRecord)(CUevent, CUstream) = nullptr;
  CUresult (*cuEventSynchronize)(CUevent) = nullptr;
  CUresult (*cuEventElapsedTime)(float*, CUevent, CUevent) = nullptr;
  CUresult (*cuEventDestroy)(CUevent) = nullptr;
  CUresult (*cuStreamIsCapturing)(CUstream, int*) = nullptr;
  bool can_time() const {
    return cuEventCreate && cuEventRecord && cuEventSynchronize && cuEventElapsedTime && cuEventDestroy && cuStreamIsCapturing;
  }
  std::string err_str(CUresult r) const {
    const char* s = nullptr;
    if (cuGetErrorString && cuGetErrorString(r, &s) == 0 && s) return std::string(s) + " (" + std::to_string(r) + ")";
    return "CUDA driver error " + std::to_string(r);
  }
};

// ------------------------------------------------------------------ NVRTC declarations
typedef int nvrtcResult;
typedef struct _nvrtcProgram* nvrtcProgram;
struct Nvrtc {
  bool ok = false;
  std::string error;
  std::string path;
  int major = 0, minor = 0;
  const char* (*nvrtcGetErrorString)(nvrtcResult);
  nvrtcResult (*nvrtcVersion)(int*, int*);
  nvrtcResult (*nvrtcCreateProgram)(nvrtcProgram*, const char*, const char*, int, const char* const*, const char* const*);
  nvrtcResult (*nvrtcDestroyProgram)(nvrtcProgram*);
  nvrtcResult (*nvrtcCompileProgram)(nvrtcProgram, int, const char* const*);
  nvrtcResult (*nvrtcGetProgramLogSize)(nvrtcProgram, size_t*);
  nvrtcResult (*nvrtcGetProgramLog)(nvrtcProgram, char*);
  nvrtcResult (*nvrtcGetPTXSize)(nvrtcProgram, size_t*);
  nvrtcResult (*nvrtcGetPTX)(nvrtcProgram, char*);
  nvrtcResult (*nvrtcGetCUBINSize)(nvrtcProgram, size_t*);
  nvrtcResult (*nvrtcGetCUBIN)(nvrtcProgram, char*);
  nvrtcResult (*nvrtcGetNumSupportedArchs)(int*);
  nvrtcResult (*nvrtcGetSupportedArchs)(int*);
};

template <class F>
bool sym(void* h, const char* name, F* out, std::string* err) {
  *out = reinterpret_cast<F>(dlsym(h, name));
  if (!*out) {
    *err += std::string(err->empty() ? "" : "; ") + "missing symbol " + name;
    return false;
  }
  return true;
}

std::mutex g_mu;

Driver& driver() {
  static Driver d;
  static bool tried = false;
  std::lock_guard<std::mutex> lock(g_mu);
  if (tried) return d;
  tried = true;
  // ONNXFUSE_CUDA_DRIVER: another driver library (tests use a mock that records launches).
  const char* path = std::getenv("ONNXFUSE_CUDA_DRIVER");
  if (!path || !*path) path = "libcuda.so.1";
  void* h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    d.error = std::string("cannot load the CUDA driver (") + path + "): " + dlerror();
    return d;
  }
  std::string e;
  bool ok = sym(h, "cuInit", &d.cuInit, &e) & sym(h, "cuDriverGetVersion", &d.cuDriverGetVersion, &e) &
            sym(h, "cuDeviceGet", &d.cuDeviceGet, &e) & sym(h, "cuDeviceGetAttribute", &d.cuDeviceGetAttribute, &e) &
            sym(h, "cuDevicePrimaryCtxRetain", &d.cuDevicePrimaryCtxRetain, &e) &
            sym(h, "cuCtxPushCurrent_v2", &d.cuCtxPushCurrent, &e) & sym(h, "cuCtxPopCurrent_v2", &d.cuCtxPopCurrent, &e) &
            sym(h, "cuCtxGetCurrent", &d.cuCtxGetCurrent, &e) & sym(h, "cuCtxSetCurrent", &d.cuCtxSetCurrent, &e) &
            sym(h, "cuModuleLoadData", &d.cuModuleLoadData, &e) &
            sym(h, "cuModuleGetFunction", &d.cuModuleGetFunction, &e) & sym(h, "cuLaunchKernel", &d.cuLaunchKernel, &e) &
            sym(h, "cuGetErrorString", &d.cuGetErrorString, &e);
  d.cuOccupancyMaxActiveBlocksPerMultiprocessor = reinterpret_cast<decltype(d.cuOccupancyMaxActiveBlocksPerMultiprocessor)>(
      dlsym(h, "cuOccupancyMaxActiveBlocksPerMultiprocessor"));
  auto opt = [h](auto* f, const char* name, const char* alt = nullptr) {
    void* a = dlsym(h, name);
    if (!a && alt) a = dlsym(h, alt);
    *f = reinterpret_cast<std::remove_pointer_t<decltype(f)>>(a);
  };
  opt(&d.cuEventCreate, "cuEventCreate");
  opt(&d.cuEventRecord, "cuEventRecord");
  opt(&d.cuEventSynchronize, "cuEventSynchronize");
  opt(&d.cuEventElapsedTime, "cuEventElapsedTime_v2", "cuEventElapsedTime");
  opt(&d.cuEventDestroy, "cuEventDestroy_v2", "cuEventDestroy");
  opt(&d.cuStreamIsCapturing, "cuStreamIsCapturing");
  if (!ok) {
    d.error = "the CUDA driver is missing entry points: " + e;
    return d;
  }
  CUresult r = d.cuInit(0);
  if (r != 0) {
    d.error = "cuInit failed: " + d.err_str(r);
    return d;
  }
  d.ok = true;
  return d;
}

std::vector<std::string> nvrtc_candidates() {
  std::vector<std::string> c;
  if (const char* p = std::getenv("ONNXFUSE_NVRTC_PATH")) {
    std::string s(p);
    size_t st = 0;
    while (st <= s.size()) {  // ':'-separated list of files
      size_t e = s.find(':', st);
      if (e == std::string::npos) e = s.size();
      if (e > st) c.push_back(s.substr(st, e - st));
      st = e + 1;
    }
  }
  // The lists come from op_table.gen.h (custom_ops.native.NVRTC_*, whose nvrtc_candidates() is this).
  for (const char* n : kNvrtcLibraryNames) c.push_back(n);
  std::vector<std::string> roots;
  for (const char* env : kNvrtcRootEnvs)
    if (const char* p = std::getenv(env)) roots.push_back(p);
  roots.push_back(kNvrtcRootDefault);
  for (const auto& r : roots)
    for (const char* sub : kNvrtcRootSubdirs)
      for (const char* n : kNvrtcLibraryNames) c.push_back(r + sub + n);
  return c;
}

Nvrtc& nvrtc() {
  static Nvrtc n;
  static bool tried = false;
  std::lock_guard<std::mutex> lock(g_mu);
  if (tried) return n;
  tried = true;
  void* h = nullptr;
  std::string tried_list;
  for (const auto& cand : nvrtc_candidates()) {
    h = dlopen(cand.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (h) {
      n.path = cand;
      break;
    }
    tried_list += (tried_list.empty() ? "" : ", ") + cand;
  }
  if (!h) {
    n.error = "cannot load NVRTC (tried " + tried_list +
              "); install the nvidia-cuda-nvrtc wheel or the CUDA toolkit, or set ONNXFUSE_NVRTC_PATH to libnvrtc.so";
    return n;
  }
  std::string e;
  bool ok = sym(h, "nvrtcGetErrorString", &n.nvrtcGetErrorString, &e) & sym(h, "nvrtcVersion", &n.nvrtcVersion, &e) &
            sym(h, "nvrtcCreateProgram", &n.nvrtcCreateProgram, &e) &
            sym(h, "nvrtcDestroyProgram", &n.nvrtcDestroyProgram, &e) &
            sym(h, "nvrtcCompileProgram", &n.nvrtcCompileProgram, &e) &
            sym(h, "nvrtcGetProgramLogSize", &n.nvrtcGetProgramLogSize, &e) &
            sym(h, "nvrtcGetProgramLog", &n.nvrtcGetProgramLog, &e) & sym(h, "nvrtcGetPTXSize", &n.nvrtcGetPTXSize, &e) &
            sym(h, "nvrtcGetPTX", &n.nvrtcGetPTX, &e);
  // Optional (CUDA >= 11.1 / 11.2).
  n.nvrtcGetCUBINSize = reinterpret_cast<decltype(n.nvrtcGetCUBINSize)>(dlsym(h, "nvrtcGetCUBINSize"));
  n.nvrtcGetCUBIN = reinterpret_cast<decltype(n.nvrtcGetCUBIN)>(dlsym(h, "nvrtcGetCUBIN"));
  n.nvrtcGetNumSupportedArchs = reinterpret_cast<decltype(n.nvrtcGetNumSupportedArchs)>(dlsym(h, "nvrtcGetNumSupportedArchs"));
  n.nvrtcGetSupportedArchs = reinterpret_cast<decltype(n.nvrtcGetSupportedArchs)>(dlsym(h, "nvrtcGetSupportedArchs"));
  if (!ok) {
    n.error = n.path + " is missing entry points: " + e;
    return n;
  }
  n.nvrtcVersion(&n.major, &n.minor);
  n.ok = true;
  return n;
}

// 64-bit FNV-1a, twice with different offsets -> 128-bit hex key.
std::string hash_hex(const std::string& s) {
  uint64_t h1 = 1469598103934665603ull, h2 = 0x84222325cbf29ce4ull ^ 0x9e3779b97f4a7c15ull;
  for (unsigned char c : s) {
    h1 = (h1 ^ c) * 1099511628211ull;
    h2 = (h2 ^ c) * 0x100000001b3ull + 0x9e37ull;
  }
  char buf[40];
  std::snprintf(buf, sizeof buf, "%016llx%016llx", static_cast<unsigned long long>(h1), static_cast<unsigned long long>(h2));
  return buf;
}

struct Stats {
  long compiles = 0, disk_hits = 0, memory_hits = 0, disk_writes = 0, disk_rejects = 0;
  double compile_ms = 0, load_ms = 0, last_compile_ms = 0, last_disk_load_ms = 0;
  std::string last_key, last_entry, last_arch, last_disk_reject, disk_refused;
  // Launch tuning: sizes tuned, how many of them kept a shape other than the default, the last decision.
  long launch_tunings = 0, launch_tunings_changed = 0;
  std::string last_launch_tuning = "null";
} g_stats;

// A refused cache folder turns the disk cache off for this kernel, with one line on stderr per
// process (the first reason; every refusal is in the stats' "disk_refused").
void note_refused(const std::string& why) {
  g_stats.disk_refused = why;
  static std::atomic<bool> logged{false};
  if (!logged.exchange(true))
    std::fprintf(stderr, "onnxfuse: kernel disk cache not used: %s; compiling CUDA kernels in memory\n", why.c_str());
}

std::string json_str(const std::string& s) {
  std::string o = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') o += '\\', o += c;
    else if (static_cast<unsigned char>(c) < 0x20) {
      char b[8];
      std::snprintf(b, sizeof b, "\\u%04x", c);
      o += b;
    } else o += c;
  }
  return o + "\"";
}

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

bool nvrtc_compile(const std::string& source, const std::string& arch, std::string* binary, std::string* log) {
  Nvrtc& nv = nvrtc();
  if (!nv.ok) {
    *log = nv.error;
    return false;
  }
  nvrtcProgram prog = nullptr;
  nvrtcResult r = nv.nvrtcCreateProgram(&prog, source.c_str(), kNvrtcSourceName, 0, nullptr, nullptr);
  if (r != 0) {
    *log = std::string("nvrtcCreateProgram failed: ") + nv.nvrtcGetErrorString(r);
    return false;
  }
  std::string arch_opt = "--gpu-architecture=" + arch;
  const char* opts[1 + kNumNvrtcOptions] = {arch_opt.c_str()};
  for (int k = 0; k < kNumNvrtcOptions; ++k) opts[1 + k] = kNvrtcOptions[k];
  r = nv.nvrtcCompileProgram(prog, 1 + kNumNvrtcOptions, opts);
  size_t log_size = 0;
  nv.nvrtcGetProgramLogSize(prog, &log_size);
  std::string lg(log_size, '\0');
  if (log_size > 1) nv.nvrtcGetProgramLog(prog, &lg[0]);
  while (!lg.empty() && (lg.back() == '\0' || lg.back() == '\n')) lg.pop_back();
  *log = lg;
  bool ok = r == 0;
  if (!ok) {
    *log = std::string("NVRTC ") + std::to_string(nv.major) + "." + std::to_string(nv.minor) + " (" + nv.path +
           ") failed: " + nv.nvrtcGetErrorString(r) + "\n" + lg;
  } else {
    bool cubin = arch.rfind("sm_", 0) == 0;
    size_t sz = 0;
    if (cubin) {
      if (!nv.nvrtcGetCUBINSize || !nv.nvrtcGetCUBIN) {
        *log = "this NVRTC cannot produce CUBIN";
        ok = false;
      } else {
        nv.nvrtcGetCUBINSize(prog, &sz);
        binary->assign(sz, '\0');
        nv.nvrtcGetCUBIN(prog, &(*binary)[0]);
      }
    } else {
      nv.nvrtcGetPTXSize(prog, &sz);
      binary->assign(sz, '\0');
      nv.nvrtcGetPTX(prog, &(*binary)[0]);  // NUL-terminated, as cuModuleLoadData wants
    }
  }
  nv.nvrtcDestroyProgram(&prog);
  return ok;
}

// The device handle and compute capability (major·10 + minor) of CUDA device `device`.
static bool device_capability(Driver& d, int device, CUdevice* dev, int* cc, std::string* err) {
  CUresult r = d.cuDeviceGet(dev, device);
  if (r != 0) {
    *err = "cuDeviceGet(" + std::to_string(device) + ") failed: " + d.err_str(r);
    return false;
  }
  int maj = 0, min = 0;
  d.cuDeviceGetAttribute(&maj, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, *dev);
  d.cuDeviceGetAttribute(&min, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, *dev);
  *cc = maj * 10 + min;
  return true;
}

// The NVRTC target for a device of compute capability `cc`: CUBIN for the device when NVRTC knows it,
// else PTX for the newest virtual architecture NVRTC supports that is not newer than the device (the
// driver JIT-compiles it).
static std::string target_arch(Nvrtc& nv, int cc) {
  std::string arch = "sm_" + std::to_string(cc);
  if (nv.nvrtcGetNumSupportedArchs && nv.nvrtcGetSupportedArchs) {
    int na = 0;
    nv.nvrtcGetNumSupportedArchs(&na);
    std::vector<int> archs(na > 0 ? na : 0);
    if (na > 0) nv.nvrtcGetSupportedArchs(archs.data());
    bool known = false;
    int best = 0;
    for (int a : archs) {
      known = known || a == cc;
      if (a <= cc && a > best) best = a;
    }
    if (!known && best > 0) arch = "compute_" + std::to_string(best);
  }
  return arch;
}

struct CudaModule {
  CUmodule module = nullptr;
  CUcontext ctx = nullptr;
  CUfunction fn[kNumKernels][2] = {};  // [kernel (kKernelNames)][64-bit index]
  LaunchTable launches;  // tuned launch shapes (launch_tuning.h), shared by the nodes of this program
};

namespace {
std::map<std::string, std::shared_ptr<CudaModule>>& module_cache() {
  static auto* m = new std::map<std::string, std::shared_ptr<CudaModule>>();  // never freed: outlives ORT
  return *m;
}
std::map<std::string, std::string>& binary_cache() {
  static auto* m = new std::map<std::string, std::string>();
  return *m;
}
std::mutex g_cache_mu;
}  // namespace

std::unique_ptr<CudaKernel> CudaKernel::create(const Program& prog, int device, std::string* err, bool placed) {
  Driver& d = driver();
  if (!d.ok) {
    *err = d.error;
    return nullptr;
  }
  const int nin = static_cast<int>(prog.inputs.size()), nout = static_cast<int>(prog.outputs.size());
  const int slots = cuda_out_slots(nout, placed);
  if (nin > kCudaMaxInputs || nout > kCudaMaxOutputs || cuda_max_dims(nin, slots) < 1 ||
      cuda_params_size(nin, slots) > static_cast<size_t>(kCudaParamBytes)) {
    *err = "too many inputs/outputs for one CUDA kernel (at most " + std::to_string(kCudaMaxInputs) + " inputs and " +
           std::to_string(kCudaMaxOutputs) + " outputs)";
    return nullptr;
  }
  CUdevice dev;
  int cc = 0;
  if (!device_capability(d, device, &dev, &cc, err)) return nullptr;
  CUresult r = 0;

  CudaSource src = cuda_source(prog, kVariantAll, placed);
  std::lock_guard<std::mutex> lock(g_cache_mu);
  Nvrtc& nv = nvrtc();
  if (!nv.ok) {
    *err = nv.error;
    return nullptr;
  }
  const std::string arch = target_arch(nv, cc);
  const std::string key = "v" + std::to_string(kKernelCacheVersion) + " " + arch + " nvrtc" + std::to_string(nv.major) + "." +
                          std::to_string(nv.minor) + " " + hash_hex(src.code);
  const std::string mkey = key + " dev" + std::to_string(device);
  g_stats.last_key = key;
  g_stats.last_entry = KernelDiskCache::entry_name(key);
  g_stats.last_arch = arch;

  auto it = module_cache().find(mkey);
  std::shared_ptr<CudaModule> mod;
  if (it != module_cache().end()) {
    g_stats.memory_hits++;
    mod = it->second;
  } else {
    std::string bin;
    auto bit = binary_cache().find(key);
    KernelDiskCache disk;  // opened (and its folder checked) only when the binary is not in memory
    bool from_disk = false;
    if (bit != binary_cache().end()) {
      bin = bit->second;
      g_stats.memory_hits++;
    } else {
      auto t0 = std::chrono::steady_clock::now();
      const std::string dir = kernel_cache_dir();
      std::string why;
      if (!dir.empty() && !disk.open(dir, &why)) note_refused(why);
      KernelDiskCache::Result found = disk.load(key, src.code, &bin, &why);
      if (found == KernelDiskCache::kHit) {
        from_disk = true;
        g_stats.disk_hits++;
        g_stats.last_disk_load_ms = ms_since(t0);
      } else {
        if (found == KernelDiskCache::kRejected) {  // never loaded; recompiled and rewritten below
          g_stats.disk_rejects++;
          g_stats.last_disk_reject = why;
        }
        bin.clear();
        std::string log;
        if (!nvrtc_compile(src.code, arch, &bin, &log)) {
          *err = "NVRTC could not compile the kernel for this program:\n" + prog.text + "\n--- NVRTC log ---\n" + log;
          return nullptr;
        }
        g_stats.compiles++;
        g_stats.last_compile_ms = ms_since(t0);
        g_stats.compile_ms += g_stats.last_compile_ms;
      }
    }
    // Load into the device's primary context (the one the CUDA runtime, and so ONNX Runtime, uses).
    auto t1 = std::chrono::steady_clock::now();
    mod = std::make_shared<CudaModule>();
    r = d.cuDevicePrimaryCtxRetain(&mod->ctx, dev);
    if (r != 0) {
      *err = "cuDevicePrimaryCtxRetain failed: " + d.err_str(r);
      return nullptr;
    }
    d.cuCtxPushCurrent(mod->ctx);
    r = d.cuModuleLoadData(&mod->module, bin.data());
    if (r != 0 && from_disk) {  // a verified entry the driver refuses (e.g. PTX newer than the driver): recompile
      std::string log;
      if (!nvrtc_compile(src.code, arch, &bin, &log)) {
        CUcontext dummy;
        d.cuCtxPopCurrent(&dummy);
        *err = "NVRTC could not compile the kernel for this program:\n" + prog.text + "\n--- NVRTC log ---\n" + log;
        return nullptr;
      }
      g_stats.compiles++;
      from_disk = false;
      r = d.cuModuleLoadData(&mod->module, bin.data());
    }
    if (r == 0) {
      for (int v = 0; v < kNumKernels && r == 0; ++v)
        for (int w = 0; w < 2 && r == 0; ++w)
          r = d.cuModuleGetFunction(&mod->fn[v][w], mod->module,
                                    (std::string(kKernelNames[v]) + "_" + std::to_string(kKernelIndexBits[w])).c_str());
    }
    CUcontext dummy;
    d.cuCtxPopCurrent(&dummy);
    if (r != 0) {
      *err = "loading the compiled kernel failed: " + d.err_str(r) + " (arch " + arch + ")";
      return nullptr;
    }
    g_stats.load_ms += ms_since(t1);
    binary_cache()[key] = bin;
    std::string why;
    if (!from_disk && disk.is_open()) {
      if (disk.store(key, src.code, bin, &why)) g_stats.disk_writes++;
    }
    module_cache()[mkey] = mod;
  }
  std::unique_ptr<CudaKernel> k(new CudaKernel());
  k->module_ = mod;
  k->nin_ = nin;
  k->nout_ = nout;
  k->vec_ = src.vec;
  k->max_dims_ = src.max_dims;
  for (int i = 0; i < nin; ++i) k->in_bytes_.push_back(static_cast<int64_t>(dtype_size(prog.values[prog.inputs[i]].dtype)));
  for (int j = 0; j < nout; ++j) k->out_bytes_.push_back(static_cast<int64_t>(dtype_size(prog.values[prog.outputs[j]].dtype)));
  k->device_ = device;
  k->placed_ = placed;
  k->used_ = src.used_inputs;
  return k;
}

namespace {

// Each candidate's time in milliseconds per launch on `stream` (CUDA events around 3 launches after one
// warm-up, the lower of two passes so a passing stall on the GPU does not decide), -1 where a call failed.
// The launches write the node's outputs from its inputs, as the real launch after them does again.
std::vector<double> time_launches(Driver& d, CUfunction fn, void** args, void* stream,
                                  const std::vector<LaunchShape>& shapes) {
  std::vector<double> ms(shapes.size(), -1.0);
  CUevent start = nullptr, stop = nullptr;
  if (d.cuEventCreate(&start, 0) != 0) return ms;
  if (d.cuEventCreate(&stop, 0) != 0) {
    d.cuEventDestroy(start);
    return ms;
  }
  const CUstream st = static_cast<CUstream>(stream);
  auto run = [&](const LaunchShape& s) {
    return d.cuLaunchKernel(fn, static_cast<unsigned>(s.blocks), 1, 1, s.threads, 1, 1, 0, st, args, nullptr) == 0;
  };
  constexpr int kRuns = 3;
  for (int pass = 0; pass < 2; ++pass) {
    for (size_t i = 0; i < shapes.size(); ++i) {
      bool ok = run(shapes[i]) && d.cuEventRecord(start, st) == 0;
      for (int k = 0; k < kRuns && ok; ++k) ok = run(shapes[i]);
      float t = 0;
      ok = ok && d.cuEventRecord(stop, st) == 0 && d.cuEventSynchronize(stop) == 0 &&
           d.cuEventElapsedTime(&t, start, stop) == 0;
      if (!ok) {  // this shape's measurement failed: it never wins; the pass stops here
        ms[i] = -1.0;
        break;
      }
      const double per = t / kRuns;
      if (pass == 0 || (ms[i] > 0 && per < ms[i])) ms[i] = per;
    }
  }
  d.cuEventDestroy(start);
  d.cuEventDestroy(stop);
  return ms;
}

// The launch shape for `items` work items of a launch over n elements: the module's recorded decision,
// else (tuning on, the driver able to time, the stream not being captured) the candidates timed now and
// the pick recorded; else the default, not recorded (launch_tuning.h says when and why).
LaunchShape tuned_launch(Driver& d, CudaModule& mod, int variant, bool wide, long long n, long long items, CUfunction fn,
                         void** args, void* stream) {
  LaunchShape shape;
  if (mod.launches.find(variant, wide, n, &shape)) return shape;
  const LaunchShape fallback = default_launch(items, kBlockThreads);
  int capturing = 1;
  if (!d.can_time() || !launch_tuning_enabled() ||
      d.cuStreamIsCapturing(static_cast<CUstream>(stream), &capturing) != 0 || capturing != 0)
    return fallback;
  const std::vector<LaunchShape> shapes = launch_candidates(items, kBlockThreads);
  const std::vector<double> ms = time_launches(d, fn, args, stream, shapes);
  const int pick = pick_launch(ms);
  shape = shapes[pick];
  mod.launches.put(variant, wide, n, shape);
  std::lock_guard<std::mutex> lock(g_cache_mu);
  g_stats.launch_tunings++;
  if (pick != 0) g_stats.launch_tunings_changed++;
  std::ostringstream js;
  js << "{\"kernel\": " << json_str(std::string(kKernelNames[variant]) + "_" + std::to_string(kKernelIndexBits[wide ? 1 : 0]))
     << ", \"elements\": " << n << ", \"threads\": " << shape.threads << ", \"items_per_thread\": " << shape.items_per_thread
     << ", \"default_ms\": " << ms[0] << ", \"chosen_ms\": " << ms[pick] << ", \"candidates\": " << shapes.size() << "}";
  g_stats.last_launch_tuning = js.str();
  return shape;
}

}  // namespace

bool CudaKernel::launch_one(const void* const* in, void* const* out, const BroadcastLayout& L, void* stream,
                            std::string* err, const OutputPlacement* place) const {
  Driver& d = driver();
  if (placed_ && !place) {
    *err = "internal error: a placed kernel launched without its placement";
    return false;
  }
  // Kernel-parameter struct, laid out as in cuda_params_size() (a placed kernel's three fields last).
  alignas(16) unsigned char buf[kCudaParamBytes];
  const size_t size = cuda_params_size(nin_, cuda_out_slots(nout_, placed_));
  std::memset(buf, 0, size);
  unsigned char* p = buf;
  std::memcpy(p, in, 8 * nin_);
  p += 8 * nin_;
  std::memcpy(p, out, 8 * nout_);
  p += 8 * nout_;
  long long n = L.n, mask = 0;
  bool all_fast = true;  // inputs the program reads all have the output's shape or one element
  for (int k = 0; k < nin_; ++k) {
    if (!used_[k]) continue;
    if (L.kind[k] == BroadcastLayout::kScalar) mask |= 1ll << k;
    all_fast = all_fast && L.kind[k] != BroadcastLayout::kGeneral;
  }
  auto aligned16 = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  bool outs_aligned = true;
  for (int j = 0; j < nout_; ++j) outs_aligned = outs_aligned && aligned16(out[j]);
  int variant;
  if (all_fast) {
    bool aligned = outs_aligned;
    for (int k = 0; k < nin_; ++k)
      if (used_[k] && L.kind[k] == BroadcastLayout::kFull) aligned = aligned && aligned16(in[k]);
    variant = aligned ? kKernelFastVec : kKernelFastScalar;
  } else {
    variant = kKernelBroadcast;
    int nd = static_cast<int>(L.dims.size());
    if (nd > max_dims_) {  // launch() splits such layouts; never write past dims[]/strides[][]
      *err = "internal error: " + std::to_string(nd) + " dimensions for a kernel that takes " + std::to_string(max_dims_);
      return false;
    }
    std::memcpy(p + 16, &nd, 4);
    long long* dims = reinterpret_cast<long long*>(p + 24);
    for (int i = 0; i < nd; ++i) dims[i] = L.dims[i];
    long long* strides = dims + max_dims_;
    for (int k = 0; k < nin_; ++k)
      for (int i = 0; i < nd; ++i) strides[k * max_dims_ + i] = L.strides[k][i];
    // Vectorised broadcast (ofx_bcast_vec): the innermost dim is a multiple of V, so a thread's V
    // consecutive elements share their outer coordinates; each read input has stride 0 along it (one
    // scalar load: mask bit) or stride 1 with its outer strides multiples of V and a 16-byte aligned
    // pointer (then its offsets are multiples of V: aligned 128-bit loads); outputs 16-byte aligned.
    bool vec_ok = outs_aligned && L.dims[nd - 1] % vec_ == 0;
    long long vmask = 0;
    for (int k = 0; k < nin_ && vec_ok; ++k) {
      if (!used_[k]) continue;
      const long long inner = L.strides[k][nd - 1];
      if (inner == 0) {
        vmask |= 1ll << k;
      } else if (inner == 1 && aligned16(in[k])) {
        for (int i = 0; i + 1 < nd; ++i) vec_ok = vec_ok && L.strides[k][i] % vec_ == 0;
      } else {
        vec_ok = false;
      }
    }
    if (vec_ok) {
      variant = kKernelBroadcastVec;
      mask = vmask;
    }
  }
  if (placed_) {
    // A thread of a vectorised kernel stores V consecutive elements with one 128-bit store: they must
    // land in one row of the larger tensor, at a 16-byte aligned place (V elements are 16 bytes at least).
    const bool vec_place = place->inner % vec_ == 0 && place->pitch % vec_ == 0 && place->off % vec_ == 0;
    if (!vec_place && variant == kKernelFastVec) variant = kKernelFastScalar;
    if (!vec_place && variant == kKernelBroadcastVec) {
      variant = kKernelBroadcast;
      mask = 0;  // ofx_bcast ignores it
    }
    long long fields[kPlacedParamSlots] = {place->inner, place->pitch, place->off};
    std::memcpy(buf + size - sizeof(fields), fields, sizeof(fields));  // the block's last three slots
  }
  std::memcpy(p, &n, 8);
  std::memcpy(p + 8, &mask, 8);
  long long threads = L.n;
  if (variant == kKernelFastVec) threads = L.n / vec_ + L.n % vec_;
  if (variant == kKernelBroadcastVec) threads = L.n / vec_;
  const bool wide = L.n > 2147483647ll || (placed_ && place->total > 2147483647ll);
  LaunchShape shape = default_launch(threads, kBlockThreads);
  if (shape.blocks > 2147483647ll) {
    *err = "tensor too large for one launch";
    return false;
  }
  CUfunction fn = module_->fn[variant][wide ? 1 : 0];
  CUcontext cur = nullptr;
  if (d.cuCtxGetCurrent(&cur) != 0 || cur == nullptr) d.cuCtxSetCurrent(module_->ctx);
  void* args[] = {buf};
  if (L.n >= kTuneMinElements) shape = tuned_launch(d, *module_, variant, wide, L.n, threads, fn, args, stream);
  CUresult r = d.cuLaunchKernel(fn, static_cast<unsigned>(shape.blocks), 1, 1, shape.threads, 1, 1, 0,
                                static_cast<CUstream>(stream), args, nullptr);
  if (r != 0) {
    *err = "cuLaunchKernel failed: " + d.err_str(r);
    return false;
  }
  return true;
}

bool CudaKernel::launch(const void* const* in, void* const* out, const BroadcastLayout& L, void* stream,
                        std::string* err, const OutputPlacement* place) const {
  if (L.n == 0) return true;
  const int nd = static_cast<int>(L.dims.size());
  if (nd > kMaxRank) {  // make_layout refuses these; nothing below is sized for them
    *err = rank_limit_error(nd);
    return false;
  }
  if (nd <= max_dims_) return launch_one(in, out, L, stream, err, place);
  if (placed_) {  // FusedConcat's rule keeps its programs within the dims one launch takes
    *err = "internal error: " + std::to_string(nd) + " dimensions for a placed kernel that takes " + std::to_string(max_dims_);
    return false;
  }
  // More merged dims than this kernel's parameter block holds (programs with many inputs, see
  // cuda_max_dims): one launch per coordinate of the `outer` outermost dims, each over the inner
  // max_dims_ dims with the data pointers moved to that coordinate (outputs are contiguous, so
  // their block is the next inner.n elements). Still no allocation and no synchronisation.
  const int outer = nd - max_dims_;
  BroadcastLayout inner;
  inner.dims.assign(L.dims.begin() + outer, L.dims.end());
  inner.out_shape = inner.dims;
  inner.n = 1;
  for (int64_t v : inner.dims) inner.n *= v;
  inner.strides.resize(nin_);
  for (int k = 0; k < nin_; ++k) inner.strides[k].assign(L.strides[k].begin() + outer, L.strides[k].end());
  inner.kind.assign(nin_, BroadcastLayout::kGeneral);  // nd > 1 merged dims: some input is not full
  std::vector<const void*> pin(nin_);
  std::vector<void*> pout(nout_);
  int64_t coord[kMaxRank] = {};
  int64_t count = 1;
  for (int i = 0; i < outer; ++i) count *= L.dims[i];
  for (int64_t o = 0; o < count; ++o) {
    for (int k = 0; k < nin_; ++k) {
      int64_t off = 0;
      for (int i = 0; i < outer; ++i) off += coord[i] * L.strides[k][i];
      pin[k] = static_cast<const char*>(in[k]) + off * in_bytes_[k];
    }
    for (int j = 0; j < nout_; ++j) pout[j] = static_cast<char*>(out[j]) + o * inner.n * out_bytes_[j];
    if (!launch_one(pin.data(), pout.data(), inner, stream, err, nullptr)) return false;
    for (int i = outer - 1; i >= 0 && ++coord[i] == L.dims[i]; --i) coord[i] = 0;
  }
  return true;
}

// ------------------------------------------------------------------ fixed kernels
// A CUDA source that does not depend on a program (AttentionInputs): compiled once per process and
// device, kept in memory (its compile is a few hundred milliseconds, once).
struct FixedModule {
  CUmodule module = nullptr;
  CUcontext ctx = nullptr;
  std::vector<CUfunction> fns;
};

bool fixed_kernels(const std::string& source, const std::vector<std::string>& names, int device,
                   std::vector<void*>* fns, void** ctx, std::string* err) {
  Driver& d = driver();
  if (!d.ok) {
    *err = d.error;
    return false;
  }
  static auto* cache = new std::map<std::string, std::shared_ptr<FixedModule>>();  // never freed: outlives ORT
  std::lock_guard<std::mutex> lock(g_cache_mu);
  const std::string key = hash_hex(source) + " dev" + std::to_string(device);
  auto it = cache->find(key);
  std::shared_ptr<FixedModule> mod;
  if (it != cache->end()) {
    mod = it->second;
  } else {
    Nvrtc& nv = nvrtc();
    if (!nv.ok) {
      *err = nv.error;
      return false;
    }
    CUdevice dev;
    int cc = 0;
    if (!device_capability(d, device, &dev, &cc, err)) return false;
    CUresult r = 0;
    const std::string arch = target_arch(nv, cc);
    std::string bin, log;
    auto t0 = std::chrono::steady_clock::now();
    if (!nvrtc_compile(source, arch, &bin, &log)) {
      *err = "NVRTC could not compile a fixed kernel:\n" + log;
      return false;
    }
    g_stats.compiles++;
    g_stats.last_compile_ms = ms_since(t0);
    g_stats.compile_ms += g_stats.last_compile_ms;
    mod = std::make_shared<FixedModule>();
    r = d.cuDevicePrimaryCtxRetain(&mod->ctx, dev);
    if (r != 0) {
      *err = "cuDevicePrimaryCtxRetain failed: " + d.err_str(r);
      return false;
    }
    d.cuCtxPushCurrent(mod->ctx);
    r = d.cuModuleLoadData(&mod->module, bin.data());
    for (size_t i = 0; r == 0 && i < names.size(); ++i) {
      CUfunction f = nullptr;
      r = d.cuModuleGetFunction(&f, mod->module, names[i].c_str());
      mod->fns.push_back(f);
    }
    CUcontext dummy;
    d.cuCtxPopCurrent(&dummy);
    if (r != 0) {
      *err = "loading a fixed kernel failed: " + d.err_str(r) + " (arch " + arch + ")";
      return false;
    }
    (*cache)[key] = mod;
  }
  fns->assign(mod->fns.begin(), mod->fns.end());
  *ctx = mod->ctx;
  return true;
}

bool launch_fixed(void* fn, void* ctx, long long blocks, unsigned threads, void* stream, void** args, std::string* err,
                  long long blocks_y, unsigned shared_bytes) {
  Driver& d = driver();
  if (blocks <= 0 || blocks_y <= 0) return true;
  if (blocks > 2147483647ll || blocks_y > 65535) {
    *err = "tensor too large for one launch";
    return false;
  }
  CUcontext cur = nullptr;
  if (d.cuCtxGetCurrent(&cur) != 0 || cur == nullptr) d.cuCtxSetCurrent(static_cast<CUcontext>(ctx));
  CUresult r = d.cuLaunchKernel(static_cast<CUfunction>(fn), static_cast<unsigned>(blocks), static_cast<unsigned>(blocks_y), 1,
                                threads, 1, 1, shared_bytes, static_cast<CUstream>(stream), args, nullptr);
  if (r != 0) {
    *err = "cuLaunchKernel failed: " + d.err_str(r);
    return false;
  }
  return true;
}

int compute_capability(int device) {
  Driver& d = driver();
  CUdevice dev;
  int cc = 0;
  std::string err;
  return d.ok && device_capability(d, device, &dev, &cc, &err) ? cc : 0;
}

int resident_blocks(void* fn, void* ctx, int device, unsigned threads, unsigned shared_bytes) {
  Driver& d = driver();
  CUdevice dev;
  int sms = 0, per_sm = 0;
  if (!d.ok || d.cuDeviceGet(&dev, device) != 0 || d.cuDeviceGetAttribute(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev) != 0 ||
      !d.cuOccupancyMaxActiveBlocksPerMultiprocessor)
    return 0;
  d.cuCtxPushCurrent(static_cast<CUcontext>(ctx));
  if (d.cuOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, static_cast<CUfunction>(fn), static_cast<int>(threads),
                                                    shared_bytes) != 0)
    per_sm = 0;
  CUcontext dummy;
  d.cuCtxPopCurrent(&dummy);
  return sms > 0 && per_sm > 0 ? sms * per_sm : 0;
}

std::string cuda_stats_json() {
  std::lock_guard<std::mutex> lock(g_cache_mu);
  std::ostringstream s;
  s << "{\"compiles\": " << g_stats.compiles << ", \"disk_hits\": " << g_stats.disk_hits
    << ", \"memory_hits\": " << g_stats.memory_hits << ", \"disk_writes\": " << g_stats.disk_writes
    << ", \"compile_ms\": " << g_stats.compile_ms << ", \"last_compile_ms\": " << g_stats.last_compile_ms
    << ", \"last_disk_load_ms\": " << g_stats.last_disk_load_ms << ", \"load_ms\": " << g_stats.load_ms
    << ", \"disk_rejects\": " << g_stats.disk_rejects << ", \"last_disk_reject\": " << json_str(g_stats.last_disk_reject)
    << ", \"disk_refused\": " << json_str(g_stats.disk_refused)
    << ", \"launch_tunings\": " << g_stats.launch_tunings << ", \"launch_tunings_changed\": " << g_stats.launch_tunings_changed
    << ", \"last_launch_tuning\": " << g_stats.last_launch_tuning
    << ", \"last_entry\": " << json_str(g_stats.last_entry) << ", \"last_arch\": " << json_str(g_stats.last_arch) << ", \"cache_dir\": " << json_str(kernel_cache_dir()) << "}";
  return s.str();
}

}  // namespace onnxfuse
