// A decoder layer's small operations on CPU, fused: the residual add with the RMSNorm after it,
// rotary embedding with the KV pool write, SiLU(gate) * up. In torch each is 3-8 operations, and
// at a few tokens a step every operation's dispatch costs more than its arithmetic (on 2 cores
// ~9 ms of a 29 ms SmolLM2 decode step were such operations). Each function here makes one pass
// over its rows and rounds where the torch operations it replaces round (a bf16 result per
// operation), so the lean forward computes the same values either way: the same bf16 bits for
// the rotation and the adds, within float32 rounding elsewhere (see simd.h on FMA).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>

#include "simd.h"

namespace {

using namespace specd::simd;

// sum = x + delta (rounded as the dtype's add; no delta: x itself), normed = weight * rms_norm(sum)
// as transformers' LlamaRMSNorm: the norm in float32, rounded to the dtype, then scaled in the dtype.
template <typename scalar_t>
void add_rms_norm_rows(const scalar_t* x, const scalar_t* delta, const scalar_t* weight, scalar_t* sum,
                       scalar_t* normed, int64_t rows, int64_t dim, float eps) {
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* in = x + r * dim;
      fvec squares{};
      for (int64_t c = 0; c < dim; c += kLanes) {
        fvec v = load_chunk(in, c, dim);
        if (delta) {
          v = round_as<scalar_t>(v + load_chunk(delta + r * dim, c, dim));
          store_chunk(sum + r * dim, c, dim, v);
        }
        squares += v * v;
      }
      const float inv = 1.0f / std::sqrt(hsum(squares) / static_cast<float>(dim) + eps);
      const scalar_t* total = delta ? sum + r * dim : in;
      for (int64_t c = 0; c < dim; c += kLanes) {
        const fvec v = round_as<scalar_t>(load_chunk(total, c, dim) * inv);
        store_chunk(normed + r * dim, c, dim, load_chunk(weight, c, dim) * v);
      }
    }
  });
}

// Both ops below: x [..., dim], weight [dim], one dtype.
void check_norm(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.device().is_cpu() && weight.scalar_type() == x.scalar_type(), "rms_norm: CPU, one dtype");
  TORCH_CHECK(x.dim() >= 1 && weight.numel() == x.size(-1), "rms_norm: one weight per column");
}

// x -> weight * rms_norm(x).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_norm(x, weight);
  const at::Tensor in = x.contiguous(), w = weight.contiguous();
  at::Tensor normed = at::empty_like(in);
  const int64_t dim = in.size(-1), rows = dim ? in.numel() / dim : 0;
  dispatch_dtype(in.scalar_type(), "rms_norm", [&](auto zero) {
    using scalar_t = decltype(zero);
    add_rms_norm_rows<scalar_t>(in.data_ptr<scalar_t>(), nullptr, w.data_ptr<scalar_t>(), nullptr,
                                normed.data_ptr<scalar_t>(), rows, dim, static_cast<float>(eps));
  });
  return normed;
}

// (x, delta) -> (x + delta, weight * rms_norm(x + delta)): a residual add and the norm after it.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& delta,
                                                const at::Tensor& weight, double eps) {
  check_norm(x, weight);
  TORCH_CHECK(delta.sizes() == x.sizes() && delta.scalar_type() == x.scalar_type(), "add_rms_norm: delta differs from x");
  const at::Tensor in = x.contiguous(), d = delta.contiguous(), w = weight.contiguous();
  at::Tensor sum = at::empty_like(in), normed = at::empty_like(in);
  const int64_t dim = in.size(-1), rows = dim ? in.numel() / dim : 0;
  dispatch_dtype(in.scalar_type(), "rms_norm", [&](auto zero) {
    using scalar_t = decltype(zero);
    add_rms_norm_rows<scalar_t>(in.data_ptr<scalar_t>(), d.data_ptr<scalar_t>(), w.data_ptr<scalar_t>(),
                                sum.data_ptr<scalar_t>(), normed.data_ptr<scalar_t>(), rows, dim,
                                static_cast<float>(eps));
  });
  return {sum, normed};
}

// gate_up [..., 2 I] (gate, then up) -> silu(gate) * up [..., I], each rounded as torch rounds.
at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.device().is_cpu() && gate_up.size(-1) % 2 == 0, "silu_mul: CPU, an even last dim");
  const at::Tensor in = gate_up.contiguous();
  const int64_t width = in.size(-1), dim = width / 2, rows = width ? in.numel() / width : 0;
  auto sizes = in.sizes().vec();
  sizes.back() = dim;
  at::Tensor out = at::empty(sizes, in.options());
  dispatch_dtype(in.scalar_type(), "silu_mul", [&](auto zero) {
    using scalar_t = decltype(zero);
    const scalar_t* src = in.data_ptr<scalar_t>();
    scalar_t* dst = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
      const fvec one = fvec{} + 1.0f;
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* gate = src + r * width;
        for (int64_t c = 0; c < dim; c += kLanes) {
          const fvec g = load_chunk(gate, c, dim);
          const fvec silu = round_as<scalar_t>(g / (one + exp_vec(fvec{} - g)));
          store_chunk(dst + r * dim, c, dim, silu * load_chunk(gate + dim, c, dim));
        }
      }
    });
  });
  return out;
}

// qkv [T, (H + 2 KVH) * D] -> queries [T, H, D] rotated; keys rotated and values copied into rows
// `dest` [T] of the pools [KVH, slots, D]. The rotation is x * cos + roll(x, D / 2) * sin with sin
// [T, D] already negated on its first half; cos and sin in the dtype, a rounding per product
// and per sum as the torch expression has (in bf16; see simd.h on float32).
at::Tensor rotary_kv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_pool,
                     at::Tensor v_pool, const at::Tensor& dest, int64_t heads, int64_t kv_heads) {
  const int64_t tokens = qkv.size(0), dim = k_pool.size(2), half = dim / 2, slots = k_pool.size(1);
  TORCH_CHECK(qkv.device().is_cpu() && qkv.dim() == 2 && qkv.size(1) == (heads + 2 * kv_heads) * dim,
              "rotary_kv: qkv is not [T, (H + 2 KVH) * D]");
  TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(0) == tokens && cos.size(1) == dim,
              "rotary_kv: cos/sin [T, D]");
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous() && k_pool.sizes() == v_pool.sizes() &&
                  k_pool.size(0) == kv_heads, "rotary_kv: pools [KVH, slots, D], contiguous");
  TORCH_CHECK(dim % 2 == 0 && dest.scalar_type() == at::kLong && dest.numel() == tokens, "rotary_kv: dest [T] int64");
  TORCH_CHECK(qkv.scalar_type() == cos.scalar_type() && qkv.scalar_type() == k_pool.scalar_type(),
              "rotary_kv: one dtype");
  const at::Tensor in = qkv.contiguous(), c = cos.contiguous(), s = sin.contiguous(), where = dest.contiguous();
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t row = where.data_ptr<int64_t>()[t];
    TORCH_CHECK(row >= 0 && row < slots, "rotary_kv: pool row ", row, " out of range");
  }
  at::Tensor q = at::empty({tokens, heads, dim}, in.options());
  dispatch_dtype(in.scalar_type(), "rotary_kv", [&](auto zero) {
    using scalar_t = decltype(zero);
    const scalar_t* src = in.data_ptr<scalar_t>();
    const scalar_t* cos_rows = c.data_ptr<scalar_t>();
    const scalar_t* sin_rows = s.data_ptr<scalar_t>();
    scalar_t* queries = q.data_ptr<scalar_t>();
    scalar_t* keys = k_pool.data_ptr<scalar_t>();
    scalar_t* values = v_pool.data_ptr<scalar_t>();
    const int64_t* slot = where.data_ptr<int64_t>();
    const int64_t width = in.size(1);
    at::parallel_for(0, tokens, 4, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const scalar_t* row = src + t * width;
        for (int64_t h = 0; h < heads + kv_heads; ++h) {
          const scalar_t* x = row + h * dim;
          scalar_t* out = h < heads ? queries + (t * heads + h) * dim : keys + ((h - heads) * slots + slot[t]) * dim;
          for (int64_t d = 0; d < dim; d += kLanes) {
            // roll(x, D / 2)[d] = x[(d + D / 2) mod D]: whole vectors where D / 2 is a lane multiple.
            const int64_t n = std::min(kLanes, dim - d);
            fvec rolled{};
            if (half % kLanes == 0 && n == kLanes) {
              rolled = load_vec(x + (d + half) % dim);
            } else {
              for (int64_t l = 0; l < n; ++l) rolled[l] = static_cast<float>(x[(d + l + half) % dim]);
            }
            const fvec a = round_as<scalar_t>(load_chunk(x, d, dim) * load_chunk(cos_rows + t * dim, d, dim));
            const fvec b = round_as<scalar_t>(rolled * load_chunk(sin_rows + t * dim, d, dim));
            store_chunk(out, d, dim, a + b);
          }
        }
        for (int64_t h = 0; h < kv_heads; ++h)
          std::memcpy(values + (h * slots + slot[t]) * dim, row + (heads + kv_heads + h) * dim, dim * sizeof(scalar_t));
      }
    });
  });
  return q;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specd, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor delta, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("rotary_kv(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_pool, Tensor(b!) v_pool, Tensor dest, "
        "int heads, int kv_heads) -> Tensor");
}

TORCH_LIBRARY_IMPL(specd, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_mul", &silu_mul);
  m.impl("rotary_kv", &rotary_kv);
}
