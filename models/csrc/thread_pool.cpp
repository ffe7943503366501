#include "thread_pool.h"

#include <immintrin.h>
#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace adaspec {
namespace {

constexpr auto SPIN = std::chrono::microseconds(50);  // a step's kernels come closer together than this
constexpr int64_t CHUNKS_PER_THREAD = 4;  // chunks of a job: at most 65535 (16 bits of the ticket)

thread_local bool in_job = false;

class Pool {
 public:
  explicit Pool(int threads) : threads_(std::max(1, threads)) {
    for (int i = 1; i < threads_; ++i) workers_.emplace_back([this] { work_loop(); });
  }

  // Ends the workers once the running job is done; the pool then runs every job on its caller.
  void stop() {
    std::lock_guard<std::mutex> busy(busy_);
    {
      std::lock_guard<std::mutex> lock(sleep_mutex_);
      stop_.store(true);
    }
    ticket_.fetch_add(uint64_t(1) << 32, std::memory_order_release);
    wake_.notify_all();
    for (auto& t : workers_) t.join();
    workers_.clear();
  }

  int threads() const { return threads_; }

  // false when the pool is taken (the caller then runs the job itself).
  bool run(int64_t begin, int64_t end, int64_t chunk, int64_t chunks, const std::function<void(int64_t, int64_t)>& fn) {
    std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
    if (!busy.owns_lock()) return false;
    fn_ = &fn;
    begin_ = begin, end_ = end, chunk_ = chunk;
    error_ = nullptr;
    done_.store(0, std::memory_order_relaxed);
    const uint64_t gen = (ticket_.load(std::memory_order_relaxed) >> 32) + 1;
    ticket_.store((gen << 32) | (uint64_t(chunks) << 16), std::memory_order_release);  // publishes the job
    if (sleeping_.load(std::memory_order_acquire) > 0) {
      std::lock_guard<std::mutex> lock(sleep_mutex_);
      wake_.notify_all();
    }
    claim_all(gen);
    while (done_.load(std::memory_order_acquire) < chunks) _mm_pause();
    fn_ = nullptr;
    if (error_) std::rethrow_exception(error_);
    return true;
  }

 private:
  // Claims and runs chunks of job `gen` until none is left (or another job has begun). The
  // claim is decided on the ticket alone: a successful exchange from (gen, chunks, c < chunks)
  // proves job gen is still running (its chunk c was unclaimed), so its fields are current.
  void claim_all(uint64_t gen) {
    uint64_t t = ticket_.load(std::memory_order_acquire);
    while ((t >> 32) == gen && (t & 0xffffu) < ((t >> 16) & 0xffffu)) {
      if (!ticket_.compare_exchange_weak(t, t + 1, std::memory_order_acq_rel)) continue;
      const int64_t c = int64_t(t & 0xffffu);
      const int64_t lo = begin_ + c * chunk_, hi = std::min(end_, lo + chunk_);
      try {
        in_job = true;
        (*fn_)(lo, hi);
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mutex_);
        if (!error_) error_ = std::current_exception();
      }
      in_job = false;
      done_.fetch_add(1, std::memory_order_release);
      t = ticket_.load(std::memory_order_acquire);
    }
  }

  void work_loop() {
    uint64_t seen = ticket_.load(std::memory_order_acquire) >> 32;
    while (true) {
      uint64_t gen = ticket_.load(std::memory_order_acquire) >> 32;
      const auto until = std::chrono::steady_clock::now() + SPIN;
      for (int i = 0; gen == seen; ++i) {
        _mm_pause();
        if ((i & 63) == 63 && std::chrono::steady_clock::now() > until) break;
        gen = ticket_.load(std::memory_order_acquire) >> 32;
      }
      if (gen == seen) {
        std::unique_lock<std::mutex> lock(sleep_mutex_);
        sleeping_.fetch_add(1, std::memory_order_acq_rel);
        wake_.wait(lock, [&] { return stop_.load() || (ticket_.load(std::memory_order_acquire) >> 32) != seen; });
        sleeping_.fetch_sub(1, std::memory_order_acq_rel);
        gen = ticket_.load(std::memory_order_acquire) >> 32;
      }
      if (stop_.load()) return;
      seen = gen;
      claim_all(gen);
    }
  }

  const int threads_;
  std::vector<std::thread> workers_;
  std::mutex busy_;
  // ticket: job generation (high 32 bits), its number of chunks (16 bits) and the next
  // unclaimed chunk (low 16 bits).
  std::atomic<uint64_t> ticket_{0};
  std::atomic<int64_t> done_{0};
  std::atomic<int> sleeping_{0};
  std::mutex sleep_mutex_, error_mutex_;
  std::condition_variable wake_;
  std::atomic<bool> stop_{false};
  const std::function<void(int64_t, int64_t)>* fn_ = nullptr;
  int64_t begin_ = 0, end_ = 0, chunk_ = 1;
  std::exception_ptr error_;
};

std::mutex pool_mutex;
Pool* pool = nullptr;  // replaced on resize (the old one stopped, not freed: a caller may hold it)
int wanted = 0;        // 0: not set yet, std::thread::hardware_concurrency()

void forget_pool_in_child() { pool = nullptr; }  // a forked child has none of the workers

Pool* current() {
  Pool* p = __atomic_load_n(&pool, __ATOMIC_ACQUIRE);
  if (p) return p;
  std::lock_guard<std::mutex> lock(pool_mutex);
  if (!pool) {
    static bool registered = (pthread_atfork(nullptr, nullptr, forget_pool_in_child), true);
    (void)registered;
    const int n = wanted ? wanted : int(std::max(1u, std::thread::hardware_concurrency()));
    __atomic_store_n(&pool, new Pool(n), __ATOMIC_RELEASE);
  }
  return pool;
}

}  // namespace

void set_num_threads(int n) {
  std::lock_guard<std::mutex> lock(pool_mutex);
  wanted = std::max(1, n);
  if (pool && pool->threads() == wanted) return;
  Pool* old = pool;
  __atomic_store_n(&pool, new Pool(wanted), __ATOMIC_RELEASE);
  if (old) old->stop();
}

int get_num_threads() { return current()->threads(); }

void parallel_for(int64_t begin, int64_t end, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
  if (begin >= end) return;
  const int64_t n = end - begin;
  Pool* p = in_job ? nullptr : current();
  if (p && p->threads() > 1) {
    const int64_t g = std::max<int64_t>(grain, 1);
    const int64_t want = std::min<int64_t>((n + g - 1) / g, p->threads() * CHUNKS_PER_THREAD);
    const int64_t chunk = (n + want - 1) / want, chunks = (n + chunk - 1) / chunk;
    if (chunks > 1 && p->run(begin, end, chunk, chunks, fn)) return;
  }
  fn(begin, end);
}

}  // namespace adaspec
