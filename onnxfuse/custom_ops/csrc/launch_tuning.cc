#include "launch_tuning.h"

#include <cmath>
#include <cstdlib>
#include <cstring>

namespace onnxfuse {

namespace {
long long ceil_div(long long a, long long b) { return (a + b - 1) / b; }
}  // namespace

LaunchShape default_launch(long long items, unsigned threads) {
  LaunchShape s;
  s.threads = threads;
  s.blocks = ceil_div(items, threads);
  s.items_per_thread = 1;
  return s;
}

std::vector<LaunchShape> launch_candidates(long long items, unsigned default_threads) {
  std::vector<LaunchShape> out{default_launch(items, default_threads)};
  for (unsigned threads : {128u, 256u}) {
    for (int per : {1, 2, 4, 8}) {
      LaunchShape s;
      s.threads = threads;
      s.blocks = ceil_div(items, static_cast<long long>(threads) * per);
      s.items_per_thread = per;
      bool seen = false;
      for (const auto& o : out) seen = seen || o == s;
      if (!seen) out.push_back(s);
    }
  }
  return out;
}

int pick_launch(const std::vector<double>& ms) {
  if (ms.empty() || !(ms[0] > 0) || !std::isfinite(ms[0])) return 0;
  int best = 0;
  for (size_t i = 1; i < ms.size(); ++i)
    if (ms[i] > 0 && std::isfinite(ms[i]) && ms[i] < ms[best]) best = static_cast<int>(i);
  return ms[best] < ms[0] * (1.0 - kTuneMargin) ? best : 0;
}

bool launch_tuning_enabled() {
  const char* v = std::getenv("ONNXFUSE_LAUNCH_TUNING");
  return !(v && std::strcmp(v, "0") == 0);
}

bool LaunchTable::find(int variant, bool wide, long long n, LaunchShape* out) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = table_.find(std::make_tuple(variant, wide, n));
  if (it == table_.end()) return false;
  *out = it->second;
  return true;
}

void LaunchTable::put(int variant, bool wide, long long n, const LaunchShape& s) {
  std::lock_guard<std::mutex> lock(mu_);
  table_[std::make_tuple(variant, wide, n)] = s;
}

}  // namespace onnxfuse
