// GGUF's quantized blocks in Kev's tiled layout: the formats, each row's scales, each weight's value.
// quant.cpp (decoded weights, quant_rows, the AMX products) and quant_scaled.cpp (block-scaled
// products) both read weights through these.
//
// Layout (`models/quant.py` builds it from the file's blocks; the same bytes, reordered): the
// outputs in panels of 16 (a last panel and an odd panel count padded with zero bytes), each
// panel's blocks along K in the file's order, each block [16 rows' scale bytes as in the file, row
// after row; the K-quants' first 16 as four dword planes, plane i every row's bytes 4i..4i+3
// side by side (one load puts a row's dword in each lane: panel_scales), then Q6_K's d, row
// after row]
// [low plane: per k 16 rows' 8-bit values (Q8_0); or the other formats' 4-bit values (the 5- and
// 6-bit formats' low four bits) in runs of 8 k, 16 rows' in 64 bytes, dword j row j's: its values
// at k 0, 2, 4, 6 in nibbles 0-3 (bits 0-15), at k 1, 3, 5, 7 in nibbles 4-7, so one shift puts a
// pair of k's in place for every row at once (PanelValues::pairs)]
// [high plane, per run: the fifth bits in 16 bytes, a dword per pair of k (bit 2j + 1 row j's at
// the odd k, 2j at the even: a mask of the words that pair fills); Q6_K's fifth and sixth bits in
// 32 bytes, byte 2j + 1 (k odd) or 2j (even) row j's two bits at k, from bit 2 * (k % 8 / 2): zero
// extended to words these lie beside the low plane's run shifted to words (PanelValues::six_bits)].
// Decoding a k reads 16 outputs' values side by side: one vector, the layout linear.cpp's panels have.
#pragma once

#include <torch/extension.h>
#include <c10/util/Half.h>

#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace kev_quant {

// GGML's type ids
constexpr int kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14;
constexpr int kLanes = 16;  // outputs per panel

// A format: block_k weights a block, scale_bytes a row's scales in it, a scale every `group` weights,
// bits of the low plane (4 or 8), high bits (0-2), `zero` subtracted from each stored value, and
// how scale S and offset O apply: kind 0 S * q, 1 S * q + O, 2 S * q - O.
struct Format {
  int block_k, scale_bytes, group, low_bits, high_bits, zero, kind;
};

constexpr Format format_of(int type) {
  switch (type) {
    case kQ4_0: return {32, 2, 32, 4, 0, 8, 0};
    case kQ4_1: return {32, 4, 32, 4, 0, 0, 1};
    case kQ5_0: return {32, 2, 32, 4, 1, 16, 0};
    case kQ5_1: return {32, 4, 32, 4, 1, 0, 1};
    case kQ8_0: return {32, 2, 32, 8, 0, 0, 0};
    case kQ4_K: return {256, 16, 32, 4, 0, 0, 2};
    case kQ5_K: return {256, 16, 32, 4, 1, 0, 2};
    case kQ6_K: return {256, 18, 16, 4, 2, 32, 0};
    default: return {0, 0, 0, 0, 0, 0, 0};
  }
}

constexpr int64_t block_bytes(const Format& f) {  // a panel's block: 16 x the file's block bytes
  return kLanes * f.scale_bytes + f.block_k * (f.low_bits == 8 ? 16 : 8) + f.block_k * f.high_bits * 2;
}

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  return c10::detail::fp16_ieee_to_fp32_value(bits);
}

// One row's scales S and offsets O for each group of a block, as gguf's dequantize computes them.
template <int T>
inline void row_scales(const uint8_t* s, float* S, float* O) {
  if constexpr (T == kQ4_0 || T == kQ5_0 || T == kQ8_0) {
    S[0] = half_at(s);
  } else if constexpr (T == kQ4_1 || T == kQ5_1) {
    S[0] = half_at(s);
    O[0] = half_at(s + 2);
  } else if constexpr (T == kQ4_K || T == kQ5_K) {
    const float d = half_at(s), dmin = half_at(s + 2);
    const uint8_t* q = s + 4;  // 12 bytes: six-bit scales and mins of 8 groups
    for (int g = 0; g < 4; ++g) {
      S[g] = d * static_cast<float>(q[g] & 0x3F);
      O[g] = dmin * static_cast<float>(q[4 + g] & 0x3F);
      S[4 + g] = d * static_cast<float>((q[8 + g] & 0x0F) | ((q[g] >> 2) & 0x30));
      O[4 + g] = dmin * static_cast<float>((q[8 + g] >> 4) | ((q[4 + g] >> 2) & 0x30));
    }
  } else {  // Q6_K: 16 signed eight-bit scales, then d
    const float d = half_at(s + 16);
    for (int g = 0; g < 16; ++g) S[g] = d * static_cast<float>(static_cast<int8_t>(s[g]));
  }
}

// Row r's scale bytes (the file's order) of a panel's block into out [scale_bytes]: the K-quants'
// from their dword planes, the others' where they lie.
template <int T>
inline const uint8_t* lane_scale_bytes(const uint8_t* block, int r, uint8_t* out) {
  constexpr Format f = format_of(T);
  if constexpr (f.block_k != 256) {
    return block + r * f.scale_bytes;
  } else {
    for (int i = 0; i < 4; ++i) std::memcpy(out + 4 * i, block + i * 4 * kLanes + 4 * r, 4);
    std::memcpy(out + 16, block + 16 * kLanes + r * (f.scale_bytes - 16), f.scale_bytes - 16);
    return out;
  }
}

// Where k's 4-bit value (or low four bits) lies in its row's dword of a run of 8 k.
constexpr int nibble_shift(int k) { return 16 * (k & 1) + 4 * (k % 8 / 2); }

// Lane r's stored value at k of a panel's block (its low and high planes), less the format's zero.
template <int T>
inline int32_t stored_value(const uint8_t* block, int k, int r) {
  constexpr Format f = format_of(T);
  const uint8_t* low = block + kLanes * f.scale_bytes;
  const uint8_t* high = low + f.block_k * (f.low_bits == 8 ? 16 : 8);
  int32_t v;
  if constexpr (f.low_bits == 8) {
    v = static_cast<int8_t>(low[k * 16 + r]);
  } else {
    uint32_t row;
    std::memcpy(&row, low + k / 8 * 64 + r * 4, sizeof(row));
    v = (row >> nibble_shift(k)) & 0x0F;
  }
  if constexpr (f.high_bits == 1) {
    uint32_t bits;
    std::memcpy(&bits, high + k / 8 * 16 + k % 8 / 2 * 4, sizeof(bits));
    v |= ((bits >> (2 * r + (k & 1))) & 1) << 4;
  } else if constexpr (f.high_bits == 2) {
    v |= ((high[k / 8 * 32 + 2 * r + (k & 1)] >> (2 * (k % 8 / 2))) & 3) << 4;
  }
  return v - f.zero;
}

// Lane r of the block at `block` (a panel's) into out [block_k] as fp32: gguf's dequantized values.
template <int T>
inline void decode_lane(const uint8_t* block, int r, float* out) {
  constexpr Format f = format_of(T);
  float S[f.block_k / f.group], O[f.block_k / f.group] = {};
  uint8_t bytes[f.scale_bytes];
  row_scales<T>(lane_scale_bytes<T>(block, r, bytes), S, O);
  for (int k = 0; k < f.block_k; ++k) {
    const int g = k / f.group;
    const float w = S[g] * static_cast<float>(stored_value<T>(block, k, r));
    if constexpr (f.kind == 1)
      out[k] = w + O[g];
    else if constexpr (f.kind == 2)
      out[k] = w - O[g];
    else
      out[k] = w;
  }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__F16C__)
// The 16 rows' scales S and offsets O of each group of a panel's block, one vector a group: the
// values row_scales gives (its arithmetic, or vcvtph2ps, exact as every fp16 → fp32 conversion is).
template <int T>
inline void panel_scales(const uint8_t* block, __m512* S, __m512* O) {
  constexpr Format f = format_of(T);
  if constexpr (f.scale_bytes == 2) {  // Q4_0, Q5_0, Q8_0: 16 rows' d side by side
    S[0] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block)));
  } else if constexpr (f.scale_bytes == 4) {  // Q4_1, Q5_1: each row's (d, m)
    const __m512i dm = _mm512_loadu_si512(block);
    S[0] = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dm));
    O[0] = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(dm, 16)));
  } else {  // the K-quants: each row's dword of scale bytes at `offset` from its plane, then row_scales' arithmetic
    auto dwords = [&](int offset) { return _mm512_loadu_si512(block + offset / 4 * 4 * kLanes); };
    auto floats = [](__m512i v) { return _mm512_cvtepi32_ps(v); };
    const __m512i six = _mm512_set1_epi32(0x3F), four = _mm512_set1_epi32(0x0F), high = _mm512_set1_epi32(0x30);
    if constexpr (T == kQ4_K || T == kQ5_K) {
      const __m512i dm = dwords(0), q0 = dwords(4), q1 = dwords(8), q2 = dwords(12);
      const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dm));
      const __m512 dmin = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(dm, 16)));
      for (int g = 0; g < 4; ++g) {
        const __m512i a = _mm512_srli_epi32(q0, 8 * g), b = _mm512_srli_epi32(q1, 8 * g);
        const __m512i c = _mm512_srli_epi32(q2, 8 * g);
        S[g] = _mm512_mul_ps(d, floats(_mm512_and_si512(a, six)));
        O[g] = _mm512_mul_ps(dmin, floats(_mm512_and_si512(b, six)));
        S[4 + g] = _mm512_mul_ps(d, floats(_mm512_or_si512(_mm512_and_si512(c, four),
                                                           _mm512_and_si512(_mm512_srli_epi32(a, 2), high))));
        O[4 + g] = _mm512_mul_ps(dmin, floats(_mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(c, 4), four),
                                                              _mm512_and_si512(_mm512_srli_epi32(b, 2), high))));
      }
    } else {  // Q6_K: 16 signed eight-bit scales, then d
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 16 * kLanes)));
      for (int i = 0; i < 4; ++i) {
        const __m512i v = dwords(4 * i);
        for (int byte = 0; byte < 4; ++byte)
          S[4 * i + byte] = _mm512_mul_ps(d, floats(_mm512_srai_epi32(_mm512_slli_epi32(v, 24 - 8 * byte), 24)));
      }
    }
  }
}

// One panel's stored values along a block's k, 16 outputs a vector, as fp32 (less the zero).
template <int T>
struct PanelValues {
  static constexpr Format f = format_of(T);
  const uint8_t* low;
  const uint8_t* high;

  explicit PanelValues(const uint8_t* block)
      : low(block + kLanes * f.scale_bytes), high(low + f.block_k * (f.low_bits == 8 ? 16 : 8)) {}

  // the run of 8 k holding k, 16 rows' dwords (the 4-bit formats)
  inline __m512i run(int k) const { return _mm512_loadu_si512(low + k / 8 * 64); }
  // The run's 4-bit values at k = k8 + 2P and k + 1 in each word's bits 0-3 (word 2j row j's at k,
  // 2j + 1 its at k + 1), `above`'s bits over them: the 5- and 6-bit formats' lookup indices
  template <int P>
  inline __m512i low_under(int k8, __m512i above) const {
    constexpr int kLowThenHigh = 0xE4;  // ternary logic (a & c) | (b & ~c)
    return _mm512_ternarylogic_epi32(_mm512_srli_epi16(run(k8), 4 * P), above, _mm512_set1_epi16(0x0F), kLowThenHigh);
  }
  // The 5-bit formats' stored values at k = k8 + 2P and k + 1: word 2j (and 2j + 1) row j's at k
  // (at k + 1) in bits 0-4, the bits above them others' (vpermw reads an index's low five)
  template <int P>
  inline __m512i five_bits(int k8) const {
    uint32_t words;  // the mask of the words whose fifth bit is set
    std::memcpy(&words, high + k8 / 8 * 16 + 4 * P, sizeof(words));
    return low_under<P>(k8, _mm512_maskz_mov_epi16(_cvtu32_mask32(words), _mm512_set1_epi16(16)));
  }
  // Q6_K's six-bit stored values at k = k8 + 2P and k + 1: word 2j (and 2j + 1) row j's at k (at
  // k + 1) in bits 0-5, the bits above them others' (every reader masks or ignores them)
  template <int P>
  inline __m512i six_bits(int k8) const {
    const __m512i h = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(high + k8 / 8 * 32)));
    __m512i at4;  // the pair's two high bits moved to bits 4-5
    if constexpr (P < 2)
      at4 = _mm512_slli_epi16(h, 4 - 2 * P);
    else if constexpr (P == 2)
      at4 = h;
    else
      at4 = _mm512_srli_epi16(h, 2);
    return low_under<P>(k8, at4);
  }
  // The values of a format with high bits at k = k8 + 2P and k + 1 as bf16 pairs (pairs' form;
  // exact), looked up in a table of all 32 (vpermw) or 64 (Q6_K: vpermt2w)
  template <int P>
  inline __m512i high_pairs(int k8) const {
    if constexpr (f.high_bits == 1)
      return _mm512_permutexvar_epi16(five_bits<P>(k8), table32_bf16(0));
    else
      return _mm512_permutex2var_epi16(table32_bf16(0), six_bits<P>(k8), table32_bf16(32));
  }
  // value(q) as bf16 for the stored q = from, ..., from + 31 (word i: from + i)
  static inline __m512i table32_bf16(int from) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(bf16_words(table16(from))), bf16_words(table16(from + 16)), 1);
  }
  // 16 exact floats of at most eight significant bits (table16's) as bf16: their high halves
  static inline __m256i bf16_words(__m512 v) {
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16));
  }
  inline __m512 value(__m512i q) const {
    if constexpr (f.zero != 0) q = _mm512_sub_epi32(q, _mm512_set1_epi32(f.zero));
    return _mm512_cvtepi32_ps(q);
  }
  // the values at k and k + 1 for k = k8 + 2P (k8 a multiple of 8: P the pair's place in its run,
  // known when compiled, so a run's shifts are immediates)
  template <int P>
  inline void pair(int k8, __m512& even, __m512& odd) const {
    if constexpr (f.low_bits == 8) {
      const int k = k8 + 2 * P;
      even = value(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(low + k * 16))));
      odd = value(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(low + (k + 1) * 16))));
    } else if constexpr (f.high_bits != 0) {  // five or six bits: looked up as bf16 (exact), each half widened
      const __m512i both = high_pairs<P>(k8);
      even = _mm512_castsi512_ps(_mm512_slli_epi32(both, 16));
      odd = _mm512_castsi512_ps(_mm512_and_si512(both, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
    } else {  // four bits: the table's lookup reads each lane's low four
      const __m512i rows = run(k8);
      even = _mm512_permutexvar_ps(_mm512_srli_epi32(rows, nibble_shift(2 * P)), table16());
      odd = _mm512_permutexvar_ps(_mm512_srli_epi32(rows, nibble_shift(2 * P + 1)), table16());
    }
  }
  // value(q) for the stored q = from, from + 1, ..., from + 15: a lookup replaces the conversion
  // (and the zero's subtraction) with the same exact floats
  static inline __m512 table16(int from = 0) {
    const float z = static_cast<float>(from - f.zero);
    return _mm512_add_ps(_mm512_set1_ps(z), _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  }
#if defined(__AVX512BF16__)
  // the values at k and k + 1 (k = k8 + 2P) as bf16 pairs, vdpbf16ps's operand: lane j row j's value at
  // k in its low half, at k + 1 in its high half. Exact: a stored value less its zero is an integer
  // of at most eight significant bits, so its fp32 form's low half is zero and its high half is it
  // in bf16. Four bits: each row's dword shifted so its word halves hold the values at k and k + 1
  // in their low nibbles, then all 32 looked up as bf16 in one vpermw; five and six bits the same
  // way with the high bits merged in (high_pairs).
  template <int P>
  inline __m512i pairs(int k8) const {
    if constexpr (f.low_bits == 4 && f.high_bits == 0) {
      return _mm512_permutexvar_epi16(_mm512_srli_epi16(run(k8), nibble_shift(2 * P)), table_bf16());
    } else if constexpr (f.high_bits != 0) {
      return high_pairs<P>(k8);
    } else {
      __m512 even, odd;
      pair<P>(k8, even, odd);
      return as_pairs(even, odd);
    }
  }
  // two vectors of such integers as bf16 pairs (lane j: even's high half low, odd's high half high)
  static inline __m512i as_pairs(__m512 even, __m512 odd) {
    constexpr int kLowOrMasked = 0xF8;  // ternary logic a | (b & c)
    return _mm512_ternarylogic_epi32(_mm512_srli_epi32(_mm512_castps_si512(even), 16), _mm512_castps_si512(odd),
                                     _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)), kLowOrMasked);
  }
  // table16()'s values as bf16, words 0-15 and again 16-31 (vpermw reads an index's low five bits,
  // the fifth of them the next nibble's lowest)
  static inline __m512i table_bf16() { return _mm512_broadcast_i64x4(bf16_words(table16())); }
#endif
};
#define KEV_QUANT_AVX512 1
#endif

// f(k8, P) for each pair of k in [k0, k0 + n) (both multiples of 8), k = k8 + 2P: a run's four
// pairs written out, P an std::integral_constant (PanelValues::pair's template argument).
template <typename F>
inline void each_pair(int k0, int n, F&& f) {
  for (int k8 = k0; k8 < k0 + n; k8 += 8) {
    f(k8, std::integral_constant<int, 0>{});
    f(k8, std::integral_constant<int, 1>{});
    f(k8, std::integral_constant<int, 2>{});
    f(k8, std::integral_constant<int, 3>{});
  }
}

template <typename F>
void by_type(int type, F&& f) {
  switch (type) {
    case kQ4_0: return f(std::integral_constant<int, kQ4_0>{});
    case kQ4_1: return f(std::integral_constant<int, kQ4_1>{});
    case kQ5_0: return f(std::integral_constant<int, kQ5_0>{});
    case kQ5_1: return f(std::integral_constant<int, kQ5_1>{});
    case kQ8_0: return f(std::integral_constant<int, kQ8_0>{});
    case kQ4_K: return f(std::integral_constant<int, kQ4_K>{});
    case kQ5_K: return f(std::integral_constant<int, kQ5_K>{});
    case kQ6_K: return f(std::integral_constant<int, kQ6_K>{});
    default: TORCH_CHECK(false, "quant: GGML type ", type, " is not one Kev computes in place");
  }
}

// Panels a tiled weight of `width` outputs has: whole pairs (bf16 products take two at a time).
inline int64_t tiled_panels(int64_t width) { return (width + 2 * kLanes - 1) / (2 * kLanes) * 2; }

// A tiled weight's checks: its format, and bytes for `rows` outputs of k inputs.
inline Format check_tiled(const at::Tensor& tiled, int64_t type, int64_t rows, int64_t k) {
  const Format f = format_of(static_cast<int>(type));
  TORCH_CHECK(f.block_k > 0, "quant: GGML type ", type, " is not one Kev computes in place");
  TORCH_CHECK(k % f.block_k == 0, "quant: ", k, " inputs is not a whole number of ", f.block_k, "-weight blocks");
  TORCH_CHECK(tiled.device().is_cpu() && tiled.scalar_type() == at::kByte && tiled.is_contiguous() &&
                  tiled.numel() == tiled_panels(rows) * (k / f.block_k) * block_bytes(f),
              "quant: not a tiled weight of ", rows, " outputs x ", k, " inputs (models/quant.py's layout)");
  return f;
}

// A product's tasks, claimed by its threads: each part's panels (tiled_panels) in runs of
// `run(type)`, each run over rows [r0, r0 + row_run) for r0 = 0, row_run, ... below m; col0 is the
// part's first output.
struct Task {
  int64_t part, p0, col0, r0;
};

template <typename Run>
std::vector<Task> product_tasks(const std::vector<int64_t>& types, const std::vector<int64_t>& widths, int64_t m,
                                int64_t row_run, Run&& run) {
  std::vector<Task> tasks;
  int64_t col = 0;
  for (size_t i = 0; i < widths.size(); ++i) {
    const int64_t step = run(static_cast<int>(types[i]));
    for (int64_t r0 = 0; r0 < m; r0 += row_run)
      for (int64_t p0 = 0; p0 < tiled_panels(widths[i]); p0 += step)
        tasks.push_back({static_cast<int64_t>(i), p0, col, r0});
    col += widths[i];
  }
  return tasks;
}

// input [m, k] as fp32 (x) @ W.T (+ bias, fp32 or null) into out [m, n] (fp32 or bf16) by the
// block-scaled arithmetic (quant_scaled.cpp); `dot`: the same input's bf16 bits for vdpbf16ps's
// group sums (the AVX512-BF16 path; a build without it refuses), or null for fused multiply-adds.
// The parts checked by the caller.
void scaled_product(const float* x, const uint16_t* dot, int64_t m, int64_t k, const std::vector<at::Tensor>& parts,
                    const std::vector<int64_t>& types, const std::vector<int64_t>& widths, const float* bias,
                    at::Tensor& out);

}  // namespace kev_quant
