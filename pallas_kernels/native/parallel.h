// Work sharing and buffers for the kernels (included inside an instruction set's namespace).

inline void CpuRelax() {
#if defined(__x86_64__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ __volatile__("yield");
#endif
}

// Into L1 (T0) or L2 (T1) ahead of use.
inline void PrefetchT0(const void* p) { __builtin_prefetch(p, 0, 3); }
inline void PrefetchT1(const void* p) { __builtin_prefetch(p, 0, 2); }

template <typename T>
inline T Min(T a, T b) { return b < a ? b : a; }
template <typename T>
inline T Max(T a, T b) { return a < b ? b : a; }
template <typename T>
inline T Clamp(T v, T lo, T hi) { return v < lo ? lo : hi < v ? hi : v; }

// Parallel-for over [0, n) in chunks, on the calling thread plus the runner's threads. The caller works too and
// waits only for chunks that were started, so it finishes even if no pool thread ever picks a task up. A task
// that starts after every chunk is taken returns at once and never touches `body`, which may be gone by then;
// the state itself lives until its last task has let go of it.
struct ForState {
  std::atomic<int64_t> next{0}, done{0};
  std::atomic<int32_t> refs{1};
  int64_t n = 0;
  void (*fn)(void*, int64_t) = nullptr;
  void* ctx = nullptr;
};

inline void RunChunks(ForState* s) {
  for (;;) {
    const int64_t i = s->next.fetch_add(1, std::memory_order_relaxed);
    if (i >= s->n) return;
    s->fn(s->ctx, i);
    s->done.fetch_add(1, std::memory_order_release);
  }
}

inline void Release(ForState* s) {
  if (s->refs.fetch_sub(1, std::memory_order_acq_rel) == 1) delete s;
}

inline void ForTask(void* arg) {
  auto* s = static_cast<ForState*>(arg);
  RunChunks(s);
  Release(s);
}

template <typename Body>
void ParallelFor(const Runner& run, int64_t n, Body&& body) {
  const int64_t threads = Max<int64_t>(1, run.threads);
  if (n <= 1 || threads <= 1 || run.schedule == nullptr) {
    for (int64_t i = 0; i < n; ++i) body(i);
    return;
  }
  using B = std::remove_reference_t<Body>;
  auto* s = new ForState;
  s->n = n;
  s->fn = [](void* ctx, int64_t i) { (*static_cast<B*>(ctx))(i); };
  s->ctx = const_cast<void*>(static_cast<const void*>(&body));
  const int64_t helpers = Min<int64_t>(threads, n) - 1;
  s->refs.store(static_cast<int32_t>(helpers + 1), std::memory_order_relaxed);
  for (int64_t h = 0; h < helpers; ++h) run.schedule(run.pool, ForTask, s);
  RunChunks(s);
  while (s->done.load(std::memory_order_acquire) < n) CpuRelax();
  Release(s);
}

// A thread's growable scratch buffer, 64-byte aligned (one per use site: `thread_local Scratch s;`).
struct Scratch {
  void* p = nullptr;
  size_t cap = 0;
  Scratch() = default;
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  ~Scratch() { std::free(p); }
  template <typename T>
  T* Get(size_t n) {
    const size_t bytes = Max<size_t>(64, (n * sizeof(T) + 63) / 64 * 64);
    if (bytes > cap) {
      std::free(p);
      p = std::aligned_alloc(64, bytes);
      if (!p) std::abort();
      cap = bytes;
    }
    return static_cast<T*>(p);
  }
};

// A zero-filled buffer of n T's for the length of a call.
template <typename T>
struct Zeros {
  T* p;
  explicit Zeros(size_t n) : p(static_cast<T*>(std::calloc(n ? n : 1, sizeof(T)))) {
    if (!p) std::abort();
  }
  Zeros(const Zeros&) = delete;
  Zeros& operator=(const Zeros&) = delete;
  ~Zeros() { std::free(p); }
  T* get() const { return p; }
};

// Columns per chunk of work, in whole units of `unit` columns: about kChunkCols, at least two chunks per thread
// when N allows.
constexpr int64_t kChunkCols = 4096;
inline int64_t ChunkUnits(int64_t N, int64_t unit, int64_t threads) {
  const int64_t units = (N + unit - 1) / unit;
  return Clamp<int64_t>(units / (2 * Max<int64_t>(1, threads)), 1, Max<int64_t>(1, kChunkCols / unit));
}
