// Float SIMD for specd's CPU kernels, as wide as the machine they were compiled for
// (-march=native): 16 lanes with AVX-512, 8 with AVX2 or less. GCC/Clang vector extensions,
// so one source serves every x86 and Arm machine; bf16 is widened to float32 for arithmetic
// and rounded back to nearest-even, as torch's own bf16 operations do. In float32 the compiler
// may fuse a multiply and an add into one rounding (FMA) where torch rounds twice: the values
// differ from torch's by float32 rounding, as any reordering would.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace specd::simd {

#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
#else
constexpr int64_t kLanes = 8;
#endif
typedef float fvec __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t ivec __attribute__((vector_size(kLanes * sizeof(int32_t))));
typedef uint32_t uvec __attribute__((vector_size(kLanes * sizeof(uint32_t))));
typedef uint16_t hvec __attribute__((vector_size(kLanes * sizeof(uint16_t))));

inline fvec load_vec(const float* p) {
  fvec v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline fvec load_vec(const at::BFloat16* p) {
  // bf16 is the top half of a float32: widen and shift.
  hvec half;
  std::memcpy(&half, p, sizeof(half));
  return reinterpret_cast<fvec>(__builtin_convertvector(half, uvec) << 16);
}

// The first `count` (< kLanes) values at p, the other lanes zero.
template <typename scalar_t>
inline fvec load_part(const scalar_t* p, int64_t count) {
  fvec v{};
  for (int64_t l = 0; l < count; ++l) v[l] = static_cast<float>(p[l]);
  return v;
}

inline void store_vec(float* p, fvec v) { std::memcpy(p, &v, sizeof(v)); }

// Round to nearest even, NaN kept a (quiet) NaN: c10::BFloat16's rounding, lane by lane.
inline hvec to_bf16_bits(fvec v) {
  const uvec bits = reinterpret_cast<uvec>(v);
  const uvec rounded = (bits + (((bits >> 16) & 1) + 0x7fff)) >> 16;
  const uvec out = v != v ? uvec{} + 0x7fc0 : rounded;
  return __builtin_convertvector(out, hvec);
}

inline void store_vec(at::BFloat16* p, fvec v) {
  const hvec half = to_bf16_bits(v);
  std::memcpy(p, &half, sizeof(half));
}

template <typename scalar_t>
inline void store_part(scalar_t* p, fvec v, int64_t count) {
  for (int64_t l = 0; l < count; ++l) p[l] = static_cast<scalar_t>(v[l]);
}

// The kLanes values of a row of `dim` from offset c: a whole vector, or the zero-padded tail.
template <typename scalar_t>
inline fvec load_chunk(const scalar_t* row, int64_t c, int64_t dim) {
  return c + kLanes <= dim ? load_vec(row + c) : load_part(row + c, dim - c);
}

template <typename scalar_t>
inline void store_chunk(scalar_t* row, int64_t c, int64_t dim, fvec v) {
  if (c + kLanes <= dim) {
    store_vec(row + c, v);
  } else {
    store_part(row + c, v, dim - c);
  }
}

// v as scalar_t would hold it: where a torch op on bf16 tensors rounds its result, so do we.
template <typename scalar_t>
inline fvec round_as(fvec v) {
  if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
    return reinterpret_cast<fvec>(__builtin_convertvector(to_bf16_bits(v), uvec) << 16);
  } else {
    return v;
  }
}

// v plus v rotated down by `shift` lanes. GCC < 12 has no __builtin_shufflevector, Clang no
// __builtin_shuffle: each gets the one it has.
template <int shift>
inline fvec fold(fvec v) {
#if defined(__clang__)
#if defined(__AVX512F__)
  return v + __builtin_shufflevector(v, v, 0 + shift, 1 + shift, 2 + shift, 3 + shift, 4 + shift, 5 + shift,
                                     6 + shift, 7 + shift, 8 + shift, 9 + shift, 10 + shift, 11 + shift,
                                     12 + shift, 13 + shift, 14 + shift, 15 + shift);
#else
  return v + __builtin_shufflevector(v, v, 0 + shift, 1 + shift, 2 + shift, 3 + shift, 4 + shift, 5 + shift,
                                     6 + shift, 7 + shift);
#endif
#else
  ivec lanes;
  for (int l = 0; l < kLanes; ++l) lanes[l] = (l + shift) % kLanes;
  return v + __builtin_shuffle(v, lanes);
#endif
}

// The sum of v's lanes: halve until lane 0 holds it.
inline float hsum(fvec v) {
  if constexpr (kLanes == 16) v = fold<8>(v);
  return fold<1>(fold<2>(fold<4>(v)))[0];
}

// e^x lane by lane: x = n ln2 + r with |r| <= ln2 / 2, e^r by its degree-6 Taylor polynomial
// (relative error < 2e-7, expf's own order), 2^n put straight into the exponent bits. Above
// 88.72 the result is inf, as expf's; below -87 it is 0, where expf still returns values under
// 1.7e-38 that neither a softmax (its largest term is 1) nor a SiLU (g / (1 + e^-g)) can tell
// from 0.
inline fvec exp_vec(fvec x) {
  const fvec zero{};
  const auto underflow = x < zero - 87.0f;
  const auto overflow = x > zero + 88.72f;
  x = underflow ? zero - 87.0f : x;
  x = overflow ? zero + 88.0f : x;  // NaN compares false both ways and stays NaN
  const fvec scaled = x * 1.44269504088896341f;  // x / ln2, rounded to the nearest integer:
  const ivec n = __builtin_convertvector(scaled + (scaled < zero ? zero - 0.5f : zero + 0.5f), ivec);
  const fvec nf = __builtin_convertvector(n, fvec);
  const fvec r = x - nf * 0.693359375f + nf * 2.12194440e-4f;  // ln2 in two parts, exact first product
  fvec p = zero + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const fvec result = reinterpret_cast<fvec>(reinterpret_cast<ivec>(p) + (n << 23));
  const fvec infinity = zero + __builtin_inff();
  return underflow ? zero : (overflow ? infinity : result);
}

// Ask for the cache lines of `count` values at p (a block the next iteration reads).
template <typename scalar_t>
inline void prefetch(const scalar_t* p, int64_t count) {
  const char* bytes = reinterpret_cast<const char*>(p);
  for (int64_t offset = 0; offset < count * static_cast<int64_t>(sizeof(scalar_t)); offset += 64)
    __builtin_prefetch(bytes + offset);
}

// fn(scalar_t{}) for the dtypes the kernels take: float32 and bfloat16.
template <typename Fn>
inline void dispatch_dtype(at::ScalarType dtype, const char* op, Fn&& fn) {
  if (dtype == at::kFloat) {
    fn(float{});
  } else if (dtype == at::kBFloat16) {
    fn(at::BFloat16{});
  } else {
    TORCH_CHECK(false, op, ": float32 or bfloat16, not ", dtype);
  }
}

}  // namespace specd::simd
