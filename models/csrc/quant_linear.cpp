// Weight-only quantized linear layers on CPU: y = x @ W^T with W in int4 (groups of 32 inputs,
// a float16 scale and minimum each, or GGUF's Q4_K super-blocks: int4k), int6 (groups of 16
// inputs, a float16 scale each) or int8 (groups of 32 inputs, a float16 scale each), read once
// from memory for every row of the step.
//
// A decode or verify step is a read of every weight, so the kernel is built around the bytes:
// each weight is loaded once per tile of 16 output rows and multiplied into up to 8 token rows
// while it sits in registers (more rows reread the tile from L1/L2, not from memory). The
// products are integer dot products, as llama.cpp computes them: each token row is quantized to
// int8 per group of 32 inputs (scale = max |x| / 127) and multiplied with VNNI `vpdpbusd`, or
// `vpmaddubsw` where the CPU has no VNNI. A float path would widen every weight to a float lane
// (3-4 instructions per 16 weights) and run out of arithmetic before memory; the integer path
// spends ~3 instructions per 64-128 weights.
//
// Each row's sums run in the same order whatever else is in the call (the row's own
// quantization, then the tile's groups in order), so a row gets the same bits alone or among 32.
//
// Layouts (made by `models.quantized`):
//   int4 codes [N/16, K/8, 64] uint8: for tile t and input octet o, byte 4r+j holds row 16t+r's
//     code of input 8o+j in its low nibble and of input 8o+4+j in its high nibble, codes 0..15;
//     scales, mins [N/16, K/32, 16] float16: w = code * scale + min.
//   int4k codes as int4's; scales, mins [N/16, K/256, 16] float16 and steps, offsets [N/16, K/32,
//     16] uint8, GGUF's Q4_K: w = code * (scale * step) + min * offset, per super-block of 256
//     inputs and group of 32 (`mins` holds Q4_K's dmin negated).
//   int8 codes [N/16, K/4, 64] int8: for tile t and input quad q, byte 4r+j is row 16t+r's code
//     of input 4q+j, in -127..127; scales [N/16, K/32, 16] float16: w = code * scale.
//   int6 codes [N/16, K/16, 192] uint8: for tile t and block b of 16 inputs, three 64-byte
//     columns. In the first, byte 4r+j holds the low 4 bits of row 16t+r's codes of inputs 16b+j
//     (low nibble) and 16b+4+j (high nibble); in the second, of 16b+8+j and 16b+12+j; in the
//     third, their top 2 bits, in that order from bit 0 (as GGUF's Q6_K splits its codes, in
//     another order).
//     Codes 0..63; scales [N/16, K/16, 16] float16: w = (code - 32) * scale.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#include <immintrin.h>

#include "simd.h"

namespace {

constexpr int64_t kGroup = 32;  // inputs per activation scale (and per int4 weight scale)
constexpr int64_t kTile = 16;   // output rows per weight tile
constexpr int kMaxRows = 8;     // token rows whose accumulators stay in registers
// Codes are prefetched this far ahead: a 1-row step's loop did not keep enough loads in flight
// for the hardware prefetcher alone (int4 read 18 GB/s cold on a 2-core Xeon, 27 with this,
// where a streaming read reached 26-28).
constexpr int64_t kPrefetch = 2048;

// The integer dot products at one vector width. `kRows` output rows per vector (4 bytes each).
#if defined(__AVX512F__) && defined(__AVX512BW__)
struct Isa {
  using I = __m512i;
  using F = __m512;
  static constexpr int kRows = 16;
  static I load(const uint8_t* p) { return _mm512_loadu_si512(p); }
  static I zero() { return _mm512_setzero_si512(); }
  static I bytes(int v) { return _mm512_set1_epi8(static_cast<char>(v)); }
  static I words(int v) { return _mm512_set1_epi16(static_cast<int16_t>(v)); }
  static I dwords(int32_t v) { return _mm512_set1_epi32(v); }
  static I band(I a, I b) { return _mm512_and_si512(a, b); }
  static I bxor(I a, I b) { return _mm512_xor_si512(a, b); }
  static I bor(I a, I b) { return _mm512_or_si512(a, b); }
  // Each byte's low nibble from a, its high one from b: one vpternlogd.
  static I low_high(I a, I b) { return _mm512_ternarylogic_epi32(_mm512_set1_epi8(0x0F), a, b, 0xCA); }
  static I shr4(I a) { return _mm512_srli_epi16(a, 4); }
  static I shr2(I a) { return _mm512_srli_epi16(a, 2); }
  static I shl2(I a) { return _mm512_slli_epi16(a, 2); }
  static I shl4(I a) { return _mm512_slli_epi16(a, 4); }
  static I add16(I a, I b) { return _mm512_add_epi16(a, b); }
  static I add32(I a, I b) { return _mm512_add_epi32(a, b); }
  static I sub32(I a, I b) { return _mm512_sub_epi32(a, b); }
  static I maddubs(I u8, I s8) { return _mm512_maddubs_epi16(u8, s8); }
  static I madd16(I a, I b) { return _mm512_madd_epi16(a, b); }
  static I abs8(I a) { return _mm512_abs_epi8(a); }
  // s8 * sign(w): AVX-512 has no vpsignb; negate where w < 0, zero where w == 0.
  static I sign8(I a, I w) {
    const __mmask64 negative = _mm512_movepi8_mask(w);
    const __mmask64 zero = _mm512_testn_epi8_mask(w, w);
    return _mm512_maskz_mov_epi8(~zero, _mm512_mask_sub_epi8(a, negative, _mm512_setzero_si512(), a));
  }
#if defined(__AVX512VNNI__)
  static constexpr bool kVnni = true;
  static I dpbusd(I acc, I u8, I s8) { return _mm512_dpbusd_epi32(acc, u8, s8); }
#else
  static constexpr bool kVnni = false;
  static I dpbusd(I acc, I, I) { return acc; }
#endif
  static F to_float(I a) { return _mm512_cvtepi32_ps(a); }
  static I round(F a) { return _mm512_cvtps_epi32(a); }
  static F widen_bf16(const at::BFloat16* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
  }
  static F abs(F a) { return _mm512_abs_ps(a); }
  static F max(F a, F b) { return _mm512_max_ps(a, b); }
  static float reduce_max(F a) { return _mm512_reduce_max_ps(a); }
  static int32_t reduce_add(I a) { return _mm512_reduce_add_epi32(a); }
  static void store_bytes(int8_t* p, I a) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(a)); }
  static F halves(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static F unsigned_bytes(const uint8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static F floats(const float* p) { return _mm512_loadu_ps(p); }
  static F splat(float v) { return _mm512_set1_ps(v); }
  static F fzero() { return _mm512_setzero_ps(); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
};
#else
struct Isa {
  using I = __m256i;
  using F = __m256;
  static constexpr int kRows = 8;
  static I load(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static I zero() { return _mm256_setzero_si256(); }
  static I bytes(int v) { return _mm256_set1_epi8(static_cast<char>(v)); }
  static I words(int v) { return _mm256_set1_epi16(static_cast<int16_t>(v)); }
  static I dwords(int32_t v) { return _mm256_set1_epi32(v); }
  static I band(I a, I b) { return _mm256_and_si256(a, b); }
  static I bxor(I a, I b) { return _mm256_xor_si256(a, b); }
  static I bor(I a, I b) { return _mm256_or_si256(a, b); }
  // Each byte's low nibble from a, its high one from b.
  static I low_high(I a, I b) {
    const I low = _mm256_set1_epi8(0x0F);
    return _mm256_or_si256(_mm256_and_si256(low, a), _mm256_andnot_si256(low, b));
  }
  static I shr4(I a) { return _mm256_srli_epi16(a, 4); }
  static I shr2(I a) { return _mm256_srli_epi16(a, 2); }
  static I shl2(I a) { return _mm256_slli_epi16(a, 2); }
  static I shl4(I a) { return _mm256_slli_epi16(a, 4); }
  static I add16(I a, I b) { return _mm256_add_epi16(a, b); }
  static I add32(I a, I b) { return _mm256_add_epi32(a, b); }
  static I sub32(I a, I b) { return _mm256_sub_epi32(a, b); }
  static I maddubs(I u8, I s8) { return _mm256_maddubs_epi16(u8, s8); }
  static I madd16(I a, I b) { return _mm256_madd_epi16(a, b); }
  static I abs8(I a) { return _mm256_abs_epi8(a); }
  static I sign8(I a, I w) { return _mm256_sign_epi8(a, w); }
#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
  static constexpr bool kVnni = true;
#if defined(__AVXVNNI__)
  static I dpbusd(I acc, I u8, I s8) { return _mm256_dpbusd_avx_epi32(acc, u8, s8); }
#else
  static I dpbusd(I acc, I u8, I s8) { return _mm256_dpbusd_epi32(acc, u8, s8); }
#endif
#else
  static constexpr bool kVnni = false;
  static I dpbusd(I acc, I, I) { return acc; }
#endif
  static F to_float(I a) { return _mm256_cvtepi32_ps(a); }
  static I round(F a) { return _mm256_cvtps_epi32(a); }
  static F widen_bf16(const at::BFloat16* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
  }
  static F abs(F a) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), a); }
  static F max(F a, F b) { return _mm256_max_ps(a, b); }
  static float reduce_max(F a) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
  }
  static int32_t reduce_add(I a) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1)));
  }
  static void store_bytes(int8_t* p, I a) {  // 8 int32 lanes in -127..127 -> 8 bytes
    const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packs_epi16(words, words));
  }
  static F halves(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static F unsigned_bytes(const uint8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  static F floats(const float* p) { return _mm256_loadu_ps(p); }
  static F splat(float v) { return _mm256_set1_ps(v); }
  static F fzero() { return _mm256_setzero_ps(); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
};
#endif

// Token rows quantized per group of kGroup inputs: q = round(x / scale), scale = max |x| / 127.
struct QuantizedRows {
  std::vector<int8_t> codes;  // [M, K]
  std::vector<float> scales;  // [M, G]
  std::vector<float> sums;    // [M, G]: scale * sum(q), the group's sum as the codes say it
  std::vector<int32_t> code_sums;  // [M, G]: sum(q)
  std::vector<int32_t> half_sums;  // [M, 2G]: sum(q) over each half of a group (int6's blocks)
};

constexpr int kGroupVectors = kGroup / Isa::kRows;  // float vectors per group: 2 (AVX-512) or 4
constexpr float kTiny = 1e-30f;

inline typename Isa::F load_floats(const float* p) { return Isa::floats(p); }
inline typename Isa::F load_floats(const at::BFloat16* p) { return Isa::widen_bf16(p); }

// One group of kGroup values: its codes (int32 lanes), scale and the code sums of its two halves.
// The products and the rounding (to nearest even, the MXCSR default) are the scalar ones', lane
// by lane.
template <typename scalar_t>
inline float quantize_group(const scalar_t* in, typename Isa::I* codes, int32_t* halves) {
  typename Isa::F values[kGroupVectors];
  typename Isa::F amax = Isa::fzero();
  for (int v = 0; v < kGroupVectors; ++v) {
    values[v] = load_floats(in + v * Isa::kRows);
    amax = Isa::max(amax, Isa::abs(values[v]));
  }
  const float group_max = Isa::reduce_max(amax);
  // A group below kTiny rounds to zeros: 127 / max would overflow to inf near float's smallest values.
  const typename Isa::F inverse = Isa::splat(group_max > kTiny ? 127.0f / group_max : 0.0f);
  typename Isa::I sums[2] = {Isa::zero(), Isa::zero()};
  for (int v = 0; v < kGroupVectors; ++v) {
    codes[v] = Isa::round(Isa::mul(values[v], inverse));  // |code| <= 127: no clamp needed
    sums[2 * v / kGroupVectors] = Isa::add32(sums[2 * v / kGroupVectors], codes[v]);
  }
  halves[0] = Isa::reduce_add(sums[0]);
  halves[1] = Isa::reduce_add(sums[1]);
  return group_max / 127.0f;
}

template <typename scalar_t>
QuantizedRows quantize_rows(const scalar_t* x, int64_t rows, int64_t dim) {
  const int64_t groups = dim / kGroup;
  QuantizedRows out{std::vector<int8_t>(rows * dim), std::vector<float>(rows * groups),
                    std::vector<float>(rows * groups), std::vector<int32_t>(rows * groups),
                    std::vector<int32_t>(rows * groups * 2)};
  at::parallel_for(0, rows * groups, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {  // rows are contiguous: group i of the whole [M, K]
      typename Isa::I codes[kGroupVectors];
      int32_t* halves = out.half_sums.data() + 2 * i;
      const float scale = quantize_group(x + i * kGroup, codes, halves);
      const int32_t total = halves[0] + halves[1];
      for (int v = 0; v < kGroupVectors; ++v) Isa::store_bytes(out.codes.data() + i * kGroup + v * Isa::kRows, codes[v]);
      out.scales[i] = scale;
      out.code_sums[i] = total;
      out.sums[i] = scale * static_cast<float>(total);
    }
  });
  return out;
}

// `count` floats (a multiple of simd::kLanes) to scalar_t, rounded as torch rounds (simd.h).
template <typename scalar_t>
inline void store_rounded(scalar_t* dest, const float* values, int64_t count) {
  for (int64_t c = 0; c < count; c += specd::simd::kLanes) specd::simd::store_vec(dest + c, specd::simd::load_vec(values + c));
}

constexpr int kParts = kTile / Isa::kRows;  // vectors per tile: 1 (AVX-512) or 2 (AVX2)
constexpr int64_t kPartBytes = 64 / kParts;

// Independent accumulators per token row, so a 1-row step does not wait on one chain of 8
// dependent dot products per group (vpdpbusd: 5 cycles each); more rows overlap by themselves.
template <int MB>
constexpr int kChains = MB == 1 ? 4 : MB == 2 ? 2 : 1;

int32_t four_codes(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// An int4 tile's scale and minimum per group of kGroup inputs, for 16 rows (`part` picks the
// vector): float16 each (int4), or as Q4_K has them (int4k): 8-bit multiples of a float16 scale
// and minimum per super-block of kSuper inputs, multiplied out in float32 as GGUF's readers do.
struct GroupScales {
  const uint16_t* scales;
  const uint16_t* mins;
  typename Isa::F scale(int64_t g, int part) const { return Isa::halves(scales + g * kTile + part * Isa::kRows); }
  typename Isa::F minimum(int64_t g, int part) const { return Isa::halves(mins + g * kTile + part * Isa::kRows); }
};

constexpr int64_t kSuper = 256;  // inputs per Q4_K super-block

struct SuperBlockScales {
  const uint16_t* scales;  // [K/256, 16] float16
  const uint16_t* mins;    // [K/256, 16] float16 (Q4_K's dmin, negated)
  const uint8_t* steps;    // [K/32, 16]
  const uint8_t* offsets;  // [K/32, 16]
  typename Isa::F scale(int64_t g, int part) const {
    const int64_t block = g / (kSuper / kGroup);
    return Isa::mul(Isa::halves(scales + block * kTile + part * Isa::kRows),
                    Isa::unsigned_bytes(steps + g * kTile + part * Isa::kRows));
  }
  typename Isa::F minimum(int64_t g, int part) const {
    const int64_t block = g / (kSuper / kGroup);
    return Isa::mul(Isa::halves(mins + block * kTile + part * Isa::kRows),
                    Isa::unsigned_bytes(offsets + g * kTile + part * Isa::kRows));
  }
};

// One int4 tile (16 output rows) times token rows [m0, m0 + MB): out[r][16] in float.
template <int MB, typename Scales>
void int4_tile(const uint8_t* codes, const Scales& scales, const QuantizedRows& a, int64_t dim, int64_t m0,
               float* out) {
  const int64_t groups = dim / kGroup;
  const typename Isa::I low = Isa::bytes(0x0F);
  for (int part = 0; part < kParts; ++part) {
    typename Isa::F result[MB];
    for (int r = 0; r < MB; ++r) result[r] = Isa::fzero();
    for (int64_t g = 0; g < groups; ++g) {
      typename Isa::I acc[kChains<MB>][MB];
      for (int c = 0; c < kChains<MB>; ++c)
        for (int r = 0; r < MB; ++r) acc[c][r] = Isa::zero();
      for (int64_t o = 0; o < kGroup / 8; ++o) {
        const uint8_t* at = codes + (g * (kGroup / 8) + o) * 64 + part * kPartBytes;
        _mm_prefetch(reinterpret_cast<const char*>(at + kPrefetch), _MM_HINT_T0);
        const typename Isa::I v = Isa::load(at);
        const typename Isa::I lo = Isa::band(v, low);
        const typename Isa::I hi = Isa::band(Isa::shr4(v), low);
        const int c_lo = (2 * o) % kChains<MB>, c_hi = (2 * o + 1) % kChains<MB>;
        for (int r = 0; r < MB; ++r) {
          const int8_t* q = a.codes.data() + (m0 + r) * dim + g * kGroup + o * 8;
          const typename Isa::I q_lo = Isa::dwords(four_codes(q)), q_hi = Isa::dwords(four_codes(q + 4));
          if constexpr (Isa::kVnni) {
            acc[c_lo][r] = Isa::dpbusd(acc[c_lo][r], lo, q_lo);
            acc[c_hi][r] = Isa::dpbusd(acc[c_hi][r], hi, q_hi);
          } else {  // 16-bit lanes: 8 pairs of 15 * 127 per group stay below 2^15
            acc[c_lo][r] = Isa::add16(acc[c_lo][r], Isa::maddubs(lo, q_lo));
            acc[c_hi][r] = Isa::add16(acc[c_hi][r], Isa::maddubs(hi, q_hi));
          }
        }
      }
      const typename Isa::F scale = scales.scale(g, part), minimum = scales.minimum(g, part);
      for (int r = 0; r < MB; ++r) {
        typename Isa::I sum = acc[0][r];
        for (int c = 1; c < kChains<MB>; ++c) sum = Isa::kVnni ? Isa::add32(sum, acc[c][r]) : Isa::add16(sum, acc[c][r]);
        const typename Isa::I dot = Isa::kVnni ? sum : Isa::madd16(sum, Isa::words(1));
        const int64_t i = (m0 + r) * groups + g;
        result[r] = Isa::fma(Isa::to_float(dot), Isa::mul(scale, Isa::splat(a.scales[i])), result[r]);
        result[r] = Isa::fma(minimum, Isa::splat(a.sums[i]), result[r]);
      }
    }
    for (int r = 0; r < MB; ++r) Isa::store(out + r * kTile + part * Isa::kRows, result[r]);
  }
}

// One int8 tile (16 output rows) times token rows [m0, m0 + MB): out[r][16] in float.
template <int MB>
void int8_tile(const int8_t* codes, const uint16_t* scales, const QuantizedRows& a, int64_t dim, int64_t m0,
               float* out) {
  const int64_t groups = dim / kGroup;
  const typename Isa::I flip = Isa::bytes(0x80);
  for (int part = 0; part < kParts; ++part) {
    typename Isa::F result[MB];
    for (int r = 0; r < MB; ++r) result[r] = Isa::fzero();
    for (int64_t g = 0; g < groups; ++g) {
      typename Isa::I acc[kChains<MB>][MB];
      for (int c = 0; c < kChains<MB>; ++c)
        for (int r = 0; r < MB; ++r) acc[c][r] = Isa::zero();
      for (int64_t quad = 0; quad < kGroup / 4; ++quad) {
        const int c = quad % kChains<MB>;
        const auto* p = reinterpret_cast<const uint8_t*>(codes) + (g * (kGroup / 4) + quad) * 64 + part * kPartBytes;
        _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetch), _MM_HINT_T0);
        const typename Isa::I w = Isa::load(p);
        // VNNI multiplies unsigned by signed bytes: w + 128 as unsigned, 128 * sum(q) taken off below.
        // Without it, |w| times q with w's sign (pairs of 127 * 127 fit 16 bits).
        const typename Isa::I unsigned_w = Isa::kVnni ? Isa::bxor(w, flip) : Isa::abs8(w);
        for (int r = 0; r < MB; ++r) {
          const typename Isa::I q = Isa::dwords(four_codes(a.codes.data() + (m0 + r) * dim + g * kGroup + quad * 4));
          if constexpr (Isa::kVnni) {
            acc[c][r] = Isa::dpbusd(acc[c][r], unsigned_w, q);
          } else {
            acc[c][r] = Isa::add32(acc[c][r], Isa::madd16(Isa::maddubs(unsigned_w, Isa::sign8(q, w)), Isa::words(1)));
          }
        }
      }
      const typename Isa::F scale = Isa::halves(scales + g * kTile + part * Isa::kRows);
      for (int r = 0; r < MB; ++r) {
        const int64_t i = (m0 + r) * groups + g;
        typename Isa::I sum = acc[0][r];
        for (int c = 1; c < kChains<MB>; ++c) sum = Isa::add32(sum, acc[c][r]);
        const typename Isa::I dot = Isa::kVnni ? Isa::sub32(sum, Isa::dwords(128 * a.code_sums[i])) : sum;
        result[r] = Isa::fma(Isa::to_float(dot), Isa::mul(scale, Isa::splat(a.scales[i])), result[r]);
      }
    }
    for (int r = 0; r < MB; ++r) Isa::store(out + r * kTile + part * Isa::kRows, result[r]);
  }
}

// One int6 tile (16 output rows) times token rows [m0, m0 + MB): out[r][16] in float. Each block
// of 16 inputs has its own weight scale, so each is summed apart and scaled before the next.
template <int MB>
void int6_tile(const uint8_t* codes, const uint16_t* scales, const QuantizedRows& a, int64_t dim, int64_t m0,
               float* out) {
  const int64_t blocks = dim / (kGroup / 2), groups = dim / kGroup;
  const typename Isa::I pairs = Isa::bytes(0x33);  // bits of the first and third codes' top pairs
  for (int part = 0; part < kParts; ++part) {
    typename Isa::F result[MB];
    for (int r = 0; r < MB; ++r) result[r] = Isa::fzero();
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* at = codes + b * 192 + part * kPartBytes;
      for (int column = 0; column < 3; ++column)
        _mm_prefetch(reinterpret_cast<const char*>(at + column * 64 + kPrefetch), _MM_HINT_T0);
      const typename Isa::I first = Isa::load(at), second = Isa::load(at + 64), highs = Isa::load(at + 128);
      // Codes of inputs 16b + 4c + j, c = 0..3: low nibbles from the first two columns, top bits
      // from the third, split into its even and odd pairs so that each shift leaves the bits above
      // a code's 6 clear (the 16-bit shifts carry bits between bytes only where a nibble is taken
      // from the other operand).
      const typename Isa::I even = Isa::band(highs, pairs), odd = Isa::band(highs, Isa::bxor(pairs, Isa::bytes(0xFF)));
      const typename Isa::I c[4] = {
          Isa::low_high(first, Isa::shl4(even)),
          Isa::low_high(Isa::shr4(first), Isa::shl2(odd)),
          Isa::low_high(second, even),
          Isa::low_high(Isa::shr4(second), Isa::shr2(odd)),
      };
      typename Isa::I acc[kChains<MB>][MB];
      for (int k = 0; k < kChains<MB>; ++k)
        for (int r = 0; r < MB; ++r) acc[k][r] = Isa::zero();
      for (int r = 0; r < MB; ++r) {
        const int8_t* q = a.codes.data() + (m0 + r) * dim + b * (kGroup / 2);
        for (int k = 0; k < 4; ++k) {
          const typename Isa::I qk = Isa::dwords(four_codes(q + 4 * k));
          if constexpr (Isa::kVnni) {
            acc[k % kChains<MB>][r] = Isa::dpbusd(acc[k % kChains<MB>][r], c[k], qk);
          } else {  // pairs of 63 * 127 fit 16 bits; their sums need not: widen each
            acc[k % kChains<MB>][r] = Isa::add32(acc[k % kChains<MB>][r], Isa::madd16(Isa::maddubs(c[k], qk), Isa::words(1)));
          }
        }
      }
      const typename Isa::F scale = Isa::halves(scales + b * kTile + part * Isa::kRows);
      for (int r = 0; r < MB; ++r) {
        typename Isa::I sum = acc[0][r];
        for (int k = 1; k < kChains<MB>; ++k) sum = Isa::add32(sum, acc[k][r]);
        // codes are stored as code + 32: 32 * sum(q) over the block taken off
        const typename Isa::I dot = Isa::sub32(sum, Isa::dwords(32 * a.half_sums[(m0 + r) * 2 * groups + b]));
        result[r] = Isa::fma(Isa::to_float(dot), Isa::mul(scale, Isa::splat(a.scales[(m0 + r) * groups + b / 2])), result[r]);
      }
    }
    for (int r = 0; r < MB; ++r) Isa::store(out + r * kTile + part * Isa::kRows, result[r]);
  }
}

template <typename Tile>
void dispatch_rows(int rows, Tile&& tile) {
  switch (rows) {
    case 1: tile(std::integral_constant<int, 1>{}); break;
    case 2: tile(std::integral_constant<int, 2>{}); break;
    case 3: tile(std::integral_constant<int, 3>{}); break;
    case 4: tile(std::integral_constant<int, 4>{}); break;
    case 5: tile(std::integral_constant<int, 5>{}); break;
    case 6: tile(std::integral_constant<int, 6>{}); break;
    case 7: tile(std::integral_constant<int, 7>{}); break;
    default: tile(std::integral_constant<int, 8>{}); break;
  }
}

// out[M, N] from per-tile float results.
template <typename scalar_t, typename Tile>
void run_tiles(int64_t rows, int64_t outputs, scalar_t* out, Tile&& tile) {
  const int64_t tiles = outputs / kTile;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    float block[kMaxRows * kTile];
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t m0 = 0; m0 < rows; m0 += kMaxRows) {
        const int mb = static_cast<int>(std::min<int64_t>(kMaxRows, rows - m0));
        dispatch_rows(mb, [&](auto size) { tile(t, m0, size, block); });
        for (int r = 0; r < mb; ++r) {
          scalar_t* dest = out + (m0 + r) * outputs + t * kTile;
          store_rounded(dest, block + r * kTile, kTile);
        }
      }
    }
  });
}

// The rows' dtype as a tag: float32 or bfloat16 (`check_rows`).
template <typename Body>
void by_dtype(const at::Tensor& x, Body&& body) {
  if (x.scalar_type() == at::kBFloat16) {
    body(at::BFloat16{});
  } else {
    body(float{});
  }
}

void check_rows(const at::Tensor& x, int64_t in_features) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous(), "quantized linear: contiguous [M, K] CPU rows");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "quantized linear: float32 or bfloat16 rows");
  TORCH_CHECK(x.size(1) == in_features && in_features % kGroup == 0, "quantized linear: K must match, a multiple of 32");
}

// out [M, N] = x @ W^T: each token row of x quantized once, then every tile of 16 outputs by
// `tile(quantized rows, t, m0, mb, its float results)` (`run_tiles`).
template <typename Tile>
at::Tensor weight_only_product(const at::Tensor& x, int64_t outputs, int64_t dim, Tile&& tile) {
  const int64_t rows = x.size(0);
  at::Tensor out = at::empty({rows, outputs}, x.options());
  if (rows == 0) return out;
  by_dtype(x, [&](auto tag) {
    using scalar_t = decltype(tag);
    const QuantizedRows a = quantize_rows(x.data_ptr<scalar_t>(), rows, dim);
    run_tiles(rows, outputs, out.data_ptr<scalar_t>(),
              [&](int64_t t, int64_t m0, auto mb, float* block) { tile(a, t, m0, mb, block); });
  });
  return out;
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& mins) {
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 3 && codes.size(2) == 64 && codes.is_contiguous(),
              "int4_linear: codes [N/16, K/8, 64] uint8");
  const int64_t tiles = codes.size(0), dim = codes.size(1) * 8, outputs = tiles * kTile;
  check_rows(x, dim);
  TORCH_CHECK(scales.scalar_type() == at::kHalf && mins.scalar_type() == at::kHalf && scales.is_contiguous() &&
                  mins.is_contiguous() && scales.numel() == outputs * (dim / kGroup) && mins.numel() == scales.numel(),
              "int4_linear: scales and mins [N/16, K/32, 16] float16");
  const auto* w = codes.data_ptr<uint8_t>();
  const auto* s = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  const auto* z = reinterpret_cast<const uint16_t*>(mins.data_ptr<at::Half>());
  const int64_t tile_bytes = dim / 8 * 64, tile_groups = dim / kGroup * kTile;
  return weight_only_product(x, outputs, dim, [&](const QuantizedRows& a, int64_t t, int64_t m0, auto mb, float* out) {
    int4_tile<decltype(mb)::value>(w + t * tile_bytes, GroupScales{s + t * tile_groups, z + t * tile_groups}, a,
                                   dim, m0, out);
  });
}

at::Tensor int4k_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& mins,
                        const at::Tensor& steps, const at::Tensor& offsets) {
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 3 && codes.size(2) == 64 && codes.is_contiguous(),
              "int4k_linear: codes [N/16, K/8, 64] uint8");
  const int64_t tiles = codes.size(0), dim = codes.size(1) * 8, outputs = tiles * kTile;
  check_rows(x, dim);
  TORCH_CHECK(dim % kSuper == 0, "int4k_linear: K must be a multiple of 256");
  const int64_t tile_blocks = dim / kSuper * kTile, tile_groups = dim / kGroup * kTile;
  TORCH_CHECK(scales.scalar_type() == at::kHalf && mins.scalar_type() == at::kHalf && scales.is_contiguous() &&
                  mins.is_contiguous() && scales.numel() == tiles * tile_blocks && mins.numel() == scales.numel(),
              "int4k_linear: scales and mins [N/16, K/256, 16] float16");
  TORCH_CHECK(steps.scalar_type() == at::kByte && offsets.scalar_type() == at::kByte && steps.is_contiguous() &&
                  offsets.is_contiguous() && steps.numel() == tiles * tile_groups && offsets.numel() == steps.numel(),
              "int4k_linear: steps and offsets [N/16, K/32, 16] uint8");
  const auto* w = codes.data_ptr<uint8_t>();
  const auto* s = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  const auto* z = reinterpret_cast<const uint16_t*>(mins.data_ptr<at::Half>());
  const auto* u = steps.data_ptr<uint8_t>();
  const auto* v = offsets.data_ptr<uint8_t>();
  const int64_t tile_bytes = dim / 8 * 64;
  return weight_only_product(x, outputs, dim, [&](const QuantizedRows& a, int64_t t, int64_t m0, auto mb, float* out) {
    const SuperBlockScales source{s + t * tile_blocks, z + t * tile_blocks, u + t * tile_groups, v + t * tile_groups};
    int4_tile<decltype(mb)::value>(w + t * tile_bytes, source, a, dim, m0, out);
  });
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales) {
  TORCH_CHECK(codes.scalar_type() == at::kChar && codes.dim() == 3 && codes.size(2) == 64 && codes.is_contiguous(),
              "int8_linear: codes [N/16, K/4, 64] int8");
  const int64_t tiles = codes.size(0), dim = codes.size(1) * 4, outputs = tiles * kTile;
  check_rows(x, dim);
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.numel() == outputs * (dim / kGroup),
              "int8_linear: scales [N/16, K/32, 16] float16");
  const auto* w = codes.data_ptr<int8_t>();
  const auto* s = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  const int64_t tile_bytes = dim / 4 * 64, tile_groups = dim / kGroup * kTile;
  return weight_only_product(x, outputs, dim, [&](const QuantizedRows& a, int64_t t, int64_t m0, auto mb, float* out) {
    int8_tile<decltype(mb)::value>(w + t * tile_bytes, s + t * tile_groups, a, dim, m0, out);
  });
}

at::Tensor int6_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales) {
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 3 && codes.size(2) == 192 && codes.is_contiguous(),
              "int6_linear: codes [N/16, K/16, 192] uint8");
  const int64_t tiles = codes.size(0), dim = codes.size(1) * 16, outputs = tiles * kTile;
  check_rows(x, dim);
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.numel() == outputs * (dim / 16),
              "int6_linear: scales [N/16, K/16, 16] float16");
  const auto* w = codes.data_ptr<uint8_t>();
  const auto* s = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  const int64_t tile_bytes = dim / 16 * 192, tile_blocks = dim / 16 * kTile;
  return weight_only_product(x, outputs, dim, [&](const QuantizedRows& a, int64_t t, int64_t m0, auto mb, float* out) {
    int6_tile<decltype(mb)::value>(w + t * tile_bytes, s + t * tile_blocks, a, dim, m0, out);
  });
}

// x with each group of kGroup inputs rounded as the kernels round a token row (q * scale, in
// float32, then to x's dtype): a quantized layer's dense product on these rows computes what
// its weight-only kernel does, up to the order of the sums.
at::Tensor int8_round(const at::Tensor& x) {
  TORCH_CHECK(x.dim() >= 1, "int8_round: rows [..., K]");
  const int64_t dim = x.size(-1);
  const at::Tensor rows = x.reshape({-1, dim}).contiguous();
  check_rows(rows, dim);
  at::Tensor out = at::empty_like(rows);
  by_dtype(x, [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* in = rows.data_ptr<scalar_t>();
    scalar_t* dest = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows.numel() / kGroup, 256, [&](int64_t begin, int64_t end) {
      float values[kGroup];
      for (int64_t i = begin; i < end; ++i) {
        typename Isa::I codes[kGroupVectors];
        int32_t halves[2];
        const typename Isa::F scale = Isa::splat(quantize_group(in + i * kGroup, codes, halves));
        for (int v = 0; v < kGroupVectors; ++v) Isa::store(values + v * Isa::kRows, Isa::mul(Isa::to_float(codes[v]), scale));
        store_rounded(dest + i * kGroup, values, kGroup);
      }
    });
  });
  return out.view(x.sizes());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specd, m) {
  m.def("int8_round(Tensor x) -> Tensor");
  m.def("int4_linear(Tensor x, Tensor codes, Tensor scales, Tensor mins) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor codes, Tensor scales) -> Tensor");
  m.def("int6_linear(Tensor x, Tensor codes, Tensor scales) -> Tensor");
  m.def("int4k_linear(Tensor x, Tensor codes, Tensor scales, Tensor mins, Tensor steps, Tensor offsets) -> Tensor");
}

TORCH_LIBRARY_IMPL(specd, CPU, m) {
  m.impl("int4_linear", &int4_linear);
  m.impl("int8_linear", &int8_linear);
  m.impl("int6_linear", &int6_linear);
  m.impl("int4k_linear", &int4k_linear);
  m.impl("int8_round", &int8_round);
}

#endif  // AVX2: elsewhere the ops are not registered and quantized layers run their dense values
