// A copy engine for the expert cache: one native thread that copies queued experts into pool rows
// and never takes Python's GIL (elasticmoe/kernels/copy_engine.py binds it).
//
// Why a native thread: the cache's prefetches used to run on a Python thread, which takes the GIL
// several times per copy while the forward thread needs it back after every PyTorch op. Here the
// forward thread decides (which expert, which row, which victim) and submits; this thread only
// copies, the way a GPU's copy stream runs beside its compute stream (docs/offload.md, "A copy
// engine beside the forward").
//
// The engine is made with a table of sources: source i (an expert) is up to S segments, each a
// piece of the expert written at an offset of a row of one of the pools (w13, w2): from memory (an
// address and a count) or from a file (a descriptor, an offset and a count: the disk tier), as is
// or widened from bf16 to fp32 (a bf16 checkpoint read into an fp32 cache). A file is read with
// `pread`, not through a mapping: a file cut short under a mapping faults the process (SIGBUS),
// while a short read is an error this copy reports (`failed`) and the cache survives.
// A copy is (source, row). The protocol (every field under `mu_`):
// - copies get consecutive ids from 0; the queue holds the ones not started, in id order;
// - the worker takes the queue's front (unless paused), copies it without the lock, and then
//   advances `finished_`: every id below it is copied (or failed, below) or cancelled;
// - `cancel` drops every queued copy at once and returns the first dropped id: a dropped copy's
//   row was never written, so the caller may hand it back to the expert that held it;
// - `pause` stops the worker between two copies (an on-demand load needs the memory bandwidth);
// - a copy whose file read fails (an error, or the file ends early) still finishes; its id is
//   recorded in `failed_` before `finished_` passes it, and its row holds garbage.
// A copy makes its whole source, or one half of it (`part`): the bytes it writes, split at a
// 64-byte boundary. The caller's thread may make the other half at once (`copy_now`): two threads
// copy one expert in about half the time, for an on-demand load of a single expert.
//
// A file read may drop the pages it read from the OS page cache once copied (`drop_file_pages`): the
// expert then takes no memory beyond its cache row, as for a checkpoint larger than the host's
// memory, whose pages could not stay cached; a re-read is a real disk read. Such an engine makes
// each whole copy with two threads, a half each (the worker and a helper): the disk serves two
// reads at once at 1.5-2x the rate of one (a virtio disk measured here), and a thread waiting for
// the disk takes no core from the forward.
//
// Idle, the worker may poll for new work a while (`poll_us`) before it sleeps. Waking a sleeping
// thread costs the thread that wakes it (the forward, in `submit` and `pause`) ~20-50 us on the
// 2-vCPU KVM guests measured here, against ~2 us when the worker is polling: with a plan after
// every MoE layer, that was up to ~0.3 ms of each decode token. The poll yields the core at every turn
// (`sched_yield`), so a runnable thread of this process or another one there runs first; the
// engine asks for polling only when its compute threads leave a core free
// (`elasticmoe.engine.offload_setup`).

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <fcntl.h>
#include <mutex>
#include <sched.h>
#include <thread>
#include <unistd.h>
#include <utility>
#include <vector>

namespace {

constexpr int64_t kMemcpy = 0;          // count = bytes
constexpr int64_t kBf16ToF32 = 1;       // count = elements
constexpr int64_t kReadFile = 2;        // count = bytes; source = a file descriptor, at `file_offset`
constexpr int64_t kReadFileBf16ToF32 = 3;  // count = elements (two bytes each in the file)
constexpr int64_t kSegmentFields = 6;  // source (address or descriptor), pool, offset in the row, count, kind,
                                       // file offset

struct Segment {
  int64_t source;
  int64_t pool;
  int64_t offset;
  int64_t count;
  int64_t kind;
  int64_t file_offset;
};

struct Pool {
  char* base;
  int64_t row_bytes;
};

constexpr int64_t kWhole = 0, kFirstHalf = 1, kSecondHalf = 2;  // which part of its source a copy makes

struct Item {
  int64_t id;
  int64_t source;
  int64_t row;
  int64_t part;
};

bool widens(int64_t kind) { return kind == kBf16ToF32 || kind == kReadFileBf16ToF32; }
bool reads_file(int64_t kind) { return kind == kReadFile || kind == kReadFileBf16ToF32; }
int64_t written_bytes(const Segment& s) { return widens(s.kind) ? s.count * 4 : s.count; }

void widen_bf16(const uint16_t* src, int64_t count, char* dst) {
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);
  for (int64_t i = 0; i < count; ++i) out[i] = static_cast<uint32_t>(src[i]) << 16;  // exact
}

// Drops from the page cache every page of file `fd` that bytes [at, at + bytes) touch, the partly
// read ones at both ends too (the kernel keeps a page the range covers only in part). Advice: a
// failure leaves them cached.
void drop_cached(int fd, int64_t at, int64_t bytes) {
  static const int64_t page = sysconf(_SC_PAGESIZE);
  const int64_t first = at / page * page, end = (at + bytes + page - 1) / page * page;
  posix_fadvise(fd, first, end - first, POSIX_FADV_DONTNEED);
}

// `bytes` bytes of file `fd` from `at` into `dst`; false on an error or where the file ends first.
// `drop`: then drop the pages read from the page cache (`drop_cached`).
bool read_fully(int fd, char* dst, int64_t bytes, int64_t at, bool drop) {
  const int64_t first = at, total = bytes;
  while (bytes > 0) {
    const ssize_t n = pread(fd, dst, static_cast<size_t>(bytes), at);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    dst += n;
    bytes -= n;
    at += n;
  }
  if (drop) drop_cached(fd, first, total);
  return true;
}

// Bytes [lo, hi) of what segment `s` writes, into `dst` (where the segment's first byte goes);
// false when its file read failed. A widening segment's range is whole fp32 values (the callers
// split at multiples of 4). `scratch` holds a bf16 file piece.
bool copy_segment(const Segment& s, char* dst, int64_t lo, int64_t hi, bool drop, std::vector<uint16_t>& scratch) {
  if (hi <= lo) return true;  // nothing of it (or padding: an expert made of fewer pieces than the widest)
  const char* src = reinterpret_cast<const char*>(s.source);
  const int64_t first = lo / 4, count = (hi - lo) / 4;  // the widening kinds' values
  switch (s.kind) {
    case kMemcpy:
      std::memcpy(dst + lo, src + lo, static_cast<size_t>(hi - lo));
      return true;
    case kBf16ToF32:
      widen_bf16(reinterpret_cast<const uint16_t*>(src) + first, count, dst + lo);
      return true;
    case kReadFile:
      return read_fully(static_cast<int>(s.source), dst + lo, hi - lo, s.file_offset + lo, drop);
    default:  // kReadFileBf16ToF32
      scratch.resize(static_cast<size_t>(count));
      if (!read_fully(static_cast<int>(s.source), reinterpret_cast<char*>(scratch.data()), count * 2,
                      s.file_offset + first * 2, drop))
        return false;
      widen_bf16(scratch.data(), count, dst + lo);
      return true;
  }
}

class CopyEngine {
 public:
  CopyEngine(std::vector<Segment> table, int64_t per_source, std::vector<Pool> pools, int64_t num_rows,
             int64_t poll_us, bool drop_file_pages)
      : table_(std::move(table)), per_source_(per_source), pools_(std::move(pools)), num_rows_(num_rows),
        poll_(std::chrono::microseconds(poll_us)), drop_file_pages_(drop_file_pages), worker_([this] { run(); }) {}

  // Part `part` of source `source` into row `row`, on the calling thread; false when a file read
  // failed. The worker's copies and `copy_now` run this; neither takes the lock.
  bool copy(int64_t source, int64_t row, int64_t part, std::vector<uint16_t>& scratch) const {
    const Segment* segments = table_.data() + source * per_source_;
    int64_t total = 0;
    for (int64_t i = 0; i < per_source_; ++i) total += written_bytes(segments[i]);
    // Split at a multiple of 64 bytes; a widening segment's start in the source is a multiple of 4
    // (its pool holds fp32, and so do the memcpy segments beside it: the pools share one dtype).
    const int64_t middle = total / 2 / 64 * 64;
    const int64_t from = part == kSecondHalf ? middle : 0, to = part == kFirstHalf ? middle : total;
    int64_t at = 0;  // where segment i starts in the source's written bytes
    for (int64_t i = 0; i < per_source_; ++i) {
      const Segment& s = segments[i];
      const int64_t size = written_bytes(s);
      const Pool& pool = pools_[s.pool];
      const int64_t lo = std::clamp(from - at, int64_t{0}, size), hi = std::clamp(to - at, int64_t{0}, size);
      if (!copy_segment(s, pool.base + row * pool.row_bytes + s.offset, lo, hi, drop_file_pages_, scratch))
        return false;
      at += size;
    }
    return true;
  }

  int64_t num_sources() const { return static_cast<int64_t>(table_.size()) / per_source_; }
  int64_t num_rows() const { return num_rows_; }

  ~CopyEngine() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
      queue_.clear();
      ++epoch_;
    }
    work_cv_.notify_all();
    worker_.join();  // after the copy in progress, if any: its row stays valid until then
  }

  int64_t submit(const int64_t* copies, int64_t num_copies) {
    std::lock_guard<std::mutex> lock(mu_);
    const int64_t first = next_id_;
    for (int64_t i = 0; i < num_copies; ++i)
      queue_.push_back({next_id_++, copies[3 * i], copies[3 * i + 1], copies[3 * i + 2]});
    wake();
    return first;
  }

  int64_t cancel() {
    std::lock_guard<std::mutex> lock(mu_);
    const int64_t first = queue_.empty() ? next_id_ : queue_.front().id;
    queue_.clear();
    if (running_ < 0) finished_ = next_id_;
    done_cv_.notify_all();
    return first;
  }

  void pause(bool paused) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      paused_ = paused;
      wake();
    }
    done_cv_.notify_all();
  }

  int64_t finished() {
    std::lock_guard<std::mutex> lock(mu_);
    return finished_;
  }

  int64_t running() {
    std::lock_guard<std::mutex> lock(mu_);
    return running_;
  }

  int64_t busy_ns() {
    std::lock_guard<std::mutex> lock(mu_);
    return busy_ns_;
  }

  int64_t sleeps() {
    std::lock_guard<std::mutex> lock(mu_);
    return sleeps_;
  }

  // Up to `capacity` ids of failed copies into `out`, oldest first, and forgets them; returns how many.
  int64_t take_failed(int64_t* out, int64_t capacity) {
    std::lock_guard<std::mutex> lock(mu_);
    const int64_t n = std::min<int64_t>(capacity, static_cast<int64_t>(failed_.size()));
    for (int64_t i = 0; i < n; ++i) out[i] = failed_[static_cast<size_t>(i)];
    failed_.erase(failed_.begin(), failed_.begin() + n);
    return n;
  }

  // Block until item `id` is finished. Returns at once (false) when it is queued behind a pause or
  // was never submitted: nobody would copy it.
  bool wait(int64_t id) {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      if (id < finished_) return true;
      if (id >= next_id_ || stopping_ || (paused_ && running_ != id)) return false;
      done_cv_.wait(lock);
    }
  }

 private:
  bool has_work() const { return stopping_ || (!paused_ && !queue_.empty()); }

  // The state changed: a polling worker sees the epoch move, a sleeping one is notified. Holds mu_.
  void wake() {
    ++epoch_;
    if (sleeping_) work_cv_.notify_all();
  }

  // Until there is work: poll up to `poll_`, then sleep. Holds mu_ on entry and on return.
  void wait_for_work(std::unique_lock<std::mutex>& lock) {
    const auto until = std::chrono::steady_clock::now() + poll_;
    while (!has_work() && std::chrono::steady_clock::now() < until) {
      const int64_t seen = epoch_.load();
      lock.unlock();
      while (epoch_.load() == seen && std::chrono::steady_clock::now() < until) sched_yield();
      lock.lock();
    }
    if (has_work()) return;
    ++sleeps_;
    sleeping_ = true;
    work_cv_.wait(lock, [this] { return has_work(); });
    sleeping_ = false;
  }

  // The worker: the helper lives as long as it (a helper that cannot start leaves it copying alone).
  void run() {
    std::thread helper;
    if (drop_file_pages_) {
      try {
        helper = std::thread([this] { help(); });
      } catch (...) {  // no thread: the worker copies alone, as without drop_file_pages
      }
    }
    work(helper.joinable());
    if (helper.joinable()) {
      {
        std::lock_guard<std::mutex> lock(helper_mu_);
        helper_stopping_ = true;
      }
      helper_cv_.notify_all();
      helper.join();
    }
  }

  void work(bool in_halves) {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      wait_for_work(lock);
      if (stopping_) return;
      const Item item = queue_.front();
      queue_.pop_front();
      running_ = item.id;
      lock.unlock();
      const auto started = std::chrono::steady_clock::now();
      const bool ok = in_halves && item.part == kWhole ? copy_in_halves(item.source, item.row)
                                                       : copy(item.source, item.row, item.part, scratch_);
      const auto took = std::chrono::steady_clock::now() - started;
      lock.lock();
      if (!ok) failed_.push_back(item.id);
      busy_ns_ += std::chrono::duration_cast<std::chrono::nanoseconds>(took).count();
      running_ = -1;
      finished_ = queue_.empty() ? next_id_ : queue_.front().id;
      done_cv_.notify_all();
    }
  }

  // A whole copy by the worker (its first half) and the helper (the second); false when either failed.
  bool copy_in_halves(int64_t source, int64_t row) {
    {
      std::lock_guard<std::mutex> lock(helper_mu_);
      helper_source_ = source;
      helper_row_ = row;
      helper_done_ = false;
    }
    helper_cv_.notify_all();
    const bool first = copy(source, row, kFirstHalf, scratch_);
    std::unique_lock<std::mutex> lock(helper_mu_);
    helper_cv_.wait(lock, [this] { return helper_done_; });
    return first && helper_ok_;
  }

  void help() {
    std::unique_lock<std::mutex> lock(helper_mu_);
    for (;;) {
      helper_cv_.wait(lock, [this] { return helper_stopping_ || helper_source_ >= 0; });
      if (helper_stopping_) return;
      const int64_t source = helper_source_, row = helper_row_;
      helper_source_ = -1;
      lock.unlock();
      const bool ok = copy(source, row, kSecondHalf, helper_scratch_);
      lock.lock();
      helper_ok_ = ok;
      helper_done_ = true;
      helper_cv_.notify_all();
    }
  }

  const std::vector<Segment> table_;  // [sources, per_source_]
  const int64_t per_source_;
  const std::vector<Pool> pools_;
  const int64_t num_rows_;
  const std::chrono::microseconds poll_;
  const bool drop_file_pages_;  // a file read drops the pages it read from the page cache
  std::mutex mu_;
  std::condition_variable work_cv_, done_cv_;
  std::deque<Item> queue_;
  int64_t next_id_ = 0, finished_ = 0, running_ = -1, busy_ns_ = 0;
  int64_t sleeps_ = 0;  // times the idle thread went to sleep (each later costs a wake)
  std::deque<int64_t> failed_;  // ids of copies whose file read failed, not yet taken
  std::vector<uint16_t> scratch_;  // the worker's: a bf16 file piece before it is widened
  bool paused_ = false, stopping_ = false, sleeping_ = false;
  std::atomic<int64_t> epoch_{0};  // bumped (under mu_) by every change a waiting worker must see
  // The helper's half of the worker's copy (`copy_in_halves`, with drop_file_pages), under helper_mu_.
  std::mutex helper_mu_;
  std::condition_variable helper_cv_;
  int64_t helper_source_ = -1, helper_row_ = -1;  // the half asked for; source -1: none
  bool helper_done_ = false, helper_ok_ = true, helper_stopping_ = false;
  std::vector<uint16_t> helper_scratch_;
  std::thread worker_;  // last: it starts once the fields above are initialised
};

CopyEngine* engine(void* handle) { return static_cast<CopyEngine*>(handle); }

}  // namespace

extern "C" {

// `table` [num_sources, per_source, 6]: (source address or file descriptor, pool, offset in the row,
// count, kind, file offset);
// `pool_bases` / `row_bytes` [num_pools]: each pool's address and row size; rows 0..num_rows-1;
// `poll_us`: how long the idle thread polls before it sleeps (0: it sleeps at once);
// `drop_file_pages`: nonzero: every file read then drops the pages it read from the page cache.
// Returns null when a segment would write outside its pool row, or names an unknown pool or kind,
// or when the thread cannot start.
void* emoe_copy_engine_new(const int64_t* table, int64_t num_sources, int64_t per_source, const int64_t* pool_bases,
                           const int64_t* row_bytes, int64_t num_pools, int64_t num_rows, int64_t poll_us,
                           int64_t drop_file_pages) {
  if (num_sources < 0 || per_source < 1 || num_pools < 1 || num_rows < 0 || poll_us < 0) return nullptr;
  std::vector<Pool> pools;
  for (int64_t p = 0; p < num_pools; ++p) pools.push_back({reinterpret_cast<char*>(pool_bases[p]), row_bytes[p]});
  std::vector<Segment> segments;
  for (int64_t i = 0; i < num_sources * per_source; ++i) {
    const int64_t* f = table + i * kSegmentFields;
    const Segment s{f[0], f[1], f[2], f[3], f[4], f[5]};
    if (s.pool < 0 || s.pool >= num_pools || s.kind < kMemcpy || s.kind > kReadFileBf16ToF32 || s.count < 0 ||
        s.offset < 0 || s.offset + written_bytes(s) > pools[s.pool].row_bytes ||
        (reads_file(s.kind) && (s.source < 0 || s.file_offset < 0)))
      return nullptr;
    segments.push_back(s);
  }
  try {
    return new CopyEngine(std::move(segments), per_source, std::move(pools), num_rows, poll_us, drop_file_pages != 0);
  } catch (...) {  // no memory, or no thread: nothing may escape into the Python caller
    return nullptr;
  }
}

int emoe_copy_engine_free(void* handle) {
  delete engine(handle);
  return 0;
}

bool valid_copy(CopyEngine* e, int64_t source, int64_t row, int64_t part) {
  return source >= 0 && source < e->num_sources() && row >= 0 && row < e->num_rows() && part >= kWhole &&
         part <= kSecondHalf;
}

// `copies` [num_copies, 3]: (source, row, part). Returns the first copy's id (-1: a source, row or
// part out of range).
int64_t emoe_copy_engine_submit(void* handle, const int64_t* copies, int64_t num_copies) {
  CopyEngine* e = engine(handle);
  for (int64_t i = 0; i < num_copies; ++i) {
    if (!valid_copy(e, copies[3 * i], copies[3 * i + 1], copies[3 * i + 2])) return -1;
  }
  return e->submit(copies, num_copies);
}

// Part `part` of `source` into `row` on the calling thread (beside the worker, which may be copying
// the other half): 1, or 0 when a file read failed, -1 for a source, row or part out of range.
int emoe_copy_engine_copy_now(void* handle, int64_t source, int64_t row, int64_t part) {
  CopyEngine* e = engine(handle);
  if (!valid_copy(e, source, row, part)) return -1;
  thread_local std::vector<uint16_t> scratch;
  return e->copy(source, row, part, scratch) ? 1 : 0;
}

int64_t emoe_copy_engine_cancel(void* handle) { return engine(handle)->cancel(); }

int emoe_copy_engine_pause(void* handle, int paused) {
  engine(handle)->pause(paused != 0);
  return 0;
}

int64_t emoe_copy_engine_finished(void* handle) { return engine(handle)->finished(); }

int64_t emoe_copy_engine_running(void* handle) { return engine(handle)->running(); }

int64_t emoe_copy_engine_busy_ns(void* handle) { return engine(handle)->busy_ns(); }

int64_t emoe_copy_engine_sleeps(void* handle) { return engine(handle)->sleeps(); }

int64_t emoe_copy_engine_take_failed(void* handle, int64_t* out, int64_t capacity) {
  return engine(handle)->take_failed(out, capacity);
}

int emoe_copy_engine_wait(void* handle, int64_t id) { return engine(handle)->wait(id) ? 1 : 0; }

}  // extern "C"
