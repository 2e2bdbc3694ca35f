// The on-disk kernel cache (see kernel_cache.h for what it defends against and why it suffices).
#include "kernel_cache.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace onnxfuse {

namespace {

// ------------------------------------------------------------------ SHA-256 (FIPS 180-4)
struct Sha256 {
  uint32_t h[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
  unsigned char buf[64];
  size_t used = 0;
  uint64_t total = 0;

  static uint32_t rotr(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

  void block(const unsigned char* p) {
    static const uint32_t k[64] = {
        0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
        0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
        0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
        0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
        0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
        0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
        0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
        0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};
    uint32_t w[64];
    for (int i = 0; i < 16; ++i)
      w[i] = (uint32_t(p[4 * i]) << 24) | (uint32_t(p[4 * i + 1]) << 16) | (uint32_t(p[4 * i + 2]) << 8) | p[4 * i + 3];
    for (int i = 16; i < 64; ++i) {
      uint32_t s0 = rotr(w[i - 15], 7) ^ rotr(w[i - 15], 18) ^ (w[i - 15] >> 3);
      uint32_t s1 = rotr(w[i - 2], 17) ^ rotr(w[i - 2], 19) ^ (w[i - 2] >> 10);
      w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    uint32_t a = h[0], b = h[1], c = h[2], d = h[3], e = h[4], f = h[5], g = h[6], hh = h[7];
    for (int i = 0; i < 64; ++i) {
      uint32_t t1 = hh + (rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25)) + ((e & f) ^ (~e & g)) + k[i] + w[i];
      uint32_t t2 = (rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
      hh = g;
      g = f;
      f = e;
      e = d + t1;
      d = c;
      c = b;
      b = a;
      a = t1 + t2;
    }
    h[0] += a, h[1] += b, h[2] += c, h[3] += d, h[4] += e, h[5] += f, h[6] += g, h[7] += hh;
  }

  void update(const unsigned char* p, size_t n) {
    total += n;
    while (n > 0) {
      if (used == 0 && n >= 64) {
        block(p);
        p += 64;
        n -= 64;
        continue;
      }
      size_t take = 64 - used < n ? 64 - used : n;
      std::memcpy(buf + used, p, take);
      used += take;
      p += take;
      n -= take;
      if (used == 64) {
        block(buf);
        used = 0;
      }
    }
  }

  std::string hex() {
    const uint64_t bits = total * 8;
    const unsigned char one = 0x80, zero = 0;
    update(&one, 1);
    while (used != 56) update(&zero, 1);
    unsigned char len[8];
    for (int i = 0; i < 8; ++i) len[i] = static_cast<unsigned char>(bits >> (56 - 8 * i));
    update(len, 8);
    char out[65];
    for (int i = 0; i < 8; ++i) std::snprintf(out + 8 * i, 9, "%08x", h[i]);
    return std::string(out, 64);
  }
};

// Largest entry read back: far above any kernel module, small enough to reject a planted
// multi-gigabyte file without reading it.
constexpr off_t kMaxEntryBytes = 256l << 20;

std::string errno_text(int e) { return std::strerror(e); }

std::string mode_text(mode_t m) {
  char b[16];
  std::snprintf(b, sizeof b, "%04o", static_cast<unsigned>(m & 07777));
  return b;
}

// Creates the missing folders of `path`, each 0700 (as the XDG base directory specification asks
// for folders it creates), whatever the umask. Existing folders are left as they are.
void make_private_dirs(const std::string& path) {
  size_t st = 0;
  while (st < path.size()) {
    size_t e = path.find('/', st + 1);
    if (e == std::string::npos) e = path.size();
    const std::string cur = path.substr(0, e);
    if (!cur.empty() && mkdir(cur.c_str(), 0700) == 0) chmod(cur.c_str(), 0700);
    st = e;
  }
}

bool read_all(int fd, size_t size, std::string* out) {
  out->assign(size, '\0');
  size_t got = 0;
  while (got < size) {
    ssize_t r = ::read(fd, &(*out)[got], size - got);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    got += static_cast<size_t>(r);
  }
  char extra;
  return ::read(fd, &extra, 1) == 0;  // the file did not grow while read
}

bool write_all(int fd, const char* p, size_t n) {
  while (n > 0) {
    ssize_t r = ::write(fd, p, n);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    p += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

// Entry header: "ONNXFUSE-KERNEL 2\n<key>\nsource <bytes>\nbinary <bytes> sha256 <hex>\n", then the
// source and the binary.
std::string header_prefix(const std::string& key, const std::string& source) {
  return "ONNXFUSE-KERNEL " + std::to_string(kKernelCacheVersion) + "\n" + key + "\nsource " +
         std::to_string(source.size()) + "\nbinary ";
}

}  // namespace

std::string sha256_hex(const void* data, size_t size) {
  Sha256 s;
  s.update(static_cast<const unsigned char*>(data), size);
  return s.hex();
}

std::string kernel_cache_dir() {
  const char* env = std::getenv("ONNXFUSE_KERNEL_CACHE");
  if (env && (std::string(env) == "0" || std::string(env) == "off" || std::string(env) == "false")) return "";
  if (env && env[0] == '/') return env;  // an explicit folder
  if (const char* x = std::getenv("XDG_CACHE_HOME"); x && x[0] == '/') return std::string(x) + "/onnxfuse/kernels";
  if (const char* home = std::getenv("HOME"); home && home[0] == '/') return std::string(home) + "/.cache/onnxfuse/kernels";
  return "";
}

KernelDiskCache::~KernelDiskCache() {
  if (fd_ >= 0) ::close(fd_);
}

std::string KernelDiskCache::entry_name(const std::string& key) { return sha256_hex(key.data(), key.size()).substr(0, 32) + ".bin"; }

bool KernelDiskCache::open(const std::string& path, std::string* why) {
  // Without trailing slashes: "dir/" would resolve a symbolic link despite lstat and O_NOFOLLOW.
  std::string dir = path;
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  make_private_dirs(dir);
  struct stat st;
  if (lstat(dir.c_str(), &st) != 0) {
    *why = dir + " cannot be created: " + errno_text(errno);
    return false;
  }
  if (S_ISLNK(st.st_mode)) {
    *why = dir + " is a symbolic link (the cache folder must be a real folder)";
    return false;
  }
  // O_NOFOLLOW: a symbolic link swapped in after lstat fails here instead of being followed. The
  // checks below look at the folder actually opened, and every file is opened relative to it.
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) {
    *why = dir + " cannot be opened as a folder: " + errno_text(errno);
    return false;
  }
  if (fstat(fd, &st) != 0 || !S_ISDIR(st.st_mode)) {
    ::close(fd);
    *why = dir + " is not a folder";
    return false;
  }
  if (st.st_uid != geteuid()) {
    ::close(fd);
    *why = dir + " is owned by uid " + std::to_string(st.st_uid) + ", not by this user (uid " +
           std::to_string(geteuid()) + ")";
    return false;
  }
  if (st.st_mode & (S_IWGRP | S_IWOTH)) {
    // Others may have put files there: none of them may ever be loaded.
    ::close(fd);
    *why = dir + " is writable by its group or by others (mode " + mode_text(st.st_mode) +
           "); make it private (chmod 700) or remove it";
    return false;
  }
  if ((st.st_mode & 077) && fchmod(fd, st.st_mode & 0700) != 0) {
    // Readable by others but writable only by the user (0755: how onnxfuse before cache version 2
    // created it): nobody else can have written there, so making it private is safe.
    ::close(fd);
    *why = dir + " is readable by others (mode " + mode_text(st.st_mode) + ") and cannot be made private: " +
           errno_text(errno);
    return false;
  }
  fd_ = fd;
  return true;
}

KernelDiskCache::Result KernelDiskCache::load(const std::string& key, const std::string& source, std::string* binary,
                                              std::string* why) const {
  if (fd_ < 0) return kMiss;
  const std::string name = entry_name(key);
  // O_NONBLOCK: a FIFO planted under the entry's name must not block the open.
  int fd = ::openat(fd_, name.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    if (errno == ENOENT) return kMiss;
    *why = name + (errno == ELOOP ? " is a symbolic link" : " cannot be opened: " + errno_text(errno));
    return kRejected;
  }
  struct stat st;
  std::string data;
  const char* bad = nullptr;
  if (fstat(fd, &st) != 0) bad = "cannot be examined";
  else if (!S_ISREG(st.st_mode)) bad = "is not a regular file";
  else if (st.st_uid != geteuid()) bad = "is owned by another user";
  else if (st.st_mode & 077) bad = "is accessible by its group or by others";
  else if (st.st_size > kMaxEntryBytes) bad = "is too large";
  else if (!read_all(fd, static_cast<size_t>(st.st_size), &data)) bad = "cannot be read";
  ::close(fd);
  if (bad) {
    *why = name + " " + bad;
    return kRejected;
  }
  // Header: the key and the source length must be the ones expected, then the binary's length and
  // checksum; the file must end exactly after the binary.
  const std::string prefix = header_prefix(key, source);
  if (data.compare(0, prefix.size(), prefix) != 0) {
    *why = name + " has another key or format (a hash collision, another version, or corruption)";
    return kRejected;
  }
  size_t pos = prefix.size();
  size_t eol = data.find('\n', pos);
  unsigned long long bin_size = 0;
  char sum[65] = {0};
  int consumed = 0;
  if (eol == std::string::npos || eol - pos > 120 ||
      std::sscanf(data.substr(pos, eol - pos).c_str(), "%llu sha256 %64[0-9a-f]%n", &bin_size, sum, &consumed) != 2 ||
      static_cast<size_t>(consumed) != eol - pos || std::strlen(sum) != 64) {
    *why = name + " has a malformed header";
    return kRejected;
  }
  pos = eol + 1;
  if (data.size() < pos || data.size() - pos != source.size() + bin_size || bin_size == 0) {
    *why = name + " is truncated or has trailing bytes";
    return kRejected;
  }
  if (data.compare(pos, source.size(), source) != 0) {
    *why = name + " holds another kernel's source";
    return kRejected;
  }
  pos += source.size();
  if (sha256_hex(data.data() + pos, bin_size) != sum) {
    *why = name + " fails its checksum";
    return kRejected;
  }
  binary->assign(data, pos, bin_size);
  return kHit;
}

bool KernelDiskCache::store(const std::string& key, const std::string& source, const std::string& binary,
                            std::string* why) const {
  if (fd_ < 0) return false;
  const std::string name = entry_name(key);
  const std::string data = header_prefix(key, source) + std::to_string(binary.size()) + " sha256 " +
                           sha256_hex(binary.data(), binary.size()) + "\n" + source + binary;
  // A fresh private file: O_EXCL refuses any existing name (a symbolic link planted there included,
  // which O_NOFOLLOW also refuses to follow); mode 0600 whatever the umask (umask can only remove
  // bits). The first name is the pid's; on a clash, names with a random suffix are tried.
  static std::atomic<unsigned long long> counter{0};
  std::string tmp;
  int fd = -1;
  for (int attempt = 0; attempt < 16 && fd < 0; ++attempt) {
    tmp = name + ".tmp." + std::to_string(getpid());
    if (attempt > 0) {
      unsigned long long r = static_cast<unsigned long long>(
          std::chrono::steady_clock::now().time_since_epoch().count()) * 0x9e3779b97f4a7c15ull ^
          (++counter << 32) ^ reinterpret_cast<uintptr_t>(&tmp);
      char suffix[24];
      std::snprintf(suffix, sizeof suffix, ".%012llx", r & 0xffffffffffffull);
      tmp += suffix;
    }
    fd = ::openat(fd_, tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0 && errno != EEXIST) break;
  }
  if (fd < 0) {
    *why = "cannot create a temporary file in the cache folder: " + errno_text(errno);
    return false;
  }
  bool ok = write_all(fd, data.data(), data.size());
  ok = (::close(fd) == 0) && ok;
  if (ok && ::renameat(fd_, tmp.c_str(), fd_, name.c_str()) == 0) return true;
  *why = "cannot write " + name + ": " + errno_text(errno);
  ::unlinkat(fd_, tmp.c_str(), 0);
  return false;
}

}  // namespace onnxfuse
