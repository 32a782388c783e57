// The CPU kernels' thread pool: parallel_for over chunks that threads claim, the caller first.
//
// ATen's parallel_for (OpenMP) splits a loop into one fixed part per thread and waits for all of
// them at its end. When another program keeps a core busy, the part of a thread the OS has not
// scheduled waits a whole time slice (milliseconds) and a decode step of ~200 parallel loops
// collapses: beside a second torch process on a 2-core machine, 30 layers' linears that take 9 ms
// on 1 thread took 13 ms on 2, and once 936 ms.
// Here the loop is cut into two chunks per thread and every thread, the caller included, claims
// the next unclaimed chunk: a thread that is not running claims none and the others do its share;
// the caller only waits for chunks already being worked on. Idle workers spin briefly (loops of a
// decode step follow each other within microseconds), then sleep, so they give a busy core back.
//
// A chunk's rows are computed by the same code whatever thread runs them, so results do not depend
// on the split. The thread count is torch's (at::get_num_threads): torch.set_num_threads rules both.
#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <pthread.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>

namespace rosechat {

class Pool {
 public:
  using Body = void (*)(const void* f, int64_t begin, int64_t end);

  static Pool& instance() {
    static Pool* pool = new Pool;  // never destroyed: workers may still sleep in it at exit
    return *pool;
  }

  // Runs body(f, b, e) over [begin, end) in chunks of `step`; false if the pool is busy (another
  // thread's loop, or a loop nested in one of ours): the caller then runs the loop itself.
  bool run(int64_t begin, int64_t end, int64_t step, int64_t chunks, int threads, Body body, const void* f) {
    if (in_loop_) return false;
    std::unique_lock<std::mutex> lock(mutex_, std::try_to_lock);
    if (!lock.owns_lock()) return false;
    while (workers_ < threads - 1) {
      std::thread t(&Pool::worker, this, workers_++);
      // named here, not by the thread itself: a thread the OS has not run yet already shows as a worker
      pthread_setname_np(t.native_handle(), "rosechat-cpu");  // for top -H and the tests
      t.detach();
    }
    in_loop_ = true;
    body_ = body, f_ = f, begin_ = begin, end_ = end, step_ = step;
    error_ = nullptr;
    workers_wanted_.store(threads - 1, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    const uint32_t gen = ++gen_counter_;
    state_.store(pack(gen, 0, chunks), std::memory_order_release);  // publishes the fields above
    generation_.store(gen, std::memory_order_release);
    generation_.notify_all();
    work(gen);
    // Chunks other threads claimed: spin while they are short, then sleep so a busy machine can
    // run the thread that holds one (it may be waiting for this core).
    const auto spin_end = std::chrono::steady_clock::now() + kCallerSpin;
    for (uint32_t d; (d = done_.load(std::memory_order_acquire)) < chunks;) {
      if (std::chrono::steady_clock::now() < spin_end)
        _mm_pause();
      else
        done_.wait(d, std::memory_order_acquire);
    }
    in_loop_ = false;
    if (error_) std::rethrow_exception(error_);
    return true;
  }

 private:
  // Waking a sleeping thread takes ~10 us, up to milliseconds on a busy machine: workers spin
  // through a decode step's loops (microseconds apart) and sleep between steps, when a spinning
  // thread would only take CPU from the others; the caller spins longer than a chunk lasts, then
  // sleeps so its core can take a descheduled worker.
  static constexpr auto kWorkerSpin = std::chrono::microseconds(50);
  static constexpr auto kCallerSpin = std::chrono::microseconds(200);

  // state_: generation (32 bits) | next chunk to claim (16) | chunk count (16). A claim succeeds only
  // while its generation is current and chunks are left, so a late worker never touches a newer loop
  // whose fields it has not synchronised with: the fields are read after the claim.
  static uint64_t pack(uint32_t gen, uint32_t next, uint32_t chunks) {
    return (uint64_t{gen} << 32) | (uint64_t{next} << 16) | chunks;
  }

  // Claims and runs chunks of loop `gen` until none are left.
  void work(uint32_t gen) {
    uint64_t s = state_.load(std::memory_order_acquire);
    for (;;) {
      const uint32_t next = (s >> 16) & 0xffff, chunks = s & 0xffff;
      if ((s >> 32) != gen || next >= chunks) return;
      if (!state_.compare_exchange_weak(s, s + (1u << 16), std::memory_order_acq_rel, std::memory_order_acquire))
        continue;
      const int64_t b = begin_ + next * step_, e = std::min(end_, b + step_);
      try {
        body_(f_, b, e);
      } catch (...) {
        std::lock_guard<std::mutex> guard(error_mutex_);
        if (!error_) error_ = std::current_exception();
      }
      if (done_.fetch_add(1, std::memory_order_acq_rel) + 1 == chunks) done_.notify_one();
      s = state_.load(std::memory_order_acquire);
    }
  }

  void worker(int index) {
    in_loop_ = true;  // a loop inside a chunk runs serially
    uint32_t seen = generation_.load(std::memory_order_acquire);
    for (;;) {
      const auto spin_end = std::chrono::steady_clock::now() + kWorkerSpin;
      uint32_t gen;
      while ((gen = generation_.load(std::memory_order_acquire)) == seen) {
        if (std::chrono::steady_clock::now() < spin_end)
          _mm_pause();
        else
          generation_.wait(seen, std::memory_order_acquire);
      }
      seen = gen;
      if (index < workers_wanted_.load(std::memory_order_relaxed)) work(gen);
    }
  }

  std::mutex mutex_;  // one loop at a time
  int workers_ = 0;  // started on demand, never stopped
  std::atomic<int> workers_wanted_{0};
  uint32_t gen_counter_ = 0;
  std::atomic<uint64_t> state_{0};
  std::atomic<uint32_t> generation_{0};  // what idle workers wait on (a futex word)
  std::atomic<uint32_t> done_{0};
  Body body_ = nullptr;
  const void* f_ = nullptr;
  int64_t begin_ = 0, end_ = 0, step_ = 1;
  std::mutex error_mutex_;
  std::exception_ptr error_;
  static inline thread_local bool in_loop_ = false;
};

// f(b, e) over [begin, end) in parts of at least `grain` (multiples of it), like at::parallel_for.
// `per_thread`: chunks a thread (at most; every grain its own where there are fewer grains than that)
template <typename F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f, int64_t per_thread = 2) {
  const int64_t n = end - begin;
  if (n <= 0) return;
  const int threads = at::get_num_threads();
  const int64_t grains = (n + grain - 1) / grain;
  // two chunks a thread: the others can take over an absent thread's share, and each chunk streams
  // through contiguous weights (every chunk start restarts the prefetchers on a decode's weights read
  // from RAM: four a thread cost 0.1 ms a step at one sequence and 1 ms at eight, eight more still)
  const int64_t wanted = std::min<int64_t>({grains, per_thread * threads, 0xffff});
  if (threads > 1 && wanted > 1) {
    const int64_t step = (grains + wanted - 1) / wanted * grain;  // whole grains; the last chunk may be short
    const auto body = [](const void* p, int64_t b, int64_t e) { (*static_cast<const F*>(p))(b, e); };
    if (Pool::instance().run(begin, end, step, (n + step - 1) / step, threads, body, &f)) return;
  }
  f(begin, end);
}

}  // namespace rosechat
