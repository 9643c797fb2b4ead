// Quantized weights (GGUF's Q4_1 and Q8_0, Q4_1 and MXFP4 interleaved by 8 channels) times a few rows
// of float32 input: the decode step's projections and LM head (layouts and arithmetic: cpu_ops.cpp).

#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "isa.h"
#include "step_team.h"

namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kMaxGroups = 1024;  // in_features up to 32768 (Llama-3-8B's down_proj takes 14336)
constexpr int64_t kRowTile = 8;      // input rows that share one unpacked weight group
constexpr int64_t kPrefetchRows = 16;   // channels fetched ahead of use
constexpr int64_t kBlockPrefetchBytes = 1024;  // interleaved blocks: bytes fetched ahead of use
constexpr int64_t kQuantizeGrain = 64;  // input groups per piece of quantizing: a decode row's stay on one thread

// ---- quantized matrix times a few rows ----

enum class Format { kQ4_1, kQ8_0, kMxfp4 };

Format parse_format(const std::string& name) {
  if (name == "q4_1") return Format::kQ4_1;
  if (name == "mxfp4") return Format::kMxfp4;
  TORCH_CHECK(name == "q8_0", "quantized weights: format must be q4_1, q8_0 or mxfp4, got ", name);
  return Format::kQ8_0;
}

constexpr int64_t kBlock = 8;                              // channels of an interleaved Q4_1 or MXFP4 block
constexpr int64_t kBlockGroupBytes = kBlock * (kGroup / 2 + 4);  // a block's codes, scales, minimums of one group
constexpr int64_t kMxBlockGroupBytes = kBlock * (kGroup / 2 + 1);  // a block's codes and E8M0 scales, one group
constexpr int64_t kHeadBlock = 16;                         // channels of an interleaved Q8_0 block
constexpr int64_t kHeadBlockGroupBytes = kHeadBlock * (kGroup + 2);  // a block's codes and scales of one group

// MXFP4's 16 codes (E2M1: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives) doubled, which makes them
// integers; the scale is halved to match (mxfp4_scale).
constexpr int8_t kFp4Doubled[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
// The vector kernels' unsigned codes (their byte products take one unsigned operand): doubled plus
// this, corrected by it times the input group's integer sums (QuantizedRows8::offset_sums, offset_pairs).
constexpr int kFp4Offset = 12;

// An E8M0 scale byte (2^(e - 127)) halved, as the doubled codes need: the float whose exponent
// field is e, times one half (e = 0, which would be 2^-127, gives 0).
inline float mxfp4_scale(uint8_t e) {
  uint32_t bits = static_cast<uint32_t>(e) << 23;
  float value;
  std::memcpy(&value, &bits, 4);
  return value * 0.5f;
}

struct QuantizedWeight {  // one quantized linear: out_features rows of row_bytes, or blocks of 8 or 16 of them
  const uint8_t* data;
  Format format;
  bool interleaved;  // Q4_1 and MXFP4 in blocks of kBlock channels, Q8_0 of kHeadBlock (see cpu_ops.cpp)
  int64_t out_features, in_features, groups, row_bytes;

  int64_t group_bytes() const { return format == Format::kQ8_0 ? kGroup : kGroup / 2; }
  // row layout only: channel n's codes, scales and minimums (Q4_1)
  const uint8_t* codes(int64_t n) const { return data + n * row_bytes; }
  const at::Half* scales(int64_t n) const {
    return reinterpret_cast<const at::Half*>(codes(n) + groups * group_bytes());
  }
  const at::Half* mins(int64_t n) const { return scales(n) + groups; }
  // interleaved layout only: channels per block, and group g of the block holding channel n
  int64_t block() const { return format == Format::kQ8_0 ? kHeadBlock : kBlock; }
  int64_t block_group_bytes() const {
    return format == Format::kQ4_1 ? kBlockGroupBytes : format == Format::kQ8_0 ? kHeadBlockGroupBytes
                                                                                 : kMxBlockGroupBytes;
  }
  const uint8_t* block_group(int64_t n, int64_t g) const {
    return data + ((n / block()) * groups + g) * block_group_bytes();
  }

  // either layout: code j of group g of channel n (Q8_0's are signed, MXFP4's doubled values), its
  // scale and minimum: w = code * scale (+ min for Q4_1)
  int code(int64_t n, int64_t g, int64_t j) const {
    if (format == Format::kQ8_0) {
      return static_cast<int8_t>(interleaved ? block_group(n, g)[j / 2 * 32 + n % kHeadBlock * 2 + j % 2]
                                             : codes(n)[g * kGroup + j]);
    }
    const int64_t low = j % (kGroup / 2);  // code j sits in GGUF's byte j % 16 of the group
    const uint8_t byte = interleaved ? block_group(n, g)[low / 4 * 32 + n % kBlock * 4 + low % 4]
                                     : codes(n)[g * kGroup / 2 + low];
    const int nibble = j < kGroup / 2 ? byte & 0x0F : byte >> 4;
    return format == Format::kMxfp4 ? kFp4Doubled[nibble] : nibble;
  }
  float scale(int64_t n, int64_t g) const {
    if (format == Format::kMxfp4) return mxfp4_scale(block_group(n, g)[kBlock * kGroup / 2 + n % kBlock]);
    if (!interleaved) return static_cast<float>(scales(n)[g]);
    const int64_t codes_bytes = block() * group_bytes();
    return static_cast<float>(reinterpret_cast<const at::Half*>(block_group(n, g) + codes_bytes)[n % block()]);
  }
  float min(int64_t n, int64_t g) const {  // Q4_1 only
    return interleaved ? static_cast<float>(reinterpret_cast<const at::Half*>(block_group(n, g) + 144)[n % kBlock])
                       : static_cast<float>(mins(n)[g]);
  }
};

// A 2-D packed weight is in the row layout, a 3-D one interleaved: Q4_1 [out / 8, groups, 160],
// MXFP4 [out / 8, groups, 136] (interleaved only), Q8_0 [out / 16, groups, 544].
QuantizedWeight quantized_weight(const at::Tensor& packed, int64_t in_features, Format format) {
  TORCH_CHECK(in_features % kGroup == 0 && in_features <= kMaxGroups * kGroup,
              "quantized weights: in_features must be a multiple of 32, at most ", kMaxGroups * kGroup);
  const int64_t groups = in_features / kGroup;
  const int64_t row_bytes = format == Format::kQ4_1 ? in_features / 2 + 4 * groups : in_features + 2 * groups;
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous(),
              "quantized weights: expected contiguous uint8");
  if (packed.dim() == 3) {
    QuantizedWeight w{packed.data_ptr<uint8_t>(), format, true, 0, in_features, groups, row_bytes};
    const char* name = format == Format::kQ4_1 ? "Q4_1" : format == Format::kQ8_0 ? "Q8_0" : "MXFP4";
    TORCH_CHECK(packed.size(1) == groups && packed.size(2) == w.block_group_bytes(),
                "quantized weights: expected contiguous uint8 [out_features / ", w.block(), ", ", groups, ", ",
                w.block_group_bytes(), "] (", name, " interleaved) for in_features ", in_features);
    w.out_features = packed.size(0) * w.block();
    return w;
  }
  TORCH_CHECK(format != Format::kMxfp4,
              "quantized weights: MXFP4 is interleaved only, [out_features / 8, groups, 136]");
  TORCH_CHECK(packed.dim() == 2 && packed.size(1) == row_bytes,
              "quantized weights: expected contiguous uint8 [out_features, ", row_bytes, "] for in_features ",
              in_features);
  return {packed.data_ptr<uint8_t>(), format, false, packed.size(0), in_features, groups, row_bytes};
}

struct QuantizedRows {  // the input, 16 bits per group of 32
  std::vector<int16_t> codes;  // [M, K]
  std::vector<float> scales;   // [M, K / 32]
  std::vector<float> sums;     // [M, K / 32], exact float sums of each group
};

// One group of 32 inputs: its scale, its sum, and its codes 0..15 at `first`, 16..31 at `second`.
// Division rather than a multiply by 1 / scale, whose rounding would break exact ties (frequent
// with bfloat16 inputs) towards zero.
// A group's largest magnitude; its sum into `sum`.
float group_amax(const float* src, float& sum) {
  float amax = 0.f;
  sum = 0.f;
  for (int64_t j = 0; j < kGroup; ++j) {
    amax = std::max(amax, std::fabs(src[j]));
    sum += src[j];
  }
  return amax;
}

void quantize_group(const float* src, int16_t* first, int16_t* second, float& scale, float& sum) {
  scale = group_amax(src, sum) / 32767.f;
  for (int64_t j = 0; j < kGroup; ++j) {
    (j < kGroup / 2 ? first : second - kGroup / 2)[j] =
        scale > 0.f ? static_cast<int16_t>(std::nearbyint(src[j] / scale)) : 0;
  }
}

#ifdef HYPERSERVE_X86


// group_amax in four vectors, left in v (the sum in another order: equal within float rounding).
AVX2 float group_amax_avx2(const float* src, __m256 (&v)[4], float& sum) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 amax = _mm256_setzero_ps();
  for (int k = 0; k < 4; ++k) {
    v[k] = _mm256_loadu_ps(src + 8 * k);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[k]));
  }
  sum = hsum(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])));
  return hmax(amax);
}

// quantize_group in four vectors.
AVX2 void quantize_group_avx2(const float* src, int16_t* first, int16_t* second, float& scale, float& sum) {
  __m256 v[4];
  scale = group_amax_avx2(src, v, sum) / 32767.f;
  const __m256 divisor = _mm256_set1_ps(scale);
  for (int k = 0; k < 4; k += 2) {  // rounds to nearest, ties to even, as nearbyint does
    const __m256i a = scale > 0.f ? _mm256_cvtps_epi32(_mm256_div_ps(v[k], divisor)) : _mm256_setzero_si256();
    const __m256i b = scale > 0.f ? _mm256_cvtps_epi32(_mm256_div_ps(v[k + 1], divisor)) : _mm256_setzero_si256();
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(k == 0 ? first : second),
                        _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8));
  }
}
#endif

// The rows [rows, in_features] quantized group by group. `paired`: each pair of groups (g, g + 1)
// laid out as g's codes 0..15, g + 1's 0..15, g's 16..31, g + 1's 16..31, to match how the AVX-512
// kernel widens two groups of Q4_1 codes at once (in_features must then hold an even number).
QuantizedRows quantize_rows(const float* x, int64_t rows, int64_t in_features, bool avx2, bool paired) {
  const int64_t groups = in_features / kGroup, half = kGroup / 2;
  QuantizedRows q{std::vector<int16_t>(rows * in_features), std::vector<float>(rows * groups),
                  std::vector<float>(rows * groups)};
  parallel_for(0, rows * groups, kQuantizeGrain, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      int16_t* first = q.codes.data() + g * kGroup;
      int16_t* second = first + half;
      if (paired) {  // groups (g, g + 1) share 64 codes; g % 2 says which half of each 32 is g's
        first = q.codes.data() + (g - g % 2) * kGroup + (g % 2) * half;
        second = first + kGroup;
      }
#ifdef HYPERSERVE_X86
      if (avx2) {
        quantize_group_avx2(x + g * kGroup, first, second, q.scales[g], q.sums[g]);
        continue;
      }
#endif
      quantize_group(x + g * kGroup, first, second, q.scales[g], q.sums[g]);
    }
  });
  return q;
}

// The input at 8 bits per group of 32 (scale amax / 127), for the interleaved Q4_1 and MXFP4 kernels.
struct QuantizedRows8 {
  std::vector<int8_t> codes;       // [M, K]
  std::vector<float> scales;       // [M, K / 32]
  std::vector<float> sums;         // [M, K / 32], exact float sums of each group
  // Against MXFP4 only, [M, K / 32]: kFp4Offset times each group's code sum (the 32-bit kernels'),
  // and in two int16 halves of an int32 kFp4Offset times the sums of codes 4i, 4i+1 (low) and of
  // codes 4i+2, 4i+3 (high): the inputs each 16-bit lane of group_dot meets
  std::vector<int32_t> offset_sums, offset_pairs;
};

// A group's offset_sums and offset_pairs entries.
void fp4_offsets(const int8_t* codes, int32_t& sum, int32_t& pair) {
  int32_t low = 0, high = 0;
  for (int64_t j = 0; j < kGroup; j += 4) {
    low += codes[j] + codes[j + 1];
    high += codes[j + 2] + codes[j + 3];
  }
  sum = kFp4Offset * (low + high);
  pair = static_cast<int32_t>(static_cast<uint16_t>(kFp4Offset * low) |
                              static_cast<uint32_t>(static_cast<uint16_t>(kFp4Offset * high)) << 16);
}

void quantize_group8(const float* src, int8_t* dst, float& scale, float& sum) {
  scale = group_amax(src, sum) / 127.f;
  for (int64_t j = 0; j < kGroup; ++j) dst[j] = scale > 0.f ? static_cast<int8_t>(std::nearbyint(src[j] / scale)) : 0;
}

#ifdef HYPERSERVE_X86
// quantize_group8 in four vectors.
AVX2 void quantize_group8_avx2(const float* src, int8_t* dst, float& scale, float& sum) {
  __m256 v[4];
  scale = group_amax_avx2(src, v, sum) / 127.f;
  if (scale == 0.f) {
    std::memset(dst, 0, kGroup);
    return;
  }
  const __m256 divisor = _mm256_set1_ps(scale);
  __m256i q[4];
  for (int k = 0; k < 4; ++k) q[k] = _mm256_cvtps_epi32(_mm256_div_ps(v[k], divisor));  // ties to even
  // the packs work within 128-bit lanes: dwords come out as 0, 2, 4, 6, 1, 3, 5, 7 of the wanted order
  const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst),
                      _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}
#endif

// offsets: whether the weight needs them (MXFP4's offset codes).
QuantizedRows8 quantize_rows8(const float* x, int64_t rows, int64_t in_features, bool avx2, bool offsets) {
  const int64_t groups = in_features / kGroup;
  QuantizedRows8 q{std::vector<int8_t>(rows * in_features), std::vector<float>(rows * groups),
                   std::vector<float>(rows * groups), std::vector<int32_t>(offsets ? rows * groups : 0),
                   std::vector<int32_t>(offsets ? rows * groups : 0)};
  parallel_for(0, rows * groups, kQuantizeGrain, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      int8_t* codes = q.codes.data() + g * kGroup;
#ifdef HYPERSERVE_X86
      if (avx2)
        quantize_group8_avx2(x + g * kGroup, codes, q.scales[g], q.sums[g]);
      else
#endif
        quantize_group8(x + g * kGroup, codes, q.scales[g], q.sums[g]);
      if (offsets) fp4_offsets(codes, q.offset_sums[g], q.offset_pairs[g]);
    }
  });
  return q;
}

// Channel n against R input rows from row0: `ds` holds each row's combined scales d[g] * dx[g],
// `tail` each row's minimum term sum_g m[g] * s[g] (zero for Q8_0, which has no minimums).
void rows_portable(const QuantizedWeight& w, int64_t n, const float* ds, const float* tail, const QuantizedRows& x,
                   int64_t row0, int64_t R, float* out, int64_t out_stride) {
  for (int64_t r = 0; r < R; ++r) {
    const int16_t* xq = x.codes.data() + (row0 + r) * w.in_features;
    float total = tail[r];
    for (int64_t g = 0; g < w.groups; ++g) {
      int32_t dot = 0;
      for (int64_t j = 0; j < kGroup; ++j) dot += w.code(n, g, j) * xq[g * kGroup + j];
      total += ds[r * w.groups + g] * static_cast<float>(dot);
    }
    out[r * out_stride] = total;
  }
}

// ds[r][g] = d[g] * dx[r][g] and tail[r] = sum_g m[g] * s[r][g].
void scales_portable(const QuantizedWeight& w, int64_t n, const QuantizedRows& x, int64_t row0, int64_t R, float* ds,
                     float* tail) {
  const at::Half* d = w.scales(n);
  for (int64_t r = 0; r < R; ++r) {
    const float* dx = x.scales.data() + (row0 + r) * w.groups;
    const float* sx = x.sums.data() + (row0 + r) * w.groups;
    tail[r] = 0.f;
    for (int64_t g = 0; g < w.groups; ++g) {
      ds[r * w.groups + g] = static_cast<float>(d[g]) * dx[g];
      if (w.format == Format::kQ4_1) tail[r] += static_cast<float>(w.mins(n)[g]) * sx[g];
    }
  }
}

#ifdef HYPERSERVE_X86

// scales_portable, eight groups at a time.
AVX2 void scales_avx2(const QuantizedWeight& w, int64_t n, const QuantizedRows& x, int64_t row0, int64_t R,
                      float* ds, float* tail) {
  const at::Half* d = w.scales(n);
  const at::Half* m = w.mins(n);
  const bool has_mins = w.format == Format::kQ4_1;
  const int64_t vectorized = w.groups / 8 * 8;
  for (int64_t r = 0; r < R; ++r) {
    const float* dx = x.scales.data() + (row0 + r) * w.groups;
    const float* sx = x.sums.data() + (row0 + r) * w.groups;
    float* dsr = ds + r * w.groups;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t g = 0; g < vectorized; g += 8) {
      _mm256_storeu_ps(dsr + g, _mm256_mul_ps(load8_half(d + g), _mm256_loadu_ps(dx + g)));
      if (has_mins) acc = _mm256_fmadd_ps(load8_half(m + g), _mm256_loadu_ps(sx + g), acc);
    }
    float total = hsum(acc);
    for (int64_t g = vectorized; g < w.groups; ++g) {
      dsr[g] = half_to_float(d[g]) * dx[g];
      if (has_mins) total += half_to_float(m[g]) * sx[g];
    }
    tail[r] = total;
  }
}

// A group's 32 codes as two vectors of 16-bit lanes: codes 0..15 and 16..31.
template <Format F>
AVX2 inline void unpack_group(const uint8_t* group, __m256i& first, __m256i& second) {
  if constexpr (F == Format::kQ4_1) {
    const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(group)));
    first = _mm256_and_si256(bytes, _mm256_set1_epi16(0x0F));
    second = _mm256_srli_epi16(bytes, 4);
  } else {
    first = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(group)));
    second = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(group + kGroup / 2)));
  }
}

// C channels from n against R input rows from row0: ds and tail hold channel c's row r at c * R + r.
// Each (channel, row) pair has its own accumulator, summed over the groups in order, so neither a
// row's batch nor the channel tiling changes its result; C > 1 gives a single row independent
// chains to overlap (one chain waits on its multiply-add's latency every group).
template <Format F, int R, int C>
AVX2 void rows_avx2(const QuantizedWeight& w, int64_t n, const float* ds, const float* tail, const QuantizedRows& x,
                    int64_t row0, float* out, int64_t out_stride) {
  constexpr int64_t group_bytes = F == Format::kQ4_1 ? kGroup / 2 : kGroup;
  const uint8_t* codes = w.codes(n);
  const int64_t groups = w.groups, row_bytes = w.row_bytes;
  const int16_t* xq = x.codes.data() + row0 * w.in_features;
  __m256 acc[C][R];
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r) acc[c][r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    for (int c = 0; c < C; ++c) {  // each weight group is unpacked once, used R times
      __m256i first, second;
      unpack_group<F>(codes + c * row_bytes + g * group_bytes, first, second);
      for (int r = 0; r < R; ++r) {
        const int16_t* group = xq + r * groups * kGroup + g * kGroup;
        const __m256i dot = _mm256_add_epi32(
            _mm256_madd_epi16(first, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(group))),
            _mm256_madd_epi16(second, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(group + kGroup / 2))));
        acc[c][r] =
            _mm256_fmadd_ps(_mm256_broadcast_ss(ds + (c * R + r) * groups + g), _mm256_cvtepi32_ps(dot), acc[c][r]);
      }
    }
  }
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r) out[r * out_stride + c] = hsum(acc[c][r]) + tail[c * R + r];
}

using RowsKernel = decltype(&rows_avx2<Format::kQ4_1, 1, 1>);

// The instance `Kernels::of<R, C>` for a tile of R input rows by C channels: R up to kRowTile with one
// channel, C > 1 only as channel_tile gives it (C * R == 4).
template <typename Kernels, int... Rows>
auto tile_kernel(int64_t R, int64_t C, std::integer_sequence<int, Rows...>) {
  TORCH_CHECK(C == 1 || C * R == 4, "quantized kernel: no tile of ", C, " channels by ", R, " rows");
  if (C == 4) return Kernels::template of<1, 4>;
  if (C == 2) return Kernels::template of<2, 2>;
  static constexpr decltype(Kernels::template of<1, 1>) one_channel[] = {Kernels::template of<Rows + 1, 1>...};
  return one_channel[R - 1];
}

template <typename Kernels>
auto tile_kernel(int64_t R, int64_t C) {
  return tile_kernel<Kernels>(R, C, std::make_integer_sequence<int, kRowTile>());
}

template <Format F>
struct RowsAvx2 {
  template <int R, int C>
  static constexpr RowsKernel of = rows_avx2<F, R, C>;
};

// ---- the same on AVX-512 with VNNI: a group of 32 in one 512-bit register ----

// C channels from n against R input rows from row0, as rows_avx2 but with the scales (d * dx, and
// Q4_1's minimum term m * s) taken 16 groups at a time in the kernel itself. Q4_1 takes groups in
// pairs: 32 code bytes widen to [g's low nibbles, g+1's low nibbles] and [g's high nibbles, g+1's
// high nibbles], and the input rows are laid out to match (`paired`), so two _mm512_dpwssd_epi32
// leave g's sum in lanes 0-7 and g+1's in lanes 8-15, scaled by one multiply-add: half the
// instructions per weight of the AVX2 kernel. Q8_0's group of 32 signed codes widens to one
// register as it is.
template <Format F, int R, int C>
AVX512 void rows_avx512(const QuantizedWeight& w, int64_t n, const QuantizedRows& x, int64_t row0, float* out,
                        int64_t out_stride) {
  const uint8_t* codes = w.codes(n);
  const int64_t groups = w.groups, row_bytes = w.row_bytes;
  const int16_t* xq = x.codes.data() + row0 * w.in_features;
  const float* dx = x.scales.data() + row0 * groups;
  const float* sx = x.sums.data() + row0 * groups;
  const __m512i mask = _mm512_set1_epi16(0x0F);
  __m512 acc[C][R];
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r) acc[c][r] = _mm512_setzero_ps();
  for (int64_t g0 = 0; g0 < groups; g0 += 16) {
    const int64_t count = std::min<int64_t>(16, groups - g0);
    const __mmask16 valid = static_cast<__mmask16>((1u << count) - 1);
    __m512 scales[C][R];  // d * dx of these 16 groups, spread to each group's lanes by a permute
    for (int c = 0; c < C; ++c) {
      const __m512 d = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(valid, w.scales(n + c) + g0));
      for (int r = 0; r < R; ++r) {
        scales[c][r] = _mm512_mul_ps(d, _mm512_maskz_loadu_ps(valid, dx + r * groups + g0));
      }
      if constexpr (F == Format::kQ4_1) {
        const __m512 m = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(valid, w.mins(n + c) + g0));
        for (int r = 0; r < R; ++r) {
          acc[c][r] = _mm512_fmadd_ps(m, _mm512_maskz_loadu_ps(valid, sx + r * groups + g0), acc[c][r]);
        }
      }
    }
    if constexpr (F == Format::kQ4_1) {
      for (int pair = 0; pair < count; pair += 2) {  // lanes 0-7: group g0 + pair, lanes 8-15: the next
        const __m512i spread = _mm512_set_epi32(pair + 1, pair + 1, pair + 1, pair + 1, pair + 1, pair + 1, pair + 1,
                                                pair + 1, pair, pair, pair, pair, pair, pair, pair, pair);
        const int64_t g = g0 + pair;
        for (int c = 0; c < C; ++c) {
          const __m512i bytes = _mm512_cvtepu8_epi16(
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + c * row_bytes + g * kGroup / 2)));
          const __m512i low = _mm512_and_si512(bytes, mask), high = _mm512_srli_epi16(bytes, 4);
          for (int r = 0; r < R; ++r) {
            const int16_t* pairx = xq + r * groups * kGroup + g * kGroup;
            const __m512i dot = _mm512_dpwssd_epi32(
                _mm512_dpwssd_epi32(_mm512_setzero_si512(), low, _mm512_loadu_si512(pairx)), high,
                _mm512_loadu_si512(pairx + kGroup));
            acc[c][r] =
                _mm512_fmadd_ps(_mm512_permutexvar_ps(spread, scales[c][r]), _mm512_cvtepi32_ps(dot), acc[c][r]);
          }
        }
      }
    } else {
      for (int i = 0; i < count; ++i) {
        const __m512i spread = _mm512_set1_epi32(i);
        const int64_t g = g0 + i;
        for (int c = 0; c < C; ++c) {
          const __m512i group = _mm512_cvtepi8_epi16(
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + c * row_bytes + g * kGroup)));
          for (int r = 0; r < R; ++r) {
            const __m512i dot = _mm512_dpwssd_epi32(_mm512_setzero_si512(), group,
                                                    _mm512_loadu_si512(xq + r * groups * kGroup + g * kGroup));
            acc[c][r] =
                _mm512_fmadd_ps(_mm512_permutexvar_ps(spread, scales[c][r]), _mm512_cvtepi32_ps(dot), acc[c][r]);
          }
        }
      }
    }
  }
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r) out[r * out_stride + c] = _mm512_reduce_add_ps(acc[c][r]);
}

using Avx512Kernel = decltype(&rows_avx512<Format::kQ4_1, 1, 1>);

template <Format F>
struct RowsAvx512 {
  template <int R, int C>
  static constexpr Avx512Kernel of = rows_avx512<F, R, C>;
};
#endif

// ---- interleaved Q4_1 against 8-bit rows: a block of 8 channels at a time ----

// Input rows per pass over a block, with AVX2 and AVX-512 alike (AVX2 keeps 8 rows' sums in registers
// by taking a few groups' integer sums before their float steps, see block_avx2).
constexpr int64_t kBlockRowTile = 8;
// With AVX-512, steps of at most this many rows read the interleaved int4 blocks one at a time
// (block_vnni256) rather than in pairs (block_pair_avx512); 0: always in pairs. Which is faster
// at few rows depends on the CPU, so it is timed once (FusedDecode) and set (set_one_stream_rows).
int64_t one_stream_rows = 0;

// The block holding channel n against R input rows from row0 -> out[r * out_stride + c], c < 8 (Q4_1)
// or 16 (Q8_0). Per row and channel: sum over the groups in order of d * dx * (integer dot) (+ m * s
// for Q4_1), as the vector kernels compute it (fused multiply-adds included), so all give the same
// numbers. `Rows`: QuantizedRows8 against Q4_1 and MXFP4, QuantizedRows (16 bits) against the Q8_0 head.
template <typename Rows>
void block_portable(const QuantizedWeight& w, int64_t n, const Rows& x, int64_t row0, int64_t R, float* out,
                    int64_t out_stride) {
  for (int64_t r = 0; r < R; ++r) {
    const auto* xq = x.codes.data() + (row0 + r) * w.in_features;
    const float* dx = x.scales.data() + (row0 + r) * w.groups;
    const float* sx = x.sums.data() + (row0 + r) * w.groups;
    for (int64_t c = 0; c < w.block(); ++c) {
      float total = 0.f;
      for (int64_t g = 0; g < w.groups; ++g) {
        int32_t dot = 0;
        for (int64_t j = 0; j < kGroup; ++j) dot += w.code(n + c, g, j) * xq[g * kGroup + j];
        total = std::fma(w.scale(n + c, g) * dx[g], static_cast<float>(dot), total);
        if (w.format == Format::kQ4_1) total = std::fma(w.min(n + c, g), sx[g], total);
      }
      out[r * out_stride + c] = total;
    }
  }
}

#ifdef HYPERSERVE_X86
// block_portable for R rows: the group's 128 code bytes widen to 8 registers of 32 codes (4 of each
// channel); _mm256_maddubs_epi16 against 4 input codes broadcast gives each channel's pairs, whose 8
// products per group add up in 16 bits without overflow (8 * 2 * 15 * 127 < 32767), then one
// _mm256_madd_epi16 leaves channel c's dot product in lane c (group_dot).
inline int32_t load_i32(const void* p) {  // 4 bytes (4 input codes of 8 bits, or 2 of 16), unaligned
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

AVX2 inline __m256i broadcast4(const int8_t* p) { return _mm256_set1_epi32(load_i32(p)); }  // into every lane

// Fetch the group kBlockPrefetchBytes ahead of this one, Bytes long (one group of a block).
template <int64_t Bytes>
inline void prefetch_group_ahead(const uint8_t* group) {
  for (int64_t line = 0; line < Bytes; line += 64) __builtin_prefetch(group + kBlockPrefetchBytes + line);
}

// One group of an interleaved Q4_1 or MXFP4 block: codes 4k..4k+3 of each of the 8 channels in low[k],
// codes 16+4k.. in high[k] (MXFP4's as kFp4Doubled + kFp4Offset, 0..24: unsigned); then the channels'
// scales and minimums (BlockScales; MXFP4's halved, its minimums unused).
struct BlockCodes {
  __m256i low[4], high[4];
};

struct BlockScales {
  __m256 d, m;
};

template <Format F>
constexpr int64_t kInterleavedGroupBytes = F == Format::kMxfp4 ? kMxBlockGroupBytes : kBlockGroupBytes;

// kFp4Doubled + kFp4Offset by code, in each 128-bit lane (the shuffles look up within lanes).
AVX2 inline __m256i fp4_codes_avx2() {
  return _mm256_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0,
                          12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0);
}

template <Format F>
AVX2 inline BlockCodes load_block_codes(const uint8_t* group) {
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  BlockCodes b;
  for (int k = 0; k < 4; ++k) {
    const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(group + 32 * k));
    b.low[k] = _mm256_and_si256(bytes, nibble);
    b.high[k] = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble);
    if constexpr (F == Format::kMxfp4) {
      b.low[k] = _mm256_shuffle_epi8(fp4_codes_avx2(), b.low[k]);
      b.high[k] = _mm256_shuffle_epi8(fp4_codes_avx2(), b.high[k]);
    }
  }
  return b;
}

// 8 E8M0 bytes -> their halved scales (mxfp4_scale): each byte becomes a float's exponent field.
AVX2 inline __m256 mxfp4_scales(__m128i bytes) {
  const __m256i bits = _mm256_slli_epi32(_mm256_cvtepu8_epi32(bytes), 23);
  return _mm256_mul_ps(_mm256_castsi256_ps(bits), _mm256_set1_ps(0.5f));
}

template <Format F>
AVX2 inline BlockScales load_block_scales(const uint8_t* group) {
  if constexpr (F == Format::kMxfp4) {
    return {mxfp4_scales(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(group + 128))), _mm256_setzero_ps()};
  }
  return {load8_half(reinterpret_cast<const at::Half*>(group + 128)),
          load8_half(reinterpret_cast<const at::Half*>(group + 144))};
}

// The 8 channels' integer dot products with one row's 32 input codes xg, one per 32-bit lane. Q4_1's
// 8 pair sums per channel add up in 16 bits without overflow (8 * 2 * 15 * 127 < 32767). MXFP4's
// offset codes reach 24, so theirs may wrap, but less the offset times the inputs they met
// (offset_pair, QuantizedRows8::offset_pairs) they are the doubled codes' sums, within
// 16 * 12 * 127 < 32767: wrapping arithmetic gives them exactly.
template <Format F>
AVX2 inline __m256i group_dot(const BlockCodes& b, const int8_t* xg, int32_t offset_pair) {
  __m256i low = _mm256_maddubs_epi16(b.low[0], broadcast4(xg));
  __m256i high = _mm256_maddubs_epi16(b.high[0], broadcast4(xg + 16));
  for (int k = 1; k < 4; ++k) {
    low = _mm256_add_epi16(low, _mm256_maddubs_epi16(b.low[k], broadcast4(xg + 4 * k)));
    high = _mm256_add_epi16(high, _mm256_maddubs_epi16(b.high[k], broadcast4(xg + 16 + 4 * k)));
  }
  __m256i sums = _mm256_add_epi16(low, high);
  if constexpr (F == Format::kMxfp4) sums = _mm256_sub_epi16(sums, _mm256_set1_epi32(offset_pair));
  return _mm256_madd_epi16(sums, _mm256_set1_epi16(1));
}

// A row's running sums of the 8 channels plus this group's: d * dx * (integer dot) (+ m * sx for Q4_1).
template <Format F>
AVX2 inline __m256 add_group(__m256 acc, const BlockScales& s, __m256i dot, float dx, float sx) {
  acc = _mm256_fmadd_ps(_mm256_mul_ps(s.d, _mm256_set1_ps(dx)), _mm256_cvtepi32_ps(dot), acc);
  if constexpr (F == Format::kQ4_1) acc = _mm256_fmadd_ps(s.m, _mm256_set1_ps(sx), acc);
  return acc;
}

template <int R>
AVX2 inline void store_block_rows(const __m256 (&acc)[R], float* out, int64_t out_stride) {
  for (int r = 0; r < R; ++r) {
    float lanes[kBlock];
    _mm256_storeu_ps(lanes, acc[r]);
    std::copy(lanes, lanes + kBlock, out + r * out_stride);
  }
}

// Beyond 3 rows, the integer sums of kChunk groups come before their float steps: a loop that took
// each group's float steps at once kept 4 rows' sums and the 8 registers of codes in more registers
// than AVX2 has, and its copies to the stack lengthened every sum's chain. Taken apart, 8 rows cost
// 17% less a row than 4 did together (a cache-warm 3072 x 576 weight, one core of a Zen 4 EPYC on
// its AVX2 paths: 8.8 against 10.6 cycles per row and group). Each row's float steps stay in the
// same order: the same numbers.
template <Format F, int R>
AVX2 void block_avx2(const QuantizedWeight& w, int64_t n, const QuantizedRows8& x, int64_t row0, float* out,
                     int64_t out_stride) {
  constexpr int64_t kChunk = R <= 3 ? 1 : 8, kBytes = kInterleavedGroupBytes<F>;
  const uint8_t* first = w.block_group(n, 0);
  const int8_t* xq = x.codes.data() + row0 * w.in_features;
  const float* dx = x.scales.data() + row0 * w.groups;
  const float* sx = x.sums.data() + row0 * w.groups;
  const int32_t* offsets = F == Format::kMxfp4 ? x.offset_pairs.data() + row0 * w.groups : nullptr;
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g0 = 0; g0 < w.groups; g0 += kChunk) {
    const int64_t count = std::min(kChunk, w.groups - g0);
    __m256i dots[kChunk][R];
    for (int64_t i = 0; i < count; ++i) {
      const uint8_t* group = first + (g0 + i) * kBytes;
      prefetch_group_ahead<kBytes>(group);
      const BlockCodes b = load_block_codes<F>(group);
      for (int r = 0; r < R; ++r) {
        const int64_t at = r * w.groups + g0 + i;
        dots[i][r] = group_dot<F>(b, xq + r * w.in_features + (g0 + i) * kGroup, F == Format::kMxfp4 ? offsets[at] : 0);
      }
    }
    for (int64_t i = 0; i < count; ++i) {
      const BlockScales s = load_block_scales<F>(first + (g0 + i) * kBytes);
      for (int r = 0; r < R; ++r) {
        const int64_t at = r * w.groups + g0 + i;
        acc[r] = add_group<F>(acc[r], s, dots[i][r], dx[at], sx[at]);
      }
    }
  }
  store_block_rows<R>(acc, out, out_stride);
}

using BlockKernel = decltype(&block_avx2<Format::kQ4_1, 1>);
template <Format F>
constexpr BlockKernel kBlockKernels[kBlockRowTile] = {
    block_avx2<F, 1>, block_avx2<F, 2>, block_avx2<F, 3>, block_avx2<F, 4>,
    block_avx2<F, 5>, block_avx2<F, 6>, block_avx2<F, 7>, block_avx2<F, 8>};

// block_avx2 for two blocks at once (16 channels, one per 32-bit lane; `pair` false: the block at n
// alone, its 8 channels computed twice and stored once). `_mm512_dpbusd_epi32` adds each lane's four
// products of unsigned codes and signed inputs straight into 32 bits, the exact integer sums of the
// AVX2 kernel's 17 instructions in 8, and the float arithmetic after them is the same lane for lane:
// both kernels give the same numbers.
AVX512 inline __m512 load16_half_pair(const uint8_t* a, const uint8_t* b) {  // 8 float16 at each -> 16 floats
  return _mm512_cvtph_ps(_mm256_inserti128_si256(
      _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a))),
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(b)), 1));
}

AVX512 inline __m512 mxfp4_scale_pair(const uint8_t* a, const uint8_t* b) {  // 8 E8M0 bytes at each -> 16 floats
  const __m128i bytes = _mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(a)),
                                           _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b)));
  const __m512i bits = _mm512_slli_epi32(_mm512_cvtepu8_epi32(bytes), 23);
  return _mm512_mul_ps(_mm512_castsi512_ps(bits), _mm512_set1_ps(0.5f));
}

template <Format F, int R>
AVX512 void block_pair_avx512(const QuantizedWeight& w, int64_t n, bool pair, const QuantizedRows8& x, int64_t row0,
                              float* out, int64_t out_stride) {
  constexpr int64_t kBytes = kInterleavedGroupBytes<F>;
  const uint8_t* first = w.block_group(n, 0);
  const uint8_t* second = pair ? w.block_group(n + kBlock, 0) : first;
  const int8_t* xq = x.codes.data() + row0 * w.in_features;
  const float* dx = x.scales.data() + row0 * w.groups;
  const float* sx = x.sums.data() + row0 * w.groups;
  const int32_t* offsets = F == Format::kMxfp4 ? x.offset_sums.data() + row0 * w.groups : nullptr;
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  const __m512i fp4_codes = _mm512_broadcast_i64x4(fp4_codes_avx2());
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < w.groups; ++g, first += kBytes, second += kBytes) {
    for (const uint8_t* block : {first, second}) prefetch_group_ahead<kBytes>(block);
    __m512i low[4], high[4];  // as block_avx2's, the first block's in the low half, the second's in the high
    for (int k = 0; k < 4; ++k) {
      const __m512i bytes = _mm512_inserti64x4(
          _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(first + 32 * k))),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(second + 32 * k)), 1);
      low[k] = _mm512_and_si512(bytes, nibble);
      high[k] = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), nibble);
      if constexpr (F == Format::kMxfp4) {
        low[k] = _mm512_shuffle_epi8(fp4_codes, low[k]);
        high[k] = _mm512_shuffle_epi8(fp4_codes, high[k]);
      }
    }
    __m512 d, m;
    if constexpr (F == Format::kMxfp4) {
      d = mxfp4_scale_pair(first + 128, second + 128);
    } else {
      d = load16_half_pair(first + 128, second + 128), m = load16_half_pair(first + 144, second + 144);
    }
    for (int r = 0; r < R; ++r) {
      const int8_t* xg = xq + r * w.in_features + g * kGroup;
      __m512i dot = _mm512_setzero_si512();
      for (int k = 0; k < 4; ++k) {  // codes 4k..4k+3 against the low nibbles, 16+4k.. against the high
        dot = _mm512_dpbusd_epi32(dot, low[k], _mm512_set1_epi32(load_i32(xg + 4 * k)));
        dot = _mm512_dpbusd_epi32(dot, high[k], _mm512_set1_epi32(load_i32(xg + 16 + 4 * k)));
      }
      const int64_t at = r * w.groups + g;
      if constexpr (F == Format::kMxfp4) dot = _mm512_sub_epi32(dot, _mm512_set1_epi32(offsets[at]));
      acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(dx[at])), _mm512_cvtepi32_ps(dot), acc[r]);
      if constexpr (F == Format::kQ4_1) acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(sx[at]), acc[r]);
    }
  }
  const __mmask16 stored = pair ? 0xFFFF : 0x00FF;
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(out + r * out_stride, stored, acc[r]);
}

// block_avx2 with `_mm256_dpbusd_epi32` (AVX-512 VNNI on 256-bit registers): one block, one read
// stream, for the few rows where a step waits on memory. On a Zen 4 EPYC, SmolLM2's 30 layers at
// one row took 3.1-3.9 ms in block_pair_avx512's two streams, 2.0-2.6 in block_avx2, 1.9-2.5 here.
// The same integer sums and float steps as both, lane for lane: the same bits.
template <Format F, int R>
AVX512 void block_vnni256(const QuantizedWeight& w, int64_t n, const QuantizedRows8& x, int64_t row0, float* out,
                          int64_t out_stride) {
  constexpr int64_t kBytes = kInterleavedGroupBytes<F>;
  const uint8_t* group = w.block_group(n, 0);
  const int8_t* xq = x.codes.data() + row0 * w.in_features;
  const float* dx = x.scales.data() + row0 * w.groups;
  const float* sx = x.sums.data() + row0 * w.groups;
  const int32_t* offsets = F == Format::kMxfp4 ? x.offset_sums.data() + row0 * w.groups : nullptr;
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < w.groups; ++g, group += kBytes) {
    prefetch_group_ahead<kBytes>(group);
    const BlockCodes b = load_block_codes<F>(group);
    const BlockScales scales = load_block_scales<F>(group);
    for (int r = 0; r < R; ++r) {
      const int8_t* xg = xq + r * w.in_features + g * kGroup;
      __m256i dot = _mm256_setzero_si256();
      for (int k = 0; k < 4; ++k) {
        dot = _mm256_dpbusd_epi32(dot, b.low[k], broadcast4(xg + 4 * k));
        dot = _mm256_dpbusd_epi32(dot, b.high[k], broadcast4(xg + 16 + 4 * k));
      }
      const int64_t at = r * w.groups + g;
      if constexpr (F == Format::kMxfp4) dot = _mm256_sub_epi32(dot, _mm256_set1_epi32(offsets[at]));
      acc[r] = add_group<F>(acc[r], scales, dot, dx[at], sx[at]);
    }
  }
  store_block_rows<R>(acc, out, out_stride);
}

template <Format F>
constexpr BlockKernel kBlockKernelsVnni256[kBlockRowTile] = {
    block_vnni256<F, 1>, block_vnni256<F, 2>, block_vnni256<F, 3>, block_vnni256<F, 4>,
    block_vnni256<F, 5>, block_vnni256<F, 6>, block_vnni256<F, 7>, block_vnni256<F, 8>};

using BlockPairKernel = decltype(&block_pair_avx512<Format::kQ4_1, 1>);
template <Format F>
constexpr BlockPairKernel kBlockPairKernels[kBlockRowTile] = {
    block_pair_avx512<F, 1>, block_pair_avx512<F, 2>, block_pair_avx512<F, 3>, block_pair_avx512<F, 4>,
    block_pair_avx512<F, 5>, block_pair_avx512<F, 6>, block_pair_avx512<F, 7>, block_pair_avx512<F, 8>};
#endif

// The rows of the pass over a block from row0 on, in passes of at most `tile`: as even as they go
// (17 rows in 8s: 6, 6, 5), since a pass of one row costs that row nearly what a pass of four costs.
inline int64_t pass_rows(int64_t rows, int64_t row0, int64_t tile) {
  const int64_t left = rows - row0, passes = (left + tile - 1) / tile;
  return (left + passes - 1) / passes;
}

// out [rows, out_features] = x W^T for an interleaved Q4_1 or MXFP4 weight: blocks of 8 channels, two
// at a time with AVX-512.
void block_matmul(const QuantizedWeight& w, const float* x, int64_t rows, float* out, Isa isa) {
  const QuantizedRows8 q = quantize_rows8(x, rows, w.in_features, isa != Isa::kPortable,
                                          w.format == Format::kMxfp4);
  const bool one_stream = isa == Isa::kAvx512 && rows <= one_stream_rows;
  const int64_t step = isa == Isa::kAvx512 && !one_stream ? 2 : 1;  // blocks per kernel call
  const int64_t calls = (w.out_features / kBlock + step - 1) / step;
#ifdef HYPERSERVE_X86
  const bool mx = w.format == Format::kMxfp4;
  const BlockKernel* avx2 = mx ? kBlockKernels<Format::kMxfp4> : kBlockKernels<Format::kQ4_1>;
  const BlockKernel* vnni256 = mx ? kBlockKernelsVnni256<Format::kMxfp4> : kBlockKernelsVnni256<Format::kQ4_1>;
  const BlockPairKernel* pairs = mx ? kBlockPairKernels<Format::kMxfp4> : kBlockPairKernels<Format::kQ4_1>;
#endif
  parallel_for(0, calls, 8 / step, [&](int64_t begin, int64_t end) {
    for (int64_t call = begin; call < end; ++call) {
      const int64_t b = call * step;
      for (int64_t row0 = 0, R; row0 < rows; row0 += R) {
        R = pass_rows(rows, row0, kBlockRowTile);
        float* dst = out + row0 * w.out_features + b * kBlock;
#ifdef HYPERSERVE_X86
        if (one_stream) {
          vnni256[R - 1](w, b * kBlock, q, row0, dst, w.out_features);
          continue;
        }
        if (isa == Isa::kAvx512) {
          pairs[R - 1](w, b * kBlock, b + 1 < w.out_features / kBlock, q, row0, dst, w.out_features);
          continue;
        }
        if (isa == Isa::kAvx2) {
          avx2[R - 1](w, b * kBlock, q, row0, dst, w.out_features);
          continue;
        }
#endif
        block_portable(w, b * kBlock, q, row0, R, dst, w.out_features);
      }
    }
  });
}

// ---- interleaved Q8_0 (the LM head) against 16-bit rows: a block of 16 channels at a time ----

constexpr int64_t kHeadRowTile = 3;  // AVX2 registers: two halves' float and integer sums per row

#ifdef HYPERSERVE_X86
// block_portable for a Q8_0 block, its group's codes 32 bytes at a time: 2 codes of each of the 16
// channels, sign-extended to 16 bits (channels 0-7, then 8-15), against the same 2 input codes
// broadcast once for both (_mm256_madd_epi16: each channel's pair sum in its 32-bit lane). Both
// halves in one pass halve the broadcast loads, which bounded the loop; 3 rows keep every sum in
// registers: a cache-warm head block took 27.5 cycles per row and group against 30.4 (4 rows, one
// half at a time) on a Zen 4 EPYC's AVX2 paths.
template <int R>
AVX2 void head_block_avx2(const QuantizedWeight& w, int64_t n, const QuantizedRows& x, int64_t row0, float* out,
                          int64_t out_stride) {
  const uint8_t* group = w.block_group(n, 0);
  const int16_t* xq = x.codes.data() + row0 * w.in_features;
  const float* dx = x.scales.data() + row0 * w.groups;
  __m256 acc[2][R];
  for (int h = 0; h < 2; ++h)
    for (int r = 0; r < R; ++r) acc[h][r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < w.groups; ++g, group += kHeadBlockGroupBytes) {
    prefetch_group_ahead<kHeadBlockGroupBytes>(group);
    __m256i dot[2][R];
    for (int h = 0; h < 2; ++h)
      for (int r = 0; r < R; ++r) dot[h][r] = _mm256_setzero_si256();
    for (int p = 0; p < kGroup / 2; ++p) {
      __m256i codes[2];
      for (int h = 0; h < 2; ++h) {
        const auto* half = reinterpret_cast<const __m128i*>(group + 32 * p + 16 * h);
        codes[h] = _mm256_cvtepi8_epi16(_mm_loadu_si128(half));
      }
      for (int r = 0; r < R; ++r) {
        const __m256i pair = _mm256_set1_epi32(load_i32(xq + r * w.in_features + g * kGroup + 2 * p));
        for (int h = 0; h < 2; ++h) {
          dot[h][r] = _mm256_add_epi32(dot[h][r], _mm256_madd_epi16(codes[h], pair));
        }
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 d = load8_half(reinterpret_cast<const at::Half*>(group + kHeadBlock * kGroup) + 8 * h);
      for (int r = 0; r < R; ++r) {
        acc[h][r] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(dx[r * w.groups + g])),
                                    _mm256_cvtepi32_ps(dot[h][r]), acc[h][r]);
      }
    }
  }
  for (int h = 0; h < 2; ++h)
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + r * out_stride + 8 * h, acc[h][r]);
}

// The same with all 16 channels in one register: `_mm512_dpwssd_epi32` multiplies and adds each
// channel's pair into its lane in one instruction.
template <int R>
AVX512 void head_block_avx512(const QuantizedWeight& w, int64_t n, const QuantizedRows& x, int64_t row0, float* out,
                              int64_t out_stride) {
  const uint8_t* group = w.block_group(n, 0);
  const int16_t* xq = x.codes.data() + row0 * w.in_features;
  const float* dx = x.scales.data() + row0 * w.groups;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < w.groups; ++g, group += kHeadBlockGroupBytes) {
    prefetch_group_ahead<kHeadBlockGroupBytes>(group);
    __m512i dot[R];
    for (int r = 0; r < R; ++r) dot[r] = _mm512_setzero_si512();
    for (int p = 0; p < kGroup / 2; ++p) {
      const __m512i codes = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(group + 32 * p)));
      for (int r = 0; r < R; ++r) {
        dot[r] = _mm512_dpwssd_epi32(dot[r], codes,
                                     _mm512_set1_epi32(load_i32(xq + r * w.in_features + g * kGroup + 2 * p)));
      }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(group + kHeadBlock * kGroup)));
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(dx[r * w.groups + g])), _mm512_cvtepi32_ps(dot[r]),
                               acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * out_stride, acc[r]);
}

using HeadKernel = decltype(&head_block_avx2<1>);
constexpr HeadKernel kHeadKernelsAvx2[kHeadRowTile] = {head_block_avx2<1>, head_block_avx2<2>,
                                                       head_block_avx2<3>};
constexpr HeadKernel kHeadKernelsAvx512[kBlockRowTile] = {
    head_block_avx512<1>, head_block_avx512<2>, head_block_avx512<3>, head_block_avx512<4>,
    head_block_avx512<5>, head_block_avx512<6>, head_block_avx512<7>, head_block_avx512<8>};
#endif

// out [rows, out_features] = x W^T for an interleaved Q8_0 weight, a block of 16 channels per call.
void head_matmul(const QuantizedWeight& w, const float* x, int64_t rows, float* out, Isa isa) {
  const QuantizedRows q = quantize_rows(x, rows, w.in_features, isa != Isa::kPortable, false);
  const int64_t tile = isa == Isa::kAvx512 ? kBlockRowTile : kHeadRowTile;
  parallel_for(0, w.out_features / kHeadBlock, 4, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      for (int64_t row0 = 0, R; row0 < rows; row0 += R) {
        R = pass_rows(rows, row0, tile);
        float* dst = out + row0 * w.out_features + b * kHeadBlock;
#ifdef HYPERSERVE_X86
        if (isa != Isa::kPortable) {
          (isa == Isa::kAvx512 ? kHeadKernelsAvx512 : kHeadKernelsAvx2)[R - 1](w, b * kHeadBlock, q, row0, dst,
                                                                               w.out_features);
          continue;
        }
#endif
        block_portable(w, b * kHeadBlock, q, row0, R, dst, w.out_features);
      }
    }
  });
}

// Channels per kernel call for a batch of `rows`: enough independent sums to keep the CPU busy. Q8_0
// on AVX2 takes one channel at a time: four rows of 612 bytes read in turn left AMD's prefetchers
// behind (the LM head ran at 4.8 GB/s against 8.6 one row at a time on a 2-core EPYC, AVX2 only).
int64_t channel_tile(int64_t rows, Isa isa, Format format) {
  if (isa == Isa::kPortable || rows > 2 || (isa == Isa::kAvx2 && format == Format::kQ8_0)) return 1;
  return 4 / rows;
}

// C channels from n against every input row, `kRowTile` rows at a time.
void channels(const QuantizedWeight& w, int64_t n, int64_t C, const QuantizedRows& x, int64_t rows, float* out,
              int64_t out_stride, Isa isa) {
  float ds[kRowTile * kMaxGroups], tail[kRowTile];  // C * R <= kRowTile
  for (int64_t row0 = 0; row0 < rows; row0 += kRowTile) {
    const int64_t R = std::min(kRowTile, rows - row0);
    float* dst = out + row0 * out_stride;
#ifdef HYPERSERVE_X86
    const bool q41 = w.format == Format::kQ4_1;
    if (isa == Isa::kAvx512) {
      (q41 ? tile_kernel<RowsAvx512<Format::kQ4_1>>(R, C) : tile_kernel<RowsAvx512<Format::kQ8_0>>(R, C))(
          w, n, x, row0, dst, out_stride);
      continue;
    }
    if (isa == Isa::kAvx2) {
      for (int64_t c = 0; c < C; ++c) scales_avx2(w, n + c, x, row0, R, ds + c * R * w.groups, tail + c * R);
      (q41 ? tile_kernel<RowsAvx2<Format::kQ4_1>>(R, C) : tile_kernel<RowsAvx2<Format::kQ8_0>>(R, C))(
          w, n, ds, tail, x, row0, dst, out_stride);
      continue;
    }
#endif
    scales_portable(w, n, x, row0, R, ds, tail);
    rows_portable(w, n, ds, tail, x, row0, R, dst, out_stride);
  }
}

// Fetch channel n's bytes ahead of use: streaming rows of a few hundred bytes each, the hardware
// prefetcher alone left the kernel waiting on memory at the start of every row.
inline void prefetch_rows(const QuantizedWeight& w, int64_t n, int64_t count, int64_t end) {
  if (n >= end) return;
  const char* first = reinterpret_cast<const char*>(w.codes(n));
  const char* last = reinterpret_cast<const char*>(w.codes(std::min(n + count, end)));
  for (const char* line = first; line < last; line += 64) __builtin_prefetch(line);
}

// out [rows, out_features] = x W^T for float32 x [rows, in_features].
void quantized_matmul(const QuantizedWeight& w, const float* x, int64_t rows, float* out, Isa isa) {
  if (rows == 0) return;  // a step that samples nothing (a prefill chunk) asks for no logits
  if (w.interleaved) return (w.format == Format::kQ8_0 ? head_matmul : block_matmul)(w, x, rows, out, isa);
  const bool q41 = w.format == Format::kQ4_1;
  if (isa == Isa::kAvx512 && q41 && w.groups % 2 == 1) isa = Isa::kAvx2;  // it takes Q4_1 groups in pairs
  const QuantizedRows q = quantize_rows(x, rows, w.in_features, isa != Isa::kPortable, isa == Isa::kAvx512 && q41);
  const int64_t tile = channel_tile(rows, isa, w.format);
  // Enough channels per task that each thread streams a long stretch of weights.
  parallel_for(0, w.out_features, 64, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end;) {
      const int64_t C = end - n >= tile ? tile : 1;
      prefetch_rows(w, n + kPrefetchRows, C, end);
      channels(w, n, C, q, rows, out + n, w.out_features, isa);
      n += C;
    }
  });
}

}  // namespace
