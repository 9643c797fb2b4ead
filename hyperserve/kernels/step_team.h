// The threads of one decode step (StepTeam), for cpu_ops.cpp: included once, into its translation unit.
//
// A decode step runs ~200 parallel operations (projections, attention) of tens of microseconds each.
// As OpenMP regions with fixed halves, each one waits at its end for its slowest thread: when the
// server's event loop or its client takes a core for a moment (on two cores they must), every
// operation in that moment waits for the thread it displaced. A StepTeam keeps the step's threads in
// one region and splits each operation into pieces. Each thread owns a contiguous run of them and
// takes them from its front, so its weights still stream in order; a thread that runs out takes
// pieces from the back of another's run. A thread that is descheduled before it takes a piece holds
// nobody up: the others do its share.

#pragma once

#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <utility>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

inline void spin_pause() {
#if defined(__x86_64__)
  _mm_pause();
#endif
}

class StepTeam {
 public:
  explicit StepTeam(int threads) : threads_(std::min(threads, kMaxThreads)) {}

  // The team of the calling thread's step, if it is the step's first thread.
  static StepTeam*& active() {
    thread_local StepTeam* team = nullptr;
    return team;
  }

  // fn(lo, hi) over [begin, end) in pieces of about `grain` or more, on the team; from thread 0 only.
  template <typename F>
  void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& fn) {
    const int64_t size = end - begin;
    const int64_t pieces = std::min<int64_t>({(size + grain - 1) / std::max<int64_t>(grain, 1),
                                              kPiecesPerThread * threads_, kMaxPieces});
    if (pieces <= 1) {
      if (size > 0) fn(begin, end);
      return;
    }
    body_ = [](const void* f, int64_t lo, int64_t hi) { (*static_cast<const F*>(f))(lo, hi); };
    context_ = &fn;
    begin_ = begin, size_ = size, pieces_ = pieces;
    remaining_.store(pieces, std::memory_order_relaxed);
    uint64_t generation = ++generation_ & kField16;
    if (generation == 0) generation = ++generation_ & kField16;  // 0 is what a thread has seen before any
    for (int t = 0; t < threads_; ++t) {  // releases the fields above to whoever claims a piece
      runs_[t].word.store(pack(generation, pieces * t / threads_, pieces * (t + 1) / threads_),
                          std::memory_order_release);
    }
    work(0, generation);
    while (remaining_.load(std::memory_order_acquire) != 0) spin_pause();
    if (failed_.load(std::memory_order_acquire)) {
      failed_.store(false, std::memory_order_relaxed);
      std::rethrow_exception(std::exchange(error_, nullptr));
    }
  }

  // Threads 1.. of the region: work on each operation as it is published, until stop().
  void serve(int thread) {
    if (thread >= threads_) return;
    uint64_t seen = 0;
    while (true) {
      uint64_t word;
      while (generation_of(word = runs_[thread].word.load(std::memory_order_acquire)) == seen) {
        if (stopped_.load(std::memory_order_acquire)) return;
        spin_pause();
      }
      seen = generation_of(word);
      work(thread, seen);
    }
  }

  void stop() { stopped_.store(true, std::memory_order_release); }

 private:
  static constexpr int kMaxThreads = 64;
  static constexpr int64_t kPiecesPerThread = 8;
  static constexpr int64_t kMaxPieces = (int64_t{1} << 24) - 1;
  static constexpr uint64_t kField16 = 0xFFFF, kField24 = 0xFFFFFF;

  // A thread's run of pieces [first, last) of the operation `generation`, in one word.
  static uint64_t pack(uint64_t generation, int64_t first, int64_t last) {
    return generation << 48 | static_cast<uint64_t>(first) << 24 | static_cast<uint64_t>(last);
  }
  static uint64_t generation_of(uint64_t word) { return word >> 48; }
  static int64_t first_of(uint64_t word) { return static_cast<int64_t>(word >> 24 & kField24); }
  static int64_t last_of(uint64_t word) { return static_cast<int64_t>(word & kField24); }

  // Takes the front piece of `owner`'s run (or its back), if that run is still of `generation`.
  int64_t take(int owner, uint64_t generation, bool front) {
    std::atomic<uint64_t>& run = runs_[owner].word;
    uint64_t word = run.load(std::memory_order_acquire);
    while (generation_of(word) == generation && first_of(word) < last_of(word)) {
      const int64_t first = first_of(word), last = last_of(word);
      const uint64_t taken = front ? pack(generation, first + 1, last) : pack(generation, first, last - 1);
      if (run.compare_exchange_weak(word, taken, std::memory_order_acq_rel, std::memory_order_acquire)) {
        return front ? first : last - 1;
      }
    }
    return -1;
  }

  // The operation's fields stay as they are while any of its pieces is unfinished, so a thread that
  // took a piece reads them safely.
  void run_piece(int64_t piece) {
    try {
      body_(context_, begin_ + size_ * piece / pieces_, begin_ + size_ * (piece + 1) / pieces_);
    } catch (...) {
      if (!failed_.exchange(true, std::memory_order_acq_rel)) error_ = std::current_exception();
    }
    remaining_.fetch_sub(1, std::memory_order_release);
  }

  void work(int thread, uint64_t generation) {
    for (int64_t piece; (piece = take(thread, generation, true)) >= 0;) run_piece(piece);
    for (int k = 1; k < threads_; ++k) {
      for (int64_t piece; (piece = take((thread + k) % threads_, generation, false)) >= 0;) run_piece(piece);
    }
  }

  struct alignas(64) Run {
    std::atomic<uint64_t> word{0};
  };

  const int threads_;
  Run runs_[kMaxThreads];
  uint64_t generation_ = 0;  // thread 0's count of operations
  void (*body_)(const void*, int64_t, int64_t) = nullptr;
  const void* context_ = nullptr;
  int64_t begin_ = 0, size_ = 0, pieces_ = 0;
  alignas(64) std::atomic<int64_t> remaining_{0};
  std::atomic<bool> failed_{false}, stopped_{false};
  std::exception_ptr error_;
};

// Rows per piece of a step's row-wise work (norms, residual adds, SiLU, rotary): a verify step's
// k + 1 rows or a prefill chunk's are split over the threads, a decode step's few stay on the
// calling thread, for which a hand-off would cost more than it saves.
constexpr int64_t kRowGrain = 4;

// fn(first, count) over [0, size) in `parts` runs whose sizes differ by one at most.
template <typename F>
void for_each_even_part(int64_t size, int64_t parts, const F& fn) {
  for (int64_t p = 0, first = 0; p < parts; first += (size + p) / parts, ++p) fn(first, (size + p) / parts);
}

// at::parallel_for, or the step's team when the calling thread leads one.
template <typename F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& fn) {
  if (StepTeam* team = StepTeam::active()) return team->parallel_for(begin, end, grain, fn);
  at::parallel_for(begin, end, grain, fn);
}

// Runs step(): with a StepTeam of at::get_num_threads() threads in one OpenMP region where there are
// several, so every parallel_for inside it uses the team.
template <typename F>
void run_step(const F& step) {
  const int threads = at::get_num_threads();
  if (threads <= 1 || at::in_parallel_region() || StepTeam::active() != nullptr) return step();
  StepTeam team(threads);
  std::exception_ptr error;
#pragma omp parallel num_threads(threads)
  {
    if (omp_get_thread_num() == 0) {
      StepTeam::active() = &team;
      try {
        step();
      } catch (...) {
        error = std::current_exception();
      }
      StepTeam::active() = nullptr;
      team.stop();
    } else {
      team.serve(omp_get_thread_num());
    }
  }
  if (error) std::rethrow_exception(error);
}

}  // namespace
