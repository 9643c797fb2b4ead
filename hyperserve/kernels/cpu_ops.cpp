// CPU kernels for decode-sized batches, where PyTorch's general kernels spend more time per call
// than the work needs. Registered as torch.ops.hyperserve.*; loaded by hyperserve/kernels.
//
// Weights come in two of GGUF's layouts, groups of 32 along the input, one output channel per row
// of bytes read as one stream: its codes, then its float16 scales (and minimums), as in the GGUF.
// - Q4_1 (the int4 projections): w = q * d + m, q in 0..15; byte j of a group holds q[j] in the low
//   nibble and q[j + 16] in the high one. 20 bytes per 32 weights.
// - Q8_0 (the embedding and LM head of an int4 model): w = q * d, q in -127..127. 34 bytes per 32.
// - Q4_1 interleaved by 8 channels (a 3-D weight [out / 8, groups, 160]; on AVX2-only CPUs, see
//   interleaves_q41 in layers/quantization.py): for each block of 8 channels and group g, 128 code
//   bytes, then the 8 channels' float16 scales, then their minimums. Code byte 32 k + 4 c + i is GGUF's byte 4 k + i of
//   channel c's group (k, i in 0..3), so one 32-byte load holds 4 codes of each of the 8 channels.
//
// The input is quantized to 16 bits per group of 32 (scale dx, and its exact float sum s), so a
// group's dot product is integer work:  sum_j w_j x_j = d * dx * sum_j q_j xq_j + m * s.
// 16 bits rather than llama.cpp's 8: with 8-bit activations SmolLM2's decode perplexity rose
// 1.8-3.1% over float32 (outlier channels take a group's whole range); with 16 it is within float
// rounding of exact, for 1.3x the instructions. On AVX2 a group costs two _mm256_madd_epi16 per
// row; with AVX-512 VNNI two _mm512_dpwssd_epi32 cover a pair of groups. The interleaved layout
// takes 8-bit activations instead: each _mm256_maddubs_epi16 multiplies 4 codes of 8 channels at
// once, a group's 8 products sum in 16 bits, and one scale multiply serves 8 channels, for 2.2x fewer
// instructions per weight than the 16-bit AVX2 kernel on CPUs without VNNI, where decode is bound by
// instructions more than by memory. The instruction set is
// picked at run time (`isa()`): one build serves AVX2 and AVX-512 machines alike; quantized_linear's
// `isa` argument forces a lesser one (tests), "portable" the plain C++ loops.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#define HYPERSERVE_X86 1
#endif

#include "step_team.h"

namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kMaxGroups = 256;  // in_features up to 8192
constexpr int64_t kRowTile = 8;      // input rows that share one unpacked weight group
constexpr int64_t kPrefetchRows = 16;   // channels fetched ahead of use
constexpr int64_t kBlockPrefetchBytes = 1024;  // interleaved blocks: bytes fetched ahead of use

// The instruction sets the kernels are written for. kAvx512 (AVX-512 F/BW/VL with VNNI) only
// changes the quantized matrix kernel; everything else runs its AVX2 code there too.
enum class Isa { kPortable, kAvx2, kAvx512 };

#ifdef HYPERSERVE_X86
bool cpu_has_avx2() {
  static const bool has =
      __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  return has;
}

bool cpu_has_avx512() {  // HYPERSERVE_MAX_ISA=avx2 hides it, as it does from the Python side
  static const bool has = [] {
    const char* cap = std::getenv("HYPERSERVE_MAX_ISA");
    return !(cap && std::string(cap) == "avx2") && cpu_has_avx2() && __builtin_cpu_supports("avx512f") &&
           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512vnni");
  }();
  return has;
}
#else
bool cpu_has_avx2() { return false; }
bool cpu_has_avx512() { return false; }
#endif

Isa best_isa() { return cpu_has_avx512() ? Isa::kAvx512 : cpu_has_avx2() ? Isa::kAvx2 : Isa::kPortable; }

const char* isa_name(Isa isa) {
  return isa == Isa::kAvx512 ? "avx512_vnni" : isa == Isa::kAvx2 ? "avx2" : "portable";
}

// "" for the best this CPU has; a named one only where the CPU has it.
Isa parse_isa(const std::string& name) {
  if (name.empty()) return best_isa();
  for (const Isa isa : {Isa::kPortable, Isa::kAvx2, Isa::kAvx512}) {
    if (name != isa_name(isa)) continue;
    TORCH_CHECK(isa <= best_isa(), "quantized kernels: this CPU cannot run ", name);
    return isa;
  }
  TORCH_CHECK(false, "quantized kernels: isa must be portable, avx2 or avx512_vnni, got ", name);
}

// ---- quantized matrix times a few rows ----

enum class Format { kQ4_1, kQ8_0 };

Format parse_format(const std::string& name) {
  if (name == "q4_1") return Format::kQ4_1;
  TORCH_CHECK(name == "q8_0", "quantized weights: format must be q4_1 or q8_0, got ", name);
  return Format::kQ8_0;
}

constexpr int64_t kBlock = 8;                              // channels of an interleaved Q4_1 block
constexpr int64_t kBlockGroupBytes = kBlock * (kGroup / 2 + 4);  // a block's codes, scales, minimums of one group

struct QuantizedWeight {  // one quantized linear: out_features rows of row_bytes, or blocks of 8 of them
  const uint8_t* data;
  Format format;
  bool interleaved;  // Q4_1 in blocks of kBlock channels (see the top of the file)
  int64_t out_features, in_features, groups, row_bytes;

  int64_t group_bytes() const { return format == Format::kQ4_1 ? kGroup / 2 : kGroup; }
  // row layout only: channel n's codes, scales and minimums (Q4_1)
  const uint8_t* codes(int64_t n) const { return data + n * row_bytes; }
  const at::Half* scales(int64_t n) const {
    return reinterpret_cast<const at::Half*>(codes(n) + groups * group_bytes());
  }
  const at::Half* mins(int64_t n) const { return scales(n) + groups; }
  // interleaved layout only: group g of the block holding channel n
  const uint8_t* block_group(int64_t n, int64_t g) const {
    return data + ((n / kBlock) * groups + g) * kBlockGroupBytes;
  }

  // either layout: code j of group g of channel n (Q8_0's are signed), its scale and minimum
  int code(int64_t n, int64_t g, int64_t j) const {
    if (format == Format::kQ8_0) return static_cast<int8_t>(codes(n)[g * kGroup + j]);
    const int64_t low = j % (kGroup / 2);  // code j sits in GGUF's byte j % 16 of the group
    const uint8_t byte = interleaved ? block_group(n, g)[low / 4 * 32 + n % kBlock * 4 + low % 4]
                                     : codes(n)[g * kGroup / 2 + low];
    return j < kGroup / 2 ? byte & 0x0F : byte >> 4;
  }
  float scale(int64_t n, int64_t g) const {
    return interleaved ? static_cast<float>(reinterpret_cast<const at::Half*>(block_group(n, g) + 128)[n % kBlock])
                       : static_cast<float>(scales(n)[g]);
  }
  float min(int64_t n, int64_t g) const {  // Q4_1 only
    return interleaved ? static_cast<float>(reinterpret_cast<const at::Half*>(block_group(n, g) + 144)[n % kBlock])
                       : static_cast<float>(mins(n)[g]);
  }
};

// A 2-D packed weight is in the row layout, a 3-D one [out / 8, groups, 160] interleaved (Q4_1 only).
QuantizedWeight quantized_weight(const at::Tensor& packed, int64_t in_features, Format format) {
  TORCH_CHECK(in_features % kGroup == 0 && in_features <= kMaxGroups * kGroup,
              "quantized weights: in_features must be a multiple of 32, at most 8192");
  const int64_t groups = in_features / kGroup;
  const int64_t row_bytes = format == Format::kQ4_1 ? in_features / 2 + 4 * groups : in_features + 2 * groups;
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous(), "quantized weights: expected contiguous uint8");
  if (packed.dim() == 3) {
    TORCH_CHECK(format == Format::kQ4_1 && packed.size(1) == groups && packed.size(2) == kBlockGroupBytes,
                "quantized weights: expected contiguous uint8 [out_features / 8, ", groups, ", ", kBlockGroupBytes,
                "] (Q4_1 interleaved) for in_features ", in_features);
    return {packed.data_ptr<uint8_t>(), format, true, packed.size(0) * kBlock, in_features, groups, row_bytes};
  }
  TORCH_CHECK(packed.dim() == 2 && packed.size(1) == row_bytes, "quantized weights: expected contiguous uint8 [out_features, ",
              row_bytes, "] for in_features ", in_features);
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
#define AVX2 __attribute__((target("avx2,fma,f16c")))

AVX2 inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// group_amax in four vectors, left in v (the sum in another order: equal within float rounding).
AVX2 float group_amax_avx2(const float* src, __m256 (&v)[4], float& sum) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 amax = _mm256_setzero_ps();
  for (int k = 0; k < 4; ++k) {
    v[k] = _mm256_loadu_ps(src + 8 * k);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[k]));
  }
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  sum = hsum(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])));
  return _mm_cvtss_f32(m);
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
  for (int64_t g = 0; g < rows * groups; ++g) {
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
  return q;
}

// The input at 8 bits per group of 32 (scale amax / 127), for the interleaved Q4_1 kernels.
struct QuantizedRows8 {
  std::vector<int8_t> codes;  // [M, K]
  std::vector<float> scales;  // [M, K / 32]
  std::vector<float> sums;    // [M, K / 32], exact float sums of each group
};

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

QuantizedRows8 quantize_rows8(const float* x, int64_t rows, int64_t in_features, bool avx2) {
  const int64_t groups = in_features / kGroup;
  QuantizedRows8 q{std::vector<int8_t>(rows * in_features), std::vector<float>(rows * groups),
                   std::vector<float>(rows * groups)};
  for (int64_t g = 0; g < rows * groups; ++g) {
#ifdef HYPERSERVE_X86
    if (avx2) {
      quantize_group8_avx2(x + g * kGroup, q.codes.data() + g * kGroup, q.scales[g], q.sums[g]);
      continue;
    }
#endif
    quantize_group8(x + g * kGroup, q.codes.data() + g * kGroup, q.scales[g], q.sums[g]);
  }
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
AVX2 inline __m256 load8_half(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

AVX2 inline float half_to_float(const at::Half h) { return _cvtsh_ss(h.x); }  // one instruction, not c10's bit twiddling

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

template <Format F>
RowsKernel rows_avx2_for(int64_t R, int64_t C) {  // C > 1 only as channel_tile gives it: C * R == 4
  TORCH_CHECK(C == 1 || C * R == 4, "quantized kernel: no tile of ", C, " channels by ", R, " rows");
  if (C == 4) return rows_avx2<F, 1, 4>;
  if (C == 2) return rows_avx2<F, 2, 2>;
  static constexpr RowsKernel kernels[kRowTile] = {
      rows_avx2<F, 1, 1>, rows_avx2<F, 2, 1>, rows_avx2<F, 3, 1>, rows_avx2<F, 4, 1>,
      rows_avx2<F, 5, 1>, rows_avx2<F, 6, 1>, rows_avx2<F, 7, 1>, rows_avx2<F, 8, 1>};
  return kernels[R - 1];
}

// ---- the same on AVX-512 with VNNI: a group of 32 in one 512-bit register ----
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))

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
Avx512Kernel rows_avx512_for(int64_t R, int64_t C) {
  TORCH_CHECK(C == 1 || C * R == 4, "quantized kernel: no tile of ", C, " channels by ", R, " rows");
  if (C == 4) return rows_avx512<F, 1, 4>;
  if (C == 2) return rows_avx512<F, 2, 2>;
  static constexpr Avx512Kernel kernels[kRowTile] = {
      rows_avx512<F, 1, 1>, rows_avx512<F, 2, 1>, rows_avx512<F, 3, 1>, rows_avx512<F, 4, 1>,
      rows_avx512<F, 5, 1>, rows_avx512<F, 6, 1>, rows_avx512<F, 7, 1>, rows_avx512<F, 8, 1>};
  return kernels[R - 1];
}
#endif

// ---- interleaved Q4_1 against 8-bit rows: a block of 8 channels at a time ----

constexpr int64_t kBlockRowTile = 4;  // input rows per pass over a block (registers: 8 of codes, one sum per row)

// The block holding channel n against R input rows from row0 -> out[r * out_stride + c], c < 8. Per
// row and channel: sum over the groups in order of d * dx * (integer dot) + m * s, as the AVX2 kernel
// computes it (fused multiply-adds included), so both give the same numbers.
void block_portable(const QuantizedWeight& w, int64_t n, const QuantizedRows8& x, int64_t row0, int64_t R, float* out,
                    int64_t out_stride) {
  for (int64_t r = 0; r < R; ++r) {
    const int8_t* xq = x.codes.data() + (row0 + r) * w.in_features;
    const float* dx = x.scales.data() + (row0 + r) * w.groups;
    const float* sx = x.sums.data() + (row0 + r) * w.groups;
    for (int64_t c = 0; c < kBlock; ++c) {
      float total = 0.f;
      for (int64_t g = 0; g < w.groups; ++g) {
        int32_t dot = 0;
        for (int64_t j = 0; j < kGroup; ++j) dot += w.code(n + c, g, j) * xq[g * kGroup + j];
        total = std::fma(w.scale(n + c, g) * dx[g], static_cast<float>(dot), total);
        total = std::fma(w.min(n + c, g), sx[g], total);
      }
      out[r * out_stride + c] = total;
    }
  }
}

#ifdef HYPERSERVE_X86
// block_portable for R rows: the group's 128 code bytes widen to 8 registers of 32 codes (4 of each
// channel); _mm256_maddubs_epi16 against 4 input codes broadcast gives each channel's pairs, whose 8
// products per group add up in 16 bits without overflow (8 * 2 * 15 * 127 < 32767), then one
// _mm256_madd_epi16 leaves channel c's dot product in lane c.
AVX2 inline __m256i broadcast4(const int8_t* p) {  // 4 bytes into every 32-bit lane
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

template <int R>
AVX2 void block_avx2(const QuantizedWeight& w, int64_t n, const QuantizedRows8& x, int64_t row0, float* out,
                     int64_t out_stride) {
  const uint8_t* group = w.block_group(n, 0);
  const int8_t* xq = x.codes.data() + row0 * w.in_features;
  const float* dx = x.scales.data() + row0 * w.groups;
  const float* sx = x.sums.data() + row0 * w.groups;
  const __m256i nibble = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < w.groups; ++g, group += kBlockGroupBytes) {
    __builtin_prefetch(group + kBlockPrefetchBytes);
    __builtin_prefetch(group + kBlockPrefetchBytes + 64);
    __builtin_prefetch(group + kBlockPrefetchBytes + 128);
    __m256i low[4], high[4];  // codes 4k..4k+3 and 16+4k..16+4k+3 of each channel
    for (int k = 0; k < 4; ++k) {
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(group + 32 * k));
      low[k] = _mm256_and_si256(bytes, nibble);
      high[k] = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble);
    }
    const __m256 d = load8_half(reinterpret_cast<const at::Half*>(group + 128));
    const __m256 m = load8_half(reinterpret_cast<const at::Half*>(group + 144));
    for (int r = 0; r < R; ++r) {
      const int8_t* xg = xq + r * w.in_features + g * kGroup;
      __m256i pairs = _mm256_maddubs_epi16(low[0], broadcast4(xg));
      for (int k = 1; k < 4; ++k) pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(low[k], broadcast4(xg + 4 * k)));
      for (int k = 0; k < 4; ++k) {
        pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(high[k], broadcast4(xg + 16 + 4 * k)));
      }
      const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones));
      const int64_t at = r * w.groups + g;
      acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(dx[at])), dot, acc[r]);
      acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(sx[at]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    float lanes[kBlock];
    _mm256_storeu_ps(lanes, acc[r]);
    std::copy(lanes, lanes + kBlock, out + r * out_stride);
  }
}

using BlockKernel = decltype(&block_avx2<1>);
constexpr BlockKernel kBlockKernels[kBlockRowTile] = {block_avx2<1>, block_avx2<2>, block_avx2<3>, block_avx2<4>};
#endif

// out [rows, out_features] = x W^T for an interleaved Q4_1 weight, a block of 8 channels per task.
void block_matmul(const QuantizedWeight& w, const float* x, int64_t rows, float* out, Isa isa) {
  const QuantizedRows8 q = quantize_rows8(x, rows, w.in_features, isa != Isa::kPortable);
  parallel_for(0, w.out_features / kBlock, 8, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      for (int64_t row0 = 0; row0 < rows; row0 += kBlockRowTile) {
        const int64_t R = std::min(kBlockRowTile, rows - row0);
        float* dst = out + row0 * w.out_features + b * kBlock;
#ifdef HYPERSERVE_X86
        if (isa != Isa::kPortable) {
          kBlockKernels[R - 1](w, b * kBlock, q, row0, dst, w.out_features);
          continue;
        }
#endif
        block_portable(w, b * kBlock, q, row0, R, dst, w.out_features);
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
      (q41 ? rows_avx512_for<Format::kQ4_1>(R, C) : rows_avx512_for<Format::kQ8_0>(R, C))(w, n, x, row0, dst,
                                                                                          out_stride);
      continue;
    }
    if (isa == Isa::kAvx2) {
      for (int64_t c = 0; c < C; ++c) scales_avx2(w, n + c, x, row0, R, ds + c * R * w.groups, tail + c * R);
      (q41 ? rows_avx2_for<Format::kQ4_1>(R, C) : rows_avx2_for<Format::kQ8_0>(R, C))(w, n, ds, tail, x, row0, dst,
                                                                                    out_stride);
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
  if (w.interleaved) return block_matmul(w, x, rows, out, isa == Isa::kAvx512 ? Isa::kAvx2 : isa);
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

at::Tensor quantized_linear(const at::Tensor& x, const at::Tensor& weight, const std::string& format,
                            const std::string& isa) {
  TORCH_CHECK(x.dim() == 2, "quantized_linear: x must be [rows, in_features]");
  const QuantizedWeight w = quantized_weight(weight, x.size(1), parse_format(format));
  const at::Tensor input = x.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({x.size(0), w.out_features}, x.options().dtype(at::kFloat));
  const Isa chosen = parse_isa(isa);
  run_step([&] { quantized_matmul(w, input.data_ptr<float>(), x.size(0), out.data_ptr<float>(), chosen); });
  return out.to(x.scalar_type());
}

// The weight as float32 [out_features, in_features]: for steps too large for the kernel above
// (prefill), which multiply it densely so that no dense copy lives beside the packed one, and for
// embedding lookups of a few rows.
at::Tensor dequantize(const at::Tensor& weight, int64_t in_features, const std::string& format) {
  const QuantizedWeight w = quantized_weight(weight, in_features, parse_format(format));
  at::Tensor out = at::empty({w.out_features, in_features}, weight.options().dtype(at::kFloat));
  float* dst = out.data_ptr<float>();
  if (w.interleaved) {
    at::parallel_for(0, w.out_features / kBlock, 2, [&](int64_t begin, int64_t end) {
      for (int64_t n = begin * kBlock; n < end * kBlock; n += kBlock) {
        for (int64_t g = 0; g < w.groups; ++g) {
          const uint8_t* group = w.block_group(n, g);
          for (int64_t c = 0; c < kBlock; ++c) {
            const float d = w.scale(n + c, g), m = w.min(n + c, g);
            float* row = dst + (n + c) * in_features + g * kGroup;
            for (int64_t j = 0; j < kGroup / 2; ++j) {
              const uint8_t byte = group[j / 4 * 32 + c * 4 + j % 4];
              row[j] = static_cast<float>(byte & 0x0F) * d + m;
              row[j + kGroup / 2] = static_cast<float>(byte >> 4) * d + m;
            }
          }
        }
      }
    });
    return out;
  }
  at::parallel_for(0, w.out_features, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      for (int64_t g = 0; g < w.groups; ++g) {
        const uint8_t* group = w.codes(n) + g * w.group_bytes();
        const float d = static_cast<float>(w.scales(n)[g]);
        float* row = dst + n * in_features + g * kGroup;
        if (w.format == Format::kQ8_0) {
          for (int64_t j = 0; j < kGroup; ++j) row[j] = static_cast<float>(static_cast<int8_t>(group[j])) * d;
          continue;
        }
        const float m = static_cast<float>(w.mins(n)[g]);
        for (int64_t j = 0; j < kGroup / 2; ++j) {
          row[j] = static_cast<float>(group[j] & 0x0F) * d + m;
          row[j + kGroup / 2] = static_cast<float>(group[j] >> 4) * d + m;
        }
      }
    }
  });
  return out;
}

// ---- attention of one new token per sequence over its paged K/V ----

inline float to_float(float v) { return v; }
inline float to_float(at::BFloat16 v) { return static_cast<float>(v); }
inline float to_float(at::Half v) { return static_cast<float>(v); }

template <typename T>
float dot_portable(const float* q, const T* k, int64_t n) {
  float acc = 0.f;
  for (int64_t j = 0; j < n; ++j) acc += q[j] * to_float(k[j]);
  return acc;
}

template <typename T>
void axpy_portable(float a, const T* v, float* out, int64_t n) {
  for (int64_t j = 0; j < n; ++j) out[j] += a * to_float(v[j]);
}

#ifdef HYPERSERVE_X86
AVX2 inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
AVX2 inline __m256 load8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
AVX2 inline __m256 load8(const at::BFloat16* p) {  // bfloat16 is float32's upper half
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

// Cephes' expf: e^x = 2^n e^r with |r| <= ln 2 / 2 and e^r a degree-6 polynomial, within ~2 ulp of
// std::exp; e^x below float's smallest normal gives 0.
AVX2 inline __m256 exp_avx2(__m256 x) {
  const __m256 lowest = _mm256_set1_ps(-87.33f), one = _mm256_set1_ps(1.f);
  const __m256 underflow = _mm256_cmp_ps(x, lowest, _CMP_LT_OQ);
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.f)), lowest);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // ln 2 in two parts
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  for (const float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f}) {
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  }
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, one));
  const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(underflow, _mm256_mul_ps(p, _mm256_castsi256_ps(two_n)));
}

template <typename T>
AVX2 float dot_avx2(const float* q, const T* k, int64_t n) {  // n: a multiple of 8
  __m256 acc = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; j += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + j), load8(k + j), acc);
  return hsum(acc);
}

template <typename T>
AVX2 void axpy_avx2(float a, const T* v, float* out, int64_t n) {
  const __m256 scale = _mm256_set1_ps(a);
  for (int64_t j = 0; j < n; j += 8) {
    _mm256_storeu_ps(out + j, _mm256_fmadd_ps(scale, load8(v + j), _mm256_loadu_ps(out + j)));
  }
}

// exp_shifted and silu_mul eight at a time, from i up to the last multiple of 8 (i is left there).
AVX2 float exp_shifted_avx2(float* x, int64_t n, float shift, int64_t& i) {
  __m256 total = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(x + i), _mm256_set1_ps(shift)));
    _mm256_storeu_ps(x + i, e);
    total = _mm256_add_ps(total, e);
  }
  return hsum(total);
}

AVX2 void silu_mul_avx2(const float* gate, const float* up, float* out, int64_t n, int64_t& j) {
  const __m256 one = _mm256_set1_ps(1.f);
  for (; j + 8 <= n; j += 8) {
    const __m256 g = _mm256_loadu_ps(gate + j);
    const __m256 sigmoid = _mm256_div_ps(one, _mm256_add_ps(one, exp_avx2(_mm256_sub_ps(_mm256_setzero_ps(), g))));
    _mm256_storeu_ps(out + j, _mm256_mul_ps(_mm256_mul_ps(g, sigmoid), _mm256_loadu_ps(up + j)));
  }
}
#endif

struct PagedKV {  // one layer's cache, [slots, kv_heads, head_dim], and one sequence's block table
  int64_t block_size, num_kv_heads, head_dim;
  const int64_t* block_table;

  // fn(t, offset of token t's vector) for t in 0..length-1, a block at a time: no division per
  // token, whose latency once made up most of the attention's time.
  template <typename Fn>
  void for_each_token(int64_t length, int64_t kv_head, Fn fn) const {
    const int64_t stride = num_kv_heads * head_dim;
    for (int64_t b = 0, start = 0; start < length; ++b, start += block_size) {
      int64_t offset = block_table[b] * block_size * stride + kv_head * head_dim;
      const int64_t end = std::min(start + block_size, length);
      for (int64_t t = start; t < end; ++t, offset += stride) fn(t, offset);
    }
  }
};

// x[i] = exp(x[i] - shift) for i < n; returns their sum.
float exp_shifted(float* x, int64_t n, float shift, bool avx2) {
  float total = 0.f;
  int64_t i = 0;
#ifdef HYPERSERVE_X86
  if (avx2) total = exp_shifted_avx2(x, n, shift, i);
#endif
  for (; i < n; ++i) total += x[i] = std::exp(x[i] - shift);
  return total;
}

// out[j] = silu(gate[j]) * up[j] for j < n.
void silu_mul(const float* gate, const float* up, float* out, int64_t n, bool avx2) {
  int64_t j = 0;
#ifdef HYPERSERVE_X86
  if (avx2) silu_mul_avx2(gate, up, out, n, j);
#endif
  for (; j < n; ++j) out[j] = gate[j] / (1.f + std::exp(-gate[j])) * up[j];
}

#ifdef HYPERSERVE_X86
// Attention is computed in spans of kAttentionSpan positions of a sequence's context, cut at
// multiples of it whatever the batch, each span a task of its own: a single decoding sequence
// (SmolLM2: 3 K/V heads) spreads over both threads of a 2-core CPU, and a span's values, read
// twice when three heads share them (below), are still in cache the second time. At 8,000 tokens
// of context SmolLM2's attention took 16-21 ms a token against 19-29 with whole-context tasks
// (2-core EPYC, AVX2): about what reading its 184 MB of cached K/V takes there.
constexpr int64_t kAttentionSpan = 256;
constexpr int64_t kMaxAttentionHeadDim = 512;
constexpr int64_t kMaxHeadsPerTask = 3;  // query heads sharing a K/V head that one task attends for

inline int64_t spans_of(int64_t length) { return (length + kAttentionSpan - 1) / kAttentionSpan; }

// One span [begin, end) of G query heads that share one K/V head (G <= kMaxHeadsPerTask), head_dim
// a multiple of 64: q [G, D] -> for each head its scores' largest value (`best`), the sum of exp(score - best)
// (`total`) and the unnormalised sum of exp(score - best) * v (`out` [G, D]); combine_spans makes
// one output of a sequence's spans. Each cached vector is widened once for the G heads; nothing is
// called per token; each score is two independent sums; the outputs stay in registers (64 or 32
// values of each head at a time) while the tokens stream past. A head's numbers do not depend on G.
template <typename T, int G>
AVX2 void attend_span_avx2(const float* q, const T* keys, const T* values, const PagedKV& kv, int64_t begin,
                           int64_t end, int64_t kv_head, float* scores, float* out, float* best, float* total) {
  const int64_t d = kv.head_dim, stride = kv.num_kv_heads * d, bs = kv.block_size, span = end - begin;
  // tokens are visited a block at a time (no division per token), in plain loops: a lambda would
  // not inherit this function's target attribute
  for (int64_t t = begin; t < end;) {
    const T* k = keys + (kv.block_table[t / bs] * bs + t % bs) * stride + kv_head * d;
    for (const int64_t block_end = std::min(end, (t / bs + 1) * bs); t < block_end; ++t, k += stride) {
      __m256 acc[G][2];
      for (int g = 0; g < G; ++g) acc[g][0] = acc[g][1] = _mm256_setzero_ps();
      for (int64_t j = 0; j < d; j += 16) {
        const __m256 even = load8(k + j), odd = load8(k + j + 8);
        for (int g = 0; g < G; ++g) {
          acc[g][0] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * d + j), even, acc[g][0]);
          acc[g][1] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * d + j + 8), odd, acc[g][1]);
        }
      }
      for (int g = 0; g < G; ++g) scores[g * span + t - begin] = hsum(_mm256_add_ps(acc[g][0], acc[g][1]));
    }
  }
  for (int g = 0; g < G; ++g) {
    float* own = scores + g * span;
    best[g] = *std::max_element(own, own + span);
    int64_t i = 0;
    total[g] = exp_shifted_avx2(own, span, best[g], i);
    for (; i < span; ++i) total[g] += own[i] = std::exp(own[i] - best[g]);
  }
  constexpr int64_t kWidth = G == 1 ? 64 : 32;  // output values per head held in registers
  constexpr int kVectors = kWidth / 8;
  for (int64_t c = 0; c < d; c += kWidth) {
    __m256 acc[G][kVectors];
    for (int g = 0; g < G; ++g)
      for (int j = 0; j < kVectors; ++j) acc[g][j] = _mm256_setzero_ps();
    for (int64_t t = begin; t < end;) {
      const T* v = values + (kv.block_table[t / bs] * bs + t % bs) * stride + kv_head * d + c;
      for (const int64_t block_end = std::min(end, (t / bs + 1) * bs); t < block_end; ++t, v += stride) {
        __m256 widened[kVectors];
        for (int j = 0; j < kVectors; ++j) widened[j] = load8(v + 8 * j);
        for (int g = 0; g < G; ++g) {
          const __m256 weight = _mm256_set1_ps(scores[g * span + t - begin]);
          for (int j = 0; j < kVectors; ++j) acc[g][j] = _mm256_fmadd_ps(weight, widened[j], acc[g][j]);
        }
      }
    }
    for (int g = 0; g < G; ++g)
      for (int j = 0; j < kVectors; ++j) _mm256_storeu_ps(out + g * d + c + 8 * j, acc[g][j]);
  }
}

// out [D] = the softmax-weighted sum over a head's spans (each: out [D], best, total, `pitch`
// floats apart), combined in span order.
void combine_spans(const float* spans, int64_t count, int64_t pitch, int64_t d, const float* best,
                   const float* total, float* out) {
  float top = best[0];
  for (int64_t s = 1; s < count; ++s) top = std::max(top, best[s * pitch]);
  float denominator = 0.f;
  std::fill(out, out + d, 0.f);
  for (int64_t s = 0; s < count; ++s) {
    const float weight = std::exp(best[s * pitch] - top);
    denominator += weight * total[s * pitch];
    for (int64_t j = 0; j < d; ++j) out[j] += weight * spans[s * pitch + j];
  }
  for (int64_t j = 0; j < d; ++j) out[j] /= denominator;
}
#endif

// q [D] (rotated, scaled) of one head against positions 0..length-1 -> out [D]: scores, softmax,
// weighted sum of values. `scores` has room for `length` floats.
template <typename T>
void attend(const float* q, const T* keys, const T* values, const PagedKV& kv, int64_t length, int64_t kv_head,
            float* scores, float* out, bool avx2) {
  const int64_t d = kv.head_dim;
#ifdef HYPERSERVE_X86
  if (avx2) {
    kv.for_each_token(length, kv_head, [&](int64_t t, int64_t offset) { scores[t] = dot_avx2(q, keys + offset, d); });
  } else
#endif
    kv.for_each_token(length, kv_head, [&](int64_t t, int64_t offset) { scores[t] = dot_portable(q, keys + offset, d); });
  const float best = *std::max_element(scores, scores + length);
  const float total = exp_shifted(scores, length, best, avx2);
  std::fill(out, out + d, 0.f);
#ifdef HYPERSERVE_X86
  if (avx2) {
    kv.for_each_token(length, kv_head, [&](int64_t t, int64_t offset) { axpy_avx2(scores[t] / total, values + offset, out, d); });
    return;
  }
#endif
  kv.for_each_token(length, kv_head, [&](int64_t t, int64_t offset) { axpy_portable(scores[t] / total, values + offset, out, d); });
}

// x [heads, D] rotated in place: x * cos + roll(x, D / 2) * signed_sin (signed_sin = [-s, s]).
void rotate(float* x, int64_t heads, int64_t head_dim, const float* cos, const float* signed_sin) {
  const int64_t half = head_dim / 2;
  for (int64_t h = 0; h < heads; ++h) {
    float* v = x + h * head_dim;
    for (int64_t j = 0; j < half; ++j) {
      const float a = v[j], b = v[j + half];
      v[j] = a * cos[j] + b * signed_sin[j];
      v[j + half] = b * cos[j + half] + a * signed_sin[j + half];
    }
  }
}

struct DecodeBatch {  // per token: its slot, its sequence's block table and context length
  const int64_t* slots;
  const int64_t* block_tables;
  const int64_t* lengths;
  int64_t max_blocks, block_size;
};

// qkv [rows, (H + 2 Hkv) D] -> out [rows, H D]: rotates q and k, stores k and v at each token's
// slot, then attends every query head over its sequence's cached K/V.
template <typename T>
void decode_attention(float* qkv, int64_t rows, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                      const float* cos, const float* signed_sin, float scale, T* keys, T* values,
                      const DecodeBatch& batch, float* out, bool avx2) {
  const int64_t width = (num_heads + 2 * num_kv_heads) * head_dim, kv_width = num_kv_heads * head_dim;
  int64_t longest = 0;
  for (int64_t r = 0; r < rows; ++r) {
    float* q = qkv + r * width;
    rotate(q, num_heads + num_kv_heads, head_dim, cos + r * head_dim, signed_sin + r * head_dim);
    const float* k = q + num_heads * head_dim;
    for (int64_t j = 0; j < kv_width; ++j) {
      keys[batch.slots[r] * kv_width + j] = static_cast<T>(k[j]);
      values[batch.slots[r] * kv_width + j] = static_cast<T>(k[kv_width + j]);
    }
    for (int64_t j = 0; j < num_heads * head_dim; ++j) q[j] *= scale;
    longest = std::max(longest, batch.lengths[r]);
  }
#ifdef HYPERSERVE_X86
  if (avx2 && head_dim % 64 == 0) {
    // tasks of up to 3 query heads sharing a K/V head and one span of its context: even one row's 3
    // K/V heads of 3 query heads (SmolLM2) make several tasks once its context passes one span
    const int64_t group = num_heads / num_kv_heads;
    const int64_t per_task = std::min(kMaxHeadsPerTask, group);
    const int64_t tasks_per_kv_head = (group + per_task - 1) / per_task;
    const int64_t pitch = head_dim + 2;  // a span's floats for one head: out, best, total
    struct Task { int64_t row, kv_head, first_head, heads, span, slot; };  // slot: its partials' offset
    std::vector<Task> tasks;
    std::vector<int64_t> first_slot(rows * num_heads);  // each (row, head): its first span's slot
    int64_t slots = 0;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t spans = spans_of(batch.lengths[r]);
      for (int64_t kv_head = 0; kv_head < num_kv_heads; ++kv_head) {
        for (int64_t k = 0; k < tasks_per_kv_head; ++k) {
          const int64_t first = kv_head * group + k * per_task, heads = std::min(per_task, kv_head * group + group - first);
          for (int64_t h = 0; h < heads; ++h) first_slot[r * num_heads + first + h] = slots + h * spans;
          for (int64_t sp = 0; sp < spans; ++sp) tasks.push_back({r, kv_head, first, heads, sp, slots + sp});
          slots += heads * spans;
        }
      }
    }
    TORCH_CHECK(head_dim <= kMaxAttentionHeadDim, "decode_layer: head_dim above ", kMaxAttentionHeadDim);
    // kept between calls (a fresh buffer per layer would be page-faulted in every time); it grows to the
    // largest step's rows x spans x heads x (D + 2) floats: 39 MB for a 512-token chunk at 8,000 of context
    thread_local std::vector<float> partials;
    if (static_cast<int64_t>(partials.size()) < slots * pitch) partials.resize(slots * pitch);
    float* parts = partials.data();
    parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
      float scores[kMaxHeadsPerTask * kAttentionSpan];
      float out_g[kMaxHeadsPerTask * kMaxAttentionHeadDim], best[kMaxHeadsPerTask], total[kMaxHeadsPerTask];
      for (int64_t i = begin; i < end; ++i) {
        const Task& task = tasks[i];
        const int64_t length = batch.lengths[task.row];
        const int64_t from = task.span * kAttentionSpan, to = std::min(length, from + kAttentionSpan);
        const PagedKV kv{batch.block_size, num_kv_heads, head_dim, batch.block_tables + task.row * batch.max_blocks};
        const float* q = qkv + task.row * width + task.first_head * head_dim;
        static_assert(kMaxHeadsPerTask == 3, "one case per head count");
        switch (task.heads) {
          case 3: attend_span_avx2<T, 3>(q, keys, values, kv, from, to, task.kv_head, scores, out_g, best, total); break;
          case 2: attend_span_avx2<T, 2>(q, keys, values, kv, from, to, task.kv_head, scores, out_g, best, total); break;
          default: attend_span_avx2<T, 1>(q, keys, values, kv, from, to, task.kv_head, scores, out_g, best, total);
        }
        const int64_t spans = spans_of(length);
        for (int64_t g = 0; g < task.heads; ++g) {  // head g's spans are consecutive slots
          float* part = parts + (task.slot + g * spans) * pitch;
          std::copy(out_g + g * head_dim, out_g + (g + 1) * head_dim, part);
          part[head_dim] = best[g];
          part[head_dim + 1] = total[g];
        }
      }
    });
    parallel_for(0, rows * num_heads, 8, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t spans = spans_of(batch.lengths[i / num_heads]);
        const float* part = parts + first_slot[i] * pitch;
        combine_spans(part, spans, pitch, head_dim, part + head_dim, part + head_dim + 1, out + i * head_dim);
      }
    });
    return;
  }
#endif
  const bool vectorized = avx2 && head_dim % 8 == 0;
  parallel_for(0, rows * num_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(longest);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = i / num_heads, h = i % num_heads;
      const PagedKV kv{batch.block_size, num_kv_heads, head_dim, batch.block_tables + r * batch.max_blocks};
      attend<T>(qkv + r * width + h * head_dim, keys, values, kv, batch.lengths[r], h / (num_heads / num_kv_heads),
                scores.data(), out + i * head_dim, vectorized);
    }
  });
}

// ---- LoRA adapters on a projection, each row its own ----

constexpr int64_t kLoRATile = 64;  // output columns per tile of B

// One adapter's weights on one projection, float32 or bfloat16 (all adapters alike): a [S * r, in]
// (its A of each shard the projection fuses (q, k, v; gate, up), shard-major, zero for shards it
// does not target), b: r * out values, B^T [r, out] (row j holds, in each shard's output columns,
// that shard's B[:, j] times the scaling) cut into tiles of kLoRATile columns (fewer at a shard's
// end), each tile's [r, width] stored contiguously, tiles in column order, so the tile starting at
// column c begins at c * r. Shards sit at `offsets` (S + 1 of them). a == nullptr: the adapter
// leaves the projection alone.
struct LoRAWeights {
  const void* a = nullptr;
  const void* b = nullptr;
  int64_t rank = 0;
};

LoRAWeights lora_weights(const at::Tensor& a, const at::Tensor& b, int64_t in, int64_t out, int64_t shards,
                         at::ScalarType dtype) {
  if (a.numel() == 0) return {};
  TORCH_CHECK(a.scalar_type() == dtype && b.scalar_type() == dtype && a.is_contiguous() && b.is_contiguous() &&
                  a.dim() == 2 && b.dim() == 2 && a.size(1) == in && b.size(1) == out &&
                  a.size(0) == shards * b.size(0),
              "decode_layer: LoRA weights must be contiguous A [shards * r, in] and B [r, out] (tiled), of one dtype");
  return {a.data_ptr(), b.data_ptr(), b.size(0)};
}

#ifdef HYPERSERVE_X86
// out[i] = dot(xs[i], w) for R rows at once: each 8 values of w loaded once, R independent chains.
// A row's sum runs in the same order whatever R, as dot_avx2's.
template <typename T, int R>
AVX2 void dots_avx2(const float* const* xs, const T* w, int64_t n, float* out) {
  __m256 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t k = 0; k < n; k += 8) {
    const __m256 wk = load8(w + k);
    for (int i = 0; i < R; ++i) acc[i] = _mm256_fmadd_ps(_mm256_loadu_ps(xs[i] + k), wk, acc[i]);
  }
  for (int i = 0; i < R; ++i) out[i] = hsum(acc[i]);
}

// y[0..64) += sum_j h[j] * b[j * stride + (0..64)], y held in registers over the rank.
template <typename T>
AVX2 void expand64_avx2(const float* h, int64_t rank, const T* b, int64_t stride, float* y) {
  __m256 acc[8];
  for (int i = 0; i < 8; ++i) acc[i] = _mm256_loadu_ps(y + 8 * i);
  for (int64_t j = 0; j < rank; ++j) {
    if (h[j] == 0.f) continue;
    const __m256 weight = _mm256_set1_ps(h[j]);
    for (int i = 0; i < 8; ++i) acc[i] = _mm256_fmadd_ps(weight, load8(b + j * stride + 8 * i), acc[i]);
  }
  for (int i = 0; i < 8; ++i) _mm256_storeu_ps(y + 8 * i, acc[i]);
}
#endif

// out[i] = dot(xs[i], w) for `count` rows.
template <typename T>
void lora_dots(const float* const* xs, int64_t count, const T* w, int64_t n, float* out, bool avx2) {
#ifdef HYPERSERVE_X86
  if (avx2 && n % 8 == 0) {
    for (int64_t i = 0; i < count; i += 4) {
      switch (std::min<int64_t>(4, count - i)) {
        case 4: dots_avx2<T, 4>(xs + i, w, n, out + i); break;
        case 3: dots_avx2<T, 3>(xs + i, w, n, out + i); break;
        case 2: dots_avx2<T, 2>(xs + i, w, n, out + i); break;
        default: dots_avx2<T, 1>(xs + i, w, n, out + i);
      }
    }
    return;
  }
#endif
  for (int64_t i = 0; i < count; ++i) out[i] = dot_portable(xs[i], w, n);
}

// y[0..columns) += sum_j h[j] * b[j * stride + (0..columns)].
template <typename T>
void lora_expand(const float* h, int64_t rank, const T* b, int64_t stride, float* y, int64_t columns, bool avx2) {
#ifdef HYPERSERVE_X86
  if (avx2 && columns == kLoRATile) return expand64_avx2(h, rank, b, stride, y);
#endif
  for (int64_t j = 0; j < rank; ++j) {
    if (h[j] != 0.f) axpy_portable(h[j], b + j * stride, y, columns);
  }
}

// y [rows, out] += each row's adapter delta (row_adapter[r] < 0: the base model, nothing added):
// h = A x, then y[shard s] += sum_j h[s][j] * B[j][shard s]. Rows are grouped by adapter, so each
// adapter's weights are read once per step however many rows use it; the work is split over A's
// rows, then over tiles of output columns, so no two threads write the same place.
template <typename T>
void lora_add(const std::vector<LoRAWeights>& adapters, const int64_t* row_adapter, const float* x, int64_t rows,
              int64_t in, float* y, int64_t out, const std::vector<int64_t>& offsets, bool avx2) {
  const int64_t shards = static_cast<int64_t>(offsets.size()) - 1;
  std::vector<std::vector<int64_t>> members(adapters.size());
  int64_t max_rank = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t adapter = row_adapter[r];
    if (adapter >= 0 && adapters[adapter].a != nullptr) {
      members[adapter].push_back(r);
      max_rank = std::max(max_rank, adapters[adapter].rank);
    }
  }
  if (max_rank == 0) return;
  const int64_t width = shards * max_rank;  // h's row stride
  std::vector<float> h(rows * width, 0.f);
  std::vector<std::pair<int64_t, int64_t>> a_rows;  // (adapter, row of its A)
  for (size_t i = 0; i < adapters.size(); ++i) {
    for (int64_t j = 0; !members[i].empty() && j < shards * adapters[i].rank; ++j) a_rows.emplace_back(i, j);
  }
  parallel_for(0, static_cast<int64_t>(a_rows.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<const float*> xs(rows);
    std::vector<float> sums(rows);
    for (int64_t i = begin; i < end; ++i) {
      const auto [adapter, j] = a_rows[i];
      const std::vector<int64_t>& own = members[adapter];
      for (size_t m = 0; m < own.size(); ++m) xs[m] = x + own[m] * in;
      lora_dots(xs.data(), own.size(), static_cast<const T*>(adapters[adapter].a) + j * in, in, sums.data(), avx2);
      for (size_t m = 0; m < own.size(); ++m) h[own[m] * width + j] = sums[m];
    }
  });
  std::vector<std::pair<int64_t, int64_t>> tiles;  // (shard, first column)
  for (int64_t s = 0; s < shards; ++s) {
    for (int64_t c = offsets[s]; c < offsets[s + 1]; c += kLoRATile) tiles.emplace_back(s, c);
  }
  parallel_for(0, static_cast<int64_t>(tiles.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const auto [s, first] = tiles[i];
      const int64_t columns = std::min(kLoRATile, offsets[s + 1] - first);
      for (size_t adapter = 0; adapter < adapters.size(); ++adapter) {
        const int64_t rank = adapters[adapter].rank;
        const T* tile = static_cast<const T*>(adapters[adapter].b) + first * rank;
        for (const int64_t r : members[adapter]) {  // h is 0 where the adapter does not target the shard
          lora_expand(h.data() + r * width + s * rank, rank, tile, columns, y + r * out + first, columns, avx2);
        }
      }
    }
  });
}

void lora_add(const std::vector<LoRAWeights>& adapters, at::ScalarType dtype, const int64_t* row_adapter,
              const float* x, int64_t rows, int64_t in, float* y, int64_t out, const std::vector<int64_t>& offsets,
              bool avx2) {
  if (adapters.empty()) return;
  if (dtype == at::kBFloat16) return lora_add<at::BFloat16>(adapters, row_adapter, x, rows, in, y, out, offsets, avx2);
  lora_add<float>(adapters, row_adapter, x, rows, in, y, out, offsets, avx2);
}

// ---- one Llama decoder layer ----

void rms_norm(const float* x, const float* weight, int64_t rows, int64_t dim, float eps, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* src = x + r * dim;
    float squares = 0.f;
    for (int64_t j = 0; j < dim; ++j) squares += src[j] * src[j];
    const float inverse = 1.f / std::sqrt(squares / static_cast<float>(dim) + eps);
    for (int64_t j = 0; j < dim; ++j) out[r * dim + j] = src[j] * inverse * weight[j];
  }
}

// The step's rows as DecodeBatch, each slot and block inside a cache of num_slots (an index out of
// range would write outside it). Checked once per step: every layer's cache has num_slots.
DecodeBatch checked_batch(const at::Tensor& slots, const at::Tensor& block_tables, const at::Tensor& lengths,
                          int64_t rows, int64_t block_size, int64_t num_slots) {
  for (const at::Tensor* t : {&slots, &block_tables, &lengths}) {
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->size(0) == rows,
                "decode_layer: slots, block tables and lengths must be contiguous int64, one row per token");
  }
  TORCH_CHECK(block_tables.dim() == 2 && block_size > 0, "decode_layer: block tables must be [rows, max_blocks]");
  const DecodeBatch batch{slots.data_ptr<int64_t>(), block_tables.data_ptr<int64_t>(), lengths.data_ptr<int64_t>(),
                          block_tables.size(1), block_size};
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t length = batch.lengths[r];
    TORCH_CHECK(batch.slots[r] >= 0 && batch.slots[r] < num_slots && length >= 1 &&
                    length <= batch.max_blocks * block_size,
                "decode_layer: slot or context length out of range");
    for (int64_t b = 0; b < (length + block_size - 1) / block_size; ++b) {
      const int64_t block = batch.block_tables[r * batch.max_blocks + b];
      TORCH_CHECK(block >= 0 && (block + 1) * block_size <= num_slots, "decode_layer: block out of range");
    }
  }
  return batch;
}

// hidden [rows, dim] (float32, updated in place) through one Llama decoder layer, one new token
// per row. weights: input norm, qkv, o, post-attention norm, gate_up, down (norms float32, the
// projections Q4_1 as above). K/V caches are [slots, kv_heads, head_dim] in float32, bfloat16 or
// float16; token t of row r lives at slot block_tables[r][t / block_size] * block_size + t % block_size.
// lora: for each adapter of the step, A and B (as LoRAWeights says) of qkv, o, gate_up and down;
// lora_rows: each row's adapter, an index into them (-1: none). The batch is checked already.
void run_decode_layer(at::Tensor hidden, at::TensorList weights, const at::Tensor& cos, const at::Tensor& signed_sin,
                      at::Tensor key_cache, at::Tensor value_cache, const DecodeBatch& batch, int64_t num_heads,
                      int64_t num_kv_heads, double eps, double scale, at::TensorList lora,
                      const at::Tensor& lora_rows) {
  TORCH_CHECK(weights.size() == 6, "decode_layer: expected 6 weights (norm, qkv, o, norm, gate_up, down)");
  TORCH_CHECK(hidden.scalar_type() == at::kFloat && hidden.is_contiguous() && hidden.dim() == 2,
              "decode_layer: hidden must be contiguous float32 [rows, dim]");
  TORCH_CHECK(key_cache.sizes() == value_cache.sizes() && key_cache.scalar_type() == value_cache.scalar_type() &&
                  key_cache.is_contiguous() && value_cache.is_contiguous() && key_cache.dim() == 3 &&
                  key_cache.size(1) == num_kv_heads && num_kv_heads > 0 && num_heads % num_kv_heads == 0,
              "decode_layer: K/V caches must be contiguous [slots, kv_heads, head_dim] of one dtype");
  const int64_t rows = hidden.size(0), dim = hidden.size(1), head_dim = key_cache.size(2);
  const int64_t qkv_features = (num_heads + 2 * num_kv_heads) * head_dim;
  for (int i : {0, 3}) {
    TORCH_CHECK(weights[i].scalar_type() == at::kFloat && weights[i].is_contiguous() && weights[i].numel() == dim,
                "decode_layer: norm weights must be contiguous float32 [dim]");
  }
  const QuantizedWeight qkv = quantized_weight(weights[1], dim, Format::kQ4_1);
  const QuantizedWeight o = quantized_weight(weights[2], num_heads * head_dim, Format::kQ4_1);
  const QuantizedWeight gate_up = quantized_weight(weights[4], dim, Format::kQ4_1);
  const int64_t intermediate = gate_up.out_features / 2;
  const QuantizedWeight down = quantized_weight(weights[5], intermediate, Format::kQ4_1);
  TORCH_CHECK(head_dim % 2 == 0 && qkv.out_features == qkv_features && o.out_features == dim &&
                  down.out_features == dim,
              "decode_layer: weight shapes do not fit the layer");
  for (const at::Tensor* t : {&cos, &signed_sin}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == rows * head_dim,
                "decode_layer: cos and sin must be contiguous float32 [rows, head_dim]");
  }

  TORCH_CHECK(lora.size() % 8 == 0, "decode_layer: LoRA takes A and B of the four projections per adapter");
  std::vector<LoRAWeights> lora_qkv, lora_o, lora_gate_up, lora_down;
  at::ScalarType lora_dtype = at::kFloat;
  const int64_t* row_adapter = nullptr;
  const std::vector<int64_t> qkv_offsets{0, num_heads * head_dim, (num_heads + num_kv_heads) * head_dim,
                                         qkv_features};
  if (!lora.empty()) {
    const int64_t num_adapters = static_cast<int64_t>(lora.size()) / 8;
    TORCH_CHECK(lora_rows.scalar_type() == at::kLong && lora_rows.is_contiguous() && lora_rows.numel() == rows,
                "decode_layer: lora_rows must be contiguous int64, one per row");
    row_adapter = lora_rows.data_ptr<int64_t>();
    for (int64_t r = 0; r < rows; ++r) {
      TORCH_CHECK(row_adapter[r] < num_adapters, "decode_layer: a row's adapter is out of range");
    }
    for (const at::Tensor& t : lora) {
      if (t.numel() > 0) lora_dtype = t.scalar_type();
    }
    TORCH_CHECK(lora_dtype == at::kFloat || lora_dtype == at::kBFloat16,
                "decode_layer: LoRA weights must be float32 or bfloat16");
    for (int64_t i = 0; i < num_adapters; ++i) {
      const at::Tensor* t = lora.data() + 8 * i;
      lora_qkv.push_back(lora_weights(t[0], t[1], dim, qkv_features, 3, lora_dtype));
      lora_o.push_back(lora_weights(t[2], t[3], num_heads * head_dim, dim, 1, lora_dtype));
      lora_gate_up.push_back(lora_weights(t[4], t[5], dim, 2 * intermediate, 2, lora_dtype));
      lora_down.push_back(lora_weights(t[6], t[7], intermediate, dim, 1, lora_dtype));
    }
  }

  const Isa isa = best_isa();
  const bool avx2 = isa != Isa::kPortable;
  float* h = hidden.data_ptr<float>();
  std::vector<float> x(rows * std::max(dim, intermediate));
  std::vector<float> wide(rows * std::max(qkv_features, 2 * intermediate));
  std::vector<float> attended(rows * num_heads * head_dim), projected(rows * dim);

  rms_norm(h, weights[0].data_ptr<float>(), rows, dim, static_cast<float>(eps), x.data());
  quantized_matmul(qkv, x.data(), rows, wide.data(), isa);
  lora_add(lora_qkv, lora_dtype, row_adapter, x.data(), rows, dim, wide.data(), qkv_features, qkv_offsets, avx2);
  const auto attend_all = [&](auto* keys, auto* values) {
    decode_attention(wide.data(), rows, num_heads, num_kv_heads, head_dim, cos.data_ptr<float>(),
                     signed_sin.data_ptr<float>(), static_cast<float>(scale), keys, values, batch, attended.data(),
                     avx2);
  };
  switch (key_cache.scalar_type()) {
    case at::kFloat: attend_all(key_cache.data_ptr<float>(), value_cache.data_ptr<float>()); break;
    case at::kBFloat16:
      attend_all(key_cache.data_ptr<at::BFloat16>(), value_cache.data_ptr<at::BFloat16>());
      break;
    case at::kHalf: attend_all(key_cache.data_ptr<at::Half>(), value_cache.data_ptr<at::Half>()); break;
    default: TORCH_CHECK(false, "decode_layer: K/V caches must be float32, bfloat16 or float16");
  }
  quantized_matmul(o, attended.data(), rows, projected.data(), isa);
  lora_add(lora_o, lora_dtype, row_adapter, attended.data(), rows, num_heads * head_dim, projected.data(), dim,
           {0, dim}, avx2);
  for (int64_t i = 0; i < rows * dim; ++i) h[i] += projected[i];

  rms_norm(h, weights[3].data_ptr<float>(), rows, dim, static_cast<float>(eps), x.data());
  quantized_matmul(gate_up, x.data(), rows, wide.data(), isa);
  lora_add(lora_gate_up, lora_dtype, row_adapter, x.data(), rows, dim, wide.data(), 2 * intermediate,
           {0, intermediate, 2 * intermediate}, avx2);
  for (int64_t r = 0; r < rows; ++r) {
    const float* gate = wide.data() + r * 2 * intermediate;
    silu_mul(gate, gate + intermediate, x.data() + r * intermediate, intermediate, avx2);
  }
  quantized_matmul(down, x.data(), rows, projected.data(), isa);
  lora_add(lora_down, lora_dtype, row_adapter, x.data(), rows, intermediate, projected.data(), dim, {0, dim}, avx2);
  for (int64_t i = 0; i < rows * dim; ++i) h[i] += projected[i];
}

// decode_layer as an op: checks the batch, then runs the layer.
void decode_layer(at::Tensor hidden, at::TensorList weights, const at::Tensor& cos, const at::Tensor& signed_sin,
                  at::Tensor key_cache, at::Tensor value_cache, const at::Tensor& slots, const at::Tensor& block_tables,
                  const at::Tensor& lengths, int64_t block_size, int64_t num_heads, int64_t num_kv_heads, double eps,
                  double scale, at::TensorList lora, const at::Tensor& lora_rows) {
  TORCH_CHECK(hidden.dim() == 2, "decode_layer: hidden must be contiguous float32 [rows, dim]");
  const DecodeBatch batch = checked_batch(slots, block_tables, lengths, hidden.size(0), block_size, key_cache.size(0));
  run_step([&] {
    run_decode_layer(hidden, weights, cos, signed_sin, key_cache, value_cache, batch, num_heads, num_kv_heads, eps,
                     scale, lora, lora_rows);
  });
}

// Every layer of a model through decode_layer in one call, without LoRA: weights holds each layer's
// six in turn, key_caches and value_caches one per layer. One dispatch from Python per step rather
// than one per layer.
void decode_layers(at::Tensor hidden, at::TensorList weights, const at::Tensor& cos, const at::Tensor& signed_sin,
                   at::TensorList key_caches, at::TensorList value_caches, const at::Tensor& slots,
                   const at::Tensor& block_tables, const at::Tensor& lengths, int64_t block_size, int64_t num_heads,
                   int64_t num_kv_heads, double eps, double scale) {
  const size_t layers = key_caches.size();
  TORCH_CHECK(layers > 0 && value_caches.size() == layers && weights.size() == 6 * layers && hidden.dim() == 2,
              "decode_layers: six weights and one K and V cache per layer");
  for (size_t i = 0; i < layers; ++i) {
    TORCH_CHECK(key_caches[i].size(0) == key_caches[0].size(0), "decode_layers: every layer's cache has one size");
  }
  const DecodeBatch batch =
      checked_batch(slots, block_tables, lengths, hidden.size(0), block_size, key_caches[0].size(0));
  run_step([&] {
    for (size_t i = 0; i < layers; ++i) {
      run_decode_layer(hidden, weights.slice(6 * i, 6), cos, signed_sin, key_caches[i], value_caches[i], batch,
                       num_heads, num_kv_heads, eps, scale, {}, at::Tensor());
    }
  });
}

// float32 x [rows, dim] RMS-normalised and scaled by weight [dim], as the fused layers do it.
at::Tensor rms_norm_op(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat &&
                  weight.numel() == x.size(1),
              "rms_norm: x must be float32 [rows, dim] and weight float32 [dim]");
  const at::Tensor input = x.contiguous(), scale = weight.contiguous();
  at::Tensor out = at::empty_like(input);
  rms_norm(input.data_ptr<float>(), scale.data_ptr<float>(), input.size(0), input.size(1), static_cast<float>(eps),
           out.data_ptr<float>());
  return out;
}

std::string isa() { return isa_name(best_isa()); }

}  // namespace

TORCH_LIBRARY(hyperserve, m) {
  m.def("quantized_linear(Tensor x, Tensor weight, str format, str isa=\"\") -> Tensor");
  m.def("dequantize(Tensor weight, int in_features, str format) -> Tensor");
  m.def("decode_layer(Tensor(a!) hidden, Tensor[] weights, Tensor cos, Tensor signed_sin, Tensor(b!) key_cache, "
        "Tensor(c!) value_cache, Tensor slots, Tensor block_tables, Tensor lengths, int block_size, int num_heads, "
        "int num_kv_heads, float eps, float scale, Tensor[] lora, Tensor lora_rows) -> ()");
  m.def("decode_layers(Tensor(a!) hidden, Tensor[] weights, Tensor cos, Tensor signed_sin, Tensor(b!)[] key_caches, "
        "Tensor(c!)[] value_caches, Tensor slots, Tensor block_tables, Tensor lengths, int block_size, int num_heads, "
        "int num_kv_heads, float eps, float scale) -> ()");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("isa() -> str", &isa);
}

TORCH_LIBRARY_IMPL(hyperserve, CPU, m) {
  m.impl("quantized_linear", &quantized_linear);
  m.impl("dequantize", &dequantize);
  m.impl("decode_layer", &decode_layer);
  m.impl("decode_layers", &decode_layers);
  m.impl("rms_norm", &rms_norm_op);
}
