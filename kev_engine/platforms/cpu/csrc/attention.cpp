// Batch-invariant paged attention for CPU: every row of a pass — prefill chunks and decode rows
// alike — over its own KV blocks, in ONE call per layer.
//
// Why: a query row's result must not depend on what else is in the pass, on whether its prefix
// was shared with another question, cached from an earlier call or computed alone, nor on how
// its prompt was chunked. So a row always walks its keys the same way: positions 0..L-1 in
// chunks of C positions (`chunk_of`: 16 with 8 lanes, 32 with 16 lanes where the block size
// allows), in order; per chunk the scores (each a chain of fused multiply-adds over the head
// dimension), the chunk's max, an online-softmax update (running max and sum, as
// flash-attention does) and the weighted values (a chain of fused multiply-adds over the chunk's
// positions). Tiles of rows share each chunk's keys and values from L1, but every row's
// arithmetic is its own: the same operations whether it is computed with other rows of a
// prefill or alone in a decode step.
//
// Layout (kv_pool.py, "exact" pools): keys [num_blocks, kv_heads, head_dim, block_size] — a
// block's keys transposed, so one head dimension of C positions is one vector load — and values
// [num_blocks, kv_heads, block_size, head_dim]. Only a row's own positions enter its softmax;
// positions past them (a freed tail, another question's tokens) are masked out by selection, so
// whatever stale memory holds never reaches a result. Threads: torch's pool, tasks taken as free.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <limits>
#include <vector>

#include "pool.h"
#include "simd.h"

namespace {

using namespace kev;

// (row, head) vectors of a tile: their scores over a chunk stay in registers (12 x 2 of the 32
// AVX-512 registers; 6 x 2 of AVX2's 16, with 16-position chunks), and as many value chains run at once
constexpr int kMaxTile = kLanes == 16 ? 12 : 6;
// Head-dimension slices of the values a sweep carries for a tile of R vectors: R x S accumulators
// in registers, as many chains in flight as fit beside the values loaded. A decode row's tile is
// only its query heads of one kv head (a few vectors): more slices keep the multiply-adds busy.
constexpr int value_slices(int rows) {
  return kLanes == 16 ? (rows <= 3 ? 4 : rows <= 6 ? 2 : 1) : (rows <= 2 ? 4 : 2);
}
static_assert(kMaxTile <= kLanes, "one exp rescales every row of a tile");

// bf16 read in pairs: one load of 2 x kLanes values widened to fp32 as two vectors, the even
// elements (a 32-bit lane's low half, shifted up) and the odd ones (its high half, masked): two
// integer operations where widening each half in order takes four. The arithmetic of each element
// is unchanged; only which lane holds it: scores are put back in position order before the
// softmax (interleave), values' accumulators stay paired until the output (paired_dim).
template <typename T>
constexpr bool kPaired = !std::is_same_v<T, float>;
typedef uint32_t vpair __attribute__((vector_size(kLanes * 4)));
template <typename T>
inline void load_pairs(const T* p, vf& even, vf& odd) {
  vpair v;
  std::memcpy(&v, p, sizeof(v));
  even = (vf)(v << 16);
  odd = (vf)(v & 0xFFFF0000u);
}
// lanes 0..kLanes-1 of the elements in order (the first half of even and odd interleaved), and the rest
inline vf interleave_low(vf even, vf odd) {
#if defined(__AVX512F__)
  return __builtin_shufflevector(even, odd, 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
#else
  return __builtin_shufflevector(even, odd, 0, 8, 1, 9, 2, 10, 3, 11);
#endif
}
inline vf interleave_high(vf even, vf odd) {
#if defined(__AVX512F__)
  return __builtin_shufflevector(even, odd, 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
#else
  return __builtin_shufflevector(even, odd, 4, 12, 5, 13, 6, 14, 7, 15);
#endif
}
// The head dimension an accumulator slot holds where values were read in pairs: slot i of a
// group of 2 x kLanes holds dimension 2i (the even vector), slot kLanes + i dimension 2i + 1.
constexpr int64_t paired_dim(int64_t slot) {
  const int64_t group = slot / (2 * kLanes), within = slot % (2 * kLanes);
  return group * 2 * kLanes + (within < kLanes ? 2 * within : 2 * (within - kLanes) + 1);
}

struct Segment {  // one question's rows in this pass
  int64_t first_row, num_rows, past;  // rows first_row.. are positions past, past + 1, ...
  const int32_t* table;               // its blocks
};

struct Task {  // rows [r0, r1) of a segment, for kv heads [h0, h1)
  int64_t segment, h0, h1, r0, r1, cost;
};

// Positions per chunk: 16 with 8 lanes (a tile's scores then fit AVX2's registers), else 32 where
// the block size allows. One value per build and block size: every row of every pass alike.
constexpr int64_t chunk_of(int64_t block) { return kLanes == 8 || block % 32 != 0 ? 16 : 32; }

template <typename T>
struct Pass {
  const T* q;  // [rows, heads, dim]
  const T* k;  // [blocks, kv_heads, dim, block]
  const T* v;  // [blocks, kv_heads, block, dim]
  T* out;      // [rows, heads, dim]
  int64_t heads, kv_heads, group, dim, block, num_blocks, chunk;
  float scale;
};

// One tile of R query rows (vectors of `dim`) sharing a kv head, over one chunk of `chunk`
// positions at key/value pointers kc (transposed: [dim][block]) and vc ([block][dim]).
// n[r]: the chunk's positions row r may see (<= 0: none — the row is past its own length).
// next_k, next_v: the keys and values the task reads next (or nullptr), requested a line or two per
// step of the score loop: spread so, the requests stay within what a core keeps in flight while
// the arithmetic runs (all at once, most wait behind the first ones and the loop waits too).
template <typename T, int R, int NV>
void tile_chunk(const Pass<T>& p, const float* qbuf, const T* kc, const T* vc, const int64_t* n, bool first,
                float* m, float* l, float* acc, float* probs, const char* next_k, const char* next_v) {
  const int64_t dim = p.dim, block = p.block, chunk = NV * kLanes, padded = (dim + kLanes - 1) / kLanes * kLanes;
  vf s[R][NV];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NV; ++j) s[r][j] = vf{};
  constexpr int64_t line = NV * kLanes * sizeof(T);  // a chunk's keys at one d; its values per d of dim
  for (int64_t d = 0; d < dim; ++d) {  // scores: a chain of fused multiply-adds over d per (row, position)
    if (next_k != nullptr) {
      for (int64_t b = 0; b < line; b += 64) {
        __builtin_prefetch(next_k + d * block * static_cast<int64_t>(sizeof(T)) + b);
        __builtin_prefetch(next_v + d * line + b);
      }
    }
    vf key[NV];
    if constexpr (kPaired<T> && NV == 2) {
      load_pairs(kc + d * block, key[0], key[1]);  // positions 0, 2, ... and 1, 3, ...
    } else {
      for (int j = 0; j < NV; ++j) key[j] = load_as_float(kc + d * block + j * kLanes);
    }
    for (int r = 0; r < R; ++r) {
      const vf q = vset(qbuf[r * dim + d]);
      for (int j = 0; j < NV; ++j) s[r][j] = vfma(q, key[j], s[r][j]);
    }
  }
  if constexpr (kPaired<T> && NV == 2) {
    for (int r = 0; r < R; ++r) {
      const vf even = s[r][0], odd = s[r][1];
      s[r][0] = interleave_low(even, odd);
      s[r][1] = interleave_high(even, odd);
    }
  }
  const vi ids = lane_ids();
  int64_t widest = 0;
  bool full = true;
  float alpha[R], new_max[R];
  vf shift = vf{};  // lane r: m[r] - new_max[r], for one exp over every row's rescale
  for (int r = 0; r < R; ++r) {  // per row: the chunk's max and the new running max
    if (n[r] <= 0) {
      full = false;
      continue;
    }
    widest = std::max(widest, n[r]);
    full = full && n[r] == chunk;
    float chunk_max = -std::numeric_limits<float>::infinity();
    for (int j = 0; j < NV; ++j) {
      const vi valid = (ids + j * kLanes) < static_cast<int32_t>(n[r]);
      chunk_max = std::max(chunk_max, hmax(vselect(valid, s[r][j], vset(-std::numeric_limits<float>::infinity()))));
    }
    new_max[r] = first ? chunk_max : std::max(m[r], chunk_max);
    if (!first) shift[r] = m[r] - new_max[r];
  }
  const vf rescale = vexp(shift);  // R <= kLanes rows (kMaxTile)
  for (int r = 0; r < R; ++r) {  // per row: weights, their sum, the running sum
    if (n[r] <= 0) continue;
    vf total = vf{};
    for (int j = 0; j < NV; ++j) {
      const vi valid = (ids + j * kLanes) < static_cast<int32_t>(n[r]);
      const vf w = vselect(valid, vexp(s[r][j] - vset(new_max[r])), vf{});
      vstore(probs + r * chunk + j * kLanes, w);
      total = total + w;
    }
    const float sum = hsum(total);
    alpha[r] = first ? 0.f : rescale[r];
    l[r] = first ? sum : l[r] * alpha[r] + sum;
    m[r] = new_max[r];
  }
  // values: acc = acc * alpha, then a chain of fused multiply-adds over the positions per lane;
  // S slices of the head dimension at once, so S x R chains are in flight (a fused multiply-add
  // waits for the one before it; each element's chain is the same whatever S is)
  constexpr int S = value_slices(R);
  int64_t d0 = 0;
  for (; d0 + S * kLanes <= dim; d0 += S * kLanes) {
    vf a[R][S];
    for (int r = 0; r < R; ++r) {
      if (n[r] <= 0) continue;
      for (int s = 0; s < S; ++s) {
        a[r][s] = vload(acc + r * padded + d0 + s * kLanes);
        if (!first) a[r][s] = a[r][s] * vset(alpha[r]);
      }
    }
    for (int64_t t = 0; t < widest; ++t) {
      vf value[S];
      if constexpr (kPaired<T> && S % 2 == 0) {
        for (int s = 0; s < S; s += 2) load_pairs(vc + t * dim + d0 + s * kLanes, value[s], value[s + 1]);
      } else {
        for (int s = 0; s < S; ++s) value[s] = load_as_float(vc + t * dim + d0 + s * kLanes);
      }
      for (int r = 0; r < R; ++r) {
        if (n[r] > 0 && (full || t < n[r])) {
          const vf w = vset(probs[r * chunk + t]);
          for (int s = 0; s < S; ++s) a[r][s] = vfma(w, value[s], a[r][s]);
        }
      }
    }
    for (int r = 0; r < R; ++r)
      if (n[r] > 0)
        for (int s = 0; s < S; ++s) vstore(acc + r * padded + d0 + s * kLanes, a[r][s]);
  }
  for (; d0 < dim; d0 += kLanes) {  // what is left of the head dimension, one slice at a time
    const int64_t width = std::min<int64_t>(kLanes, dim - d0);
    vf a[R];
    for (int r = 0; r < R; ++r) {
      if (n[r] <= 0) continue;
      a[r] = vload(acc + r * padded + d0);
      if (!first) a[r] = a[r] * vset(alpha[r]);
    }
    for (int64_t t = 0; t < widest; ++t) {
      vf value;
      if (width == kLanes) {
        value = load_as_float(vc + t * dim + d0);
      } else {
        value = vf{};
        for (int64_t i = 0; i < width; ++i) value[i] = static_cast<float>(vc[t * dim + d0 + i]);
      }
      for (int r = 0; r < R; ++r)
        if (n[r] > 0 && (full || t < n[r])) a[r] = vfma(vset(probs[r * chunk + t]), value, a[r]);
    }
    for (int r = 0; r < R; ++r)
      if (n[r] > 0) vstore(acc + r * padded + d0, a[r]);
  }
}

// R rows' vectors of a segment under kv heads [h0, h1), chunk by chunk and within a chunk head by
// head (each head's part of a block follows the previous head's in the pool). heads[r]: vector
// r's query head under kv head h0 (under kv head h: heads[r] + (h - h0) * group). Each kv head's
// state sits kMaxTile vectors further into qbuf and acc (and kMaxTile floats into m and l).
// Every vector's arithmetic is its own, in the same order whichever heads share its task.
template <typename T, int R, int NV>
void run_tile(const Pass<T>& p, const Segment& seg, int64_t h0, int64_t h1, const int64_t* rows, const int64_t* heads,
              float* qbuf, float* acc, float* probs, float* m, float* l) {
  const int64_t dim = p.dim, chunk = NV * kLanes, padded = (dim + kLanes - 1) / kLanes * kLanes;
  int64_t length[R], longest = 0;
  for (int64_t h = h0; h < h1; ++h) {
    const int64_t at = h - h0;
    for (int r = 0; r < R; ++r) {
      const T* qr = p.q + (rows[r] * p.heads + heads[r] + at * p.group) * dim;
      float* qb = qbuf + (at * kMaxTile + r) * dim;
      for (int64_t d = 0; d < dim; ++d) qb[d] = static_cast<float>(qr[d]) * p.scale;
      std::fill(acc + (at * kMaxTile + r) * padded, acc + (at * kMaxTile + r + 1) * padded, 0.f);
    }
  }
  for (int r = 0; r < R; ++r) {
    length[r] = seg.past + (rows[r] - seg.first_row) + 1;  // its own position and those before it
    longest = std::max(longest, length[r]);
  }
  for (int64_t c = 0; c * chunk < longest; ++c) {
    const int64_t position = c * chunk, id = seg.table[position / p.block], offset = position % p.block;
    TORCH_CHECK(id >= 0 && id < p.num_blocks, "paged_attention: a row names block ", id, " of ", p.num_blocks);
    int64_t next_id = -1, next_offset = 0;
    if ((c + 1) * chunk < longest) {
      const int64_t at = position + chunk, next = seg.table[at / p.block];
      if (next >= 0 && next < p.num_blocks) next_id = next, next_offset = at % p.block;
    }
    int64_t n[R];
    for (int r = 0; r < R; ++r) n[r] = std::min<int64_t>(chunk, length[r] - position);
    for (int64_t h = h0; h < h1; ++h) {
      // what is read next, requested while this runs (tile_chunk): the next kv head's part of this
      // chunk, after the last head the first head's part of the next chunk
      const bool last = h + 1 == h1;
      const int64_t nid = last ? next_id : id, nh = last ? h0 : h + 1, noff = last ? next_offset : offset;
      const char* next_k = nullptr;
      const char* next_v = nullptr;
      if (nid >= 0) {
        next_k = reinterpret_cast<const char*>(p.k + (nid * p.kv_heads + nh) * dim * p.block + noff);
        next_v = reinterpret_cast<const char*>(p.v + ((nid * p.kv_heads + nh) * p.block + noff) * dim);
      }
      const T* kc = p.k + (id * p.kv_heads + h) * dim * p.block + offset;
      const T* vc = p.v + ((id * p.kv_heads + h) * p.block + offset) * dim;
      const int64_t at = h - h0;
      tile_chunk<T, R, NV>(p, qbuf + at * kMaxTile * dim, kc, vc, n, c == 0, m + at * kMaxTile, l + at * kMaxTile,
                           acc + at * kMaxTile * padded, probs, next_k, next_v);
    }
  }
  constexpr int S = value_slices(R);  // tile_chunk's: the dimensions it read in pairs, if any
  const int64_t paired = kPaired<T> && S % 2 == 0 ? dim / (S * kLanes) * (S * kLanes) : 0;
  for (int64_t h = h0; h < h1; ++h) {
    const int64_t at = h - h0;
    for (int r = 0; r < R; ++r) {
      T* orow = p.out + (rows[r] * p.heads + heads[r] + at * p.group) * dim;
      const float* a = acc + (at * kMaxTile + r) * padded;
      const float total = l[at * kMaxTile + r];
      for (int64_t i = 0; i < paired; ++i) orow[paired_dim(i)] = static_cast<T>(a[i] / total);
      for (int64_t d = paired; d < dim; ++d) orow[d] = static_cast<T>(a[d] / total);
    }
  }
}

template <typename T, int NV>
void run_tile_any(int R, const Pass<T>& p, const Segment& seg, int64_t h0, int64_t h1, const int64_t* rows,
                  const int64_t* heads, float* qbuf, float* acc, float* probs, float* m, float* l) {
  switch (R) {
#define KEV_TILE(N) \
  case N: return run_tile<T, N, NV>(p, seg, h0, h1, rows, heads, qbuf, acc, probs, m, l);
    KEV_TILE(1) KEV_TILE(2) KEV_TILE(3) KEV_TILE(4) KEV_TILE(5) KEV_TILE(6)
#if defined(__AVX512F__)
    KEV_TILE(7) KEV_TILE(8) KEV_TILE(9) KEV_TILE(10) KEV_TILE(11) KEV_TILE(12)
#endif
#undef KEV_TILE
    default: TORCH_CHECK(false, "paged_attention: tile of ", R, " rows");
  }
}

template <typename T>
void attend(const Pass<T>& p, const std::vector<Segment>& segments) {
  // a task: a few consecutive rows of one segment for some kv heads, all their query heads — a
  // tile holds up to kMaxTile (row, head) vectors per kv head; rows of a task share every chunk
  // it reads. A segment of one tile (a decode row) takes several kv heads in one task when there
  // are enough such segments to keep every thread busy: the task then reads chunk by chunk
  // across its heads, and a block's heads lie next to each other in the pool, so it reads one
  // run of memory per block (and, the allocator handing out runs, mostly one run per row)
  // instead of a separate 4 KB island per head, each requested ahead as tile_chunk does.
  const int64_t rows_per_task = std::max<int64_t>(1, kMaxTile / p.group);
  int64_t small = 0;
  for (const Segment& seg : segments) small += seg.num_rows <= rows_per_task;
  const int64_t heads_per_task =
      std::clamp<int64_t>(small * p.kv_heads / (kev::kTasksPerThread * kev::pool_threads()), 1, p.kv_heads);
  std::vector<Task> tasks;
  for (int64_t s = 0; s < static_cast<int64_t>(segments.size()); ++s) {
    const Segment& seg = segments[s];
    const int64_t width = seg.num_rows <= rows_per_task ? heads_per_task : 1;
    for (int64_t r0 = 0; r0 < seg.num_rows; r0 += rows_per_task) {
      const int64_t r1 = std::min(seg.num_rows, r0 + rows_per_task);
      for (int64_t h = 0; h < p.kv_heads; h += width) {
        const int64_t h1 = std::min(p.kv_heads, h + width);
        tasks.push_back({s, h, h1, r0, r1, (seg.past + r1) * (h1 - h)});
      }
    }
  }
  // the longest first, so no thread is left with one long task while the others are idle
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.cost > b.cost; });
  std::atomic<int64_t> next{0};
  const int64_t count = static_cast<int64_t>(tasks.size());
  const int64_t padded = (p.dim + kLanes - 1) / kLanes * kLanes;
  kev::on_threads([&] {
    const int64_t span = heads_per_task * kMaxTile;  // per kv head of a task: a tile's state
    std::vector<float> qbuf(span * p.dim), acc(span * padded), probs(kMaxTile * p.chunk), m(span), l(span);
    std::vector<int64_t> rows(kMaxTile), heads(kMaxTile);
    for (int64_t i = next++; i < count; i = next++) {
      const Task& task = tasks[i];
      const Segment& seg = segments[task.segment];
      int R = 0;
      auto flush = [&] {
        if (R == 0) return;
        if (p.chunk == 32)
          run_tile_any<T, 32 / kLanes>(R, p, seg, task.h0, task.h1, rows.data(), heads.data(), qbuf.data(),
                                      acc.data(), probs.data(), m.data(), l.data());
        else
          run_tile_any<T, 16 / kLanes>(R, p, seg, task.h0, task.h1, rows.data(), heads.data(), qbuf.data(),
                                      acc.data(), probs.data(), m.data(), l.data());
        R = 0;
      };
      for (int64_t r = task.r0; r < task.r1; ++r) {
        for (int64_t g = 0; g < p.group; ++g) {
          rows[R] = seg.first_row + r;
          heads[R] = task.h0 * p.group + g;
          if (++R == kMaxTile) flush();
        }
      }
      flush();
    }
  });
}

}  // namespace

// query [rows, heads, dim]; keys [num_blocks, kv_heads, dim, block_size] and values
// [num_blocks, kv_heads, block_size, dim] of the query's dtype; tables [segments, width] int32;
// cu_seqlens [segments + 1] int32 (segment s is rows cu[s]..cu[s+1]-1); past [segments] int32
// (positions already in the pool before those rows). Row i of segment s sits at position
// past[s] + i and attends positions 0..past[s] + i of its table's blocks.
at::Tensor paged_attention(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values,
                           const at::Tensor& tables, const at::Tensor& cu_seqlens, const at::Tensor& past,
                           double scale) {
  TORCH_CHECK(query.device().is_cpu() && keys.device().is_cpu(), "paged_attention runs on CPU tensors");
  TORCH_CHECK(query.dim() == 3 && keys.dim() == 4 && values.dim() == 4, "paged_attention: bad shapes");
  TORCH_CHECK(keys.size(0) == values.size(0) && keys.size(1) == values.size(1) && keys.size(2) == values.size(3) &&
                  keys.size(3) == values.size(2) && keys.size(2) == query.size(2),
              "paged_attention: keys [blocks, kv_heads, dim, block] and values [blocks, kv_heads, block, dim] "
              "must match the query's head size");
  TORCH_CHECK(query.size(1) % keys.size(1) == 0, "paged_attention: heads are not a multiple of kv heads");
  TORCH_CHECK(keys.scalar_type() == query.scalar_type() && values.scalar_type() == query.scalar_type(),
              "paged_attention: query, keys and values must share a dtype");
  TORCH_CHECK(keys.is_contiguous() && values.is_contiguous(), "paged_attention: the pool must be contiguous");
  TORCH_CHECK(tables.scalar_type() == at::kInt && cu_seqlens.scalar_type() == at::kInt && past.scalar_type() == at::kInt,
              "paged_attention: tables, cu_seqlens and past are int32");
  const int64_t num_segments = past.numel(), block = keys.size(3);
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == num_segments && cu_seqlens.numel() == num_segments + 1,
              "paged_attention: one table row and one past length per segment, cu_seqlens one longer");
  const int64_t chunk = chunk_of(block);
  TORCH_CHECK(block % 16 == 0, "paged_attention: block_size ", block, " is not a multiple of 16");
  const auto q = query.contiguous();
  const auto t = tables.contiguous();
  const auto cu = cu_seqlens.contiguous();
  const auto pl = past.contiguous();
  const int32_t* cup = cu.data_ptr<int32_t>();
  const int32_t* pp = pl.data_ptr<int32_t>();
  TORCH_CHECK(cup[0] == 0 && cup[num_segments] == q.size(0), "paged_attention: cu_seqlens must cover the ",
              q.size(0), " query rows");
  std::vector<Segment> segments;
  for (int64_t s = 0; s < num_segments; ++s) {
    const int64_t rows = cup[s + 1] - cup[s];
    TORCH_CHECK(rows >= 0 && pp[s] >= 0, "paged_attention: segment ", s, " has ", rows, " rows after ", pp[s]);
    TORCH_CHECK(pp[s] + rows <= t.size(1) * block, "paged_attention: segment ", s, " reaches position ",
                pp[s] + rows, "; its table holds ", t.size(1) * block);
    if (rows > 0) segments.push_back({cup[s], rows, pp[s], t.data_ptr<int32_t>() + s * t.size(1)});
  }
  auto out = at::empty_like(q);
  const int64_t heads = q.size(1), kv_heads = keys.size(1);
  auto run = [&](auto tag) {
    using T = decltype(tag);
    Pass<T> p{q.data_ptr<T>(), keys.data_ptr<T>(), values.data_ptr<T>(), out.data_ptr<T>(), heads, kv_heads,
              heads / kv_heads, q.size(2), block, keys.size(0), chunk, static_cast<float>(scale)};
    attend<T>(p, segments);
  };
  switch (q.scalar_type()) {
    case at::kFloat: run(float{}); break;
    case at::kBFloat16: run(at::BFloat16{}); break;
    default: TORCH_CHECK(false, "paged_attention supports float32 and bfloat16, not ", q.scalar_type());
  }
  return out;
}

// Store a pass's new keys and values in an "exact" pool: key/value [kv_heads, T, dim] (any
// strides over kv_heads and T), token t to block block_ids[t], offset offsets[t]; keys go in
// transposed ([dim][block] per block and head). Every slot is checked before anything is written.
void paged_write_transposed(at::Tensor& keys, at::Tensor& values, const at::Tensor& key, const at::Tensor& value,
                            const at::Tensor& block_ids, const at::Tensor& offsets) {
  TORCH_CHECK(keys.device().is_cpu() && key.device().is_cpu(), "paged_write_transposed runs on CPU tensors");
  TORCH_CHECK(keys.dim() == 4 && values.dim() == 4 && keys.is_contiguous() && values.is_contiguous() &&
                  keys.size(2) == values.size(3) && keys.size(3) == values.size(2),
              "paged_write_transposed: pools must be contiguous keys [blocks, kv_heads, dim, block] and values "
              "[blocks, kv_heads, block, dim]");
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes() && key.size(0) == keys.size(1) &&
                  key.size(2) == keys.size(2),
              "paged_write_transposed: keys/values must be [kv_heads, T, dim] of the pool's shape");
  TORCH_CHECK(key.scalar_type() == keys.scalar_type() && value.scalar_type() == keys.scalar_type() &&
                  values.scalar_type() == keys.scalar_type(),
              "paged_write_transposed: one dtype for pools, keys and values");
  TORCH_CHECK(block_ids.scalar_type() == at::kLong && offsets.scalar_type() == at::kLong &&
                  block_ids.numel() == key.size(1) && offsets.numel() == key.size(1),
              "paged_write_transposed: one int64 block id and offset per token");
  const auto k = key.stride(2) == 1 ? key : key.contiguous();
  const auto v = value.stride(2) == 1 ? value : value.contiguous();
  const auto ids = block_ids.contiguous();
  const auto offs = offsets.contiguous();
  const int64_t kv_heads = keys.size(1), dim = keys.size(2), block = keys.size(3), tokens = key.size(1);
  const int64_t num_blocks = keys.size(0), item = keys.element_size();
  const int64_t* id = ids.data_ptr<int64_t>();
  const int64_t* off = offs.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(id[t] >= 0 && id[t] < num_blocks && off[t] >= 0 && off[t] < block, "paged_write_transposed: token ",
                t, " goes to block ", id[t], " offset ", off[t], "; the pool has ", num_blocks, " blocks of ", block);
  }
  char* kd = static_cast<char*>(keys.data_ptr());
  char* vd = static_cast<char*>(values.data_ptr());
  const char* ks = static_cast<const char*>(k.data_ptr());
  const char* vs = static_cast<const char*>(v.data_ptr());
  // a key's head dimension goes to `dim` places `block` apart: one typed store each (a memcpy of
  // two or four bytes per value was a call per value)
  auto transpose_key = [&](auto tag, const char* src, char* dst) {
    using E = decltype(tag);
    const E* from = reinterpret_cast<const E*>(src);
    E* to = reinterpret_cast<E*>(dst);
    for (int64_t d = 0; d < dim; ++d) to[d * block] = from[d];
  };
  kev::parallel_for(0, kv_heads, kev::grain_for(tokens * dim), [&](int64_t h0, int64_t h1) {
    for (int64_t h = h0; h < h1; ++h) {
      for (int64_t t = 0; t < tokens; ++t) {
        const char* src_k = ks + (h * k.stride(0) + t * k.stride(1)) * item;
        char* dst_k = kd + ((id[t] * kv_heads + h) * dim * block + off[t]) * item;
        if (keys.scalar_type() == at::kFloat) {
          transpose_key(float{}, src_k, dst_k);
        } else if (keys.scalar_type() == at::kBFloat16) {
          transpose_key(at::BFloat16{}, src_k, dst_k);
        } else {
          for (int64_t d = 0; d < dim; ++d) std::memcpy(dst_k + d * block * item, src_k + d * item, item);
        }
        std::memcpy(vd + ((id[t] * kv_heads + h) * block + off[t]) * dim * item,
                    vs + (h * v.stride(0) + t * v.stride(1)) * item, dim * item);
      }
    }
  });
}
