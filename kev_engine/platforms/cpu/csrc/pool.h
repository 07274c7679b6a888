// Kev's kernels' threads: each call's tasks handed out one at a time to whichever thread is free.
//
// Why not torch's pool (at::parallel_for, OpenMP underneath): it gives each thread an equal share
// and every call ends in a barrier that waits for all of them. On a machine where another program
// takes a core — a laptop with a browser, a desktop with an IDE — the thread on that core is
// descheduled for milliseconds at a time, and every one of a pass's hundreds of calls waits for it:
// two threads on two cores with one core busy ran three times slower than idle, slower than one
// thread alone. Here a call's tasks are claimed from a counter, the calling thread claims them too,
// and the call returns once every task is done: a thread that is late takes less of the work or
// none, and nobody waits for a thread that never started. Each task is computed whole by the one
// thread that claimed it, in its one order, so which thread runs it changes no bit.
//
// The workers wait a few microseconds for the next call, then sleep. The pool has the engine's
// `threads` (set_threads; else torch's intra-op count), the caller included. A call made while
// another thread's call runs, or from inside a task, runs its tasks on its own thread. After a
// fork the child starts a pool of its own (the parent's workers do not exist there; a call would
// complete without them, the caller claiming every task, but a mutex a worker held would not).
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace kev {

// The pool's threads, the caller included: set_threads' count, else torch's intra-op count.
inline std::atomic<int>& thread_setting() {
  static std::atomic<int> threads{0};
  return threads;
}

inline int pool_threads() {
  const int set = thread_setting().load(std::memory_order_relaxed);
  return set > 0 ? set : std::max(1, at::get_num_threads());
}

// Tasks a call is cut into per thread where their size is the kernel's to choose: enough that a
// thread whose core another program takes can leave its share to the others.
constexpr int64_t kTasksPerThread = 2;

// Kev's kernels on `threads` threads from now on (0: torch's count, read at each call).
inline void set_threads(int64_t threads) {
  TORCH_CHECK(threads >= 0, "set_threads: ", threads, " threads");
  thread_setting().store(static_cast<int>(threads), std::memory_order_relaxed);
}

inline void relax() {
#if defined(__x86_64__)
  _mm_pause();
#else
  std::this_thread::yield();
#endif
}

class Pool {
 public:
  using Task = std::function<void(int64_t)>;

  // The process's pool (a new one in a forked child).
  static Pool& get() {
    static const bool registered = [] {
      pthread_atfork(nullptr, nullptr, [] { slot().store(new Pool(), std::memory_order_release); });  // the old one leaks
      return true;
    }();
    (void)registered;
    Pool* pool = slot().load(std::memory_order_acquire);
    if (pool == nullptr) {
      Pool* fresh = new Pool();  // never destroyed: its workers run until the process ends
      if (slot().compare_exchange_strong(pool, fresh)) return *fresh;
      delete fresh;
    }
    return *pool;
  }

  // fn(0) .. fn(n - 1), each once, on this thread and the pool's; returns when every one is done,
  // rethrowing the first exception a task raised.
  void run(int64_t n, const Task& fn) {
    const int threads = pool_threads();
    if (n <= 0) return;
    std::unique_lock<std::mutex> alone(run_mutex_, std::try_to_lock);
    if (n == 1 || threads == 1 || in_task() || !alone.owns_lock()) {
      for (int64_t i = 0; i < n; ++i) fn(i);
      return;
    }
    auto job = std::make_shared<Job>(&fn, n);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      while (started_ < threads - 1) std::thread([this, index = started_++] { loop(index); }).detach();
      wanted_.store(threads - 1, std::memory_order_relaxed);
      job_ = job;
      generation_.fetch_add(1, std::memory_order_release);
    }
    if (sleeping_.load(std::memory_order_acquire) > 0) wake_.notify_all();
    work(*job);
    for (int spins = 0; job->done.load(std::memory_order_acquire) < n; ++spins) {
      if (spins < 4096) relax(); else std::this_thread::yield();  // a task claimed by a descheduled thread
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      job_.reset();
    }
    if (job->error) std::rethrow_exception(job->error);
  }

 private:
  struct Job {
    Job(const Task* f, int64_t count) : fn(f), n(count) {}
    const Task* fn;  // called only for a claimed index below n: while the caller still waits
    int64_t n;
    std::atomic<int64_t> next{0}, done{0};
    std::mutex error_mutex;
    std::exception_ptr error;
  };

  static std::atomic<Pool*>& slot() {
    static std::atomic<Pool*> pool{nullptr};
    return pool;
  }

  static bool& in_task() {
    static thread_local bool inside = false;
    return inside;
  }

  static void work(Job& job) {
    in_task() = true;
    for (int64_t i = job.next.fetch_add(1); i < job.n; i = job.next.fetch_add(1)) {
      try {
        (*job.fn)(i);
      } catch (...) {
        std::lock_guard<std::mutex> lock(job.error_mutex);
        if (!job.error) job.error = std::current_exception();
      }
      job.done.fetch_add(1, std::memory_order_release);
    }
    in_task() = false;
  }

  void loop(int index) {
    uint64_t seen = 0;
    for (;;) {
      int spins = 0;
      while (generation_.load(std::memory_order_acquire) == seen && ++spins < kSpins) relax();
      if (generation_.load(std::memory_order_acquire) == seen) {
        std::unique_lock<std::mutex> lock(mutex_);
        sleeping_.fetch_add(1);
        wake_.wait(lock, [&] { return generation_.load(std::memory_order_acquire) != seen; });
        sleeping_.fetch_sub(1);
      }
      std::shared_ptr<Job> job;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        seen = generation_.load(std::memory_order_acquire);
        if (index < wanted_.load(std::memory_order_relaxed)) job = job_;
      }
      if (job) work(*job);
    }
  }

  // Pauses a worker waits for the next call before it sleeps: microseconds, not OpenMP's longer
  // spin. A worker spinning on a core another program wants spends the time slice that would have
  // let it finish its next task undisturbed; a longer spin measured slower under load and no
  // faster idle (docs/benchmarks.md, "Sharing the machine").
  static constexpr int kSpins = 256;

  std::mutex run_mutex_;  // one call at a time uses the workers
  std::mutex mutex_;      // job_, started_, the sleepers' wake-up
  std::condition_variable wake_;
  std::shared_ptr<Job> job_;
  std::atomic<uint64_t> generation_{0};  // one more for each call's job
  std::atomic<int> sleeping_{0};
  std::atomic<int> wanted_{0};  // workers that take jobs: the pool's threads less the caller
  int started_ = 0;             // workers running loop()
};

// parallel_for's grain over units of `unit` elements each (rows of a width, heads of tokens x dim):
// enough units that a task holds about `elements`, so a decode step's few rows stay on the calling
// thread, where a call to the pool would cost more than their work.
inline int64_t grain_for(int64_t unit, int64_t elements = 16384) {
  return std::max<int64_t>(1, elements / std::max<int64_t>(unit, 1));
}

// at::parallel_for's contract — f(b, e) over consecutive ranges covering [begin, end), none
// shorter than `grain` but the last — on Kev's pool: the range in several chunks per thread, so
// a thread whose core is taken computes fewer of them.
template <typename F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  const int64_t range = end - begin;
  if (range <= 0) return;
  const int64_t threads = pool_threads();
  const int64_t chunk = std::max<int64_t>(std::max<int64_t>(grain, 1),
                                          (range + threads * kTasksPerThread - 1) / (threads * kTasksPerThread));
  const int64_t chunks = (range + chunk - 1) / chunk;
  Pool::get().run(chunks, [&](int64_t i) {
    const int64_t b = begin + i * chunk;
    f(b, std::min(end, b + chunk));
  });
}

// One call of f per thread of the pool at most (a thread that comes late may make none): for
// kernels whose threads each set up their buffers once, then claim work from a counter of their own.
template <typename F>
void on_threads(const F& f) {
  Pool::get().run(pool_threads(), [&](int64_t) { f(); });
}

}  // namespace kev
