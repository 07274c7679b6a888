// Linear layers over few rows (a decode pass: one row per running question) for float32 on CPU.
//
// Why: a decode pass multiplies each weight matrix by a handful of rows, so its time is the
// weights streaming from memory once (the embedded model: 537 MB a pass) plus M multiply-adds
// per weight. MKL's sgemm is tuned for many rows; measured on the embedded model's 30 layers
// with each layer's own weights (2-core AMD EPYC, MKL 2024.2, torch 2.13), every hidden
// product of one pass: 1 row 28.2 -> 16.1 ms, 16 rows 68.0 -> 40.2, 20 rows 74.1 -> 47.0,
// 32 rows 90.9 -> 66.8; even at 48 rows, slower beyond (cpu_linear switches at KERNEL_ROWS).
//
// How: out[m, n] = x[m] . w[n], tiles of 4 rows x 3 outputs held in 12 vector registers while K
// streams through; each tile of w (3 rows of the weight) is read once from memory and serves
// every input row from L1. Each (m, n) is the same sequence of operations whatever the other
// rows and the tile it falls in, so a row's result does not depend on what it is packed with:
// a question decoded beside 15 others gets bitwise the products it gets alone.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#if defined(__FMA__)
#include <immintrin.h>
#endif

// The extension builds with -ffast-math (paged_decode.cpp's vectorized exp wants it). Here the
// compiler would otherwise be free to reorder a dot product's additions, or to fuse some
// multiply-adds and not others, differently in each tile shape (seen with GCC 12: the
// 1-output tiles), and a row's result would depend on how many rows it is packed with. So no
// reordering, no implicit fusing, and the fused multiply-adds are written out.
#if defined(__clang__)
#pragma clang fp reassociate(off)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("no-associative-math", "fp-contract=off")
#endif

namespace {

typedef float v8 __attribute__((vector_size(32)));  // GCC/Clang vector extension: AVX on x86, 2x NEON on ARM

inline v8 load8(const float* p) {
  v8 x;
  __builtin_memcpy(&x, p, sizeof(x));
  return x;
}

#if defined(__FMA__)
inline v8 fma8(v8 a, v8 b, v8 c) { return (v8)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c); }
#else
inline v8 fma8(v8 a, v8 b, v8 c) { return a * b + c; }  // two roundings, the same in every tile
#endif

inline float sum_lanes(v8 x) { return ((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7])); }

// out[m0 + i, n0 + j] for i < MT, j < NT: one vector accumulator per (row, output) over K.
template <int MT, int NT>
inline void tile(const float* x, const float* w, float* out, int64_t k, int64_t n, int64_t m0, int64_t n0) {
  v8 acc[MT][NT] = {};
  for (int64_t c = 0; c < k; c += 8) {
    v8 wv[NT];
    for (int j = 0; j < NT; ++j) wv[j] = load8(w + (n0 + j) * k + c);
    for (int i = 0; i < MT; ++i) {
      const v8 xv = load8(x + (m0 + i) * k + c);
      for (int j = 0; j < NT; ++j) acc[i][j] = fma8(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NT; ++j) out[(m0 + i) * n + n0 + j] = sum_lanes(acc[i][j]);
}

// Outputs n0 .. n0 + NT - 1 for every row: the weight's NT rows stay in L1 across the row tiles.
template <int NT>
void outputs(const float* x, const float* w, float* out, int64_t m, int64_t k, int64_t n, int64_t n0) {
  int64_t m0 = 0;
  for (; m0 + 4 <= m; m0 += 4) tile<4, NT>(x, w, out, k, n, m0, n0);
  switch (m - m0) {
    case 3: tile<3, NT>(x, w, out, k, n, m0, n0); break;
    case 2: tile<2, NT>(x, w, out, k, n, m0, n0); break;
    case 1: tile<1, NT>(x, w, out, k, n, m0, n0); break;
    default: break;
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
  constexpr int64_t kOutputs = 3;
  const int64_t tiles = n / kOutputs;
  at::parallel_for(0, tiles, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) outputs<kOutputs>(xp, wp, op, m, k, n, t * kOutputs);
  });
  for (int64_t n0 = tiles * kOutputs; n0 < n; ++n0) outputs<1>(xp, wp, op, m, k, n, n0);
  return out;
}
