// Products on GGUF's quantized weights as they ship: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K.
//
// Why: a quantized file is 3-4x smaller than its weights in bf16, and a decode step of a model of
// a few billion weights is bound by reading them. Here the weights stay in memory at the file's
// size and each chunk of outputs is decoded when a product needs it.
//
// What it computes: every weight decoded to exactly the value gguf's own `dequantize` gives
// (the same fp32 operations in the same order: d * q, d * q + m, (d * sc) * q - dmin * m, ...),
// rounded to bf16 as torch rounds (to nearest even) where the product is bf16, then multiplied
// by linear.cpp's kernel on those values: each output summed in one order fixed by K alone. So a
// row's product is the same bits alone or in any pack, and the same bits as `linear_packed` on the
// dequantized weight (tests/test_quant.py checks both).
//
// Layout (`models/quant.py` builds it from the file's blocks; the same bytes, reordered): the
// outputs in panels of 16 (a last panel and an odd panel count padded with zero bytes), each
// panel's blocks along K in the file's order, each block [16 rows' scale bytes as in the file]
// [low plane: per pair of k, 16 rows' 4-bit values (byte j: row j's at the even k low, at the odd
// k high), or per k 16 rows' 8-bit ones]
// [high plane: per k, the 16 rows' fifth bits (2 bytes) or fifth and sixth (4 bytes)]. Decoding
// a k reads 16 outputs' values side by side: one vector, the layout linear.cpp's panels have.
//
// Threads: a product's tasks (a run of panels x a run of rows) are claimed from a counter; each
// decodes its panels into its thread's buffer and runs linear.cpp's product on them there. A
// decode pass on AMX decodes block by block into an L1 buffer instead, running linear.cpp's
// decode-tile steps on each block (amx_decoded_panels).
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "exact.h"
#include "pool.h"

namespace {

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

// The block at `block` (a panel's), lanes [lane, lane + L), into out [block_k][L] as fp32.
template <int T, int L>
inline void decode_block(const uint8_t* block, int lane, float* out) {
  constexpr Format f = format_of(T);
  constexpr int groups = f.block_k / f.group;
  float S[groups][L], O[groups][L];
  for (int j = 0; j < L; ++j) {
    float s[groups], o[groups] = {};
    row_scales<T>(block + (lane + j) * f.scale_bytes, s, o);
    for (int g = 0; g < groups; ++g) {
      S[g][j] = s[g];
      O[g][j] = o[g];
    }
  }
  const uint8_t* low = block + kLanes * f.scale_bytes;
  const uint8_t* high = low + f.block_k * (f.low_bits == 8 ? 16 : 8);
  for (int k = 0; k < f.block_k; ++k) {
    const int g = k / f.group;
    int32_t q[L];
    for (int j = 0; j < L; ++j) {
      const int r = L == kLanes ? j : lane + j;  // a whole panel: lanes known here, the loop vectorizes
      if constexpr (f.low_bits == 8)
        q[j] = static_cast<int8_t>(low[k * 16 + r]);
      else
        q[j] = k % 2 == 0 ? low[k / 2 * 16 + r] & 0x0F : low[k / 2 * 16 + r] >> 4;
    }
    if constexpr (f.high_bits == 1) {
      uint16_t h;
      std::memcpy(&h, high + k * 2, sizeof(h));
      for (int j = 0; j < L; ++j) q[j] |= ((h >> (lane + j)) & 1) << 4;
    } else if constexpr (f.high_bits == 2) {
      uint32_t h;
      std::memcpy(&h, high + k * 4, sizeof(h));
      for (int j = 0; j < L; ++j) q[j] |= ((h >> (2 * (lane + j))) & 3) << 4;
    }
    for (int j = 0; j < L; ++j) {
      const float w = S[g][j] * static_cast<float>(q[j] - f.zero);
      if constexpr (f.kind == 1)
        out[k * L + j] = w + O[g][j];
      else if constexpr (f.kind == 2)
        out[k * L + j] = w - O[g][j];
      else
        out[k * L + j] = w;
    }
  }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__F16C__)
// decode_block<T, 16> on AVX-512: the same operations on the same values, one k's 16 outputs a
// vector; `emit(k, w)` takes each k's weights. The scales as decode_block's (row_scales, or
// vcvtph2ps, exact as every fp16 → fp32 conversion is).
template <int T, typename Emit>
inline void decode_panel_block(const uint8_t* block, Emit&& emit) {
  constexpr Format f = format_of(T);
  constexpr int groups = f.block_k / f.group;
  __m512 S[groups], O[groups] = {};  // O: none for the formats without an offset
  if constexpr (f.scale_bytes == 2) {  // Q4_0, Q5_0, Q8_0: 16 rows' d side by side
    S[0] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block)));
  } else if constexpr (f.scale_bytes == 4) {  // Q4_1, Q5_1: each row's (d, m)
    const __m512i dm = _mm512_loadu_si512(block);
    S[0] = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dm));
    O[0] = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(dm, 16)));
  } else {  // the K-quants: each row's dwords of scale bytes gathered into lanes, then row_scales' arithmetic
    const __m512i rows = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32(f.scale_bytes));
    auto dwords = [&](int offset) { return _mm512_i32gather_epi32(rows, block + offset, 1); };
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
      const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dwords(16)));
      for (int i = 0; i < 4; ++i) {
        const __m512i v = dwords(4 * i);
        for (int byte = 0; byte < 4; ++byte)
          S[4 * i + byte] = _mm512_mul_ps(d, floats(_mm512_srai_epi32(_mm512_slli_epi32(v, 24 - 8 * byte), 24)));
      }
    }
  }
  const uint8_t* low = block + kLanes * f.scale_bytes;
  const uint8_t* high = low + f.block_k * (f.low_bits == 8 ? 16 : 8);
  const __m128i nibble = _mm_set1_epi8(0x0F);
  __m128i pair = _mm_setzero_si128();  // 4-bit values: a pair of k's 16 bytes, read at the even k
  for (int g = 0; g < groups; ++g) {  // group by group: each one's scale and offset stay in registers
    const __m512 scale = S[g], offset = O[g];
    for (int i = 0; i < f.group; ++i) {
      const int k = g * f.group + i;
      __m512i q;
      if constexpr (f.low_bits == 8) {
        q = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(low + k * 16)));
      } else if (k % 2 == 0) {
        pair = _mm_loadu_si128(reinterpret_cast<const __m128i*>(low + k / 2 * 16));
        q = _mm512_cvtepu8_epi32(_mm_and_si128(pair, nibble));
      } else {
        q = _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(pair, 4), nibble));
      }
      if constexpr (f.high_bits == 1) {
        uint16_t h;
        std::memcpy(&h, high + k * 2, sizeof(h));
        q = _mm512_or_si512(q, _mm512_maskz_set1_epi32(static_cast<__mmask16>(h), 16));
      } else if constexpr (f.high_bits == 2) {
        uint32_t h;
        std::memcpy(&h, high + k * 4, sizeof(h));
        const __mmask16 even = static_cast<__mmask16>(_pext_u32(h, 0x55555555u));
        const __mmask16 odd = static_cast<__mmask16>(_pext_u32(h, 0xAAAAAAAAu));
        q = _mm512_or_si512(q, _mm512_or_si512(_mm512_maskz_set1_epi32(even, 16),
                                               _mm512_maskz_set1_epi32(odd, 32)));
      }
      if constexpr (f.zero != 0) q = _mm512_sub_epi32(q, _mm512_set1_epi32(f.zero));
      __m512 w = _mm512_mul_ps(scale, _mm512_cvtepi32_ps(q));
      if constexpr (f.kind == 1) w = _mm512_add_ps(w, offset);
      if constexpr (f.kind == 2) w = _mm512_sub_ps(w, offset);
      emit(k, w);
    }
  }
}

// Two k's 16 weights each as bf16 pairs (lane j: row j's even k, then its odd k), to nearest even.
// vcvtne2ps2bf16 rounds as c10 does wherever c10 and it agree: every value but NaN payloads and
// fp32 subnormals (which it flushes), and a decoded weight is never subnormal: every format's
// values are multiples of 2^-24 (fp16 scales times integers), so zero or at least 2^-24.
inline __m512i bf16_pairs(__m512 even, __m512 odd) {
#if defined(__AVX512BF16__)
  const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(odd, even);  // [even 0..15 | odd 0..15]
  const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                         21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return _mm512_permutexvar_epi16(order, both);
#else
  auto lanes = [](__m512 v) {  // bf16_bits' arithmetic, 16 lanes
    const __m512i u = _mm512_castps_si512(v);
    const __m512i bias = _mm512_add_epi32(_mm512_set1_epi32(0x7FFF),
                                          _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)));
    const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
    return _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  };
  return _mm512_or_si512(lanes(even), _mm512_slli_epi32(lanes(odd), 16));
#endif
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
#define KEV_QUANT_AVX512 1
#endif

// fp32 → bf16 bits, to nearest even (c10's rounding: the value torch's .to(bfloat16) gives).
inline uint32_t bf16_bits(float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof(u));
  const uint32_t rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16;
  return (u & 0x7FFFFFFF) > 0x7F800000 ? 0x7FC0 : rounded;
}

// Panels [p0, p0 + count) of a weight of k inputs into linear.cpp's packed layout at dst:
// float32 [count][k][16], or bfloat16 [count][k / 2][16][2].
template <int T>
void decode_panels(const uint8_t* tiled, int64_t k, int64_t p0, int64_t count, bool f32, void* dst) {
  constexpr Format f = format_of(T);
  const int64_t blocks = k / f.block_k;
  alignas(64) float tmp[f.block_k * kLanes];
  // block by block across the panels: `count` streams from memory in flight at once, where one
  // panel after another would leave a core waiting on one stream
  for (int64_t b = 0; b < blocks; ++b) {
    for (int64_t p = 0; p < count; ++p) {
      const uint8_t* block = tiled + ((p0 + p) * blocks + b) * block_bytes(f);
#if defined(KEV_QUANT_AVX512)
      if (f32) {
        float* w = static_cast<float*>(dst) + (p * k + b * f.block_k) * kLanes;
        decode_panel_block<T>(block, [&](int kk, __m512 v) { _mm512_storeu_ps(w + kk * kLanes, v); });
      } else {
        decode_block_pairs<T>(block, static_cast<uint32_t*>(dst) + (p * k + b * f.block_k) / 2 * kLanes);
      }
      continue;
#endif
      if (f32) {
        decode_block<T, kLanes>(block, 0, static_cast<float*>(dst) + (p * k + b * f.block_k) * kLanes);
        continue;
      }
      decode_block<T, kLanes>(block, 0, tmp);
      uint32_t* pairs = static_cast<uint32_t*>(dst) + (p * k + b * f.block_k) / 2 * kLanes;
      for (int kp = 0; kp < f.block_k / 2; ++kp)
        for (int j = 0; j < kLanes; ++j)
          pairs[kp * kLanes + j] =
              bf16_bits(tmp[2 * kp * kLanes + j]) | bf16_bits(tmp[(2 * kp + 1) * kLanes + j]) << 16;
    }
  }
}

// Row `row` of the weight (all k values) as fp32 into out.
template <int T>
void decode_row(const uint8_t* tiled, int64_t k, int64_t row, float* out) {
  constexpr Format f = format_of(T);
  const int64_t blocks = k / f.block_k;
  const uint8_t* panel = tiled + (row / kLanes) * blocks * block_bytes(f);
  for (int64_t b = 0; b < blocks; ++b)
    decode_block<T, 1>(panel + b * block_bytes(f), static_cast<int>(row % kLanes), out + b * f.block_k);
}

#if defined(KEV_QUANT_AVX512) && defined(__AMX_BF16__) && defined(__AMX_TILE__)
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
  struct Task {
    int64_t part, p0, count, col0;
  };
  std::vector<Task> tasks;
  int64_t col = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    const int64_t panels = (widths[i] + 2 * kLanes - 1) / (2 * kLanes) * 2;  // the tiled layout's: pairs
    const int64_t run = amx_panels(static_cast<int>(types[i]));
    for (int64_t p0 = 0; p0 < panels; p0 += run)
      tasks.push_back({static_cast<int64_t>(i), p0, std::min<int64_t>(run, panels - p0), col});
    col += widths[i];
  }
  bf16* o = out.data_ptr<bf16>();
  std::atomic<int64_t> next{0};
  kev::on_threads([&] {
    amx_configure_tiles();
    alignas(64) float c[kLanes * kAmxPanels * kLanes];
    std::vector<uint32_t> buffer(kAmxPanels * 256 / 2 * kLanes);  // each panel's block of K (at most 256)
    for (int64_t t = next++; t < static_cast<int64_t>(tasks.size()); t = next++) {
      const Task& task = tasks[t];
      by_type(static_cast<int>(types[task.part]), [&](auto tc) {
        amx_decoded_panels<decltype(tc)::value>(parts[task.part].data_ptr<uint8_t>(), k, task.p0, task.count,
                                                a.data(), c, buffer.data());
      });
      const int64_t n0 = task.p0 * kLanes, cols = std::min(task.count * kLanes, widths[task.part] - n0);
      store_bf16_rows(c, task.count * kLanes, m, bias != nullptr ? bias + task.col0 + n0 : nullptr,
                      o + task.col0 + n0, n, cols);
    }
    _tile_release();
  });
}
#endif

// A tiled weight's checks: its format, and bytes for `rows` outputs of k inputs.
Format check_tiled(const at::Tensor& tiled, int64_t type, int64_t rows, int64_t k) {
  const Format f = format_of(static_cast<int>(type));
  TORCH_CHECK(f.block_k > 0, "quant: GGML type ", type, " is not one Kev computes in place");
  TORCH_CHECK(k % f.block_k == 0, "quant: ", k, " inputs is not a whole number of ", f.block_k, "-weight blocks");
  const int64_t panels = (rows + 2 * kLanes - 1) / (2 * kLanes) * 2;
  TORCH_CHECK(tiled.device().is_cpu() && tiled.scalar_type() == at::kByte && tiled.is_contiguous() &&
                  tiled.numel() == panels * (k / f.block_k) * block_bytes(f),
              "quant: not a tiled weight of ", rows, " outputs x ", k, " inputs (models/quant.py's layout)");
  return f;
}

}  // namespace

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

// input [M, k] (float32 or bfloat16) @ W.T (+ bias) → [M, sum(widths)], W the parts stacked: part i
// tiled (`types[i]`, widths[i] outputs). `path`: a bf16 path for tests ("": this process's).
at::Tensor quant_linear(const at::Tensor& input, const std::vector<at::Tensor>& parts,
                        const std::vector<int64_t>& types, const std::vector<int64_t>& widths,
                        const c10::optional<at::Tensor>& bias, const std::string& path) {
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
  auto out = at::empty({m, n}, x.options());
  if (m == 0) return out;
  const int bf16_path = f32 ? -1 : linear_bf16_path(path);
  // a decode pass (few rows): runs of 4 panels, so the threads share even small products finely
  // (and a run's decoded weights stay in L1); a prefill: runs of 8 panels over 768 rows, each run
  // decoded once for its rows
  const bool few = m <= 96;
  const int64_t run = few ? 4 : 8, row_run = few ? m : 768;
  struct Task {
    int64_t part, p0, col0, r0;
  };
  std::vector<Task> tasks;
  int64_t col = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    const int64_t panels = (widths[i] + kLanes - 1) / kLanes;
    for (int64_t r0 = 0; r0 < m; r0 += row_run)
      for (int64_t p0 = 0; p0 < panels; p0 += run) tasks.push_back({static_cast<int64_t>(i), p0, col, r0});
    col += widths[i];
  }
  const size_t esize = f32 ? sizeof(float) : sizeof(at::BFloat16);
  const char* xs = static_cast<const char*>(x.data_ptr());
  char* os = static_cast<char*>(out.data_ptr());
  const float* b = bias32.defined() ? bias32.data_ptr<float>() : nullptr;
#if defined(KEV_QUANT_AMX)
  if (bf16_path == 0 && m <= 16) {  // AMX (linear.cpp's path 0) and one decode tile of rows: decoded in the tile
    amx_decode_product(x, m, k, parts, types, widths, b, out);
    return out;
  }
#endif
  std::atomic<int64_t> next{0};
  kev::on_threads([&] {
    std::vector<uint8_t> scratch(run * kLanes * k * esize);
    for (int64_t t = next++; t < static_cast<int64_t>(tasks.size()); t = next++) {
      const Task& task = tasks[t];
      const int64_t width = widths[task.part], n0 = task.p0 * kLanes;
      const int64_t count = std::min(run, (width + kLanes - 1) / kLanes - task.p0);
      const int64_t decoded = (count + 1) / 2 * 2;  // bf16 panels come in pairs: the padding's zeros
      const int64_t cols = std::min(count * kLanes, width - n0), rows = std::min(row_run, m - task.r0);
      by_type(static_cast<int>(types[task.part]), [&](auto tc) {
        decode_panels<decltype(tc)::value>(parts[task.part].data_ptr<uint8_t>(), k, task.p0, f32 ? count : decoded,
                                           f32, scratch.data());
      });
      linear_packed_into(xs + task.r0 * k * esize, rows, k, scratch.data(), cols,
                         b != nullptr ? b + task.col0 + n0 : nullptr, os + (task.r0 * n + task.col0 + n0) * esize, n,
                         f32, bf16_path);
    }
  });
  return out;
}
