// The vector arithmetic Kev's exact kernels share (attention.cpp, elementwise.cpp).
//
// GCC/Clang vector extensions over 16 lanes where AVX-512 exists, else 8 (AVX2, or two NEON
// registers). Built without -ffast-math and without implicit contraction (kernels.py's "exact"
// flags): every operation written here is the operation executed, lane by lane, so one value
// gets the same result in every lane, tile and call — what batch invariance rests on.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace kev {

#if defined(__AVX512F__)
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif
typedef float vf __attribute__((vector_size(kLanes * 4)));
typedef int32_t vi __attribute__((vector_size(kLanes * 4)));

inline vf vload(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void vstore(float* p, vf v) { std::memcpy(p, &v, sizeof(v)); }
inline vf vset(float s) { return vf{} + s; }
inline vf vfma(vf a, vf b, vf c) {
#if defined(__AVX512F__)
  return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__)
  return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
  return a * b + c;  // built without contraction: the same two roundings everywhere
#endif
}
inline vf vselect(vi mask, vf a, vf b) { return (vf)((mask & (vi)a) | (~mask & (vi)b)); }
inline vf vmax(vf a, vf b) { return vselect(a > b, a, b); }
inline vi lane_ids() {
  vi v;
  for (int i = 0; i < kLanes; ++i) v[i] = i;
  return v;
}

// e^x for x <= 0 (a score minus its row's running max), by 2^n * p(r): range reduction with
// ln 2 in two parts and a degree-6 polynomial, all fused multiply-adds. Results below e^-87
// (that far under the max, a key weighs nothing) flush to 0. One formula for every lane.
inline vf vexp(vf x) {
  const vf lower = vset(-87.0f);
  const vi tiny = x < lower;
  x = vselect(tiny, lower, x);
  const vf magic = vset(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer (ties to even)
  const vf n = (x * vset(1.44269504088896341f) + magic) - magic;
  vf r = vfma(n, vset(-0.693359375f), x);
  r = vfma(n, vset(2.12194440e-4f), r);
  vf p = vset(1.9875691500e-4f);
  p = vfma(p, r, vset(1.3981999507e-3f));
  p = vfma(p, r, vset(8.3334519073e-3f));
  p = vfma(p, r, vset(4.1665795894e-2f));
  p = vfma(p, r, vset(1.6666665459e-1f));
  p = vfma(p, r, vset(5.0000001201e-1f));
  p = vfma(p * r, r, r) + vset(1.0f);
  const vi exponent = (__builtin_convertvector(n, vi) + 127) << 23;
  return vselect(tiny, vf{}, p * (vf)exponent);
}

// Halving trees over the lanes (the upper half onto the lower, then again): one fixed order.
inline vf upper_half(vf v) {
#if defined(__AVX512F__)
  return __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15);
#else
  return __builtin_shufflevector(v, v, 4, 5, 6, 7, 4, 5, 6, 7);
#endif
}
inline float hsum(vf v) {
  v = v + upper_half(v);
  float lanes[kLanes];
  std::memcpy(lanes, &v, sizeof(v));
  float quarter[kLanes / 4];
  for (int i = 0; i < kLanes / 4; ++i) quarter[i] = lanes[i] + lanes[i + kLanes / 4];
  for (int w = kLanes / 8; w >= 1; w /= 2)
    for (int i = 0; i < w; ++i) quarter[i] = quarter[i] + quarter[i + w];
  return quarter[0];
}
inline float hmax(vf v) {  // max is exact: any order gives the same value
  v = vmax(v, upper_half(v));
  float lanes[kLanes];
  std::memcpy(lanes, &v, sizeof(v));
  float m = lanes[0];
  for (int i = 1; i < kLanes / 2; ++i) m = std::max(m, lanes[i]);
  return m;
}

typedef uint16_t vh __attribute__((vector_size(kLanes * 2)));
typedef uint32_t vu __attribute__((vector_size(kLanes * 4)));

template <typename T>
inline vf load_as_float(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return vload(p);
  } else {  // bfloat16: the upper half of a float32, exactly
    vh h;
    std::memcpy(&h, p, sizeof(h));
    return (vf)(__builtin_convertvector(h, vu) << 16);
  }
}

// bfloat16 from float32, rounding to nearest even (NaN stays NaN), lane by lane.
inline vh to_bf16(vf x) {
  vu bits = (vu)x;
  const vu rounded = (bits + (vu{} + 0x7FFFu) + ((bits >> 16) & 1u)) >> 16;
  const vi nan = x != x;
  bits = (vu)vselect(nan, (vf)(vu{} + 0x7FC0u), (vf)rounded);  // c10's NaN
  return __builtin_convertvector(bits, vh);
}

}  // namespace kev
