// CPU kernels for decode-sized batches, where PyTorch's general kernels spend more time per call
// than the work needs. Registered as torch.ops.hyperserve.*; loaded by hyperserve/kernels.
//
// Weights come in two of GGUF's layouts, groups of 32 along the input, one output channel per row
// of bytes read as one stream: its codes, then its float16 scales (and minimums), as in the GGUF.
// - Q4_1 (the int4 projections): w = q * d + m, q in 0..15; byte j of a group holds q[j] in the low
//   nibble and q[j + 16] in the high one. 20 bytes per 32 weights.
// - Q8_0 (the embedding and LM head of an int4 model): w = q * d, q in -127..127. 34 bytes per 32.
// - Q4_1 interleaved by 8 channels (a 3-D weight [out / 8, groups, 160]; the int4 projections'
//   layout wherever the CPU has AVX2, see interleaves_q41 in layers/quantization.py): for each block
//   of 8 channels and group g, 128 code bytes, then the 8 channels' float16 scales, then their
//   minimums. Code byte 32 k + 4 c + i is GGUF's byte 4 k + i of channel c's group (k, i in 0..3),
//   so one 32-byte load holds 4 codes of each of the 8 channels.
// - MXFP4 interleaved by 8 channels (the mxfp4 projections, [out / 8, groups, 136]): the same 128
//   code bytes, each nibble an E2M1 code (sign, two exponent bits, one mantissa bit: 0 to 6), then
//   the 8 channels' E8M0 scale bytes (2^(e - 127)). The kernels look the codes up as integers (the
//   values doubled, kFp4Doubled) with a byte shuffle and run them as the Q4_1 kernels do, 17 bytes
//   per 32 weights against Q4_1's 20.
// - Q8_0 interleaved by 16 channels (the LM head where the int4 projections are interleaved; a 3-D
//   weight [out / 16, groups, 544]): for each block and group, 512 code bytes, then the 16 channels'
//   float16 scales. Code byte 32 p + 2 c + i is code 2 p + i of channel c (p in 0..15, i in 0..1),
//   so one 32-byte load holds 2 codes of each of the 16 channels, one read stream per block.
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
// instructions more than by memory. With AVX-512 VNNI one _mm512_dpbusd_epi32 multiplies 4 codes of
// 16 channels (two blocks) and sums them into 32 bits, the same integer sums in a third of the
// instructions a row, which is what a verified draft row costs. The instruction set is
// picked at run time (`isa()`): one build serves AVX2 and AVX-512 machines alike; quantized_linear's
// `isa` argument forces a lesser one (tests), "portable" the plain C++ loops.
//
// The kernels live in the headers included below, one concept each, all compiled into this one
// translation unit; this file holds the operators (their checks on the tensors) and registers them.

#include <torch/library.h>

#include <numeric>
#include <optional>
#include <string>
#include <vector>

#include "decode_layer.h"
#include "isa.h"
#include "quantized_matmul.h"
#include "step_team.h"

namespace {

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

// Channels ids[0..count) of w as float32 rows into dst, through the layout-independent accessors:
// the embedding lookup of a step's tokens, and the Q8_0 head's blocks, which nothing multiplies densely.
void dequantize_channels(const QuantizedWeight& w, const int64_t* ids, int64_t count, float* dst) {
  for (int64_t i = 0; i < count; ++i) {
    const int64_t n = ids[i];
    TORCH_CHECK(n >= 0 && n < w.out_features, "dequantize: channel ", n, " out of range for ", w.out_features);
    for (int64_t g = 0; g < w.groups; ++g) {
      const float d = w.scale(n, g), m = w.format == Format::kQ4_1 ? w.min(n, g) : 0.f;
      float* row = dst + i * w.in_features + g * kGroup;
      for (int64_t j = 0; j < kGroup; ++j) row[j] = static_cast<float>(w.code(n, g, j)) * d + m;
    }
  }
}

// The weight as float32 [out_features, in_features]: for steps too large for the kernel above
// (prefill), which multiply it densely so that no dense copy lives beside the packed one. With
// `channels` (int64 [N]), only those: the embedding lookup of N tokens, in any layout.
at::Tensor dequantize(const at::Tensor& weight, int64_t in_features, const std::string& format,
                      const std::optional<at::Tensor>& channels) {
  const QuantizedWeight w = quantized_weight(weight, in_features, parse_format(format));
  if (channels.has_value()) {
    TORCH_CHECK(channels->dim() == 1 && channels->scalar_type() == at::kLong, "dequantize: channels must be int64 [N]");
    const at::Tensor ids = channels->contiguous();
    at::Tensor out = at::empty({ids.size(0), in_features}, at::kFloat);
    dequantize_channels(w, ids.data_ptr<int64_t>(), ids.size(0), out.data_ptr<float>());
    return out;
  }
  at::Tensor out = at::empty({w.out_features, in_features}, weight.options().dtype(at::kFloat));
  float* dst = out.data_ptr<float>();
  if (w.interleaved && w.format == Format::kQ8_0) {
    std::vector<int64_t> all(w.out_features);
    std::iota(all.begin(), all.end(), 0);
    dequantize_channels(w, all.data(), w.out_features, dst);
    return out;
  }
  if (w.interleaved) {  // Q4_1 or MXFP4
    const bool mx = w.format == Format::kMxfp4;
    const auto value = [mx](int nibble) { return static_cast<float>(mx ? kFp4Doubled[nibble] : nibble); };
    at::parallel_for(0, w.out_features / kBlock, 2, [&](int64_t begin, int64_t end) {
      for (int64_t n = begin * kBlock; n < end * kBlock; n += kBlock) {
        for (int64_t g = 0; g < w.groups; ++g) {
          const uint8_t* group = w.block_group(n, g);
          for (int64_t c = 0; c < kBlock; ++c) {
            const float d = w.scale(n + c, g), m = mx ? 0.f : w.min(n + c, g);
            float* row = dst + (n + c) * in_features + g * kGroup;
            for (int64_t j = 0; j < kGroup / 2; ++j) {
              const uint8_t byte = group[j / 4 * 32 + c * 4 + j % 4];
              row[j] = value(byte & 0x0F) * d + m;
              row[j + kGroup / 2] = value(byte >> 4) * d + m;
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

void set_one_stream_rows(int64_t rows) {
  TORCH_CHECK(rows >= 0 && rows <= kBlockRowTile, "set_one_stream_rows: rows must be in [0, ", kBlockRowTile,
              "], got ", rows);
  one_stream_rows = rows;
}

}  // namespace


TORCH_LIBRARY(hyperserve, m) {
  m.def("quantized_linear(Tensor x, Tensor weight, str format, str isa=\"\") -> Tensor");
  m.def("dequantize(Tensor weight, int in_features, str format, Tensor? channels=None) -> Tensor");
  m.def("decode_layer(Tensor(a!) hidden, Tensor[] weights, Tensor cos, Tensor signed_sin, Tensor(b!) key_cache, "
        "Tensor(c!) value_cache, Tensor slots, Tensor block_tables, Tensor lengths, int block_size, int num_heads, "
        "int num_kv_heads, float eps, float scale, Tensor[] lora, Tensor lora_rows, int sliding_window=0, "
        "bool gelu=False, float softcap=0.) -> ()");
  m.def("decode_layers(Tensor(a!) hidden, Tensor[] weights, Tensor cos, Tensor signed_sin, Tensor(b!)[] key_caches, "
        "Tensor(c!)[] value_caches, Tensor slots, Tensor block_tables, Tensor lengths, int block_size, int num_heads, "
        "int num_kv_heads, float eps, float scale) -> ()");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("isa() -> str", &isa);
  m.def("set_one_stream_rows(int rows) -> ()", &set_one_stream_rows);
}

TORCH_LIBRARY_IMPL(hyperserve, CPU, m) {
  m.impl("quantized_linear", &quantized_linear);
  m.impl("dequantize", &dequantize);
  m.impl("decode_layer", &decode_layer);
  m.impl("decode_layers", &decode_layers);
  m.impl("rms_norm", &rms_norm_op);
}
