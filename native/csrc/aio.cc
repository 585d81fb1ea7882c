// Asynchronous file I/O for the disk tier.
//
// An engine owns a queue and a few worker threads that run blocking
// pread/pwrite/fdatasync calls; many requests can be in flight at once (on
// NVMe several concurrent requests are needed to reach full bandwidth). Each
// submit returns a handle; poll asks whether it finished, wait blocks until it
// did and then forgets the handle, returning the bytes moved and the errno.
// Plain threads rather than io_uring or libaio: no extra library, works on
// every filesystem and in containers that forbid io_uring.
//
// Files are opened with O_DIRECT when asked and the filesystem accepts it
// (bypassing the page cache avoids double buffering of chunks that already
// live in RAM); capstan_file_open reports whether it did so that the caller
// can fall back to buffered I/O and say so once.
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

#include "internal.h"

namespace {

struct Request {
  int fd, op;
  char* buf;
  int64_t nbytes, offset;
  bool done = false;
  bool claimed = false;  // a thread is in capstan_aio_wait for it
  int err = 0;        // errno of the failing call, 0 if none
  bool short_read = false;
  int64_t moved = 0;  // bytes transferred
};

// Loops over partial transfers (pread/pwrite may move fewer bytes than asked
// for) and EINTR. A read returning 0 before nbytes is end of file.
void execute(Request* r) {
  if (r->op == CAPSTAN_AIO_FSYNC) {
    if (fdatasync(r->fd) != 0) r->err = errno;
    return;
  }
  while (r->moved < r->nbytes) {
    const size_t left = (size_t)(r->nbytes - r->moved);
    const off_t off = (off_t)(r->offset + r->moved);
    ssize_t k = r->op == CAPSTAN_AIO_READ ? pread(r->fd, r->buf + r->moved, left, off)
                                          : pwrite(r->fd, r->buf + r->moved, left, off);
    if (k < 0) {
      if (errno == EINTR) continue;
      r->err = errno;
      return;
    }
    if (k == 0) {
      if (r->op == CAPSTAN_AIO_READ) r->short_read = true;
      else r->err = EIO;  // pwrite made no progress: should not happen
      return;
    }
    r->moved += k;
  }
}

struct Engine {
  std::mutex mu;
  std::condition_variable work_cv, done_cv;
  std::deque<Request*> queue;
  std::unordered_map<int64_t, Request*> table;
  std::vector<std::thread> threads;
  int64_t next_id = 1;
  bool stop = false;

  void worker() {
    for (;;) {
      Request* r;
      {
        std::unique_lock<std::mutex> lk(mu);
        work_cv.wait(lk, [&] { return stop || !queue.empty(); });
        if (queue.empty()) return;  // stop requested and nothing left to do
        r = queue.front();
        queue.pop_front();
      }
      execute(r);
      {
        std::lock_guard<std::mutex> lk(mu);
        r->done = true;
      }
      done_cv.notify_all();
    }
  }
};

// Buffers of at least one huge page are mapped on their own, 2 MiB aligned,
// with MADV_HUGEPAGE. Why: an O_DIRECT request pins every page of its buffer
// in the kernel, and 4 KiB pages make that 2048 pins per 8 MiB request, CPU
// time taken from whatever computes meanwhile. With transparent huge pages
// ("madvise" or "always" in /sys/kernel/mm/transparent_hugepage/enabled) a
// matmul running beside 8 requests of 8 MiB in flight slowed by 8% instead of
// 13% (dd: 18%) on this project's VM. Own mappings also give the memory back
// to the OS when the buffer is freed (the chunk store's disk buffers come and
// go), where glibc's heap may keep it. Where THP is off the madvise fails
// harmlessly and the buffer is an ordinary mapping.
constexpr int64_t kHugePage = 2 << 20;
std::mutex g_mapped_mu;
std::unordered_map<void*, size_t> g_mapped;  // base -> length of the buffers mapped here

void* map_huge(int64_t size) {
  const size_t len = (size_t)((size + 4095) / 4096 * 4096);
  const size_t span = len + (size_t)kHugePage;
  char* raw = (char*)mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) return nullptr;
  char* base = (char*)(((uintptr_t)raw + kHugePage - 1) & ~(uintptr_t)(kHugePage - 1));
  if (base > raw) munmap(raw, (size_t)(base - raw));
  if (raw + span > base + len) munmap(base + len, (size_t)(raw + span - (base + len)));
#ifdef MADV_HUGEPAGE
  madvise(base, len, MADV_HUGEPAGE);
#endif
  std::lock_guard<std::mutex> lk(g_mapped_mu);
  g_mapped.emplace(base, len);
  return base;
}

}  // namespace

extern "C" {

void* capstan_alloc_aligned(int64_t nbytes, int64_t alignment) {
  if (nbytes <= 0 || alignment < (int64_t)sizeof(void*) || (alignment & (alignment - 1))) return nullptr;
  // Round the size up so the last O_DIRECT block of the buffer is addressable.
  const int64_t size = (nbytes + alignment - 1) / alignment * alignment;
  if (size >= kHugePage && alignment <= kHugePage) {
    if (void* p = map_huge(size)) return p;
  }
  void* p = nullptr;
  if (posix_memalign(&p, (size_t)alignment, (size_t)size) != 0) return nullptr;
  return p;
}

void capstan_free_aligned(void* ptr) {
  if (!ptr) return;
  {
    std::lock_guard<std::mutex> lk(g_mapped_mu);
    auto it = g_mapped.find(ptr);
    if (it != g_mapped.end()) {
      munmap(ptr, it->second);
      g_mapped.erase(it);
      return;
    }
  }
  free(ptr);
}

int capstan_file_open(const char* path, int mode, int direct, int* fd_out, int* direct_out,
                      int* err) {
  if (!path || !fd_out || !direct_out || !err) return CAPSTAN_EINVAL;
  int flags = O_CLOEXEC;
  if (mode == CAPSTAN_OPEN_READ) flags |= O_RDONLY;
  else if (mode == CAPSTAN_OPEN_WRITE) flags |= O_RDWR | O_CREAT;
  else if (mode == CAPSTAN_OPEN_TRUNC) flags |= O_RDWR | O_CREAT | O_TRUNC;
  else return CAPSTAN_EINVAL;
  *err = 0;
  *direct_out = 0;
  int fd = -1;
  if (direct) {
    fd = open(path, flags | O_DIRECT, 0644);
    // EINVAL: the filesystem (tmpfs on older kernels, some FUSE) has no O_DIRECT.
    if (fd >= 0) *direct_out = 1;
    else if (errno != EINVAL) {
      *err = errno;
      return CAPSTAN_EIO;
    }
  }
  if (fd < 0) fd = open(path, flags, 0644);
  if (fd < 0) {
    *err = errno;
    return CAPSTAN_EIO;
  }
  *fd_out = fd;
  return CAPSTAN_OK;
}

int capstan_file_close(int fd, int* err) {
  if (!err) return CAPSTAN_EINVAL;
  *err = 0;
  if (close(fd) != 0) {
    *err = errno;
    return CAPSTAN_EIO;
  }
  return CAPSTAN_OK;
}

int capstan_aio_create(int nthreads, void** engine_out) {
  if (nthreads < 1 || nthreads > 256 || !engine_out) return CAPSTAN_EINVAL;
  auto* e = new Engine();
  for (int i = 0; i < nthreads; ++i) e->threads.emplace_back([e] { e->worker(); });
  *engine_out = e;
  return CAPSTAN_OK;
}

// Finishes every queued request, joins the workers, frees what was never waited for.
int capstan_aio_destroy(void* engine) {
  if (!engine) return CAPSTAN_EINVAL;
  auto* e = (Engine*)engine;
  {
    std::lock_guard<std::mutex> lk(e->mu);
    e->stop = true;
  }
  e->work_cv.notify_all();
  for (auto& t : e->threads) t.join();
  for (auto& kv : e->table) delete kv.second;
  delete e;
  return CAPSTAN_OK;
}

int capstan_aio_submit(void* engine, int fd, int op, void* buf, int64_t nbytes, int64_t offset,
                       int64_t* handle_out) {
  if (!engine || !handle_out || fd < 0 || nbytes < 0 || offset < 0) return CAPSTAN_EINVAL;
  if (op != CAPSTAN_AIO_READ && op != CAPSTAN_AIO_WRITE && op != CAPSTAN_AIO_FSYNC)
    return CAPSTAN_EINVAL;
  if (op != CAPSTAN_AIO_FSYNC && !buf && nbytes > 0) return CAPSTAN_EINVAL;
  auto* e = (Engine*)engine;
  auto* r = new Request();
  r->fd = fd;
  r->op = op;
  r->buf = (char*)buf;
  r->nbytes = nbytes;
  r->offset = offset;
  {
    std::lock_guard<std::mutex> lk(e->mu);
    if (e->stop) {
      delete r;
      return CAPSTAN_EINVAL;
    }
    *handle_out = e->next_id++;
    e->table[*handle_out] = r;
    e->queue.push_back(r);
  }
  e->work_cv.notify_one();
  return CAPSTAN_OK;
}

int capstan_aio_poll(void* engine, int64_t handle, int* done) {
  if (!engine || !done) return CAPSTAN_EINVAL;
  auto* e = (Engine*)engine;
  std::lock_guard<std::mutex> lk(e->mu);
  auto it = e->table.find(handle);
  if (it == e->table.end()) return CAPSTAN_EHANDLE;
  *done = it->second->done ? 1 : 0;
  return CAPSTAN_OK;
}

int capstan_aio_wait(void* engine, int64_t handle, int64_t* done_bytes, int* err) {
  if (!engine || !done_bytes || !err) return CAPSTAN_EINVAL;
  auto* e = (Engine*)engine;
  Request* r;
  {
    std::unique_lock<std::mutex> lk(e->mu);
    auto it = e->table.find(handle);
    if (it == e->table.end() || it->second->claimed) return CAPSTAN_EHANDLE;
    r = it->second;
    r->claimed = true;
    e->done_cv.wait(lk, [&] { return r->done; });
    e->table.erase(handle);  // by key: `it` may be stale after other submits rehashed
  }
  *done_bytes = r->moved;
  *err = r->err;
  const bool short_read = r->short_read;
  delete r;
  if (*err) return CAPSTAN_EIO;
  return short_read ? CAPSTAN_ESHORT : CAPSTAN_OK;
}

}  // extern "C"
