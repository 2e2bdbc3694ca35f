// The on-disk cache of compiled CUDA kernels: a private folder of verified entries.
//
// What it defends against, and how:
// * other users planting or replacing entries (a planted binary would run on the GPU in the
//   user's process): the folder must be a real folder (not a symbolic link), owned by the user,
//   with no group/other write permission; the library creates it 0700 and makes an older
//   onnxfuse's 0755 folder private; anything else turns the disk cache off with one line on stderr
//   (kernels are then compiled in memory; the session never fails because of the cache). Every
//   file is opened relative to the checked folder's descriptor, entries with O_NOFOLLOW and
//   checked to be regular files owned by the user and private (0600), temporary files created
//   with O_CREAT|O_EXCL|O_NOFOLLOW (mode 0600, whatever the umask) and renamed into place, so a
//   symbolic link planted at any name is never followed.
// * accidental corruption (a full disk, a crash mid-write, a truncated or edited file): each
//   entry holds its key, the full CUDA source and the binary's length and SHA-256; an entry
//   whose header, source, length or checksum does not match is ignored, never loaded, and
//   rewritten after the kernel is compiled again.
// The checksum is not a signature: anyone who can write into the folder can write a matching
// checksum too. It does not need to be one, because only the user can write there (the owner
// and mode checks above), and the user can run code anyway. SHA-256 is used because it rules out
// an accidental match outright and costs ~1 ms for a 200 KB CUBIN, not because of an adversary.
#ifndef ONNXFUSE_KERNEL_CACHE_H_
#define ONNXFUSE_KERNEL_CACHE_H_

#include <cstddef>
#include <string>

namespace onnxfuse {

// Version of the entry format and of the key; entries of other versions are never read.
constexpr int kKernelCacheVersion = 2;

// SHA-256 of `size` bytes as 64 lowercase hex digits.
std::string sha256_hex(const void* data, size_t size);

// The disk cache folder the environment asks for, "" when disabled: ONNXFUSE_KERNEL_CACHE
// (0/off/false: disabled, an absolute path: that folder), else $XDG_CACHE_HOME/onnxfuse/kernels,
// else $HOME/.cache/onnxfuse/kernels.
std::string kernel_cache_dir();

class KernelDiskCache {
 public:
  KernelDiskCache() = default;
  KernelDiskCache(const KernelDiskCache&) = delete;
  KernelDiskCache& operator=(const KernelDiskCache&) = delete;
  ~KernelDiskCache();

  // Creates `dir` (missing folders 0700) and checks it. false with *why set when it is refused.
  bool open(const std::string& dir, std::string* why);
  bool is_open() const { return fd_ >= 0; }

  enum Result { kMiss, kHit, kRejected };
  // The binary stored for `key` (whose entry must hold `source`): kHit with *binary set; kMiss
  // when there is no entry; kRejected with *why when an entry exists but fails verification.
  Result load(const std::string& key, const std::string& source, std::string* binary, std::string* why) const;
  // Writes the entry for `key` (a private temporary file renamed into place). false with *why.
  bool store(const std::string& key, const std::string& source, const std::string& binary, std::string* why) const;

  // File name of the entry for `key` (inside the folder).
  static std::string entry_name(const std::string& key);

 private:
  int fd_ = -1;  // the checked folder, opened O_DIRECTORY|O_NOFOLLOW; every file is opened relative to it
};

}  // namespace onnxfuse

#endif  // ONNXFUSE_KERNEL_CACHE_H_
