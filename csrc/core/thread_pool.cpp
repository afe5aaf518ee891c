// The persistent thread pool every parallel kernel runs on (parallel_for in qkernels.h), and
// its default size: the physical cores this process may run on.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <functional>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#if defined(__linux__)
#include <sched.h>
#endif

#include "qkernels.h"

namespace pqk {
namespace {

// Worker spin before sleeping, microseconds (POCKET_MLX_SPIN_US, default 50).
static int spin_us() {
  static const int v = [] {
    const char* e = std::getenv("POCKET_MLX_SPIN_US");
    int x = e ? std::atoi(e) : 50;
    return x < 0 ? 0 : x;
  }();
  return v;
}

// Persistent std::thread workers. A job is a number of tasks; tasks are claimed with an atomic
// counter, the calling thread claims tasks too and only waits for tasks already running.
class Pool {
 public:
  ~Pool() { resize(1); }

  int size() {
    std::lock_guard<std::mutex> g(run_mu_);
    return nthreads_;
  }

  void resize(int n) {
    if (n < 1) n = 1;
    std::lock_guard<std::mutex> g(run_mu_);
    if (n == nthreads_) return;
    stop_workers();
    nthreads_ = n;
    stop_ = false;
    for (int i = 0; i < n - 1; i++) workers_.emplace_back([this] { worker_loop(); });
  }

  // Runs fn(0..ntasks-1). Runs inline when the pool is busy (another caller) or single.
  void run(int64_t ntasks, const std::function<void(int64_t)>& fn, bool parallel) {
    if (ntasks <= 0) return;
    std::unique_lock<std::mutex> rl(run_mu_, std::try_to_lock);
    if (!parallel || ntasks == 1 || !rl.owns_lock() || nthreads_ <= 1) {
      if (rl.owns_lock()) rl.unlock();
      for (int64_t i = 0; i < ntasks; i++) fn(i);
      return;
    }
    auto job = std::make_shared<Job>();
    job->fn = &fn;
    job->ntasks = ntasks;
    {
      std::lock_guard<std::mutex> g(mu_);
      job_ = job;
      gen_.fetch_add(1, std::memory_order_release);
    }
    cv_.notify_all();
    work(*job);
    // Wait only for tasks other threads have already claimed.
    int spins = 0;
    while (job->done.load(std::memory_order_acquire) < ntasks) {
      if (++spins > 64) std::this_thread::yield();
    }
    {
      std::lock_guard<std::mutex> g(mu_);
      job_.reset();
    }
    if (job->error) std::rethrow_exception(job->error);
  }

 private:
  struct Job {
    const std::function<void(int64_t)>* fn = nullptr;
    int64_t ntasks = 0;
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
    std::exception_ptr error;
    std::mutex err_mu;
  };

  static void work(Job& job) {
    for (;;) {
      int64_t i = job.next.fetch_add(1, std::memory_order_relaxed);
      if (i >= job.ntasks) return;
      try {
        (*job.fn)(i);
      } catch (...) {
        std::lock_guard<std::mutex> g(job.err_mu);
        if (!job.error) job.error = std::current_exception();
      }
      job.done.fetch_add(1, std::memory_order_release);
    }
  }

  void worker_loop() {
    uint64_t seen = gen_.load(std::memory_order_acquire);
    for (;;) {
      // Spin briefly (decode calls come back-to-back), then sleep. Bounded by time, not by a
      // count (PAUSE takes ~10-140 cycles depending on the core): on a 2-core machine a spinning
      // worker steals the core the caller's graph needs between our calls.
      const auto t0 = std::chrono::steady_clock::now();
      const auto limit = std::chrono::microseconds(spin_us());
      for (int spins = 1; gen_.load(std::memory_order_acquire) == seen && !stop_flag_.load();
           spins++) {
#if defined(__x86_64__)
        __builtin_ia32_pause();
#elif defined(__aarch64__)
        asm volatile("yield");
#endif
        if ((spins & 31) == 0 && std::chrono::steady_clock::now() - t0 > limit) break;
      }
      std::shared_ptr<Job> job;
      {
        std::unique_lock<std::mutex> g(mu_);
        cv_.wait(g, [&] { return stop_ || gen_.load(std::memory_order_acquire) != seen; });
        if (stop_) return;
        seen = gen_.load(std::memory_order_acquire);
        job = job_;
      }
      if (job) work(*job);
    }
  }

  void stop_workers() {
    {
      std::lock_guard<std::mutex> g(mu_);
      stop_ = true;
      stop_flag_.store(true);
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
    workers_.clear();
    stop_flag_.store(false);
  }

  std::mutex run_mu_;  // one job at a time; also guards resizing
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::thread> workers_;
  std::shared_ptr<Job> job_;
  std::atomic<uint64_t> gen_{0};
  std::atomic<bool> stop_flag_{false};
  bool stop_ = false;
  int nthreads_ = 1;
};

static Pool& pool() {
  static Pool* p = [] {
    Pool* q = new Pool();  // intentionally leaked: no joins during static destruction
    int n = default_threads();
    if (const char* env = std::getenv("POCKET_MLX_THREADS")) {
      int e = std::atoi(env);
      if (e > 0) n = e;
    }
    q->resize(n);
    return q;
  }();
  return *p;
}

}  // namespace

int default_threads() {
  int hw = (int)std::thread::hardware_concurrency();
  if (hw <= 0) hw = 1;
  int cores = 0;
#if defined(__linux__)
  // Physical cores: distinct (package, core) pairs among the CPUs we may run on.
  cpu_set_t set;
  CPU_ZERO(&set);
  bool have_aff = sched_getaffinity(0, sizeof(set), &set) == 0;
  std::set<std::pair<int, int>> seen;
  for (int c = 0; c < 1024; c++) {
    if (have_aff && !CPU_ISSET(c, &set)) continue;
    std::string base = "/sys/devices/system/cpu/cpu" + std::to_string(c) + "/topology/";
    std::ifstream fc(base + "core_id"), fp(base + "physical_package_id");
    int core = -1, pkg = -1;
    if (!(fc >> core)) {
      if (c > hw + 64) break;
      continue;
    }
    fp >> pkg;
    seen.insert({pkg, core});
  }
  cores = (int)seen.size();
  if (have_aff) hw = std::min(hw, (int)CPU_COUNT(&set));
#endif
  if (cores <= 0) cores = hw;
  return std::max(1, std::min(cores, hw));
}

void set_threads(int n) { pool().resize(n <= 0 ? default_threads() : n); }

void parallel_for(int64_t n, bool single, const std::function<void(int64_t)>& fn) {
  pool().run(n, fn, !single);
}
int get_threads() { return pool().size(); }

}  // namespace pqk
