// Paged attention for decode and verify rows on CPU: every row's keys and values are read in
// place through its block table, once per (row, KV head), instead of gathered into a padded
// copy that SDPA then reads again. At 32 decode rows the gather alone moved the KV cache
// twice per layer; this reads it once.
//
// One work item is a (row, KV head) pair: the row's queries for every query head of that KV
// head's group, scored against the row's causal range, softmaxed and summed over the values,
// all in float32. Each item is computed by one thread in a fixed order, so a row's output does
// not depend on the thread count or on which other rows share the step. Keys are dotted a whole
// head-dim row at a time in SIMD vectors (one horizontal sum a key), the softmax and the value
// sums are vectorized too (`simd.h`): 1.5-2.1x the element-by-element loops this replaced.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "simd.h"

namespace {

using namespace specd::simd;

constexpr int64_t kMaxHeadDim = 256;
constexpr int64_t kMaxChunks = kMaxHeadDim / kLanes;

// A head-dim row as `chunks` float vectors. kChunks > 0: the head dim is kChunks * kLanes, known
// at compile time, and every chunk is one load. kChunks == 0: any head dim; the last chunk is
// read element by element and padded with zeros, which add nothing to dots or sums.
template <typename scalar_t, int64_t kChunks>
struct Rows {
  int64_t head_dim, chunks;

  explicit Rows(int64_t dim) : head_dim(dim), chunks(kChunks ? kChunks : (dim + kLanes - 1) / kLanes) {}

  fvec load(const scalar_t* row, int64_t c) const {
    if constexpr (kChunks != 0) return load_vec(row + c * kLanes);
    return load_chunk(row, c * kLanes, head_dim);
  }
};

struct Scratch {
  std::vector<fvec> queries, acc;
  std::vector<float> scores, values;
};

struct Geometry {
  int64_t num_heads, kv_heads, group, head_dim, pool_rows, block_size;
  float scale;
};

// One work item: a row's queries for every query head of KV head `head`, scored against the
// row's causal range, softmaxed and summed over the values, in float32.
template <typename scalar_t, int64_t kChunks>
void attend_item(const scalar_t* q, const scalar_t* k, const scalar_t* v, scalar_t* o, const int64_t* blocks,
                 int64_t first, int64_t num_q, int64_t start, int64_t head, const Geometry& geo, Scratch& scratch) {
  const Rows<scalar_t, kChunks> rows(geo.head_dim);
  const int64_t C = kChunks ? kChunks : rows.chunks, D = geo.head_dim, bs = geo.block_size;
  const int64_t num_keys = start + num_q;  // query i sits at position start + i, sees keys 0..start + i
  const int64_t vectors = num_q * geo.group;  // vector x = (i, g): query i, head head * group + g
  const int64_t num_blocks = (num_keys + bs - 1) / bs;
  auto& queries = scratch.queries;
  auto& scores = scratch.scores;
  queries.resize(vectors * C);
  scores.resize(vectors * num_keys);
  scratch.values.resize(bs * C * kLanes);
  scratch.acc.assign(vectors * C, fvec{});
  auto head_row = [&](int64_t i, int64_t g) { return ((first + i) * geo.num_heads + head * geo.group + g) * D; };
  for (int64_t i = 0; i < num_q; ++i)
    for (int64_t g = 0; g < geo.group; ++g)
      for (int64_t c = 0; c < C; ++c) queries[(i * geo.group + g) * C + c] = rows.load(q + head_row(i, g), c) * geo.scale;
  // Block b of this head in a pool: n rows of D, contiguous.
  auto block_at = [&](const scalar_t* pool, int64_t b) { return pool + (head * geo.pool_rows + blocks[b] * bs) * D; };

  // Scores: each key is loaded (and widened) once, then dotted with every query vector.
  for (int64_t b = 0; b < num_blocks; ++b) {
    const int64_t j0 = b * bs, n = std::min(bs, num_keys - j0);
    if (b + 1 < num_blocks) prefetch(block_at(k, b + 1), bs * D);
    const scalar_t* block = block_at(k, b);
    for (int64_t jj = 0; jj < n; ++jj) {
      fvec key[kChunks ? kChunks : kMaxChunks];
      for (int64_t c = 0; c < C; ++c) key[c] = rows.load(block + jj * D, c);
      for (int64_t x = 0; x < vectors; ++x) {
        const fvec* qv = queries.data() + x * C;
        fvec dot = qv[0] * key[0];
        for (int64_t c = 1; c < C; ++c) dot += qv[c] * key[c];
        scores[x * num_keys + j0 + jj] = hsum(dot);
      }
    }
  }
  // Softmax over each query's visible keys, kLanes at a time (the tail lanes padded so that
  // they take no part: -inf for the peak, 0 for the total).
  for (int64_t x = 0; x < vectors; ++x) {
    float* s = scores.data() + x * num_keys;
    const int64_t visible = start + x / geo.group + 1;
    const int64_t whole = visible - visible % kLanes;
    const fvec lowest = fvec{} - std::numeric_limits<float>::infinity();
    fvec peaks = lowest;
    for (int64_t j = 0; j < whole; j += kLanes) {
      const fvec value = load_vec(s + j);
      peaks = value > peaks ? value : peaks;
    }
    float peak = -std::numeric_limits<float>::infinity();
    for (int64_t l = 0; l < kLanes; ++l) peak = std::max(peak, peaks[l]);
    for (int64_t j = whole; j < visible; ++j) peak = std::max(peak, s[j]);
    fvec totals{};
    for (int64_t j = 0; j < whole; j += kLanes) {
      const fvec e = exp_vec(load_vec(s + j) - peak);
      std::memcpy(s + j, &e, sizeof(e));
      totals += e;
    }
    float total = hsum(totals);
    if (whole < visible) {
      const fvec e = exp_vec(load_part(s + whole, visible - whole) - peak);
      for (int64_t l = 0; l < visible - whole; ++l) {
        s[whole + l] = e[l];
        total += e[l];
      }
    }
    const float norm = 1.0f / total;
    for (int64_t j = 0; j < visible; ++j) s[j] *= norm;
    std::fill(s + visible, s + num_keys, 0.0f);  // keys after this query's position
  }
  // Values: a block is widened once into float32, then each query vector sums it in registers.
  float* values = scratch.values.data();
  for (int64_t b = 0; b < num_blocks; ++b) {
    const int64_t j0 = b * bs, n = std::min(bs, num_keys - j0);
    if (b + 1 < num_blocks) prefetch(block_at(v, b + 1), bs * D);
    const scalar_t* block = block_at(v, b);
    for (int64_t jj = 0; jj < n; ++jj)
      for (int64_t c = 0; c < C; ++c) {
        const fvec value = rows.load(block + jj * D, c);
        std::memcpy(values + (jj * C + c) * kLanes, &value, sizeof(value));
      }
    for (int64_t x = 0; x < vectors; ++x) {
      const float* p = scores.data() + x * num_keys + j0;
      fvec sum[kChunks ? kChunks : kMaxChunks];
      for (int64_t c = 0; c < C; ++c) sum[c] = scratch.acc[x * C + c];
      for (int64_t jj = 0; jj < n; ++jj)
        for (int64_t c = 0; c < C; ++c) sum[c] += p[jj] * load_vec(values + (jj * C + c) * kLanes);
      for (int64_t c = 0; c < C; ++c) scratch.acc[x * C + c] = sum[c];
    }
  }
  for (int64_t i = 0; i < num_q; ++i)
    for (int64_t g = 0; g < geo.group; ++g) {
      const fvec* a = scratch.acc.data() + (i * geo.group + g) * C;
      scalar_t* dst = o + head_row(i, g);
      for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<scalar_t>(a[d / kLanes][d % kLanes]);
    }
}

// Every (row, KV head) item, on torch's thread pool. Each item is computed by one thread in a
// fixed order, so a row's output does not depend on the thread count or on the other rows.
template <typename scalar_t, int64_t kChunks>
void attend_rows(const at::Tensor& query, const at::Tensor& key_pool, const at::Tensor& value_pool,
                 const at::Tensor& block_table, const at::Tensor& query_start, const at::Tensor& context_start,
                 const Geometry& geo, at::Tensor& out) {
  const int64_t num_rows = block_table.size(0), blocks_per_row = block_table.size(1);
  const scalar_t* q = query.data_ptr<scalar_t>();
  const scalar_t* k = key_pool.data_ptr<scalar_t>();
  const scalar_t* v = value_pool.data_ptr<scalar_t>();
  scalar_t* o = out.data_ptr<scalar_t>();
  const int64_t* table = block_table.data_ptr<int64_t>();
  const int64_t* q_start = query_start.data_ptr<int64_t>();
  const int64_t* ctx_start = context_start.data_ptr<int64_t>();
  at::parallel_for(0, num_rows * geo.kv_heads, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t row = item / geo.kv_heads, head = item % geo.kv_heads;
      attend_item<scalar_t, kChunks>(q, k, v, o, table + row * blocks_per_row, q_start[row],
                                     q_start[row + 1] - q_start[row], ctx_start[row], head, geo, scratch);
    }
  });
}

// The head dims that models use get an unrolled instance; any other runs the padded one.
template <typename scalar_t>
void attend_dispatch(const at::Tensor& query, const at::Tensor& key_pool, const at::Tensor& value_pool,
                     const at::Tensor& block_table, const at::Tensor& query_start,
                     const at::Tensor& context_start, const Geometry& geo, at::Tensor& out) {
  const auto run = [&](auto chunks) {
    attend_rows<scalar_t, decltype(chunks)::value>(query, key_pool, value_pool, block_table, query_start,
                                                   context_start, geo, out);
  };
  const int64_t chunks = geo.head_dim % kLanes == 0 ? geo.head_dim / kLanes : 0;
  switch (chunks) {
    case 1: return run(std::integral_constant<int64_t, 1>{});
    case 2: return run(std::integral_constant<int64_t, 2>{});
    case 4: return run(std::integral_constant<int64_t, 4>{});
    case 8: return run(std::integral_constant<int64_t, 8>{});
    case 16: return run(std::integral_constant<int64_t, 16>{});
    default: return run(std::integral_constant<int64_t, 0>{});
  }
}

// query [T, H, D] (rows' queries back to back); pools [KVH, slots, D]; block_table [rows, blocks]
// int64; query_start [rows + 1] int64 (row r's queries are query[query_start[r]:query_start[r + 1]]);
// context_start [rows] int64 (the position of each row's first query). Returns [T, H, D].
at::Tensor paged_attention(const at::Tensor& query, const at::Tensor& key_pool, const at::Tensor& value_pool,
                           const at::Tensor& block_table, const at::Tensor& query_start,
                           const at::Tensor& context_start, int64_t block_size, double scale) {
  TORCH_CHECK(query.device().is_cpu(), "paged_attention: CPU tensors only");
  TORCH_CHECK(query.dim() == 3 && key_pool.dim() == 3 && value_pool.dim() == 3, "paged_attention: 3-d tensors");
  TORCH_CHECK(query.scalar_type() == key_pool.scalar_type() && key_pool.scalar_type() == value_pool.scalar_type(),
              "paged_attention: one dtype");
  TORCH_CHECK(key_pool.sizes() == value_pool.sizes(), "paged_attention: key and value pools differ");
  TORCH_CHECK(query.size(2) == key_pool.size(2) && query.size(1) % key_pool.size(0) == 0,
              "paged_attention: heads do not match the pools");
  TORCH_CHECK(block_table.scalar_type() == at::kLong && query_start.scalar_type() == at::kLong &&
                  context_start.scalar_type() == at::kLong, "paged_attention: int64 indices");
  TORCH_CHECK(query_start.numel() == block_table.size(0) + 1 && context_start.numel() == block_table.size(0),
              "paged_attention: one query range and one start per row");
  TORCH_CHECK(query.size(2) <= kMaxHeadDim, "paged_attention: head dim over ", kMaxHeadDim);
  at::Tensor q = query.contiguous(), k = key_pool.contiguous(), v = value_pool.contiguous();
  at::Tensor table = block_table.contiguous(), q_start = query_start.contiguous(), start = context_start.contiguous();
  at::Tensor out = at::empty_like(q);
  const int64_t heads = q.size(1), kv_heads = k.size(0);
  const Geometry geo{heads, kv_heads, heads / kv_heads, q.size(2), k.size(1), block_size, static_cast<float>(scale)};
  dispatch_dtype(q.scalar_type(), "paged_attention", [&](auto zero) {
    attend_dispatch<decltype(zero)>(q, k, v, table, q_start, start, geo, out);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(specd, m) {
  m.def("paged_attention(Tensor query, Tensor key_pool, Tensor value_pool, Tensor block_table, "
        "Tensor query_start, Tensor context_start, int block_size, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(specd, CPU, m) { m.impl("paged_attention", &paged_attention); }
