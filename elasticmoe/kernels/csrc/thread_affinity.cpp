// Pin the OpenMP threads (PyTorch's pool, which our kernels share) one per CPU.
//
// Unpinned, the scheduler may run two of our threads on one core while other processes hold the
// other: every parallel region then waits out a time slice at its barrier (measured: a 64-request
// run took 100 s instead of 1.3 s beside another team's test suite). Pinned, each thread keeps
// its own core and only shares it.

#include <omp.h>
#include <sched.h>

extern "C" {

// cpus[i]: the CPU of OpenMP thread i, for i < n. Returns how many threads were pinned.
int emoe_bind_threads(const int* cpus, int n) {
  int pinned = 0;
#pragma omp parallel num_threads(n) reduction(+ : pinned)
  {
    const int t = omp_get_thread_num();
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpus[t], &set);
    pinned += sched_setaffinity(0, sizeof(set), &set) == 0;
  }
  return pinned;
}

}  // extern "C"
