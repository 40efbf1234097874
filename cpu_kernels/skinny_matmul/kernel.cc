// Skinny matmul for XLA:CPU: Y = W · X for a weight W [E, D] (row-major, [out, in]) and a few columns of X.
//
// Why: a decode or verify step multiplies every weight by 1-8 activation columns. XLA:CPU's dot runs one column
// as a memory-bound GEMV, but from two columns on it calls a GEMM library built for large M (SmolLM2-135M's
// matmuls on the 2-core EPYC: 17.7 ms for one column, 30 ms for two, 46 ms for four). Here every weight row is
// streamed once, in order, and dotted with all M columns while it is in registers, and the stream is prefetched
// into L2 a fixed distance ahead (kPrefetch): without that the FMAs of each further column held back the loads
// behind them and the stream slowed with M (134M weights: ~18 / 20 / 41 / 46 ms at 1 / 2 / 4 / 8 columns);
// with it one to four columns run at the memory's speed (~18 ms) and eight at 1.35-1.5x that.
//
// Numerics: output (e, m) is computed the same way whatever M is and whichever columns it is blocked with: L
// lane-wise partial sums over D, chunk k into partial sum k % kSplit (fused multiply-add), the partial sums added
// in order, a fixed pairwise lane reduction, then the D % L tail in order. So a column's result does not depend on
// the others (a verify step's rows equal the one-token decode step's bit for bit), which XLA's dot does not
// promise.
//
// Threads: the rows are cut into chunks that the calling thread and tasks on XLA's intra-op pool claim from one
// counter; the caller waits only for chunks already claimed, so a task that never runs cannot block it.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#if defined(__FMA__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kLanes = 8;  // 256-bit vectors: on the EPYC these ran ~1.2x the float FMAs/s of 512-bit ones
constexpr int kSplit = 2;  // partial sums per column (see row_block)
// How far ahead of the chunk being read the weight stream is prefetched, into L2 (_MM_HINT_T1): on the 2-core
// EPYC 4-8 KB kept four columns at one column's cost, where 2 KB, or prefetching into L1, did not.
constexpr int64_t kPrefetch = 8192;
typedef float vf __attribute__((vector_size(kLanes * sizeof(float))));

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// Explicitly fused where the CPU has FMA; the file is built with -ffp-contract=off, so nothing else is fused and
// every instantiation below computes a column the same way.
inline vf fused(vf a, vf b, vf c) {
#if defined(__FMA__)
  return _mm256_fmadd_ps(a, b, c);
#else
  return a * b + c;
#endif
}

inline float lane_sum(vf a) {  // fixed pairwise order: (0+4, 1+5, ..) then (0+2, ..) then 0+1
  float s[kLanes];
  std::memcpy(s, &a, sizeof(s));
  for (int w = kLanes / 2; w >= 1; w /= 2)
    for (int i = 0; i < w; ++i) s[i] += s[i + w];
  return s[0];
}

struct Problem {
  const float* w;   // [E, D]
  const float* xp;  // X packed [D / L][M][L] (full chunks), then the tail [M][D % L]
  float* y;
  int64_t e, d, m;
  int64_t y_row, y_col;  // strides of Y's row e and column m
};

// A read hint with locality 2 (x86: prefetcht1, into L2); a prefetch never faults, even past the end of W.
inline void prefetch(const float* p) {
  __builtin_prefetch(reinterpret_cast<const void*>(reinterpret_cast<uintptr_t>(p) + kPrefetch), 0, 2);
}

// Columns [m0, m0 + MB) of weight row `row`. Chunk k of the row adds into partial sum k % kSplit: one running
// sum per column would be a chain of D / L dependent FMAs, latency-bound at one or two columns. `lead`: the row's
// first block, which prefetches (once per 64-byte line: kSplit chunks of 8 floats).
template <int MB>
inline void row_block(const Problem& p, int64_t row, int64_t m0, bool lead) {
  const int64_t chunks = p.d / kLanes, tail = p.d % kLanes;
  const float* wr = p.w + row * p.d;
  vf acc[kSplit][MB];
  for (int q = 0; q < kSplit; ++q)
    for (int c = 0; c < MB; ++c) acc[q][c] = vf{};
  auto step = [&](int q, int64_t k) {
    const vf wv = load(wr + k * kLanes);
    const float* xk = p.xp + (k * p.m + m0) * kLanes;
    for (int c = 0; c < MB; ++c) acc[q][c] = fused(wv, load(xk + c * kLanes), acc[q][c]);
  };
  int64_t k = 0;
  for (; k + kSplit <= chunks; k += kSplit) {
    if (lead) prefetch(wr + k * kLanes);
    for (int q = 0; q < kSplit; ++q) step(q, k + q);
  }
  for (int q = 0; k < chunks; ++k, ++q) step(q, k);
  const float* xt = p.xp + chunks * p.m * kLanes;
  for (int c = 0; c < MB; ++c) {
    vf a = acc[0][c];
    for (int q = 1; q < kSplit; ++q) a += acc[q][c];
    float s = lane_sum(a);
    for (int64_t j = 0; j < tail; ++j) s = std::fma(wr[chunks * kLanes + j], xt[(m0 + c) * tail + j], s);
    p.y[row * p.y_row + (m0 + c) * p.y_col] = s;
  }
}

// One weight row at a time, in order: streaming rows one by one ran at the memory's speed here, two interleaved
// rows at half of it. Its columns in blocks of 8, then the rest in one block of its exact size (8 columns x 2
// partial sums: 16 vector registers, which AVX-512VL's 32 hold; every block after the first finds the row in L1).
template <int MB>
inline void rest_block(const Problem& p, int64_t row, int64_t m0, bool lead) {
  if constexpr (MB > 1) {
    if (p.m - m0 < MB) return rest_block<MB - 1>(p, row, m0, lead);
  }
  row_block<MB>(p, row, m0, lead);
}

void rows(const Problem& p, int64_t lo, int64_t hi) {
  for (int64_t r = lo; r < hi; ++r) {
    int64_t m0 = 0;
    for (; p.m - m0 >= 8; m0 += 8) row_block<8>(p, r, m0, m0 == 0);
    if (m0 < p.m) rest_block<7>(p, r, m0, m0 == 0);
  }
}

struct Shared {  // outlives the call: a pool task may start after the caller has returned
  Problem p;
  std::vector<float> xp;
  int64_t chunk, n_chunks;
  std::atomic<int64_t> next{0}, done{0};
};

void work(Shared& s) {
  for (int64_t c; (c = s.next.fetch_add(1)) < s.n_chunks;) {
    rows(s.p, c * s.chunk, std::min(s.p.e, (c + 1) * s.chunk));
    s.done.fetch_add(1, std::memory_order_release);
  }
}

ffi::Error Skinny(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::F32> x,
                  ffi::ResultBuffer<ffi::F32> y, bool x_tokens_major, bool y_tokens_major) {
  const auto wd = w.dimensions(), xd = x.dimensions();
  if (wd.size() != 2 || xd.size() != 2) return ffi::Error::InvalidArgument("skinny_matmul: W and X must be 2-D");
  const int64_t e = wd[0], d = wd[1];
  const int64_t m = x_tokens_major ? xd[0] : xd[1];
  if ((x_tokens_major ? xd[1] : xd[0]) != d) return ffi::Error::InvalidArgument("skinny_matmul: D mismatch");
  auto s = std::make_shared<Shared>();
  // Pack X once (M·D floats, a few KB): chunk k of every column contiguous, so a weight chunk meets its M
  // partners in one stream.
  const int64_t chunks = d / kLanes, tail = d % kLanes;
  s->xp.resize(m * d);
  const float* xv = x.typed_data();
  auto at = [&](int64_t mm, int64_t dd) { return x_tokens_major ? xv[mm * d + dd] : xv[dd * m + mm]; };
  for (int64_t k = 0; k < chunks; ++k)
    for (int64_t mm = 0; mm < m; ++mm)
      for (int l = 0; l < kLanes; ++l) s->xp[(k * m + mm) * kLanes + l] = at(mm, k * kLanes + l);
  for (int64_t mm = 0; mm < m; ++mm)
    for (int64_t j = 0; j < tail; ++j) s->xp[chunks * m * kLanes + mm * tail + j] = at(mm, chunks * kLanes + j);
  s->p = Problem{w.typed_data(), s->xp.data(), y->typed_data(), e, d, m,
                 y_tokens_major ? 1 : m, y_tokens_major ? e : 1};
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  // Chunks of >= 64 rows (a 576-wide row is 2.3 KB) and a few per thread, so a late task still finds work.
  s->chunk = std::max<int64_t>(64, (e + 4 * threads - 1) / (4 * threads));
  s->n_chunks = (e + s->chunk - 1) / s->chunk;
  for (int64_t t = 1; t < std::min(threads, s->n_chunks); ++t) pool.Schedule([s] { work(*s); });
  work(*s);
  while (s->done.load(std::memory_order_acquire) < s->n_chunks) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SageSkinnyMatmul, Skinny,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("x_tokens_major")
                                  .Attr<bool>("y_tokens_major"));
