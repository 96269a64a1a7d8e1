// Paged attention for decode and verify rows on CPU: every row's keys and values are read in
// place through its block table, once per (row, KV head), instead of gathered into a padded
// copy that SDPA then reads again. At 32 decode rows the gather alone moved the KV cache
// twice per layer; this reads it once.
//
// One work item is a (row, KV head) pair: the row's queries for every query head of that KV
// head's group, scored against the row's causal range, softmaxed and summed over the values,
// all in float32. Each item is computed by one thread in a fixed order, so a row's output does
// not depend on the thread count or on which other rows share the step.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

inline float load(const float* p, int64_t i) { return p[i]; }

inline float load(const at::BFloat16* p, int64_t i) {
  // bf16 is the top half of a float32: a shift, which the compiler vectorizes.
  uint32_t bits = static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(p)[i]) << 16;
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

// The next block sits anywhere in the pool: ask for its cache lines while this one is computed.
template <typename scalar_t>
inline void prefetch(const scalar_t* p, int64_t count) {
  const char* bytes = reinterpret_cast<const char*>(p);
  for (int64_t offset = 0; offset < count * static_cast<int64_t>(sizeof(scalar_t)); offset += 64)
    __builtin_prefetch(bytes + offset);
}

inline void store(float* p, int64_t i, float value) { p[i] = value; }
inline void store(at::BFloat16* p, int64_t i, float value) { p[i] = at::BFloat16(value); }

template <typename scalar_t>
void attend_rows(const at::Tensor& query, const at::Tensor& key_pool, const at::Tensor& value_pool,
                 const at::Tensor& block_table, const at::Tensor& query_start, const at::Tensor& context_start,
                 int64_t block_size, double scale, at::Tensor& out) {
  const int64_t num_heads = query.size(1), head_dim = query.size(2);
  const int64_t kv_heads = key_pool.size(0), pool_rows = key_pool.size(1);
  const int64_t group = num_heads / kv_heads;
  const int64_t num_rows = block_table.size(0), blocks_per_row = block_table.size(1);
  const scalar_t* q = query.data_ptr<scalar_t>();
  const scalar_t* k = key_pool.data_ptr<scalar_t>();
  const scalar_t* v = value_pool.data_ptr<scalar_t>();
  scalar_t* o = out.data_ptr<scalar_t>();
  const int64_t* table = block_table.data_ptr<int64_t>();
  const int64_t* q_start = query_start.data_ptr<int64_t>();
  const int64_t* ctx_start = context_start.data_ptr<int64_t>();
  const float softmax_scale = static_cast<float>(scale);

  at::parallel_for(0, num_rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> queries, scores, acc;
    std::vector<float> keys(block_size * head_dim), values(block_size * head_dim);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t row = item / kv_heads, head = item % kv_heads;
      const int64_t first = q_start[row], num_q = q_start[row + 1] - first;
      const int64_t start = ctx_start[row];  // query i sits at position start + i, sees keys 0..start + i
      const int64_t num_keys = start + num_q;
      const int64_t vectors = num_q * group;  // vector x = (i, g): query i, head head * group + g
      queries.resize(vectors * head_dim);
      scores.resize(vectors * num_keys);
      acc.assign(vectors * head_dim, 0.0f);
      for (int64_t i = 0; i < num_q; ++i) {
        for (int64_t g = 0; g < group; ++g) {
          const int64_t src = ((first + i) * num_heads + head * group + g) * head_dim;
          float* dst = queries.data() + (i * group + g) * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) dst[d] = load(q, src + d) * softmax_scale;
        }
      }
      const int64_t* blocks = table + row * blocks_per_row;
      const int64_t num_blocks = (num_keys + block_size - 1) / block_size;
      // Block b of this row and head, [n, D] in float32 into `out` (the next block prefetched); n.
      auto read_block = [&](const scalar_t* pool, int64_t b, float* out) {
        const int64_t n = std::min(block_size, num_keys - b * block_size);
        if (b + 1 < num_blocks) prefetch(pool + (head * pool_rows + blocks[b + 1] * block_size) * head_dim, block_size * head_dim);
        const scalar_t* block = pool + (head * pool_rows + blocks[b] * block_size) * head_dim;
        for (int64_t e = 0; e < n * head_dim; ++e) out[e] = load(block, e);
        return n;
      };
      // Scores block by block: a block's keys are contiguous [block, D] in the pool, converted to
      // float32 once and dotted with each of the item's query vectors.
      for (int64_t b = 0; b < num_blocks; ++b) {
        const int64_t j0 = b * block_size, n = read_block(k, b, keys.data());
        for (int64_t x = 0; x < vectors; ++x) {
          const float* qv = queries.data() + x * head_dim;
          float* out_scores = scores.data() + x * num_keys + j0;
          for (int64_t jj = 0; jj < n; ++jj) {
            const float* kj = keys.data() + jj * head_dim;
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < head_dim; ++d) dot += qv[d] * kj[d];
            out_scores[jj] = dot;
          }
        }
      }
      for (int64_t x = 0; x < vectors; ++x) {
        float* s = scores.data() + x * num_keys;
        const int64_t visible = start + x / group + 1;
        float peak = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j < visible; ++j) peak = std::max(peak, s[j]);
        float total = 0.0f;
        for (int64_t j = 0; j < visible; ++j) {
          s[j] = std::exp(s[j] - peak);
          total += s[j];
        }
        const float norm = 1.0f / total;
        for (int64_t j = 0; j < visible; ++j) s[j] *= norm;
        std::fill(s + visible, s + num_keys, 0.0f);  // keys after this query's position
      }
      for (int64_t b = 0; b < num_blocks; ++b) {
        const int64_t j0 = b * block_size, n = read_block(v, b, values.data());
        for (int64_t x = 0; x < vectors; ++x) {
          const float* p = scores.data() + x * num_keys + j0;
          float* a = acc.data() + x * head_dim;
          for (int64_t jj = 0; jj < n; ++jj) {
            const float weight = p[jj];
            const float* vj = values.data() + jj * head_dim;
#pragma omp simd
            for (int64_t d = 0; d < head_dim; ++d) a[d] += weight * vj[d];
          }
        }
      }
      for (int64_t i = 0; i < num_q; ++i) {
        for (int64_t g = 0; g < group; ++g) {
          const int64_t dst = ((first + i) * num_heads + head * group + g) * head_dim;
          const float* a = acc.data() + (i * group + g) * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) store(o, dst + d, a[d]);
        }
      }
    }
  });
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
  at::Tensor q = query.contiguous(), k = key_pool.contiguous(), v = value_pool.contiguous();
  at::Tensor table = block_table.contiguous(), q_start = query_start.contiguous(), start = context_start.contiguous();
  at::Tensor out = at::empty_like(q);
  if (q.scalar_type() == at::kFloat) {
    attend_rows<float>(q, k, v, table, q_start, start, block_size, scale, out);
  } else if (q.scalar_type() == at::kBFloat16) {
    attend_rows<at::BFloat16>(q, k, v, table, q_start, start, block_size, scale, out);
  } else {
    TORCH_CHECK(false, "paged_attention: float32 or bfloat16, not ", q.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(specd, m) {
  m.def("paged_attention(Tensor query, Tensor key_pool, Tensor value_pool, Tensor block_table, "
        "Tensor query_start, Tensor context_start, int block_size, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(specd, CPU, m) { m.impl("paged_attention", &paged_attention); }
