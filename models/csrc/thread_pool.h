// The kernels' own thread pool, in place of at::parallel_for (OpenMP). An OpenMP parallel
// region costs about 6 us from a process's main thread here but 30-55 us from any other
// thread, and a served engine steps on another thread. This pool costs the same from every
// thread: its workers spin briefly after a job, then sleep; work is split into chunks that
// any thread claims, so a late or descheduled worker delays nothing (the caller takes its
// chunks). Which thread computes a chunk never changes a result.
#pragma once

#include <cstdint>
#include <functional>

namespace adaspec {

// fn(chunk_begin, chunk_end) over [begin, end) in chunks of at least `grain` items.
// Runs inline when the range is one chunk, the pool has one thread, or the pool is busy
// (another thread's job, or a call from inside a job). The first exception is rethrown.
void parallel_for(int64_t begin, int64_t end, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);

// Threads the pool uses, the calling thread included (at least 1).
void set_num_threads(int n);
int get_num_threads();

}  // namespace adaspec
