// Products on GGUF's quantized weights as they ship (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K),
// and rows of them (a quantized embedding table's lookup).
//
// Why: a quantized file is 3-4x smaller than its weights in bf16, and a decode step of a model of
// a few billion weights is bound by reading them. Here the weights stay in memory at the file's
// size (quant_blocks.h's layout) and each product reads them as stored.
//
// Two arithmetics, chosen per row by what the row is (never by the rows beside it), so a row's
// product is the same bits alone or in any pack:
// - decoded: every weight decoded to exactly the value gguf's own `dequantize` gives (the same fp32
//   operations in the same order: d * q, d * q + m, (d * sc) * q - dmin * m, ...), for bf16 rounded
//   as torch rounds, then multiplied by linear.cpp's kernels on those values: the same bits as
//   `linear_packed` on the dequantized weight. A prompt's rows take it (a prefill shares each decoded
//   panel across its rows, so decoding costs little and the product runs at the dense kernels'
//   rate), and on AMX every row (AMX multiplies far faster than decoding costs, and AMX's sums
//   cannot be reproduced otherwise).
// - block-scaled (quant_scaled.cpp): never a weight decoded to a float, each group's scale applied
//   once to its integers' sum with the inputs. The other rows take it (a decode step's: it reads
//   every block once, and decoding each weight would cost more than the bytes saved), and every row
//   in a build without AVX512-BF16.
//
// Threads (the decoded arithmetic): a prefill's tasks (a run of panels x a run of rows) are claimed
// from a counter; each decodes its panels into its thread's buffer and runs linear.cpp's product on
// them there. A decode pass on AMX decodes block by block into an L1 buffer instead, running
// linear.cpp's decode-tile steps on each block (amx_decoded_panels).
#include <algorithm>
#include <atomic>
#include <cstring>
#include <vector>

#include "exact.h"
#include "pool.h"
#include "quant_blocks.h"

namespace kev_quant {
namespace {

// Row `row` of the weight (all k values) as fp32 into out.
template <int T>
void decode_row(const uint8_t* tiled, int64_t k, int64_t row, float* out) {
  constexpr Format f = format_of(T);
  const int64_t blocks = k / f.block_k;
  const uint8_t* panel = tiled + (row / kLanes) * blocks * block_bytes(f);
  for (int64_t b = 0; b < blocks; ++b)
    decode_lane<T>(panel + b * block_bytes(f), static_cast<int>(row % kLanes), out + b * f.block_k);
}

#if defined(KEV_QUANT_AVX512) && defined(__AVX512BF16__)
// A panel's block as gguf's dequantized values, k by k (decode_lane's operations on the same values,
// 16 outputs a vector): `emit(k, w)` takes each k's weights.
template <int T, typename Emit>
inline void decode_panel_block(const uint8_t* block, Emit&& emit) {
  constexpr Format f = format_of(T);
  constexpr int groups = f.block_k / f.group;
  __m512 S[groups], O[groups] = {};  // O: none for the formats without an offset
  panel_scales<T>(block, S, O);
  const PanelValues<T> values(block);
  auto weight = [&](int g, __m512 q) {
    const __m512 w = _mm512_mul_ps(S[g], q);
    if constexpr (f.kind == 1) return _mm512_add_ps(w, O[g]);
    if constexpr (f.kind == 2) return _mm512_sub_ps(w, O[g]);
    return w;
  };
  each_pair(0, f.block_k, [&](int k8, auto place) {
    constexpr int P = decltype(place)::value;
    const int k = k8 + 2 * P;
    __m512 even, odd;
    values.template pair<P>(k8, even, odd);
    emit(k, weight(k / f.group, even));
    emit(k + 1, weight(k / f.group, odd));
  });
}

// Two k's 16 weights each as bf16 pairs (lane j: row j's even k, then its odd k), to nearest even.
// vcvtne2ps2bf16 rounds as c10 does wherever c10 and it agree: every value but NaN payloads and
// fp32 subnormals (which it flushes), and a decoded weight is never subnormal: every format's
// values are multiples of 2^-24 (fp16 scales times integers), so zero or at least 2^-24.
inline __m512i bf16_pairs(__m512 even, __m512 odd) {
  const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(odd, even);  // [even 0..15 | odd 0..15]
  const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                         21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return _mm512_permutexvar_epi16(order, both);
}

// A panel's block decoded into linear.cpp's bf16 layout at pairs: [block_k / 2][16 rows][2].
template <int T>
inline void decode_block_pairs(const uint8_t* block, uint32_t* pairs) {
  __m512 even = _mm512_setzero_ps();
  decode_panel_block<T>(block, [&](int kk, __m512 v) {
    if (kk % 2 == 0)
      even = v;
    else
      _mm512_storeu_si512(pairs + kk / 2 * kLanes, bf16_pairs(even, v));
  });
}

// Panels [p0, p0 + count) of a weight of k inputs into linear.cpp's bf16 packed layout at dst,
// [count][k / 2][16][2], block by block across the panels: `count` streams from memory in flight at
// once, where one panel after another would leave a core waiting on one stream.
template <int T>
void decode_panels(const uint8_t* tiled, int64_t k, int64_t p0, int64_t count, uint32_t* dst) {
  constexpr Format f = format_of(T);
  const int64_t blocks = k / f.block_k;
  for (int64_t b = 0; b < blocks; ++b)
    for (int64_t p = 0; p < count; ++p)
      decode_block_pairs<T>(tiled + ((p0 + p) * blocks + b) * block_bytes(f),
                            dst + (p * k + b * f.block_k) / 2 * kLanes);
}

// Panels [p0, p0 + count) as gguf's dequantized values in linear.cpp's fp32 packed layout at dst,
// [count][k][16], block by block across the panels as decode_panels goes.
template <int T>
void decode_panels_f32(const uint8_t* tiled, int64_t k, int64_t p0, int64_t count, float* dst) {
  constexpr Format f = format_of(T);
  const int64_t blocks = k / f.block_k;
  for (int64_t b = 0; b < blocks; ++b)
    for (int64_t p = 0; p < count; ++p) {
      float* panel = dst + (p * k + b * f.block_k) * kLanes;
      decode_panel_block<T>(tiled + ((p0 + p) * blocks + b) * block_bytes(f),
                            [&](int kk, __m512 v) { _mm512_storeu_ps(panel + kk * kLanes, v); });
    }
}

// Rows of x (float32 or bfloat16) times a weight decoded to gguf's values: each task (a run of 8
// panels x a run of 768 rows, claimed from a counter) decodes its panels into its thread's buffer
// (decode_panels, or decode_panels_f32 for float32) and runs linear.cpp's product on them there
// (`path`: linear_bf16_path's), so each row gets the bits of `linear_packed` on the dequantized
// weight, whatever the rows beside it.
void decoded_product(const at::Tensor& x, int64_t k, const std::vector<at::Tensor>& parts,
                     const std::vector<int64_t>& types, const std::vector<int64_t>& widths, const float* bias,
                     at::Tensor& out, int path) {
  constexpr int64_t run = 8, row_run = 768;
  const int64_t m = x.size(0), n = out.size(1), size = x.element_size();
  const bool f32 = x.scalar_type() == at::kFloat;
  const std::vector<Task> tasks = product_tasks(types, widths, m, row_run, [](int) { return run; });
  const char* xs = static_cast<const char*>(x.data_ptr());
  char* os = static_cast<char*>(out.data_ptr());
  std::atomic<int64_t> next{0};
  kev::on_threads([&] {
    std::vector<uint32_t> scratch(run * kLanes * k / (f32 ? 1 : 2));  // a value, or a bf16 pair, each
    for (int64_t t = next++; t < static_cast<int64_t>(tasks.size()); t = next++) {
      const Task& task = tasks[t];
      const int64_t width = widths[task.part], n0 = task.p0 * kLanes;
      const int64_t count = std::min(run, tiled_panels(width) - task.p0);  // whole pairs, as bf16 panels come
      const int64_t cols = std::min(count * kLanes, width - n0), rows = std::min(row_run, m - task.r0);
      const uint8_t* tiled = parts[task.part].data_ptr<uint8_t>();
      by_type(static_cast<int>(types[task.part]), [&](auto tc) {
        constexpr int T = decltype(tc)::value;
        if (f32)
          decode_panels_f32<T>(tiled, k, task.p0, count, reinterpret_cast<float*>(scratch.data()));
        else
          decode_panels<T>(tiled, k, task.p0, count, scratch.data());
      });
      linear_packed_into(xs + task.r0 * k * size, rows, k, scratch.data(), cols,
                         bias != nullptr ? bias + task.col0 + n0 : nullptr,
                         os + (task.r0 * n + task.col0 + n0) * size, n, f32, path);
    }
  });
}
#define KEV_QUANT_DECODED 1
#endif

#if defined(KEV_QUANT_DECODED) && defined(__AMX_BF16__) && defined(__AMX_TILE__)
constexpr int kAmxPanels = 6;  // panels a decode tile streams side by side (linear.cpp's kDecodePairs pairs)
constexpr int64_t kAmxBuffer = 16 * 1024;  // bytes of decoded blocks a tile keeps in L1 at most

// Panels a decode tile of `type` takes: kAmxPanels, fewer where their decoded blocks (a K-quant's
// are 256 k long: 8 KB a panel) would crowd L1, in pairs.
int64_t amx_panels(int type) {
  const int64_t block = format_of(type).block_k * kLanes * 2;
  return std::max<int64_t>(2, std::min<int64_t>(kAmxPanels, kAmxBuffer / block / 2 * 2));
}

// A decode pass's bf16 product on AMX, decoded in the tile: for `count` panels (even, at most
// kAmxPanels) from p0, each block of K decoded into an L1 buffer in the packed layout, then the
// block's 32-wide steps run as linear.cpp's `amx_decode` runs them (A, the rows padded to 16, in
// tile 6; each panel's step loaded into tile 7 just before its product into C tile J), the same
// instructions on the same values in the same order, so the bits of `linear_packed`. C (16 rows x
// count * 16 outputs, fp32) is left in c.
template <int T>
void amx_decoded_panels(const uint8_t* tiled, int64_t k, int64_t p0, int64_t count, const at::BFloat16* a,
                        float* c, uint32_t* buffer) {
  constexpr Format f = format_of(T);
  const int64_t blocks = k / f.block_k;
  constexpr int64_t panel_pairs = f.block_k / 2 * kLanes;  // one panel's block, as bf16 pairs
  for (int j = 0; j < count; ++j) {
    switch (j) {  // the tile number is part of the instruction
      case 0: _tile_zero(0); break;
      case 1: _tile_zero(1); break;
      case 2: _tile_zero(2); break;
      case 3: _tile_zero(3); break;
      case 4: _tile_zero(4); break;
      default: _tile_zero(5); break;
    }
  }
  for (int64_t b = 0; b < blocks; ++b) {
    for (int64_t p = 0; p < count; ++p) {
      decode_block_pairs<T>(tiled + ((p0 + p) * blocks + b) * block_bytes(f), buffer + p * panel_pairs);
    }
    for (int s = 0; s < f.block_k / 32; ++s) {
      _tile_loadd(6, a + b * f.block_k + s * 32, k * 2);
#define KEV_PANEL(J)                                                   \
  if (J < count) {                                                     \
    _tile_loadd(7, buffer + J * panel_pairs + s * 16 * kLanes, 64); \
    _tile_dpbf16ps(J, 6, 7);                                           \
  }
      KEV_PANEL(0);
      KEV_PANEL(1);
      KEV_PANEL(2);
      KEV_PANEL(3);
      KEV_PANEL(4);
      KEV_PANEL(5);
#undef KEV_PANEL
    }
  }
  const int64_t ldc = count * kLanes * sizeof(float);
  _tile_stored(0, c, ldc);
  _tile_stored(1, c + 16, ldc);
  if (count > 2) {
    _tile_stored(2, c + 32, ldc);
    _tile_stored(3, c + 48, ldc);
  }
  if (count > 4) {
    _tile_stored(4, c + 64, ldc);
    _tile_stored(5, c + 80, ldc);
  }
}
#define KEV_QUANT_AMX 1
#endif

#if defined(KEV_QUANT_AMX)
// quant_linear's decode pass on AMX: the rows padded to 16 (linear.cpp's decode tile), runs of
// panels (`amx_panels`) claimed by the threads, each decoded in the tile (amx_decoded_panels), then
// + bias in fp32 and one rounding to bf16 by linear.cpp's own store (store_bf16_rows).
void amx_decode_product(const at::Tensor& x, int64_t m, int64_t k, const std::vector<at::Tensor>& parts,
                        const std::vector<int64_t>& types, const std::vector<int64_t>& widths, const float* bias,
                        at::Tensor& out) {
  using bf16 = at::BFloat16;
  const int64_t n = out.size(1);
  std::vector<bf16> a(kLanes * k, bf16(0.f));
  std::memcpy(a.data(), x.data_ptr<bf16>(), m * k * sizeof(bf16));
  const std::vector<Task> tasks = product_tasks(types, widths, m, m, amx_panels);
  bf16* o = out.data_ptr<bf16>();
  std::atomic<int64_t> next{0};
  kev::on_threads([&] {
    amx_configure_tiles();
    alignas(64) float c[kLanes * kAmxPanels * kLanes];
    std::vector<uint32_t> buffer(kAmxPanels * 256 / 2 * kLanes);  // each panel's block of K (at most 256)
    for (int64_t t = next++; t < static_cast<int64_t>(tasks.size()); t = next++) {
      const Task& task = tasks[t];
      const int64_t count = std::min(amx_panels(static_cast<int>(types[task.part])),
                                     tiled_panels(widths[task.part]) - task.p0);
      by_type(static_cast<int>(types[task.part]), [&](auto tc) {
        amx_decoded_panels<decltype(tc)::value>(parts[task.part].data_ptr<uint8_t>(), k, task.p0, count, a.data(), c,
                                                buffer.data());
      });
      const int64_t n0 = task.p0 * kLanes, cols = std::min(count * kLanes, widths[task.part] - n0);
      store_bf16_rows(c, count * kLanes, m, bias != nullptr ? bias + task.col0 + n0 : nullptr, o + task.col0 + n0, n,
                      cols);
    }
    _tile_release();
  });
}

#endif

}  // namespace
}  // namespace kev_quant

using namespace kev_quant;

// rows ids [T] of a tiled weight [n, k] as fp32 [T, k] (a quantized embedding table's lookup).
at::Tensor quant_rows(const at::Tensor& tiled, int64_t type, int64_t n, int64_t k, const at::Tensor& ids) {
  check_tiled(tiled, type, n, k);
  const auto index = ids.to(at::kLong).contiguous();
  const int64_t* id = index.data_ptr<int64_t>();
  for (int64_t i = 0; i < index.numel(); ++i)
    TORCH_CHECK(id[i] >= 0 && id[i] < n, "quant_rows: row ", id[i], " of a weight of ", n, " rows");
  auto out = at::empty({index.numel(), k}, at::kFloat);
  float* o = out.data_ptr<float>();
  const uint8_t* t = tiled.data_ptr<uint8_t>();
  by_type(static_cast<int>(type), [&](auto tc) {
    kev::parallel_for(0, index.numel(), 16, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) decode_row<decltype(tc)::value>(t, k, id[i], o + i * k);
    });
  });
  return out;
}

std::string quant_path() {
#if defined(KEV_QUANT_AVX512)
  return "avx512";
#else
  return "scalar";
#endif
}

bool quant_prompt_decoded() {
#if defined(KEV_QUANT_DECODED)
  return true;
#else
  return false;
#endif
}

namespace {

// The block-scaled products of rows x into out (quant_scaled.cpp), `bf16_path` -1 for float32.
void scaled_into(const at::Tensor& x, int64_t k, const std::vector<at::Tensor>& parts,
                 const std::vector<int64_t>& types, const std::vector<int64_t>& widths, const float* bias,
                 at::Tensor& out, int bf16_path) {
  const bool f32 = x.scalar_type() == at::kFloat;
  const auto x32 = f32 ? x : x.to(at::kFloat);
  const bool dot = bf16_path == kPathAvx512Bf16;  // vdpbf16ps's group sums
  scaled_product(x32.data_ptr<float>(), dot ? reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()) : nullptr,
                 x.size(0), k, parts, types, widths, bias, out);
}

}  // namespace

// input [M, k] (float32 or bfloat16) @ W.T (+ bias) → [M, sum(widths)], W the parts stacked: part i
// tiled (`types[i]`, widths[i] outputs). `path`: a bf16 path for tests ("": this process's).
// `prompt` (bool [M], or none: no row): the rows that are a prompt's tokens. Where this build
// decodes (quant_prompt_decoded) they take the decoded weights' arithmetic (decoded_product: a
// prefill's rows share each decoded panel, so decoding costs little there) and the others the
// block-scaled one (a decode step's rows: it reads the blocks once, and decoding each weight would
// cost more than the bytes save). Which arithmetic a row takes depends on that row alone, never on
// the rows beside it. On AMX every row takes the decoded arithmetic.
at::Tensor quant_linear(const at::Tensor& input, const std::vector<at::Tensor>& parts,
                        const std::vector<int64_t>& types, const std::vector<int64_t>& widths,
                        const c10::optional<at::Tensor>& bias, const std::string& path,
                        const c10::optional<at::Tensor>& prompt) {
  TORCH_CHECK(input.device().is_cpu() && input.dim() == 2, "quant_linear takes a CPU input [M, K]");
  TORCH_CHECK(input.scalar_type() == at::kFloat || input.scalar_type() == at::kBFloat16,
              "quant_linear computes float32 and bfloat16 inputs, not ", input.scalar_type());
  TORCH_CHECK(!parts.empty() && parts.size() == types.size() && parts.size() == widths.size(),
              "quant_linear: one type and one width for each part");
  const auto x = input.contiguous();
  const int64_t m = x.size(0), k = x.size(1);
  const bool f32 = x.scalar_type() == at::kFloat;
  int64_t n = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    check_tiled(parts[i], types[i], widths[i], k);
    n += widths[i];
  }
  at::Tensor bias32;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == n, "quant_linear: bias of ", bias->numel(), " values for ", n, " outputs");
    bias32 = bias->to(at::kFloat).contiguous();
  }
  at::Tensor mask;
  if (prompt.has_value() && prompt->defined()) {
    TORCH_CHECK(prompt->dim() == 1 && prompt->numel() == m && prompt->scalar_type() == at::kBool,
                "quant_linear: prompt must be a bool mask of the input's ", m, " rows");
    mask = prompt->contiguous();
  }
  auto out = at::empty({m, n}, x.options());
  if (m == 0) return out;
  const float* b = bias32.defined() ? bias32.data_ptr<float>() : nullptr;
  const int bf16_path = f32 ? -1 : linear_bf16_path(path);
#if defined(KEV_QUANT_AMX)
  if (bf16_path == kPathAmx) {  // linear.cpp's AMX path: the decoded weights' arithmetic, every row
    if (m <= 16)
      amx_decode_product(x, m, k, parts, types, widths, b, out);
    else
      decoded_product(x, k, parts, types, widths, b, out, bf16_path);
    return out;
  }
#endif
  TORCH_CHECK(f32 || bf16_path != kPathAmx, "quant_linear: the amx path is not built here");
#if defined(KEV_QUANT_DECODED)
  const int64_t prompt_rows = mask.defined() ? mask.sum().item<int64_t>() : 0;
  if (prompt_rows == m) {
    decoded_product(x, k, parts, types, widths, b, out, bf16_path);
    return out;
  }
  if (prompt_rows > 0) {  // each share computed apart, then put back in its rows
    const auto prompt_ids = mask.nonzero().squeeze(1), other_ids = mask.logical_not().nonzero().squeeze(1);
    auto prompt_out = at::empty({prompt_rows, n}, x.options()), other_out = at::empty({m - prompt_rows, n}, x.options());
    decoded_product(x.index_select(0, prompt_ids), k, parts, types, widths, b, prompt_out, bf16_path);
    scaled_into(x.index_select(0, other_ids), k, parts, types, widths, b, other_out, bf16_path);
    out.index_copy_(0, prompt_ids, prompt_out);
    out.index_copy_(0, other_ids, other_out);
    return out;
  }
#endif
  scaled_into(x, k, parts, types, widths, b, out, bf16_path);
  return out;
}
