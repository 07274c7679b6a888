// Products on GGUF's quantized blocks, block-scaled: each group's scale applied once to the sum of
// the activations times its stored integers, not once a weight.
//
// Why: a decode step reads every weight once, and decoding each to a float (an integer conversion,
// a multiply by its scale, an add of its offset, a rounding to bf16) costs more than the bytes it
// saves (quant.cpp's decoded products). A weight of group g is S_g * q + O'_g (O' = O, -O or none by
// the format), so a row's sum over the group is S_g * sum(x * q) + O'_g * sum(x): the integers q
// (exact as floats) multiply the activations as they are, and the scales come in once a group.
//
// What it computes, for every output of every row, whatever the rows beside it, the tile or the
// thread (so a row's product is the same bits alone or in any pack, in a prefill as in a decode
// step), from acc = 0:
//   for each group g of K in order:  p = 0;  p = fma(x[k], q[k], p) for k in g in order;
//                                    acc = fma(S_g, p, acc);  acc = fma(O'_g, sx_g, acc) (if an offset)
// where sx_g is the row's sum of x over g (adds in order); then + bias in fp32 and, for bf16, one
// rounding to nearest even. x is the input as fp32 (exact from bf16). The same operations on every
// x86 CPU with fused multiply-adds (AVX-512 tiles here; one scalar at a time elsewhere): the same
// bits on each. Not the bits of the product on gguf's dequantized weights (quant.cpp's decoded
// arithmetic, which a prompt's rows take, and on AMX every row) but within fp32 rounding of it;
// tests/test_quant.py checks this arithmetic bit for bit against tests/quant_reference.py, which
// writes it out in numpy. The rows that take it (quant_linear: a generated token's, and every row
// without AVX-512) take it whatever their count, so a row's bits never depend on the pass.
//
// bf16 on the AVX512-BF16 path (linear.cpp's `vdpbf16ps` products) takes the same arithmetic with
// a group's p summed a pair of k at a time by `vdpbf16ps` on the bf16 input and the integers q as
// bf16 (exact): p += x[k+1] * q[k+1], then p += x[k] * q[k], each rounded to fp32 (the instruction's
// order; a product of bf16s is exact in fp32), so a group's sum is the instruction's and the rest
// (scales, offsets, bias, rounding) as above.
//
// Threads: a product's tasks (a run of 8 panels x a run of up to 96 rows) are claimed from a
// counter. Up to 64 rows (kTileRows) each run of 6 is a register tile that decodes the panels'
// values as it goes; more rows' values are decoded 128 k of 4 panels at a time into an L1 buffer
// for all their tiles.
#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "exact.h"
#include "pool.h"
#include "quant_blocks.h"

namespace kev_quant {
namespace {

// Every format with an offset groups 32 weights: a row's sums of x (sx) are over runs of this many.
constexpr int64_t kSumGroup = 32;

// The input's element: float (the fused multiply-adds' arithmetic) or a bf16's bits (vdpbf16ps's).
template <typename X>
constexpr bool kDot = std::is_same_v<X, uint16_t>;

// q (the stored value less the format's zero) of every k of a panel's block, as fp32, into
// q [block_k][16]; S and O' of each group into S [groups][16], O [groups][16].
template <int T>
inline void block_q(const uint8_t* block, float* q, float* S, float* O) {
  constexpr Format f = format_of(T);
  constexpr int groups = f.block_k / f.group;
  for (int j = 0; j < kLanes; ++j) {
    float s[groups], o[groups] = {};
    uint8_t bytes[f.scale_bytes];
    row_scales<T>(lane_scale_bytes<T>(block, j, bytes), s, o);
    for (int g = 0; g < groups; ++g) {
      S[g * kLanes + j] = s[g];
      O[g * kLanes + j] = f.kind == 2 ? -o[g] : o[g];
    }
  }
  for (int k = 0; k < f.block_k; ++k)
    for (int r = 0; r < kLanes; ++r) q[k * kLanes + r] = static_cast<float>(stored_value<T>(block, k, r));
}

// R rows of x (fp32, ldx apart; sx their group sums, ldsx apart) times `count` panels (each
// `blocks` blocks from panels[i]) into c [R][count * 16] — the arithmetic above, one scalar at a time.
template <int T>
void scaled_rows_generic(const float* x, int64_t ldx, const float* sx, int64_t ldsx, int64_t rows,
                         const uint8_t* const* panels, int count, int64_t blocks, float* c, int64_t ldc) {
  constexpr Format f = format_of(T);
  constexpr int groups = f.block_k / f.group;
  alignas(64) float q[f.block_k * kLanes], S[groups * kLanes], O[groups * kLanes];
  for (int64_t r = 0; r < rows; ++r)
    for (int i = 0; i < count * kLanes; ++i) c[r * ldc + i] = 0.f;
  for (int pi = 0; pi < count; ++pi) {
    for (int64_t b = 0; b < blocks; ++b) {
      block_q<T>(panels[pi] + b * block_bytes(f), q, S, O);
      for (int64_t r = 0; r < rows; ++r) {
        const float* xr = x + r * ldx + b * f.block_k;
        float* acc = c + r * ldc + pi * kLanes;
        for (int g = 0; g < groups; ++g) {
          float p[kLanes] = {};
          for (int i = 0; i < f.group; ++i) {
            const int k = g * f.group + i;
            for (int j = 0; j < kLanes; ++j) p[j] = std::fma(xr[k], q[k * kLanes + j], p[j]);
          }
          for (int j = 0; j < kLanes; ++j) {
            float a = std::fma(S[g * kLanes + j], p[j], acc[j]);
            if constexpr (f.kind != 0) a = std::fma(O[g * kLanes + j], sx[r * ldsx + b * groups + g], a);
            acc[j] = a;
          }
        }
      }
    }
  }
}

#if defined(KEV_QUANT_AVX512)
#if defined(__AVX512BF16__)
// p + a row's pair of x at k, k + 1 (x: its bf16 bits at k) times 16 outputs' pairs of values w
inline __m512 dot_step(__m512 p, __m512i w, const uint16_t* x) {
  uint32_t both;
  std::memcpy(&both, x, sizeof(both));
  return _mm512_dpbf16_ps(p, (__m512bh)w, (__m512bh)_mm512_set1_epi32(static_cast<int>(both)));
}
#endif

// A group's end, the same in every tile: acc = fma(S, p, acc), then the offset's fma with the
// row's sum over the group (acc + O * sum, or acc - O * sum as one rounding each).
template <int T>
inline __m512 add_group(__m512 acc, __m512 S, __m512 O, __m512 p, const float* sum) {
  constexpr Format f = format_of(T);
  acc = _mm512_fmadd_ps(S, p, acc);
  if constexpr (f.kind == 1) acc = _mm512_fmadd_ps(O, _mm512_set1_ps(*sum), acc);
  if constexpr (f.kind == 2) acc = _mm512_fnmadd_ps(O, _mm512_set1_ps(*sum), acc);
  return acc;
}

// Blocks a decode tile's prefetches run ahead, requested into L2 (`prefetcht1`): a tile decodes as
// it reads, and a request into L1 waits for one of the few misses an L1 keeps in flight, while one
// into L2 joins that cache's longer queue and the line moves on to L1 in time; one block on is far
// enough (docs/benchmarks.md has the distances and hints measured).
constexpr int64_t kAhead = 1;

// From block b of one of a tile's np panels (a part's panels lie one after another, `blocks` blocks
// each), the bytes to the block kAhead on: in the same panel, or past its end in the panel the next
// tile takes in its place (np panels on), so that tile's first blocks are on their way too. A
// prefetch past the part's end is dropped by the CPU (it never faults).
inline int64_t ahead(int64_t b, int64_t blocks, int np, int64_t bytes) {
  return (kAhead + (b + kAhead < blocks ? 0 : (np - 1) * blocks)) * bytes;
}

// scaled_rows_generic's arithmetic for R rows x NP panels in registers (X: kDot's), each panel's
// values decoded as the tile takes each pair of k.
template <int T, int R, int NP, typename X>
void scaled_tile(const X* x, int64_t ldx, const float* sx, int64_t ldsx, const uint8_t* const* panels,
                 int64_t blocks, float* c, int64_t ldc) {
  constexpr Format f = format_of(T);
  constexpr int groups = f.block_k / f.group;
  __m512 acc[R][NP];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NP; ++j) acc[r][j] = _mm512_setzero_ps();
  const uint8_t* block[NP];
  for (int64_t b = 0; b < blocks; ++b) {
    __m512 S[NP][groups], O[NP][groups] = {};  // O: none for the formats without an offset
    for (int j = 0; j < NP; ++j) {
      block[j] = panels[j] + b * block_bytes(f);
      panel_scales<T>(block[j], S[j], O[j]);
    }
    const X* xb = x + b * f.block_k;
    for (int g = 0; g < groups; ++g) {
      for (int j = 0; j < NP; ++j)  // this group's share of the block kAhead on, for each panel
        for (int64_t at = g * block_bytes(f) / groups; at < (g + 1) * block_bytes(f) / groups; at += 64)
          _mm_prefetch(reinterpret_cast<const char*>(block[j] + ahead(b, blocks, NP, block_bytes(f)) + at),
                       _MM_HINT_T1);
      __m512 p[R][NP];
      for (int r = 0; r < R; ++r)
        for (int j = 0; j < NP; ++j) p[r][j] = _mm512_setzero_ps();
      each_pair(g * f.group, f.group, [&](int k8, auto place) {
        constexpr int P = decltype(place)::value;
        const int k = k8 + 2 * P;
        for (int j = 0; j < NP; ++j) {
          if constexpr (kDot<X>) {
            const __m512i w = PanelValues<T>(block[j]).template pairs<P>(k8);
            for (int r = 0; r < R; ++r) p[r][j] = dot_step(p[r][j], w, xb + r * ldx + k);
          } else {
            __m512 even, odd;
            PanelValues<T>(block[j]).template pair<P>(k8, even, odd);
            for (int r = 0; r < R; ++r) p[r][j] = _mm512_fmadd_ps(_mm512_set1_ps(xb[r * ldx + k]), even, p[r][j]);
            for (int r = 0; r < R; ++r) p[r][j] = _mm512_fmadd_ps(_mm512_set1_ps(xb[r * ldx + k + 1]), odd, p[r][j]);
          }
        }
      });
      for (int r = 0; r < R; ++r)
        for (int j = 0; j < NP; ++j)
          acc[r][j] = add_group<T>(acc[r][j], S[j][g], O[j][g], p[r][j], sx + r * ldsx + b * groups + g);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NP; ++j) _mm512_storeu_ps(c + r * ldc + j * kLanes, acc[r][j]);
}

constexpr int kChunk = 128;       // k a prefill decodes at once: whole blocks of 32, or half a K-quant's
constexpr int kChunkGroups = 8;   // groups in a chunk at most (Q6_K's 8 of 16 weights)
constexpr int kChunkPanels = 4;   // panels a prefill's register tile spans (24 products a k for 6 rows)

// scaled_tile's arithmetic for R rows x NP panels over `groups` groups whose values and scales are
// decoded already (values: fp32 [NP][kChunk][16], or for kDot bf16 pairs [NP][kChunk / 2][16]), acc in
// c (read and written back once a group: exact), so a prefill decodes a chunk once for all its
// register tiles.
template <int T, int R, int NP, typename X>
void scaled_chunk_tile(const X* x, int64_t ldx, const float* sx, int64_t ldsx, const float* values,
                       const __m512 (*S)[kChunkGroups], const __m512 (*O)[kChunkGroups], int groups, float* c,
                       int64_t ldc) {
  constexpr Format f = format_of(T);
  for (int g = 0; g < groups; ++g) {
    __m512 p[R][NP];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < NP; ++j) p[r][j] = _mm512_setzero_ps();
    if constexpr (kDot<X>) {
      for (int i = 0; i < f.group; i += 2) {
        const int k = g * f.group + i;
        __m512i w[NP];
        for (int j = 0; j < NP; ++j) w[j] = _mm512_load_si512(values + (j * kChunk + k) / 2 * kLanes);
        for (int r = 0; r < R; ++r)
          for (int j = 0; j < NP; ++j) p[r][j] = dot_step(p[r][j], w[j], x + r * ldx + k);
      }
    } else {
      for (int i = 0; i < f.group; ++i) {
        const int k = g * f.group + i;
        __m512 w[NP];
        for (int j = 0; j < NP; ++j) w[j] = _mm512_load_ps(values + (j * kChunk + k) * kLanes);
        for (int r = 0; r < R; ++r) {
          const __m512 v = _mm512_set1_ps(x[r * ldx + k]);
          for (int j = 0; j < NP; ++j) p[r][j] = _mm512_fmadd_ps(v, w[j], p[r][j]);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int j = 0; j < NP; ++j) {
        float* at = c + r * ldc + j * kLanes;
        _mm512_storeu_ps(at, add_group<T>(_mm512_loadu_ps(at), S[j][g], O[j][g], p[r][j], sx + r * ldsx + g));
      }
    }
  }
}

template <int T, int NP, typename X>
void chunk_tiles(const X* x, int64_t ldx, const float* sx, int64_t ldsx, int64_t rows, const float* values,
                 const __m512 (*S)[kChunkGroups], const __m512 (*O)[kChunkGroups], int groups, float* c,
                 int64_t ldc) {
  for (int64_t r0 = 0; r0 < rows; r0 += 6) {
    const X* xr = x + r0 * ldx;
    const float* sr = sx + r0 * ldsx;
    float* cr = c + r0 * ldc;
    switch (std::min<int64_t>(6, rows - r0)) {
      case 1: scaled_chunk_tile<T, 1, NP, X>(xr, ldx, sr, ldsx, values, S, O, groups, cr, ldc); break;
      case 2: scaled_chunk_tile<T, 2, NP, X>(xr, ldx, sr, ldsx, values, S, O, groups, cr, ldc); break;
      case 3: scaled_chunk_tile<T, 3, NP, X>(xr, ldx, sr, ldsx, values, S, O, groups, cr, ldc); break;
      case 4: scaled_chunk_tile<T, 4, NP, X>(xr, ldx, sr, ldsx, values, S, O, groups, cr, ldc); break;
      case 5: scaled_chunk_tile<T, 5, NP, X>(xr, ldx, sr, ldsx, values, S, O, groups, cr, ldc); break;
      default: scaled_chunk_tile<T, 6, NP, X>(xr, ldx, sr, ldsx, values, S, O, groups, cr, ldc); break;
    }
  }
}

// A prefill's rows x `count` panels (even): per run of 4 panels (or a last 2), chunk by chunk of K
// (kChunk k: blocks of 32 whole, a K-quant's block in halves), the chunk's values decoded once into
// an L1 buffer (fp32, or kDot's bf16 pairs) and every register tile of 6 rows run over it (the
// arithmetic of scaled_tile, acc waiting in c between chunks).
template <int T, typename X>
void scaled_prefill(const X* x, int64_t ldx, const float* sx, int64_t ldsx, int64_t rows,
                    const uint8_t* const* panels, int count, int64_t blocks, float* c, int64_t ldc) {
  constexpr Format f = format_of(T);
  constexpr int groups = f.block_k / f.group;
  constexpr int chunk_groups = kChunk / f.group;  // groups a chunk
  static_assert(chunk_groups <= kChunkGroups && (f.block_k % kChunk == 0 || kChunk % f.block_k == 0),
                "a chunk is whole blocks or a whole part of one");
  static_assert(f.kind == 0 || f.group == kSumGroup, "a chunk's groups are the sums' groups");
  alignas(64) float values[kChunkPanels * kChunk * kLanes];
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < count * kLanes; ++i) c[r * ldc + i] = 0.f;
  const int64_t K = blocks * f.block_k;
  for (int j = 0; j < count; j += kChunkPanels) {
    const int np = std::min(kChunkPanels, count - j);
    for (int64_t k0 = 0; k0 < K; k0 += kChunk) {
      const int64_t span = std::min<int64_t>(kChunk, K - k0);  // a last chunk of fewer blocks of 32
      __m512 S[kChunkPanels][kChunkGroups], O[kChunkPanels][kChunkGroups] = {};
      for (int h = 0; h < np; ++h) {
        for (int64_t kb = k0; kb < k0 + span; kb += f.block_k < kChunk ? f.block_k : kChunk) {
          const uint8_t* block = panels[j + h] + kb / f.block_k * block_bytes(f);
          const int first = static_cast<int>(kb % f.block_k);  // the chunk's first k in this block
          __m512 s[groups], o[groups] = {};
          panel_scales<T>(block, s, o);
          const int g0 = static_cast<int>((kb - k0) / f.group);
          for (int g = 0; g < std::min(groups, chunk_groups); ++g) {
            S[h][g0 + g] = s[first / f.group + g];
            O[h][g0 + g] = o[first / f.group + g];
          }
          const PanelValues<T> v(block);
          const int64_t at = h * kChunk + (kb - k0);  // the block's first k in the buffer
          each_pair(first, std::min<int>(f.block_k, kChunk), [&](int k8, auto place) {
            constexpr int P = decltype(place)::value;
            const int64_t i = at + k8 - first + 2 * P;  // this pair's place in the buffer
            if constexpr (kDot<X>) {
              _mm512_store_si512(values + i / 2 * kLanes, v.template pairs<P>(k8));
            } else {
              __m512 even, odd;
              v.template pair<P>(k8, even, odd);
              _mm512_store_ps(values + i * kLanes, even);
              _mm512_store_ps(values + (i + 1) * kLanes, odd);
            }
          });
        }
      }
      const X* xk = x + k0;
      const float* sk = sx + k0 / kSumGroup;
      float* cj = c + j * kLanes;
      const int n = static_cast<int>(span / f.group);
      if (np == kChunkPanels)
        chunk_tiles<T, kChunkPanels, X>(xk, ldx, sk, ldsx, rows, values, S, O, n, cj, ldc);
      else
        chunk_tiles<T, 2, X>(xk, ldx, sk, ldsx, rows, values, S, O, n, cj, ldc);
    }
  }
}

// Rows a product takes in register tiles (at most kTileRows): past them, scaled_prefill. A tile
// decodes its panels' values as it goes, and each run of 6 rows decodes them again (from L2, the
// task's 8 panels being read already), where a prefill decodes a chunk once into L1 for all its
// rows but then loads every value and keeps its sums in memory between groups: up to 64 rows the
// tiles measured faster on Q4_0, Q4_1, Q4_K, Q6_K and Q8_0, within 6 % of the chunks on the 5-bit
// formats (docs/benchmarks.md). A decode pass of several questions, or their drafts' rows, takes them.
constexpr int64_t kTileRows = 64;

// `rows` rows x `count` panels (even): register tiles of up to 6 rows (1 row: 4 panels at a time,
// so 4 streams and 4 chains are in flight; more rows: 2 panels, each decoded vector serving every
// row), or past kTileRows rows scaled_prefill.
template <int T, typename X>
void scaled_rows(const X* x, int64_t ldx, const float* sx, int64_t ldsx, int64_t rows,
                 const uint8_t* const* panels, int count, int64_t blocks, float* c, int64_t ldc) {
  if (rows > kTileRows) return scaled_prefill<T, X>(x, ldx, sx, ldsx, rows, panels, count, blocks, c, ldc);
  for (int64_t r0 = 0; r0 < rows; r0 += 6) {
    const int64_t r = std::min<int64_t>(6, rows - r0);
    const X* xr = x + r0 * ldx;
    const float* sr = sx + r0 * ldsx;
    float* cr = c + r0 * ldc;
    for (int j = 0; j < count;) {
      if (r == 1 && count - j >= 4) {
        scaled_tile<T, 1, 4, X>(xr, ldx, sr, ldsx, panels + j, blocks, cr + j * kLanes, ldc);
        j += 4;
        continue;
      }
      switch (r) {
        case 1: scaled_tile<T, 1, 2, X>(xr, ldx, sr, ldsx, panels + j, blocks, cr + j * kLanes, ldc); break;
        case 2: scaled_tile<T, 2, 2, X>(xr, ldx, sr, ldsx, panels + j, blocks, cr + j * kLanes, ldc); break;
        case 3: scaled_tile<T, 3, 2, X>(xr, ldx, sr, ldsx, panels + j, blocks, cr + j * kLanes, ldc); break;
        case 4: scaled_tile<T, 4, 2, X>(xr, ldx, sr, ldsx, panels + j, blocks, cr + j * kLanes, ldc); break;
        case 5: scaled_tile<T, 5, 2, X>(xr, ldx, sr, ldsx, panels + j, blocks, cr + j * kLanes, ldc); break;
        default: scaled_tile<T, 6, 2, X>(xr, ldx, sr, ldsx, panels + j, blocks, cr + j * kLanes, ldc); break;
      }
      j += 2;
    }
  }
}
#else
template <int T, typename X>
void scaled_rows(const X* x, int64_t ldx, const float* sx, int64_t ldsx, int64_t rows,
                 const uint8_t* const* panels, int count, int64_t blocks, float* c, int64_t ldc) {
  static_assert(!kDot<X>, "vdpbf16ps's arithmetic is built with AVX512-BF16 only");
  scaled_rows_generic<T>(x, ldx, sx, ldsx, rows, panels, count, blocks, c, ldc);
}
#endif

}  // namespace

void scaled_product(const float* x, const uint16_t* dot, int64_t m, int64_t k, const std::vector<at::Tensor>& parts,
                    const std::vector<int64_t>& types, const std::vector<int64_t>& widths, const float* bias,
                    at::Tensor& out) {
  const int64_t n = out.size(1);
  const bool f32 = out.scalar_type() == at::kFloat;
#if !defined(__AVX512BF16__) || !defined(KEV_QUANT_AVX512)
  TORCH_CHECK(dot == nullptr, "quant_linear: this build has no avx512_bf16 path");
#endif
  bool offsets = false;
  for (const int64_t type : types) offsets = offsets || format_of(static_cast<int>(type)).kind != 0;
  const int64_t ldsx = k / kSumGroup;  // each row's sums over its groups, in order
  std::vector<float> sums(offsets ? m * ldsx : 1, 0.f);
  if (offsets)
    kev::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        for (int64_t g = 0; g < ldsx; ++g) {
          float s = 0.f;
          for (int64_t i = 0; i < kSumGroup; ++i) s += x[r * k + g * kSumGroup + i];
          sums[r * ldsx + g] = s;
        }
    });
  constexpr int64_t kRun = 8;  // panels a task
  const int64_t row_run = std::min<int64_t>(m, 96);
  const std::vector<Task> tasks = product_tasks(types, widths, m, row_run, [](int) { return kRun; });
  std::atomic<int64_t> next{0};
  kev::on_threads([&] {
    std::vector<float> c(row_run * kRun * kLanes);
    for (int64_t t = next++; t < static_cast<int64_t>(tasks.size()); t = next++) {
      const Task& task = tasks[t];
      const int64_t width = widths[task.part], n0 = task.p0 * kLanes;
      const int count = static_cast<int>(std::min(kRun, tiled_panels(width) - task.p0));
      const int64_t cols = std::min<int64_t>(count * kLanes, width - n0), rows = std::min(row_run, m - task.r0);
      const int64_t ldc = count * kLanes;
      by_type(static_cast<int>(types[task.part]), [&](auto tc) {
        constexpr int T = decltype(tc)::value;
        constexpr Format f = format_of(T);
        const int64_t blocks = k / f.block_k;
        const uint8_t* base = parts[task.part].data_ptr<uint8_t>();
        const uint8_t* panel[kRun];
        for (int j = 0; j < count; ++j) panel[j] = base + (task.p0 + j) * blocks * block_bytes(f);
        const float* sx = sums.data() + (offsets ? task.r0 * ldsx : 0);
#if defined(__AVX512BF16__) && defined(KEV_QUANT_AVX512)
        if (dot != nullptr) {
          scaled_rows<T>(dot + task.r0 * k, k, sx, ldsx, rows, panel, count, blocks, c.data(), ldc);
          return;
        }
#endif
        scaled_rows<T>(x + task.r0 * k, k, sx, ldsx, rows, panel, count, blocks, c.data(), ldc);
      });
      const float* b = bias != nullptr ? bias + task.col0 + n0 : nullptr;
      if (f32) {
        float* o = out.data_ptr<float>() + task.r0 * n + task.col0 + n0;
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t j = 0; j < cols; ++j) o[r * n + j] = b != nullptr ? c[r * ldc + j] + b[j] : c[r * ldc + j];
      } else {
        store_bf16_rows(c.data(), ldc, rows, b, out.data_ptr<at::BFloat16>() + task.r0 * n + task.col0 + n0, n, cols);
      }
    }
  });
}

}  // namespace kev_quant
