// The stand-in device's memory: a caching device allocator over host memory and a caching pinned
// host allocator, with the statistics torch's device-generic API and capstan's tests read.
// See standin.cc for what the stand-in is and why.

#include "standin.h"

#include <ATen/core/CachingHostAllocator.h>
#include <ATen/native/Resize.h>
#include <c10/core/CachingDeviceAllocator.h>

#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>

namespace capstan_standin {

using c10::CachingAllocator::StatType;
constexpr size_t kAgg = static_cast<size_t>(StatType::AGGREGATE);
constexpr size_t kDeviceRound = 512;  // CUDA's caching allocator rounds small blocks to 512 bytes

static int64_t env_int(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  char* end = nullptr;
  long long x = std::strtoll(v, &end, 10);
  return (end != v && x > 0) ? static_cast<int64_t>(x) : fallback;
}

c10::DeviceIndex device_count() {
  static const c10::DeviceIndex n = static_cast<c10::DeviceIndex>(
      std::min<int64_t>(env_int("CAPSTAN_STANDIN_DEVICES", 2), kMaxDevices));
  return n;
}

thread_local c10::DeviceIndex current_device = 0;

void check_index(c10::DeviceIndex d) {
  TORCH_CHECK(d >= 0 && d < device_count(), "standin device index ", static_cast<int>(d),
              " out of range: ", static_cast<int>(device_count()), " devices (CAPSTAN_STANDIN_DEVICES)");
}

// ---- device memory: a caching allocator over host memory --------------------------------------
// Blocks are rounded up to 512 bytes and, once freed, kept for a request of the same rounded size
// until empty_cache: "reserved" exceeds "allocated" exactly as on CUDA, so code that budgets by
// allocated bytes alone is caught.
struct DeviceHeap {
  std::mutex mu;
  c10::CachingDeviceAllocator::DeviceStats stats;
  std::multimap<size_t, void*> cached;           // rounded size -> free block
  std::unordered_map<void*, size_t> live;        // block -> rounded size
};

DeviceHeap heaps[kMaxDevices];

size_t capacity() {
  static const size_t cap = static_cast<size_t>(env_int("CAPSTAN_STANDIN_MEMORY", int64_t(64) << 30));
  return cap;
}

void release_cached(DeviceHeap& h) {
  for (auto& [size, ptr] : h.cached) {
    std::free(ptr);
    h.stats.reserved_bytes[kAgg].decrease(size);
    h.stats.segment[kAgg].decrease(1);
    h.stats.num_device_free += 1;
  }
  h.cached.clear();
}

// What a device DataPtr's deleter needs (it receives only the context).
struct DeviceBlock {
  c10::DeviceIndex device;
  void* ptr;
  size_t size;       // rounded
  size_t requested;  // asked for
};

void free_device_block(void* ctx) {
  auto* b = static_cast<DeviceBlock*>(ctx);
  DeviceHeap& h = heaps[b->device];
  {
    std::lock_guard<std::mutex> lock(h.mu);
    h.stats.allocated_bytes[kAgg].decrease(b->size);
    h.stats.requested_bytes[kAgg].decrease(b->requested);
    h.stats.allocation[kAgg].decrease(1);
    h.stats.active[kAgg].decrease(1);
    h.stats.active_bytes[kAgg].decrease(b->size);
    h.cached.emplace(b->size, b->ptr);
  }
  delete b;
}

void reset_stats(c10::CachingDeviceAllocator::DeviceStats& s, bool peak) {
  for (auto* a : {&s.allocation, &s.segment, &s.active, &s.allocated_bytes, &s.reserved_bytes,
                  &s.active_bytes, &s.requested_bytes}) {
    if (peak) (*a)[kAgg].reset_peak(); else (*a)[kAgg].reset_accumulated();
  }
  if (!peak) s.num_ooms = s.num_alloc_retries = s.num_device_alloc = s.num_device_free = 0;
}

struct StandinDeviceAllocator final : c10::DeviceAllocator {
  c10::DataPtr allocate(size_t nbytes) override {
    const c10::DeviceIndex d = current_device;
    check_index(d);
    const c10::Device dev(c10::DeviceType::PrivateUse1, d);
    if (nbytes == 0) return {nullptr, nullptr, &c10::detail::deleteNothing, dev};
    const size_t size = (nbytes + kDeviceRound - 1) / kDeviceRound * kDeviceRound;
    DeviceHeap& h = heaps[d];
    std::lock_guard<std::mutex> lock(h.mu);
    void* ptr = nullptr;
    auto it = h.cached.find(size);
    if (it != h.cached.end()) {
      ptr = it->second;
      h.cached.erase(it);
    } else {
      if (static_cast<size_t>(h.stats.reserved_bytes[kAgg].current) + size > capacity()) {
        h.stats.num_alloc_retries += 1;
        release_cached(h);
      }
      if (static_cast<size_t>(h.stats.reserved_bytes[kAgg].current) + size > capacity()) {
        h.stats.num_ooms += 1;
        TORCH_CHECK_WITH(OutOfMemoryError, false, "standin out of memory. Tried to allocate ", nbytes,
                         " bytes; device ", static_cast<int>(d), " has a total capacity of ", capacity(),
                         " bytes, of which ", h.stats.allocated_bytes[kAgg].current,
                         " are allocated by PyTorch and ", h.stats.reserved_bytes[kAgg].current, " reserved");
      }
      ptr = std::aligned_alloc(kDeviceRound, size);
      TORCH_CHECK(ptr != nullptr, "standin: host allocation of ", size, " bytes failed");
      h.stats.reserved_bytes[kAgg].increase(size);
      h.stats.segment[kAgg].increase(1);
      h.stats.num_device_alloc += 1;
    }
    h.stats.allocated_bytes[kAgg].increase(size);
    h.stats.requested_bytes[kAgg].increase(nbytes);
    h.stats.allocation[kAgg].increase(1);
    h.stats.active[kAgg].increase(1);
    h.stats.active_bytes[kAgg].increase(size);
    return {ptr, new DeviceBlock{d, ptr, size, nbytes}, &free_device_block, dev};
  }

  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
  bool initialized() override { return true; }
  void emptyCache(c10::MempoolId_t) override {
    for (c10::DeviceIndex d = 0; d < device_count(); ++d) {
      std::lock_guard<std::mutex> lock(heaps[d].mu);
      release_cached(heaps[d]);
    }
  }
  void recordStream(const c10::DataPtr&, c10::Stream) override {}
  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(c10::DeviceIndex d) override {
    check_index(d);
    std::lock_guard<std::mutex> lock(heaps[d].mu);
    return heaps[d].stats;
  }
  void resetAccumulatedStats(c10::DeviceIndex d) override {
    check_index(d);
    std::lock_guard<std::mutex> lock(heaps[d].mu);
    reset_stats(heaps[d].stats, false);
  }
  void resetPeakStats(c10::DeviceIndex d) override {
    check_index(d);
    std::lock_guard<std::mutex> lock(heaps[d].mu);
    reset_stats(heaps[d].stats, true);
  }
  std::pair<size_t, size_t> getMemoryInfo(c10::DeviceIndex d) override {
    check_index(d);
    std::lock_guard<std::mutex> lock(heaps[d].mu);
    const size_t used = static_cast<size_t>(heaps[d].stats.reserved_bytes[kAgg].current);
    return {capacity() - std::min(used, capacity()), capacity()};
  }
};

StandinDeviceAllocator device_allocator;
REGISTER_ALLOCATOR(c10::DeviceType::PrivateUse1, &device_allocator);

// ---- pinned host memory: CUDA's caching host allocator, in miniature ---------------------------
// Requests round up to a power of two and freed blocks are kept for reuse, so what pinned memory
// really holds ("reserved") can reach twice what was asked; budgets must count that.
struct HostBlock {
  void* ptr;
  size_t size;
};

struct StandinHostAllocator final : at::HostAllocator {
  std::mutex mu;
  std::map<uintptr_t, size_t> blocks;       // every block this allocator owns, by address
  std::multimap<size_t, void*> cached;      // free blocks by size
  int64_t allocated = 0, allocated_peak = 0, reserved = 0, reserved_peak = 0, requested = 0;

  static size_t round(size_t n) {
    size_t p = 4096;
    while (p < n) p <<= 1;
    return p;
  }

  at::DataPtr allocate(size_t nbytes) override {
    const c10::Device cpu(c10::DeviceType::CPU);
    if (nbytes == 0) return {nullptr, nullptr, &c10::detail::deleteNothing, cpu};
    const size_t size = round(nbytes);
    std::lock_guard<std::mutex> lock(mu);
    void* ptr = nullptr;
    auto it = cached.find(size);
    if (it != cached.end()) {
      ptr = it->second;
      cached.erase(it);
    } else {
      ptr = std::aligned_alloc(4096, size);
      TORCH_CHECK(ptr != nullptr, "standin: pinned allocation of ", size, " bytes failed");
      blocks[reinterpret_cast<uintptr_t>(ptr)] = size;
      reserved += static_cast<int64_t>(size);
      reserved_peak = std::max(reserved_peak, reserved);
    }
    allocated += static_cast<int64_t>(size);
    requested += static_cast<int64_t>(nbytes);
    allocated_peak = std::max(allocated_peak, allocated);
    return {ptr, new HostBlock{ptr, nbytes}, &free_host_block, cpu};
  }

  static void free_host_block(void* ctx);

  void release(HostBlock* b) {
    std::lock_guard<std::mutex> lock(mu);
    const size_t size = blocks.at(reinterpret_cast<uintptr_t>(b->ptr));
    allocated -= static_cast<int64_t>(size);
    requested -= static_cast<int64_t>(b->size);
    cached.emplace(size, b->ptr);
  }

  bool owns(const void* p) {
    std::lock_guard<std::mutex> lock(mu);
    const auto a = reinterpret_cast<uintptr_t>(p);
    auto it = blocks.upper_bound(a);
    if (it == blocks.begin()) return false;
    --it;
    return a < it->first + it->second;
  }

  at::DeleterFnPtr raw_deleter() const override { return nullptr; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
  bool record_event(void*, void*, c10::Stream) override { return true; }
  void empty_cache() override {
    std::lock_guard<std::mutex> lock(mu);
    for (auto& [size, ptr] : cached) {
      blocks.erase(reinterpret_cast<uintptr_t>(ptr));
      std::free(ptr);
      reserved -= static_cast<int64_t>(size);
    }
    cached.clear();
  }
  at::HostStats get_stats() override {
    std::lock_guard<std::mutex> lock(mu);
    at::HostStats s;
    s.active_bytes.current = allocated;
    s.active_bytes.peak = allocated_peak;
    s.allocated_bytes.current = reserved;
    s.allocated_bytes.peak = reserved_peak;
    return s;
  }
  void reset_accumulated_stats() override {}
  void reset_peak_stats() override {
    std::lock_guard<std::mutex> lock(mu);
    allocated_peak = allocated;
    reserved_peak = reserved;
  }
};

StandinHostAllocator host_allocator;
REGISTER_HOST_ALLOCATOR(at::kPrivateUse1, &host_allocator);

void StandinHostAllocator::free_host_block(void* ctx) {
  auto* b = static_cast<HostBlock*>(ctx);
  host_allocator.release(b);
  delete b;
}

c10::Allocator* device_alloc() { return &device_allocator; }
at::Allocator* host_alloc() { return &host_allocator; }
bool host_owns(const void* p) { return host_allocator.owns(p); }

}  // namespace capstan_standin

extern "C" {

// out: allocated current, allocated peak, reserved current, reserved peak, allocations, OOMs
__attribute__((visibility("default"))) int capstan_standin_device_stats(int device, int64_t* out) {
  using namespace capstan_standin;
  if (device < 0 || device >= device_count() || out == nullptr) return 1;
  std::lock_guard<std::mutex> lock(heaps[device].mu);
  const auto& s = heaps[device].stats;
  out[0] = s.allocated_bytes[kAgg].current;
  out[1] = s.allocated_bytes[kAgg].peak;
  out[2] = s.reserved_bytes[kAgg].current;
  out[3] = s.reserved_bytes[kAgg].peak;
  out[4] = s.allocation[kAgg].allocated;
  out[5] = s.num_ooms;
  return 0;
}

// out: pinned bytes in use (rounded), their peak, reserved (in use + cached), its peak, requested
__attribute__((visibility("default"))) int capstan_standin_host_stats(int64_t* out) {
  using namespace capstan_standin;
  if (out == nullptr) return 1;
  std::lock_guard<std::mutex> lock(host_allocator.mu);
  out[0] = host_allocator.allocated;
  out[1] = host_allocator.allocated_peak;
  out[2] = host_allocator.reserved;
  out[3] = host_allocator.reserved_peak;
  out[4] = host_allocator.requested;
  return 0;
}

__attribute__((visibility("default"))) void capstan_standin_empty_host_cache() {
  capstan_standin::host_allocator.empty_cache();
}

}  // extern "C"
