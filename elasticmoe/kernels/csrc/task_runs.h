// How a kernel's tasks are shared among its OpenMP threads.
//
// Each thread owns one contiguous run of tasks of about equal cost, so it streams one
// contiguous stretch of the weights and the hardware prefetchers keep up: tasks handed out 4 at
// a time made the threads interleave and read at ~35 of the machine's ~87 GB/s in decode (the
// experts of 8 layers, 2 threads: 5.5 -> 3.4 ms per step of 8 layers at 2 rows per expert). A
// thread done with its run (the other was preempted, or the costs misjudged) takes tasks from
// the other runs, claimed one by one.
#pragma once

#include <atomic>
#include <cstdint>
#include <vector>

namespace emoe {

class TaskRuns {
 public:
  // `cost(task)`: a task's relative cost (e.g. its rows plus streaming its weight block).
  template <typename Cost>
  TaskRuns(int64_t num_tasks, int num_threads, Cost cost) : bounds_(num_threads + 1), cursors_(num_threads) {
    int64_t total = 0;
    for (int64_t task = 0; task < num_tasks; ++task) total += cost(task);
    int64_t acc = 0;
    int t = 1;
    bounds_[0] = 0;
    for (int64_t task = 0; task < num_tasks && t < num_threads; ++task) {
      acc += cost(task);
      while (t < num_threads && acc * num_threads >= total * t) bounds_[t++] = task + 1;
    }
    for (; t <= num_threads; ++t) bounds_[t] = num_tasks;
    for (int i = 0; i < num_threads; ++i) cursors_[i].next.store(bounds_[i], std::memory_order_relaxed);
  }

  // Called by every thread of the parallel region (`me` = its OpenMP number): its own run first,
  // then whatever is left of the others' (also the runs of threads that never came).
  template <typename Run>
  void work(int me, Run run) {
    const int n = static_cast<int>(cursors_.size());
    for (int k = 0; k < n; ++k) {
      const int r = (me + k) % n;
      for (;;) {
        const int64_t task = cursors_[r].next.fetch_add(1, std::memory_order_relaxed);
        if (task >= bounds_[r + 1]) break;
        run(task);
      }
    }
  }

 private:
  // The next unclaimed task of one run, alone on its cache line (threads claim often).
  struct alignas(64) Cursor {
    std::atomic<int64_t> next{0};
  };
  std::vector<int64_t> bounds_;
  std::vector<Cursor> cursors_;
};

}  // namespace emoe
