// Paged decode attention for CPU: every decode row of a pass over its own KV blocks, in ONE call.
//
// Why a kernel: in fp32 on CPU, torch's batched path runs one tiny GEMM per (block, kv head)
// ([G x D] @ [D x block_size]) plus a segmented softmax; those GEMMs run at a fraction of the
// machine's memory bandwidth. Here each (row, kv head) task streams its blocks once: scores for
// the G query heads sharing that kv head, an online softmax (running max and sum, as
// flash-attention does), and the weighted values, in fp32 vector registers and L1.
//
// Layout (kv_pool.py): keys/values [num_blocks, kv_heads, block_size, head_dim], contiguous.
// Only the first lens[b] tokens of row b's table are read: stale memory past them (a freed
// tail, another question's tokens) is never touched. Threads: Kev's pool (pool.h).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <type_traits>
#include <vector>

#include "pool.h"

namespace {

constexpr float kNoScore = -1e30f;  // finite: built with -ffast-math, so no infinities anywhere

typedef float v8 __attribute__((vector_size(32)));  // GCC/Clang vector extension: AVX on x86, 2x NEON on ARM

// fp32 pools with a head size the compiler can unroll: each query (or output) row lives in
// DIM/8 vector registers for a whole block, and every key/value row streams through them.
template <typename T, int DIM>
constexpr bool kInRegisters = std::is_same_v<T, float> && DIM > 0 && DIM % 16 == 0;

inline v8 load8(const float* p) {
  v8 x;
  __builtin_memcpy(&x, p, sizeof(x));
  return x;
}

inline void store8(float* p, v8 x) { __builtin_memcpy(p, &x, sizeof(x)); }

// A row of the pool as fp32: the row itself for fp32 pools, else converted into `buffer`.
template <typename T>
inline const float* as_float(const T* row, float* buffer, int64_t dim) {
  if constexpr (std::is_same_v<T, float>) {
    return row;
  } else {
    for (int64_t d = 0; d < dim; ++d) buffer[d] = static_cast<float>(row[d]);
    return buffer;
  }
}

// A block's keys and values (`count` elements each) requested from memory ahead of use: a row's
// blocks lie scattered in the pool, where the hardware prefetcher cannot guess the next one.
// Asked for when the block before it starts, they arrive while that block is computed (measured
// in docs/benchmarks.md: faster where rows read scattered blocks, unchanged where they share one
// document mostly from cache).
template <typename T>
inline void prefetch_block(const T* keys, const T* values, int64_t count) {
  for (int64_t i = 0; i < count; i += 64 / static_cast<int64_t>(sizeof(T))) {
    __builtin_prefetch(keys + i);
    __builtin_prefetch(values + i);
  }
}

// score[g * block + t] = q_g . k_t for the block's n key rows and the G query rows of one kv head.
template <typename T, int DIM>
void block_scores(const float* qf, const T* kb, int64_t n, int64_t group, int64_t dim, int64_t block, float* score,
                  float* buffer) {
  if constexpr (kInRegisters<T, DIM>) {
    for (int64_t g = 0; g < group; ++g) {
      v8 q[DIM / 8];
      for (int c = 0; c < DIM / 8; ++c) q[c] = load8(qf + g * DIM + 8 * c);
      for (int64_t t = 0; t < n; ++t) {
        const float* k = kb + t * DIM;
        v8 even = {}, odd = {};  // two partial sums: half the dependent-FMA chain
        for (int c = 0; c < DIM / 8; c += 2) {
          even += q[c] * load8(k + 8 * c);
          odd += q[c + 1] * load8(k + 8 * c + 8);
        }
        const v8 x = even + odd;
        score[g * block + t] = ((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7]));
      }
    }
  } else {
    for (int64_t t = 0; t < n; ++t) {  // each key row converted once for the G query rows
      const float* k = as_float(kb + t * dim, buffer, dim);
      for (int64_t g = 0; g < group; ++g) {
        const float* q = qf + g * dim;
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t d = 0; d < dim; ++d) sum += q[d] * k[d];
        score[g * block + t] = sum;
      }
    }
  }
}

// acc_g += sum_t p[g * block + t] * v_t for the block's n value rows.
template <typename T, int DIM>
void block_values(const float* p, const T* vb, int64_t n, int64_t group, int64_t dim, int64_t block, float* acc,
                  float* buffer) {
  if constexpr (kInRegisters<T, DIM>) {
    for (int64_t g = 0; g < group; ++g) {
      v8 a[DIM / 8];
      for (int c = 0; c < DIM / 8; ++c) a[c] = load8(acc + g * DIM + 8 * c);
      for (int64_t t = 0; t < n; ++t) {
        const float* v = vb + t * DIM;
        const float weight = p[g * block + t];
        for (int c = 0; c < DIM / 8; ++c) a[c] += weight * load8(v + 8 * c);
      }
      for (int c = 0; c < DIM / 8; ++c) store8(acc + g * DIM + 8 * c, a[c]);
    }
  } else {
    for (int64_t t = 0; t < n; ++t) {  // each value row converted once for the G output rows
      const float* v = as_float(vb + t * dim, buffer, dim);
      for (int64_t g = 0; g < group; ++g) {
        const float weight = p[g * block + t];
        float* a = acc + g * dim;
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) a[d] += weight * v[d];
      }
    }
  }
}

template <typename T, int DIM>
void decode(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& tables,
            const at::Tensor& lens, at::Tensor& out, float scale) {
  const int64_t rows = query.size(0), heads = query.size(1), dim = DIM > 0 ? DIM : query.size(2);
  const int64_t num_blocks = keys.size(0), kv_heads = keys.size(1), block = keys.size(2);
  const int64_t width = tables.size(1), group = heads / kv_heads;
  const T* q = query.data_ptr<T>();
  const T* k = keys.data_ptr<T>();
  const T* v = values.data_ptr<T>();
  const int32_t* table = tables.data_ptr<int32_t>();
  const int32_t* len = lens.data_ptr<int32_t>();
  T* o = out.data_ptr<T>();
  // Rows differ in length (a static split of the tasks would leave one thread idle while the
  // other finishes the long rows): each thread takes the next (row, kv head) task as it is free.
  std::atomic<int64_t> next{0};
  const int64_t tasks = rows * kv_heads;
  kev::on_threads([&] {
    std::vector<float> qf(group * dim), acc(group * dim), score(group * block), row_max(group), total(group);
    std::vector<float> buffer(dim);
    for (int64_t task = next++; task < tasks; task = next++) {
      const int64_t r = task / kv_heads, h = task % kv_heads, length = len[r];
      TORCH_CHECK(length >= 1 && length <= width * block, "decode row ", r, " reads ", length,
                  " tokens; its block table holds ", width * block);
      for (int64_t g = 0; g < group; ++g) {
        const T* qr = q + ((r * heads) + h * group + g) * dim;
        for (int64_t d = 0; d < dim; ++d) {
          qf[g * dim + d] = static_cast<float>(qr[d]) * scale;
          acc[g * dim + d] = 0.f;
        }
        row_max[g] = kNoScore;
        total[g] = 0.f;
      }
      for (int64_t j = 0; j * block < length; ++j) {
        const int64_t id = table[r * width + j];
        TORCH_CHECK(id >= 0 && id < num_blocks, "decode row ", r, " names block ", id, " of ", num_blocks);
        const int64_t n = std::min(block, length - j * block);
        const T* kb = k + (id * kv_heads + h) * block * dim;
        const T* vb = v + (id * kv_heads + h) * block * dim;
        if ((j + 1) * block < length) {
          const int64_t next = table[r * width + j + 1];  // checked when its turn comes
          if (next >= 0 && next < num_blocks) {
            const int64_t at = (next * kv_heads + h) * block * dim;
            prefetch_block(k + at, v + at, block * dim);
          }
        }
        block_scores<T, DIM>(qf.data(), kb, n, group, dim, block, score.data(), buffer.data());
        for (int64_t g = 0; g < group; ++g) {  // online softmax: rescale what came before to the new max
          float* s = score.data() + g * block;
          float block_max = row_max[g];
          for (int64_t t = 0; t < n; ++t) block_max = std::max(block_max, s[t]);
          const float rescale = std::exp(row_max[g] - block_max);
          float* a = acc.data() + g * dim;
          for (int64_t d = 0; d < dim; ++d) a[d] *= rescale;
          float sum = 0.f;
#pragma omp simd reduction(+ : sum)
          for (int64_t t = 0; t < n; ++t) {
            s[t] = std::exp(s[t] - block_max);
            sum += s[t];
          }
          total[g] = total[g] * rescale + sum;
          row_max[g] = block_max;
        }
        block_values<T, DIM>(score.data(), vb, n, group, dim, block, acc.data(), buffer.data());
      }
      for (int64_t g = 0; g < group; ++g) {
        T* orow = o + ((r * heads) + h * group + g) * dim;
        for (int64_t d = 0; d < dim; ++d) orow[d] = static_cast<T>(acc[g * dim + d] / total[g]);
      }
    }
  });
}

template <typename T>
void dispatch_dim(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values,
                  const at::Tensor& tables, const at::Tensor& lens, at::Tensor& out, float scale) {
  switch (query.size(2)) {  // the common head sizes get rows in registers
    case 64: return decode<T, 64>(query, keys, values, tables, lens, out, scale);
    case 128: return decode<T, 128>(query, keys, values, tables, lens, out, scale);
    default: return decode<T, 0>(query, keys, values, tables, lens, out, scale);
  }
}

}  // namespace

// query [rows, heads, dim]; keys/values [num_blocks, kv_heads, block_size, dim] of the same
// dtype; tables [rows, width] int32 block ids; lens [rows] int32 tokens each row reads.
at::Tensor paged_decode(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values,
                        const at::Tensor& tables, const at::Tensor& lens, double scale) {
  TORCH_CHECK(query.device().is_cpu() && keys.device().is_cpu(), "paged_decode runs on CPU tensors");
  TORCH_CHECK(query.dim() == 3 && keys.dim() == 4 && values.sizes() == keys.sizes(), "paged_decode: bad shapes");
  TORCH_CHECK(query.size(2) == keys.size(3) && query.size(1) % keys.size(1) == 0, "paged_decode: heads mismatch");
  TORCH_CHECK(keys.scalar_type() == query.scalar_type() && values.scalar_type() == query.scalar_type(),
              "paged_decode: query, keys and values must share a dtype");
  TORCH_CHECK(tables.scalar_type() == at::kInt && lens.scalar_type() == at::kInt, "tables and lens are int32");
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == query.size(0) && lens.numel() == query.size(0),
              "paged_decode: one table row and one length per query row");
  const auto q = query.contiguous();
  const auto k = keys.contiguous();
  const auto v = values.contiguous();
  const auto t = tables.contiguous();
  const auto n = lens.contiguous();
  auto out = at::empty_like(q);
  const float s = static_cast<float>(scale);
  switch (q.scalar_type()) {
    case at::kFloat: dispatch_dim<float>(q, k, v, t, n, out, s); break;
    case at::kBFloat16: dispatch_dim<at::BFloat16>(q, k, v, t, n, out, s); break;
    case at::kHalf: dispatch_dim<at::Half>(q, k, v, t, n, out, s); break;
    default: TORCH_CHECK(false, "paged_decode supports float32, bfloat16 and float16, not ", q.scalar_type());
  }
  return out;
}

// Store a pass's new keys and values at their slots: key/value [kv_heads, T, dim] (any strides
// over kv_heads and T), token t to block block_ids[t], offset offsets[t], of pools [num_blocks,
// kv_heads, block_size, dim]. Why: torch's index_put costs ~50 us a call in set-up alone, and a
// decode pass makes two per layer for a few hundred bytes per question; this is a row copy each.
void paged_write(at::Tensor& keys, at::Tensor& values, const at::Tensor& key, const at::Tensor& value,
                 const at::Tensor& block_ids, const at::Tensor& offsets) {
  TORCH_CHECK(keys.device().is_cpu() && key.device().is_cpu(), "paged_write runs on CPU tensors");
  TORCH_CHECK(keys.dim() == 4 && values.sizes() == keys.sizes() && keys.is_contiguous() && values.is_contiguous(),
              "paged_write: pools must be contiguous [num_blocks, kv_heads, block_size, dim]");
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes() && key.size(0) == keys.size(1) &&
              key.size(2) == keys.size(3), "paged_write: keys/values must be [kv_heads, T, dim] of the pool's shape");
  TORCH_CHECK(key.scalar_type() == keys.scalar_type() && value.scalar_type() == keys.scalar_type() &&
              values.scalar_type() == keys.scalar_type(), "paged_write: one dtype for pools, keys and values");
  TORCH_CHECK(block_ids.scalar_type() == at::kLong && offsets.scalar_type() == at::kLong &&
              block_ids.numel() == key.size(1) && offsets.numel() == key.size(1),
              "paged_write: one int64 block id and offset per token");
  const auto k = key.stride(2) == 1 ? key : key.contiguous();
  const auto v = value.stride(2) == 1 ? value : value.contiguous();
  const auto ids = block_ids.contiguous();
  const auto offs = offsets.contiguous();
  const int64_t kv_heads = keys.size(1), block = keys.size(2), dim = keys.size(3), tokens = key.size(1);
  const int64_t num_blocks = keys.size(0), item = keys.element_size(), row = dim * item;
  const int64_t* id = ids.data_ptr<int64_t>();
  const int64_t* off = offs.data_ptr<int64_t>();
  char* kd = static_cast<char*>(keys.data_ptr());
  char* vd = static_cast<char*>(values.data_ptr());
  const char* ks = static_cast<const char*>(k.data_ptr());
  const char* vs = static_cast<const char*>(v.data_ptr());
  for (int64_t t = 0; t < tokens; ++t) {  // every slot checked before anything is written
    TORCH_CHECK(id[t] >= 0 && id[t] < num_blocks && off[t] >= 0 && off[t] < block, "paged_write: token ", t,
                " goes to block ", id[t], " offset ", off[t], "; the pool has ", num_blocks, " blocks of ", block);
  }
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t h = 0; h < kv_heads; ++h) {
      const int64_t dst = ((id[t] * kv_heads + h) * block + off[t]) * row;
      __builtin_memcpy(kd + dst, ks + (h * k.stride(0) + t * k.stride(1)) * item, row);
      __builtin_memcpy(vd + dst, vs + (h * v.stride(0) + t * v.stride(1)) * item, row);
    }
  }
}
