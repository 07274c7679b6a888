// Linear layers over few rows (a decode pass: one row per running question) for float32 on CPU.
//
// Why: a decode pass multiplies each weight matrix by a handful of rows, so its time is the
// weights streaming from memory once (the embedded model: 537 MB a pass) plus M multiply-adds
// per weight. MKL's sgemm is tuned for many rows; this product beats it up to a few dozen rows
// (docs/benchmarks.md, "Few-row products"), so rows_linear.py switches to MKL at KERNEL_ROWS.
//
// How: out[m, n] = x[m] . w[n], tiles of 4 rows x NT outputs held in vector registers while K
// streams through; each tile of w (NT rows of the weight) is read once from memory and serves
// every input row from L1, and while the first rows use it the next tile's weight rows are
// prefetched, so memory streams while the multiply-adds run (without it the two barely overlap:
// 16 rows took as long as 1 row's memory time plus their arithmetic). Each (m, n) is the same
// sequence of operations whatever the other rows and the tile it falls in, so a row's result
// does not depend on what it is packed with: a question decoded beside 15 others gets bitwise
// the products it gets alone.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>

#include "pool.h"

#if defined(__FMA__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

// Built with the exact flags (kernels.py: no fast-math, no implicit contraction): otherwise the
// compiler could reorder a dot product's additions, or fuse some multiply-adds and not others,
// differently in each tile shape (seen with GCC 12: the 1-output tiles), and a row's result would
// depend on how many rows it is packed with. The fused multiply-adds are written out.
namespace {

#if defined(__AVX512F__)
// 16 lanes: 4 x 6 accumulators + 6 weight vectors + 1 input vector fill 31 of the 32 registers
typedef float vec __attribute__((vector_size(64)));
constexpr int kLanes = 16;
constexpr int64_t kOutputs = 6;
inline vec fmadd(vec a, vec b, vec c) { return (vec)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c); }
// the last 8 features when K is an odd multiple of 8: the upper lanes read as zeros and add +0
inline vec load_half(const float* p) { return (vec)_mm512_maskz_loadu_ps(0x00FF, p); }
inline float sum_lanes(vec x) {
  return (((x[0] + x[8]) + (x[1] + x[9])) + ((x[2] + x[10]) + (x[3] + x[11]))) +
         (((x[4] + x[12]) + (x[5] + x[13])) + ((x[6] + x[14]) + (x[7] + x[15])));
}
#else
// 8 lanes (AVX2, or 2x NEON on ARM through the vector extension): 4 x 3 accumulators + 3 + 1 = 16
typedef float vec __attribute__((vector_size(32)));
constexpr int kLanes = 8;
constexpr int64_t kOutputs = 3;
#if defined(__FMA__)
inline vec fmadd(vec a, vec b, vec c) { return (vec)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c); }
#else
inline vec fmadd(vec a, vec b, vec c) { return a * b + c; }  // two roundings, the same in every tile
#endif
inline float sum_lanes(vec x) { return ((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7])); }
#endif
constexpr int64_t kRows = 4;
constexpr int64_t kLine = 64 / sizeof(float);  // floats per cache line

inline vec load(const float* p) {
  vec x;
  __builtin_memcpy(&x, p, sizeof(x));
  return x;
}

// out[m0 + i, n0 + j] for i < MT, j < NT: one vector accumulator per (row, output) over K.
// `prefetch`: NT weight rows to bring into cache meanwhile (the next tile's), or nullptr.
template <int MT, int NT>
inline void tile(const float* x, const float* w, float* out, int64_t k, int64_t n, int64_t m0, int64_t n0,
                 const float* prefetch) {
  vec acc[MT][NT] = {};
  const int64_t whole = k - k % kLanes;
  for (int64_t c = 0; c < whole; c += kLanes) {
    if (prefetch != nullptr && c % kLine == 0)
      for (int j = 0; j < NT; ++j) __builtin_prefetch(prefetch + j * k + c);
    vec wv[NT];
    for (int j = 0; j < NT; ++j) wv[j] = load(w + (n0 + j) * k + c);
    for (int i = 0; i < MT; ++i) {
      const vec xv = load(x + (m0 + i) * k + c);
      for (int j = 0; j < NT; ++j) acc[i][j] = fmadd(xv, wv[j], acc[i][j]);
    }
  }
#if defined(__AVX512F__)
  if (whole < k) {  // K an odd multiple of 8 (with 8 lanes K is always a whole number of vectors)
    vec wv[NT];
    for (int j = 0; j < NT; ++j) wv[j] = load_half(w + (n0 + j) * k + whole);
    for (int i = 0; i < MT; ++i) {
      const vec xv = load_half(x + (m0 + i) * k + whole);
      for (int j = 0; j < NT; ++j) acc[i][j] = fmadd(xv, wv[j], acc[i][j]);
    }
  }
#endif
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NT; ++j) out[(m0 + i) * n + n0 + j] = sum_lanes(acc[i][j]);
}

// Outputs n0 .. n0 + NT - 1 for every row: the weight's NT rows stay in L1 across the row
// tiles; the first row tile prefetches `next` (the following NT weight rows, or nullptr).
template <int NT>
void outputs(const float* x, const float* w, float* out, int64_t m, int64_t k, int64_t n, int64_t n0,
             const float* next) {
  for (int64_t m0 = 0; m0 < m; m0 += kRows, next = nullptr) {
    switch (std::min(kRows, m - m0)) {
      case 4: tile<4, NT>(x, w, out, k, n, m0, n0, next); break;
      case 3: tile<3, NT>(x, w, out, k, n, m0, n0, next); break;
      case 2: tile<2, NT>(x, w, out, k, n, m0, n0, next); break;
      default: tile<1, NT>(x, w, out, k, n, m0, n0, next); break;
    }
  }
}

}  // namespace

// input [M, K] float32, weight [N, K] float32 contiguous (nn.Linear's layout), K a multiple of 8
// -> [M, N] = input @ weight.T, without bias. Threads: torch's own pool, split over outputs.
at::Tensor rows_linear(const at::Tensor& input, const at::Tensor& weight) {
  TORCH_CHECK(input.device().is_cpu() && weight.device().is_cpu(), "rows_linear runs on CPU tensors");
  TORCH_CHECK(input.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat,
              "rows_linear takes float32, not ", input.scalar_type(), " and ", weight.scalar_type());
  TORCH_CHECK(input.dim() == 2 && weight.dim() == 2 && weight.is_contiguous(),
              "rows_linear: input [M, K] and a contiguous weight [N, K]");
  TORCH_CHECK(input.size(1) == weight.size(1) && weight.size(1) % 8 == 0, "rows_linear: input has ",
              input.size(1), " features and the weight ", weight.size(1), "; both must match, a multiple of 8");
  const auto x = input.contiguous();
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(0);
  auto out = at::empty({m, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t tiles = n / kOutputs;
  kev::parallel_for(0, tiles, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* next = t + 1 < tiles ? wp + (t + 1) * kOutputs * k : nullptr;
      outputs<kOutputs>(xp, wp, op, m, k, n, t * kOutputs, next);
    }
  });
  for (int64_t n0 = tiles * kOutputs; n0 < n; ++n0) outputs<1>(xp, wp, op, m, k, n, n0, nullptr);
  return out;
}
