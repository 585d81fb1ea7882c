// Persistent thread pool for the CPU kernels.
//
// Workers are created once (size from capstan_set_num_threads, which the
// Python loader calls with torch.get_num_threads() or CAPSTAN_NATIVE_THREADS)
// and sleep on a condition variable between jobs, so a kernel call costs a
// wake-up rather than thread creation. The calling thread works too. One job
// runs at a time: ctypes releases the GIL, so two Python threads may call in
// concurrently, and they queue on submit_mu.
//
// The pool object is heap-allocated and never destroyed: joining threads from
// a static destructor at process exit can deadlock or std::terminate. After
// fork() only the forking thread exists in the child, so the child drops
// (leaks) the old pool and builds a fresh one on its next call.
#include <pthread.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

#include "internal.h"

namespace capstan {
namespace {

struct Pool {
  std::mutex submit_mu;  // one job at a time
  std::mutex mu;
  std::condition_variable start_cv, done_cv;
  std::vector<std::thread> workers;
  uint64_t generation = 0;
  bool stop = false;
  // Current job.
  RangeFn fn = nullptr;
  void* ctx = nullptr;
  int64_t n = 0, chunk_len = 0;
  int nchunks = 0;
  std::atomic<int> next{0};
  int remaining = 0;  // chunks not finished, guarded by mu
  // Workers inside run_chunks, guarded by mu. A new job waits for 0 before
  // overwriting the job fields, so a worker that woke late for the previous
  // job never reads half-written state.
  int active = 0;

  void run_chunks() {
    for (;;) {
      int c = next.fetch_add(1);
      if (c >= nchunks) return;
      int64_t b = (int64_t)c * chunk_len;
      int64_t e = b + chunk_len < n ? b + chunk_len : n;
      fn(ctx, b, e, c);
      std::lock_guard<std::mutex> lk(mu);
      if (--remaining == 0) done_cv.notify_all();
    }
  }

  void worker_main() {
    uint64_t seen = 0;
    for (;;) {
      {
        std::unique_lock<std::mutex> lk(mu);
        start_cv.wait(lk, [&] { return stop || generation != seen; });
        if (stop) return;
        seen = generation;
        ++active;
      }
      run_chunks();
      std::lock_guard<std::mutex> lk(mu);
      if (--active == 0) done_cv.notify_all();
    }
  }

  void start(int nthreads) {
    stop = false;
    for (int i = 1; i < nthreads; ++i) workers.emplace_back([this] { worker_main(); });
  }

  void shutdown() {
    {
      std::lock_guard<std::mutex> lk(mu);
      stop = true;
    }
    start_cv.notify_all();
    for (auto& t : workers) t.join();
    workers.clear();
  }
};

Pool* g_pool = nullptr;
int g_size = 0;
std::mutex g_pool_mu;  // guards g_pool creation and resizing

void after_fork_child() {
  // The workers do not exist in the child; the mutexes may be held by them.
  g_pool = nullptr;
  new (&g_pool_mu) std::mutex();
}

int default_size() {
  unsigned hc = std::thread::hardware_concurrency();
  return hc ? (int)hc : 1;
}

Pool* get_pool() {
  std::lock_guard<std::mutex> lk(g_pool_mu);
  if (!g_pool) {
    static std::once_flag fork_once;
    std::call_once(fork_once, [] { pthread_atfork(nullptr, nullptr, after_fork_child); });
    if (g_size <= 0) g_size = default_size();
    g_pool = new Pool();
    g_pool->start(g_size);
  }
  return g_pool;
}

}  // namespace

int pool_size() {
  std::lock_guard<std::mutex> lk(g_pool_mu);
  return g_size > 0 ? g_size : default_size();
}

void pool_resize(int n) {
  if (n < 1) n = 1;
  Pool* old = nullptr;
  {
    std::lock_guard<std::mutex> lk(g_pool_mu);
    if (n == g_size && g_pool) return;
    g_size = n;
    old = g_pool;
    g_pool = nullptr;
  }
  if (old) {
    {
      // Wait for a running job, then retire the old workers. The guard must be
      // released before `delete old`: unlocking a mutex inside freed memory
      // corrupts the heap (seen as malloc aborts far away, in torch).
      std::lock_guard<std::mutex> job(old->submit_mu);
      old->shutdown();
    }
    delete old;
  }
}

int parallel_for(int64_t n, int64_t grain, RangeFn fn, void* ctx) {
  if (n <= 0) return 0;
  if (grain < 1) grain = 1;
  int size = pool_size();
  int64_t want = n / grain;
  int nchunks = (int)(want < size ? (want < 1 ? 1 : want) : size);
  if (nchunks == 1) {
    fn(ctx, 0, n, 0);
    return 1;
  }
  int64_t len = (n + nchunks - 1) / nchunks;
  len = (len + 63) / 64 * 64;
  nchunks = (int)((n + len - 1) / len);
  Pool* pool = get_pool();
  std::lock_guard<std::mutex> job(pool->submit_mu);
  {
    std::unique_lock<std::mutex> lk(pool->mu);
    pool->done_cv.wait(lk, [&] { return pool->active == 0; });
    pool->fn = fn;
    pool->ctx = ctx;
    pool->n = n;
    pool->chunk_len = len;
    pool->nchunks = nchunks;
    pool->next.store(0);
    pool->remaining = nchunks;
    ++pool->generation;
  }
  pool->start_cv.notify_all();
  pool->run_chunks();
  std::unique_lock<std::mutex> lk(pool->mu);
  pool->done_cv.wait(lk, [&] { return pool->remaining == 0; });
  return nchunks;
}

}  // namespace capstan
