// Batch-invariant Linear products for CPU: out = input @ weight.T (+ bias), float32 and bfloat16.
//
// Why: BLAS libraries pick their kernels, K-splits and blockings by the shape of the call, so
// the same row's dot products are summed in another order when it is computed beside 5 rows
// than beside 5,000 (MKL moved the embedded model's logits by ~1e-4 between pack shapes; in
// bf16, oneDNN's results moved enough to change answers). Here every output element is summed
// in ONE order, fixed by K alone, whatever the number of rows, the tile it lands in, the
// thread that computes it or the blocking: a question's products are bitwise the same packed
// with 5,000 other rows as alone, in a prefill as in a decode step.
//
// How: the weight is packed once (`linear_pack`) into panels of 16 outputs, so a k-step reads
// 16 outputs' weights as one vector; the product is an outer product over k.
//   float32: acc[i][j] = fma(x[i][k], w[j][k], acc[i][j]) for k = 0, 1, ..., K-1, from 0 —
//            the same sequence of fused multiply-adds on AVX-512 (tiles of 6 rows x 64 outputs)
//            and AVX2 (6 x 16), so both give the same bits; without FMA, multiply then add.
//   bfloat16: fp32 accumulators over k in steps of 32 (AMX `tdpbf16ps` tiles of 16 x 16, rows
//            padded with zeros to 16), or of 2 (AVX512-BF16 `vdpbf16ps`, register tiles of 6 rows
//            x 64 outputs with K in blocks whose accumulators are stored and reloaded exactly
//            between blocks), or the fma path: per pair the even product, then the odd
//            one, each an fp32 fused multiply-add of exact values (the same tiles on AVX-512, a
//            loop elsewhere); then + bias in fp32 and one rounding to bf16. A process uses one
//            of these for its whole life (`set_bf16_path`: without AMX, the faster of the other
//            two on this CPU, measured when the kernels load).
// Packed layouts (zero-padded, so padding adds exact zeros):
//   float32  [ceil(N/16)][K][16]
//   bfloat16 [ceil(N/32)*2][ceil(K/32)*16][16][2]   (k pairs: AMX's and vdpbf16ps's B layout)
// Threads: Kev's pool (pool.h), tasks claimed as threads are free; a task never changes what an element sums.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "exact.h"
#include "pool.h"

namespace {

constexpr int64_t kPanel = 16;  // outputs per packed panel
constexpr int64_t kRows = 6;    // rows per register tile (fp32; bf16 without AMX)
constexpr int64_t kRowBlock = 96;  // rows per task at most: their inputs stay in L2 while the panels stream

// Rows per task: at most kRowBlock, and the same for every block (rounded up to `tile`, the rows
// an AMX tile takes), in a number of blocks that the threads share evenly: a short last block
// (96 + 96 + 96 + 19 rows) would leave one thread with 192 of 307 rows while the other waits, when
// both have their cores. A pass of at most kRowBlock rows (a decode
// step) stays one block: its threads split the panels, and each weight is read once.
int64_t row_block(int64_t m, int64_t tile) {
  int64_t blocks = (m + kRowBlock - 1) / kRowBlock;
  const int64_t threads = kev::pool_threads();
  if (blocks > 1 && threads > 1) blocks = (blocks + threads - 1) / threads * threads;
  const int64_t rows = (m + blocks - 1) / blocks;
  return (rows + tile - 1) / tile * tile;
}

int64_t panels_f32(int64_t n) { return (n + kPanel - 1) / kPanel; }
int64_t panels_bf16(int64_t n) { return (n + 2 * kPanel - 1) / (2 * kPanel) * 2; }  // even: AMX takes pairs
int64_t pairs_bf16(int64_t k) { return (k + 31) / 32 * 16; }                       // k pairs, K padded to 32

// ---------------------------------------------------------------------------------------------
// float32
// ---------------------------------------------------------------------------------------------

#if defined(__AVX512F__)
// R rows x NP panels (NP <= 4): 24 accumulators at most; the row's value is broadcast per k.
template <int R, int NP>
void f32_tile(const float* x, int64_t ldx, const float* w, int64_t k, const float* bias, float* out, int64_t ldo,
              int64_t cols) {
  __m512 acc[R][NP];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < NP; ++j) acc[i][j] = _mm512_setzero_ps();
  const int64_t stride = k * kPanel;  // one panel
  for (int64_t kk = 0; kk < k; ++kk) {
    __m512 b[NP];
    for (int j = 0; j < NP; ++j) b[j] = _mm512_loadu_ps(w + j * stride + kk * kPanel);
    for (int i = 0; i < R; ++i) {
      const __m512 a = _mm512_set1_ps(x[i * ldx + kk]);
      for (int j = 0; j < NP; ++j) acc[i][j] = _mm512_fmadd_ps(a, b[j], acc[i][j]);
    }
  }
  for (int j = 0; j < NP; ++j) {
    const int64_t left = std::min<int64_t>(kPanel, cols - j * kPanel);
    const __mmask16 mask = left >= kPanel ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1);
    const __m512 add = bias != nullptr ? _mm512_maskz_loadu_ps(mask, bias + j * kPanel) : _mm512_setzero_ps();
    for (int i = 0; i < R; ++i) {
      const __m512 v = bias != nullptr ? _mm512_add_ps(acc[i][j], add) : acc[i][j];
      _mm512_mask_storeu_ps(out + i * ldo + j * kPanel, mask, v);
    }
  }
}
constexpr int kGroup = 4;  // panels a tile covers
#else
typedef float v8 __attribute__((vector_size(32)));
inline v8 load8(const float* p) {
  v8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline v8 fmadd8(v8 a, v8 b, v8 c) {
#if defined(__FMA__)
  return (v8)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
  return a * b + c;  // compiled without contraction: two roundings, the same in every tile
#endif
}
// R rows x 1 panel (two vectors of 8): 12 accumulators, for 16-register machines.
template <int R, int NP>
void f32_tile(const float* x, int64_t ldx, const float* w, int64_t k, const float* bias, float* out, int64_t ldo,
              int64_t cols) {
  static_assert(NP == 1, "one panel a tile without AVX-512");
  v8 acc[R][2] = {};
  for (int64_t kk = 0; kk < k; ++kk) {
    const v8 b0 = load8(w + kk * kPanel), b1 = load8(w + kk * kPanel + 8);
    for (int i = 0; i < R; ++i) {
      const float s = x[i * ldx + kk];
      const v8 a = {s, s, s, s, s, s, s, s};
      acc[i][0] = fmadd8(a, b0, acc[i][0]);
      acc[i][1] = fmadd8(a, b1, acc[i][1]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int64_t c = 0; c < std::min<int64_t>(kPanel, cols); ++c)
      out[i * ldo + c] = acc[i][c / 8][c % 8] + (bias != nullptr ? bias[c] : 0.f);
}
constexpr int kGroup = 1;

// One row (a decode step of one question) over NP panels at once: the same chain per output as
// f32_tile<1, 1>, but 2 x NP independent chains and NP weight streams in flight, where one panel's
// two chains leave each core waiting on the latency of its fused multiply-adds and loads.
template <int NP>
void f32_row_wide(const float* x, const float* w, int64_t k, const float* bias, float* out, int64_t cols) {
  v8 acc[NP][2] = {};
  const int64_t stride = k * kPanel;  // one panel
  for (int64_t kk = 0; kk < k; ++kk) {
    const float s = x[kk];
    const v8 a = {s, s, s, s, s, s, s, s};
    for (int j = 0; j < NP; ++j) {
      acc[j][0] = fmadd8(a, load8(w + j * stride + kk * kPanel), acc[j][0]);
      acc[j][1] = fmadd8(a, load8(w + j * stride + kk * kPanel + 8), acc[j][1]);
    }
  }
  for (int j = 0; j < NP; ++j)
    for (int64_t c = 0; c < std::min<int64_t>(kPanel, cols - j * kPanel); ++c)
      out[j * kPanel + c] = acc[j][c / 8][c % 8] + (bias != nullptr ? bias[j * kPanel + c] : 0.f);
}
constexpr int kWideRow = 4;  // panels a one-row task covers
#endif

// `rows` in register tiles of kRows, then one tile of what is left: tile(R, first row) with R a
// std::integral_constant, so each tile's row count is a compile-time constant (its accumulators
// stay in registers).
template <typename Tile>
inline void row_tiles(int64_t rows, Tile&& tile) {
  static_assert(kRows == 6, "the cases below cover 1 to kRows - 1 rows");
  int64_t i = 0;
  for (; i + kRows <= rows; i += kRows) tile(std::integral_constant<int, kRows>{}, i);
  switch (rows - i) {
    case 5: tile(std::integral_constant<int, 5>{}, i); break;
    case 4: tile(std::integral_constant<int, 4>{}, i); break;
    case 3: tile(std::integral_constant<int, 3>{}, i); break;
    case 2: tile(std::integral_constant<int, 2>{}, i); break;
    case 1: tile(std::integral_constant<int, 1>{}, i); break;
    default: break;
  }
}

template <int NP>
void f32_rows(const float* x, int64_t ldx, int64_t rows, const float* w, int64_t k, const float* bias, float* out,
              int64_t ldo, int64_t cols) {
  row_tiles(rows, [&](auto r, int64_t i) {
    f32_tile<decltype(r)::value, NP>(x + i * ldx, ldx, w, k, bias, out + i * ldo, ldo, cols);
  });
}

// out: rows of ldo floats (n of them computed here; quant.cpp writes chunks of a wider output).
void linear_f32(const float* x, int64_t m, int64_t k, const float* w, int64_t n, const float* bias, float* out,
                int64_t ldo) {
#if !defined(__AVX512F__)
  if (m == 1) {  // one row: each thread an even share of the panels, kWideRow at a time (f32_row_wide)
    const int64_t panels = panels_f32(n);
    kev::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
      for (int64_t p0 = begin; p0 < end; p0 += kWideRow) {
        const int64_t n0 = p0 * kPanel, cols = std::min(kWideRow * kPanel, n - n0);
        const float* wp = w + p0 * k * kPanel;
        const float* bp = bias != nullptr ? bias + n0 : nullptr;
        switch (std::min<int64_t>(kWideRow, end - p0)) {
          case 4: f32_row_wide<4>(x, wp, k, bp, out + n0, cols); break;
          case 3: f32_row_wide<3>(x, wp, k, bp, out + n0, cols); break;
          case 2: f32_row_wide<2>(x, wp, k, bp, out + n0, cols); break;
          default: f32_row_wide<1>(x, wp, k, bp, out + n0, cols); break;
        }
      }
    });
    return;
  }
#endif
  const int64_t panels = panels_f32(n), groups = (panels + kGroup - 1) / kGroup;
  const int64_t per_block = row_block(m, 1), blocks = (m + per_block - 1) / per_block;
  kev::parallel_for(0, blocks * groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t block = t / groups, group = t % groups;
      const int64_t m0 = block * per_block, rows = std::min(per_block, m - m0);
      const int64_t p0 = group * kGroup, n0 = p0 * kPanel, cols = std::min(kGroup * kPanel, n - n0);
      const float* wp = w + p0 * k * kPanel;
      const float* bp = bias != nullptr ? bias + n0 : nullptr;
      const float* xp = x + m0 * k;
      float* op = out + m0 * ldo + n0;
      switch (std::min<int64_t>(kGroup, panels - p0)) {
#if defined(__AVX512F__)
        case 4: f32_rows<4>(xp, k, rows, wp, k, bp, op, ldo, cols); break;
        case 3: f32_rows<3>(xp, k, rows, wp, k, bp, op, ldo, cols); break;
        case 2: f32_rows<2>(xp, k, rows, wp, k, bp, op, ldo, cols); break;
#endif
        default: f32_rows<1>(xp, k, rows, wp, k, bp, op, ldo, cols); break;
      }
    }
  });
}

// ---------------------------------------------------------------------------------------------
// bfloat16
// ---------------------------------------------------------------------------------------------

using bf16 = at::BFloat16;

inline float bits_to_float(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline float bf16_to_float(bf16 v) { return bits_to_float(static_cast<uint32_t>(v.x) << 16); }

enum class Bf16Path { kAmx, kAvx512Bf16, kFma };
static_assert(static_cast<int>(Bf16Path::kAmx) == kPathAmx && static_cast<int>(Bf16Path::kAvx512Bf16) == kPathAvx512Bf16,
              "exact.h names linear_bf16_path's values");

#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
bool amx_granted() {
  // Linux hands out AMX's tile state only on request (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
  static const bool granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return granted;
}

struct TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// every tile 16 rows x 64 bytes; prefill (amx_tile): 0-3 C (16 x 16 fp32), 4, 5 A (16 rows x 32
// bf16), 6, 7 B (16 k pairs x 16); decode (amx_decode): 0-5 C, 6 A, 7 B. The configuration lives in
// static storage: built on the stack, GCC dropped the stores of its rows and widths (ldtilecfg's
// read of them is not seen), and the instruction then faulted on what was left there.
void amx_configure() {
  static const TileConfig config = [] {
    TileConfig c;
    for (int t = 0; t < 8; ++t) {
      c.rows[t] = 16;
      c.colsb[t] = 64;
    }
    return c;
  }();
  _tile_loadconfig(&config);
}

// A 32-row x 32-output tile: rows a (stride lda bytes), panels b0 and b1, steps of 32 along K.
inline void amx_tile(const bf16* a, int64_t lda, const bf16* b0, const bf16* b1, int64_t steps, float* c) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const bf16* a1 = a + 16 * (lda / 2);
  for (int64_t s = 0; s < steps; ++s) {
    _tile_loadd(4, a + s * 32, lda);
    _tile_loadd(6, b0 + s * 512, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(7, b1 + s * 512, 64);
    _tile_dpbf16ps(1, 4, 7);
    _tile_loadd(5, a1 + s * 32, lda);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, c, 128);
  _tile_stored(1, c + 16, 128);
  _tile_stored(2, c + 16 * 32, 128);
  _tile_stored(3, c + 16 * 32 + 16, 128);
}

constexpr int kDecodePairs = 3;  // pairs of panels (6 panels, 96 outputs) a decode tile streams at once

// A decode pass's tile: 16 rows (a, padded) x the panels from b, panel J in C tile J; A in tile
// 6, each panel's step loaded into tile 7 just before its product. A decode pass streams every
// weight once and that streaming is its time: six panels read side by side keep more requests to
// memory in flight per core than two, which software prefetching did not (docs/benchmarks.md).
// (the tile intrinsics paste their tile number into the instruction: one line per C tile)
template <int NP>
inline void amx_decode(const bf16* a, int64_t lda, const bf16* b, int64_t panel_size, int64_t steps, float* c) {
  static_assert(NP == 2 || NP == 4 || NP == 6, "a decode tile takes 1 to 3 pairs of panels");
  constexpr int64_t ldc = NP * 16 * sizeof(float);
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (NP > 2) {
    _tile_zero(2);
    _tile_zero(3);
  }
  if constexpr (NP > 4) {
    _tile_zero(4);
    _tile_zero(5);
  }
#define KEV_PANEL(J)                                    \
  _tile_loadd(7, b + J * panel_size + s * 512, 64); \
  _tile_dpbf16ps(J, 6, 7)
  for (int64_t s = 0; s < steps; ++s) {
    _tile_loadd(6, a + s * 32, lda);
    KEV_PANEL(0);
    KEV_PANEL(1);
    if constexpr (NP > 2) {
      KEV_PANEL(2);
      KEV_PANEL(3);
    }
    if constexpr (NP > 4) {
      KEV_PANEL(4);
      KEV_PANEL(5);
    }
  }
#undef KEV_PANEL
  _tile_stored(0, c, ldc);
  _tile_stored(1, c + 16, ldc);
  if constexpr (NP > 2) {
    _tile_stored(2, c + 32, ldc);
    _tile_stored(3, c + 48, ldc);
  }
  if constexpr (NP > 4) {
    _tile_stored(4, c + 64, ldc);
    _tile_stored(5, c + 80, ldc);
  }
}
#endif

// The fastest this CPU and build may have: AMX, else AVX512-BF16, else fused multiply-adds.
Bf16Path native_bf16_path() {
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
  if (amx_granted()) return Bf16Path::kAmx;
#endif
#if defined(__AVX512BF16__)
  return Bf16Path::kAvx512Bf16;
#else
  return Bf16Path::kFma;
#endif
}

// The path of products that name none: native_bf16_path(), or the one set_bf16_path chose
// (kernels.py, when the kernels load: where `vdpbf16ps` is slow, the fma path is faster). Fixed
// once a product ran on it, so a process computes every bf16 product one way all its life.
std::atomic<int> chosen_path{-1};
std::atomic<bool> path_used{false};

Bf16Path bf16_path() {
  const int chosen = chosen_path.load();
  return chosen >= 0 ? static_cast<Bf16Path>(chosen) : native_bf16_path();
}

const char* bf16_path_name(Bf16Path path) {
  switch (path) {
    case Bf16Path::kAmx: return "amx";
    case Bf16Path::kAvx512Bf16: return "avx512_bf16";
    default: return "fma";
  }
}

// fp32 accumulators c [rows][ldc] (+ bias) rounded once to bf16 (to nearest even, as c10 does).
void store_bf16(const float* c, int64_t ldc, int64_t rows, const float* bias, bf16* out, int64_t ldo, int64_t cols) {
#if defined(__AVX512BF16__)
  for (int64_t j = 0; j < cols; j += 16) {
    const int64_t left = std::min<int64_t>(16, cols - j);
    const __mmask16 mask = left >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1);
    const __m512 add = bias != nullptr ? _mm512_maskz_loadu_ps(mask, bias + j) : _mm512_setzero_ps();
    for (int64_t i = 0; i < rows; ++i) {
      const __m512 v = _mm512_add_ps(_mm512_loadu_ps(c + i * ldc + j), add);
      _mm256_mask_storeu_epi16(out + i * ldo + j, mask, (__m256i)_mm512_cvtneps_pbh(v));
    }
  }
#else
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) out[i * ldo + j] = static_cast<bf16>(c[i * ldc + j] + (bias ? bias[j] : 0.f));
#endif
}

#if defined(__AVX512F__)
// register tiles of kRows (6) rows x kDpPanels panels: 6 x 4 accumulators, 4 weights and one
// broadcast = 29 of the 32 vector registers
constexpr int kDpPanels = 4;
constexpr int64_t kDpKBlock = 64;   // k pairs per K block in a decode pass: 4 panels' slice is 16 KB, in L1 across row tiles
// k pairs per K block in a prefill pass: 4 panels' slice is 256 KB, read from L2 by each row tile.
// Every block stores and reloads each row tile's accumulators (a row block's are 96 KB, in L2):
// in a prefill that traffic costs more than keeping the slice in L1 saves (docs/benchmarks.md).
constexpr int64_t kPrefillKBlock = 1024;
constexpr int64_t kAccFloats = 64 * 1024;  // a task's accumulators at most (256 KB: they stay in L2)
constexpr int64_t kDpAhead = 16;  // a decode pass requests each panel's weights this many k pairs ahead

// R rows x NP panels over k pairs [kp0, kp1): fp32 accumulators in c (ldc floats a row), zero when
// kp0 is 0, else read back; each output adds its k pairs in order from 0 whatever R, NP and blocks.
// X = bf16: `vdpbf16ps` on the rows' pairs (the AVX512-BF16 path). X = float: the fma path's
// arithmetic (bf16_tile_fma's: per pair the even product, then the odd one, each a fused
// multiply-add of exact fp32 values) on vectors, the rows given as fp32 — the same bits as that
// loop, at the rate of fp32's fused multiply-adds: on a core whose `vdpbf16ps` retires slower
// than two of those, faster than the AVX512-BF16 path (`dtype_choice.choose_bf16_path` measures which).
// ahead (k pairs, 0 for none): each panel's weights that far on are requested per k pair, so a
// tile whose weights come from memory (a decode pass's first row tile) finds them arriving.
template <int R, int NP, typename X>
inline void pair_tile(const X* x, int64_t ldx, const bf16* w, int64_t panel_size, int64_t kp0, int64_t kp1, float* c,
                      int64_t ldc, int64_t ahead = 0) {
  __m512 acc[R][NP];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < NP; ++j) acc[i][j] = kp0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(c + i * ldc + j * 16);
  for (int64_t kp = kp0; kp < kp1; ++kp) {
    if (ahead != 0)  // past a panel's end: the next panel's start, or nothing (a request never faults)
      for (int j = 0; j < NP; ++j) __builtin_prefetch(w + j * panel_size + (kp + ahead) * 32);
    if constexpr (std::is_same_v<X, float>) {
      __m512 b[NP];  // each 32-bit lane holds a pair: the even k in its low half, the odd k in its high half
      for (int j = 0; j < NP; ++j)
        b[j] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_loadu_si512(w + j * panel_size + kp * 32), 16));
      for (int i = 0; i < R; ++i) {
        const __m512 a = _mm512_set1_ps(x[i * ldx + 2 * kp]);
        for (int j = 0; j < NP; ++j) acc[i][j] = _mm512_fmadd_ps(a, b[j], acc[i][j]);
      }
      const __m512i high = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
      for (int j = 0; j < NP; ++j)
        b[j] = _mm512_castsi512_ps(_mm512_and_si512(_mm512_loadu_si512(w + j * panel_size + kp * 32), high));
      for (int i = 0; i < R; ++i) {
        const __m512 a = _mm512_set1_ps(x[i * ldx + 2 * kp + 1]);
        for (int j = 0; j < NP; ++j) acc[i][j] = _mm512_fmadd_ps(a, b[j], acc[i][j]);
      }
    } else {
#if defined(__AVX512BF16__)
      __m512bh b[NP];
      for (int j = 0; j < NP; ++j) b[j] = (__m512bh)_mm512_loadu_si512(w + j * panel_size + kp * 32);
      for (int i = 0; i < R; ++i) {
        int32_t pair;
        std::memcpy(&pair, x + i * ldx + 2 * kp, sizeof(pair));
        const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
        for (int j = 0; j < NP; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], a, b[j]);
      }
#endif
    }
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < NP; ++j) _mm512_storeu_ps(c + i * ldc + j * 16, acc[i][j]);
}

// The rows in register tiles over the same weights: the first tile reads them (from memory in a
// decode pass: it requests them `ahead`), the others from L1. In a decode pass those others request
// the next K block's slice meanwhile, so memory is busy while they compute, not only during the
// first tile.
template <int NP, typename X>
inline void pair_rows(const X* x, int64_t ldx, int64_t rows, const bf16* w, int64_t panel_size, int64_t kp0,
                      int64_t kp1, float* c, int64_t ldc, int64_t ahead) {
  row_tiles(rows, [&](auto r, int64_t i) {
    pair_tile<decltype(r)::value, NP, X>(x + i * ldx, ldx, w, panel_size, kp0, kp1, c + i * ldc, ldc,
                                         i == 0 || ahead == 0 ? ahead : kDpKBlock);
  });
}

// bf16 products on AVX-512 without AMX, by pair_tile<X> (X = bf16: AVX512-BF16; float: fused
// multiply-adds): each task a row block x a run of panels, its K in blocks (kDpKBlock pairs in a
// decode pass, kPrefillKBlock in a prefill); within a block the weight slice of kDpPanels panels
// stays in cache while every row tile of the block uses it, and the accumulators wait in c between
// K blocks (stored and reloaded as fp32: exact, so blocking changes no sum).
template <typename X>
void linear_bf16_pairs(const bf16* x, int64_t m, int64_t k, const bf16* w, int64_t n, const float* bias, bf16* out,
                       int64_t ldo) {
  const int64_t panels = panels_bf16(n), panel_size = pairs_bf16(k) * 32, k_pairs = (k + 1) / 2;
  const int64_t per_block = row_block(m, 1), blocks = (m + per_block - 1) / per_block;
  // panels per task: 16 (256 outputs) when there are several row blocks (prefill); one row block
  // (a decode pass) splits its panels into whole register tiles, in as few tasks as keep a task's
  // accumulators within kAccFloats, as many as a multiple of kev::kTasksPerThread per thread: no thread
  // streams more of the weights than another, and one whose core is taken streams less
  int64_t per_task = 16;
  if (blocks == 1) {
    const int64_t shares = kev::kTasksPerThread * kev::pool_threads();
    const int64_t tiles = (panels + kDpPanels - 1) / kDpPanels;
    const int64_t most = std::max<int64_t>(1, kAccFloats / (16 * per_block) / kDpPanels);
    const int64_t tasks = ((tiles + most - 1) / most + shares - 1) / shares * shares;
    per_task = (tiles + tasks - 1) / tasks * kDpPanels;
  }
  const int64_t groups = (panels + per_task - 1) / per_task;
  const int64_t lda = 2 * k_pairs;  // pairs read two columns: an odd K gets a zero column
  kev::parallel_for(0, blocks * groups, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(per_block * per_task * 16);
    std::vector<X> rows_in;  // the block's rows as X, lda wide, where they are not already
    int64_t rows_of = -1;     // the row block rows_in holds
    for (int64_t t = begin; t < end; ++t) {
      const int64_t block = t / groups, group = t % groups;
      const int64_t m0 = block * per_block, rows = std::min(per_block, m - m0);
      const int64_t p0 = group * per_task, p1 = std::min(panels, p0 + per_task);
      const int64_t n0 = p0 * kPanel, cols = std::min((p1 - p0) * kPanel, n - n0);
      if (cols <= 0) continue;
      const int64_t ldc = (p1 - p0) * 16;
      const X* a = nullptr;
      if constexpr (std::is_same_v<X, bf16>) {
        if (lda == k) a = x + m0 * k;  // an even K: the rows as they are
      }
      if (a == nullptr) {
        if (rows_of != block) {
          rows_in.assign(rows * lda, X(0.f));
          for (int64_t r = 0; r < rows; ++r)
            for (int64_t j = 0; j < k; ++j) rows_in[r * lda + j] = static_cast<X>(x[(m0 + r) * k + j]);
          rows_of = block;
        }
        a = rows_in.data();
      }
      // a decode pass (one row block) streams its weights from memory: kDpPanels panels at a time,
      // each through all of K (a few sequential streams), requested ahead; a prefill block goes K
      // block by K block across its panels, its rows' slice of K reused from cache by every panel.
      // Each output adds its k pairs in order either way.
      const int64_t ahead = blocks == 1 ? kDpAhead : 0;
      const int64_t k_block = blocks == 1 ? kDpKBlock : kPrefillKBlock;
      auto unit = [&](int64_t kp0, int64_t p) {
        const int64_t kp1 = std::min(k_pairs, kp0 + k_block);
        const bf16* wp = w + p * panel_size;
        float* cp = acc.data() + (p - p0) * 16;
        if (p1 - p >= kDpPanels)  // panels come in pairs: the last tile of a run has 4 or 2
          pair_rows<kDpPanels>(a, lda, rows, wp, panel_size, kp0, kp1, cp, ldc, ahead);
        else
          pair_rows<2>(a, lda, rows, wp, panel_size, kp0, kp1, cp, ldc, ahead);
      };
      if (blocks == 1) {
        for (int64_t p = p0; p < p1; p += kDpPanels)
          for (int64_t kp0 = 0; kp0 < k_pairs; kp0 += k_block) unit(kp0, p);
      } else {
        for (int64_t kp0 = 0; kp0 < k_pairs; kp0 += k_block)
          for (int64_t p = p0; p < p1; p += kDpPanels) unit(kp0, p);
      }
      store_bf16(acc.data(), ldc, rows, bias != nullptr ? bias + n0 : nullptr, out + m0 * ldo + n0, ldo, cols);
    }
  });
}
#endif

// The fma path without AVX-512: up to 6 rows x 32 outputs, the even product then the odd one,
// each a fused multiply-add in fp32 (exact products of bf16s).
void bf16_tile_fma(const bf16* x, int64_t ldx, int64_t rows, const bf16* b0, const bf16* b1, int64_t k_pairs,
                   float* c) {
  for (int64_t i = 0; i < rows; ++i) {
    float acc[32] = {};
    for (int64_t kp = 0; kp < k_pairs; ++kp) {
      const float a0 = bf16_to_float(x[i * ldx + 2 * kp]), a1 = bf16_to_float(x[i * ldx + 2 * kp + 1]);
      for (int j = 0; j < 32; ++j) {
        const bf16* b = (j < 16 ? b0 : b1) + kp * 32 + (j % 16) * 2;
        acc[j] = __builtin_fmaf(a0, bf16_to_float(b[0]), acc[j]);
        acc[j] = __builtin_fmaf(a1, bf16_to_float(b[1]), acc[j]);
      }
    }
    std::memcpy(c + i * 32, acc, sizeof(acc));
  }
}

void linear_bf16(const bf16* x, int64_t m, int64_t k, const bf16* w, int64_t n, const float* bias, bf16* out,
                 int64_t ldo, Bf16Path path) {
#if defined(__AVX512BF16__)
  if (path == Bf16Path::kAvx512Bf16) return linear_bf16_pairs<bf16>(x, m, k, w, n, bias, out, ldo);
#endif
#if defined(__AVX512F__)
  if (path == Bf16Path::kFma) return linear_bf16_pairs<float>(x, m, k, w, n, bias, out, ldo);
#endif
  const int64_t panels = panels_bf16(n), pairs = panels / 2, k_pairs = pairs_bf16(k), kpad = 2 * k_pairs;
  const int64_t panel_size = k_pairs * 32;                  // bf16 elements of one packed panel
  // AMX reads 32 columns a step, the others pairs: a row whose K does not fill them is padded with zeros
  const bool padded_rows = path == Bf16Path::kAmx ? k != kpad : k % 2 != 0;
  // AMX: 32-row tiles, or 16 when the pass has no more (a decode step); the fma path: 6 rows
  const int64_t tile_rows = path != Bf16Path::kAmx ? kRows : m <= 16 ? 16 : 32;
  const int64_t per_block = row_block(m, path == Bf16Path::kAmx ? tile_rows : 1);
  const int64_t blocks = (m + per_block - 1) / per_block;
  // pairs of panels per task: 8 (256 outputs: their panels stay in L2 while each row tile of the
  // block reads them again); a pass of one row tile (a decode step) reads each panel once, so
  // each thread takes even shares, kev::kTasksPerThread of them, as the weights' streaming is its time
  const int64_t shares = kev::kTasksPerThread * kev::pool_threads();
  const int64_t per_task = m <= tile_rows ? (pairs + shares - 1) / shares : 8;
  const int64_t groups = (pairs + per_task - 1) / per_task;
  kev::parallel_for(0, blocks * groups, 1, [&](int64_t begin, int64_t end) {
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
    if (path == Bf16Path::kAmx) amx_configure();
#endif
    alignas(64) float c[32 * 32 + 16 * 32];  // a 32 x 32 tile, or a decode tile of 16 x 96
    std::vector<bf16> pad;
    for (int64_t t = begin; t < end; ++t) {
      const int64_t block = t / groups, group = t % groups;
      const int64_t m0 = block * per_block, rows_in_block = std::min(per_block, m - m0);
      const int64_t q0 = group * per_task, q1 = std::min(pairs, q0 + per_task);
      for (int64_t i = 0; i < rows_in_block; i += tile_rows) {
        const int64_t rows = std::min(tile_rows, rows_in_block - i);
        const bf16* a = x + (m0 + i) * k;
        int64_t lda = k;
        if (padded_rows || (path == Bf16Path::kAmx && rows < tile_rows)) {  // zero rows and columns
          pad.assign(tile_rows * kpad, bf16(0.f));
          for (int64_t r = 0; r < rows; ++r) std::memcpy(pad.data() + r * kpad, a + r * k, k * sizeof(bf16));
          a = pad.data();
          lda = kpad;
        }
        for (int64_t q = q0; q < q1;) {
          int64_t take = 1;  // pairs of panels this tile: a decode pass's AMX tile takes up to kDecodePairs
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
          if (path == Bf16Path::kAmx && tile_rows == 16) take = std::min<int64_t>(kDecodePairs, q1 - q);
#endif
          const bf16* b0 = w + (2 * q) * panel_size;
          const int64_t n0 = 2 * q * kPanel, cols = std::min<int64_t>(2 * take * kPanel, n - n0);
          if (cols > 0) {
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
            if (path == Bf16Path::kAmx) {
              const int64_t steps = k_pairs / 16;
              if (tile_rows == 32)
                amx_tile(a, lda * 2, b0, b0 + panel_size, steps, c);
              else if (take == 3)
                amx_decode<6>(a, lda * 2, b0, panel_size, steps, c);
              else if (take == 2)
                amx_decode<4>(a, lda * 2, b0, panel_size, steps, c);
              else
                amx_decode<2>(a, lda * 2, b0, panel_size, steps, c);
            } else
#endif
              bf16_tile_fma(a, lda, rows, b0, b0 + panel_size, (k + 1) / 2, c);
            store_bf16(c, 32 * take, rows, bias != nullptr ? bias + n0 : nullptr, out + (m0 + i) * ldo + n0, ldo, cols);
          }
          q += take;
        }
      }
    }
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
    if (path == Bf16Path::kAmx) _tile_release();
#endif
  });
}

Bf16Path parse_path(const std::string& name) {
  if (name.empty()) {
    path_used = true;
    return bf16_path();
  }
  for (Bf16Path p : {Bf16Path::kAmx, Bf16Path::kAvx512Bf16, Bf16Path::kFma}) {
    if (name == bf16_path_name(p)) {
      if (p == Bf16Path::kAmx && native_bf16_path() != Bf16Path::kAmx)
        TORCH_CHECK(false, "linear: the amx path is not available on this machine");
#if !defined(__AVX512BF16__)
      if (p == Bf16Path::kAvx512Bf16) TORCH_CHECK(false, "linear: this build has no avx512_bf16 path");
#endif
      return p;
    }
  }
  TORCH_CHECK(false, "linear: unknown bf16 path '", name, "'; use amx, avx512_bf16 or fma");
}

}  // namespace

// The packed layout of weight [N, K] (float32 or bfloat16) that `linear_packed` reads.
at::Tensor linear_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.dim() == 2, "linear_pack takes a CPU weight [N, K]");
  const int64_t n = weight.size(0), k = weight.size(1);
  const auto w = weight.contiguous();
  if (w.scalar_type() == at::kFloat) {
    auto packed = at::zeros({panels_f32(n), k, kPanel}, w.options());
    const float* src = w.data_ptr<float>();
    float* dst = packed.data_ptr<float>();
    kev::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
      for (int64_t j = begin; j < end; ++j)
        for (int64_t kk = 0; kk < k; ++kk) dst[((j / kPanel) * k + kk) * kPanel + j % kPanel] = src[j * k + kk];
    });
    return packed;
  }
  TORCH_CHECK(w.scalar_type() == at::kBFloat16, "linear_pack takes float32 or bfloat16, not ", w.scalar_type());
  const int64_t k_pairs = pairs_bf16(k);
  auto packed = at::zeros({panels_bf16(n), k_pairs, kPanel, 2}, w.options());
  const bf16* src = w.data_ptr<bf16>();
  bf16* dst = packed.data_ptr<bf16>();
  kev::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j)
      for (int64_t kk = 0; kk < k; ++kk)
        dst[(((j / kPanel) * k_pairs + kk / 2) * kPanel + j % kPanel) * 2 + kk % 2] = src[j * k + kk];
  });
  return packed;
}

// input [M, K] @ weight.T (+ bias [N]) -> [M, N] from linear_pack(weight); `path` picks a bf16
// instruction path for tests ("" = this machine's: the one an engine uses).
at::Tensor linear_packed(const at::Tensor& input, const at::Tensor& packed, int64_t n,
                         const c10::optional<at::Tensor>& bias, const std::string& path) {
  TORCH_CHECK(input.device().is_cpu() && packed.device().is_cpu(), "linear_packed runs on CPU tensors");
  TORCH_CHECK(input.dim() == 2 && input.scalar_type() == packed.scalar_type(),
              "linear_packed: input [M, K] of the packed weight's dtype (", packed.scalar_type(), "), got ",
              input.scalar_type(), " of ", input.dim(), " dims");
  const auto x = input.contiguous();
  const int64_t m = x.size(0), k = x.size(1);
  const bool f32 = x.scalar_type() == at::kFloat;
  TORCH_CHECK(packed.is_contiguous() && packed.dim() == (f32 ? 3 : 4), "linear_packed: not a packed weight");
  TORCH_CHECK(f32 ? (packed.size(0) == panels_f32(n) && packed.size(1) == k)
                  : (packed.size(0) == panels_bf16(n) && packed.size(1) == pairs_bf16(k)),
              "linear_packed: the packed weight is not [", n, ", ", k, "]");
  at::Tensor bias32;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == n, "linear_packed: bias of ", bias->numel(), " values for ", n, " outputs");
    bias32 = bias->to(at::kFloat).contiguous();
  }
  const float* b = bias32.defined() ? bias32.data_ptr<float>() : nullptr;
  auto out = at::empty({m, n}, x.options());
  if (m == 0) return out;
  if (f32) {
    linear_f32(x.data_ptr<float>(), m, k, packed.data_ptr<float>(), n, b, out.data_ptr<float>(), n);
  } else {
    linear_bf16(x.data_ptr<bf16>(), m, k, packed.data_ptr<bf16>(), n, b, out.data_ptr<bf16>(), n, parse_path(path));
  }
  return out;
}

// rows x [m, k] (float32 or bfloat16, contiguous) @ a packed weight at w (linear_pack's layout of an
// [n, k] weight, in memory of the caller's) into the first n columns of out (rows of ldo values):
// quant.cpp's products, chunk by chunk of outputs decoded into that layout. `path`: linear_bf16_path's.
void linear_packed_into(const void* x, int64_t m, int64_t k, const void* w, int64_t n, const float* bias, void* out,
                        int64_t ldo, bool f32, int path) {
  if (f32)
    linear_f32(static_cast<const float*>(x), m, k, static_cast<const float*>(w), n, bias, static_cast<float*>(out),
               ldo);
  else
    linear_bf16(static_cast<const bf16*>(x), m, k, static_cast<const bf16*>(w), n, bias, static_cast<bf16*>(out),
                ldo, static_cast<Bf16Path>(path));
}

// store_bf16 for quant.cpp's decode tiles: their accumulators rounded as linear.cpp's are.
void store_bf16_rows(const float* c, int64_t ldc, int64_t rows, const float* bias, at::BFloat16* out, int64_t ldo,
                     int64_t cols) {
  store_bf16(c, ldc, rows, bias, out, ldo, cols);
}

#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
// This thread's tiles configured as linear.cpp's AMX products have them (every tile 16 rows x 64
// bytes), for quant.cpp's decode tiles.
void amx_configure_tiles() { amx_configure(); }
#endif

// The bf16 path a product naming `name` takes ("": this process's), for linear_packed_into.
int linear_bf16_path(const std::string& name) { return static_cast<int>(parse_path(name)); }

// Which instructions compute each dtype here: "float32:<...> bfloat16:<...>".
// The bf16 path of products that name none, from now on; refused (naming both) once one ran on
// another path.
void set_bf16_path(const std::string& name) {
  TORCH_CHECK(!name.empty(), "set_bf16_path: name a path: amx, avx512_bf16 or fma");
  const Bf16Path path = parse_path(name);
  TORCH_CHECK(!path_used || path == bf16_path(), "set_bf16_path: bfloat16 products already ran on the ",
              bf16_path_name(bf16_path()), " path in this process; the ", name, " path must be set before any");
  chosen_path = static_cast<int>(path);
}

std::string linear_paths() {
#if defined(__AVX512F__)
  const std::string f32 = "avx512_fma";
#elif defined(__FMA__)
  const std::string f32 = "avx2_fma";
#else
  const std::string f32 = "vector";
#endif
  return "float32:" + f32 + " bfloat16:" + bf16_path_name(bf16_path());
}
