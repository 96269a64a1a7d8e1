// A dense linear layer whose every token row is computed alone: y = x @ W^T, each output the dot
// product of one row of x with one row of W, summed in one order (kLanes partial sums over the
// inputs, then a fixed fold) whatever the number of rows in the call. BLAS libraries pick their
// kernel, and with it the order of a row's sums, by the row count (torch's float32 product of
// SmolLM2's output projection gave a row other bits at 2 rows than at 1), so a token's logits
// would depend on whether a decode, a verify or a batch of 16 computed them.
//
// Built for the output projections that stay dense (a tied embedding): at one row it is a read of
// the weight, and each weight vector loaded is multiplied into up to kRows token rows while it
// sits in registers. On SmolLM2's 49,152 x 576 projection in float32 (2-core AMD EPYC) it took
// 4.9 ms at one row and 7.9 at five, where torch's x @ W^T took 9.8 and 18.3 and the tuned
// transposed/packed layouts (row-count dependent) 3.7 and 3.7: it reads ~23 GB/s, they ~30.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "simd.h"

namespace {

using namespace specd::simd;

constexpr int kRows = 4;     // token rows whose accumulators share each weight load
constexpr int kOutputs = 4;  // weight rows per block: kRows x kOutputs accumulators in registers

template <typename scalar_t>
void row_linear_impl(const scalar_t* x, const scalar_t* w, const scalar_t* bias, scalar_t* y, int64_t rows,
                     int64_t outputs, int64_t dim) {
  const int64_t blocks = (outputs + kOutputs - 1) / kOutputs;
  // Whole blocks of kOutputs weight rows per task; each block reads its rows once from memory
  // and again from L1 for every kRows token rows.
  at::parallel_for(0, blocks, 64, [&](int64_t begin, int64_t end) {
    const int64_t n_begin = begin * kOutputs, n_end = std::min(outputs, end * kOutputs);
    for (int64_t n0 = n_begin; n0 < n_end; n0 += kOutputs) {
      for (int64_t m0 = 0; m0 < rows; m0 += kRows) {
        const int64_t mb = std::min<int64_t>(kRows, rows - m0);
        auto run = [&](auto size, auto width) {
          constexpr int MB = decltype(size)::value, NB = decltype(width)::value;
          for (int64_t o0 = n0; o0 < std::min(n_end, n0 + kOutputs); o0 += NB) {
            fvec acc[MB][NB] = {};
            for (int64_t c = 0; c < dim; c += kLanes) {
              fvec xs[MB];
              for (int r = 0; r < MB; ++r) xs[r] = load_chunk(x + (m0 + r) * dim, c, dim);
              for (int o = 0; o < NB; ++o) {
                const fvec ws = load_chunk(w + (o0 + o) * dim, c, dim);
                for (int r = 0; r < MB; ++r) acc[r][o] += xs[r] * ws;
              }
            }
            for (int r = 0; r < MB; ++r)
              for (int o = 0; o < NB; ++o) {
                float v = hsum(acc[r][o]);
                if (bias) v += static_cast<float>(bias[o0 + o]);
                y[(m0 + r) * outputs + o0 + o] = static_cast<scalar_t>(v);
              }
          }
        };
        // A whole block shares each row's loads; the last, partial block takes its outputs one by one.
        auto rows_of = [&](auto width) {
          switch (mb) {
            case 1: run(std::integral_constant<int, 1>{}, width); break;
            case 2: run(std::integral_constant<int, 2>{}, width); break;
            case 3: run(std::integral_constant<int, 3>{}, width); break;
            default: run(std::integral_constant<int, 4>{}, width); break;
          }
        };
        if (n0 + kOutputs <= n_end) {
          rows_of(std::integral_constant<int, kOutputs>{});
        } else {
          rows_of(std::integral_constant<int, 1>{});
        }
      }
    }
  });
}

at::Tensor row_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "row_linear: CPU tensors");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "row_linear: float32 or bfloat16, one dtype");
  TORCH_CHECK(weight.dim() == 2 && x.size(-1) == weight.size(1), "row_linear: x [..., K], weight [N, K]");
  const at::Tensor rows = x.reshape({-1, x.size(-1)}).contiguous();
  const at::Tensor w = weight.contiguous();
  const at::Tensor b = bias.has_value() && bias->defined() ? bias->contiguous() : at::Tensor();
  TORCH_CHECK(!b.defined() || (b.scalar_type() == x.scalar_type() && b.numel() == w.size(0)), "row_linear: bias [N]");
  const int64_t m = rows.size(0), n = w.size(0), k = w.size(1);
  at::Tensor out = at::empty({m, n}, x.options());
  if (x.scalar_type() == at::kBFloat16) {
    row_linear_impl(rows.data_ptr<at::BFloat16>(), w.data_ptr<at::BFloat16>(),
                    b.defined() ? b.data_ptr<at::BFloat16>() : nullptr, out.data_ptr<at::BFloat16>(), m, n, k);
  } else {
    row_linear_impl(rows.data_ptr<float>(), w.data_ptr<float>(), b.defined() ? b.data_ptr<float>() : nullptr,
                    out.data_ptr<float>(), m, n, k);
  }
  auto sizes = x.sizes().vec();
  sizes.back() = n;
  return out.view(sizes);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specd, m) { m.def("row_linear(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor"); }

TORCH_LIBRARY_IMPL(specd, CPU, m) { m.impl("row_linear", &row_linear); }
