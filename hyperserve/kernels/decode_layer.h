// One Llama decoder layer for a decode step (and all of a model's layers in one call), from the
// quantized projections, paged attention and LoRA pieces; its MLP dense or a mixture of experts.

#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "isa.h"
#include "lora.h"
#include "paged_attention.h"
#include "quantized_matmul.h"
#include "step_team.h"

namespace {

// ---- one Llama decoder layer ----

void rms_norm(const float* x, const float* weight, int64_t rows, int64_t dim, float eps, float* out) {
  parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* src = x + r * dim;
      float squares = 0.f;
      for (int64_t j = 0; j < dim; ++j) squares += src[j] * src[j];
      const float inverse = 1.f / std::sqrt(squares / static_cast<float>(dim) + eps);
      for (int64_t j = 0; j < dim; ++j) out[r * dim + j] = src[j] * inverse * weight[j];
    }
  });
}

// h [rows, dim] += delta, row by row on the step's threads.
void add_rows(float* h, const float* delta, int64_t rows, int64_t dim) {
  parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin * dim; i < end * dim; ++i) h[i] += delta[i];
  });
}

// out [rows, n] += bias [n] on every row (nullptr: no bias), row by row on the step's threads.
void add_bias(float* out, const float* bias, int64_t rows, int64_t n) {
  if (bias == nullptr) return;
  parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t j = 0; j < n; ++j) out[r * n + j] += bias[j];
    }
  });
}

// A gated MLP's activation: SiLU, GELU's tanh approximation (Gemma's), or with a limit GPT-OSS's
// clamped SwiGLU (clamped_swiglu_mul).
struct Activation {
  bool gelu = false;
  float alpha = 0.f, limit = 0.f;  // limit > 0: the clamped SwiGLU
};

// out [rows, n] = act(gate) * up for each row's [gate | up] of `gates` [rows, 2n], row by row on the
// step's threads.
void gated_rows(const float* gates, int64_t rows, int64_t n, float* out, bool avx2, const Activation& act) {
  parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float *gate = gates + r * 2 * n, *up = gate + n;
      if (act.limit > 0.f) {
        clamped_swiglu_mul(gate, up, out + r * n, n, act.alpha, act.limit, avx2);
      } else {
        (act.gelu ? gelu_mul : silu_mul)(gate, up, out + r * n, n, avx2);
      }
    }
  });
}

// A projection's packed weight, Q4_1 (int4), Q8_0 (int8) or MXFP4, told apart by its bytes per group
// of 32 inputs: 160, 544 or 136 a block's group interleaved, 20 or 34 a channel's in rows.
QuantizedWeight projection(const at::Tensor& packed, int64_t in_features) {
  if (packed.dim() == 3 && packed.size(2) == kMxBlockGroupBytes) {
    return quantized_weight(packed, in_features, Format::kMxfp4);
  }
  const bool q8_0 = packed.dim() == 3 ? packed.size(2) == kHeadBlockGroupBytes
                                      : packed.dim() == 2 && packed.size(1) == in_features + in_features / 16;
  return quantized_weight(packed, in_features, q8_0 ? Format::kQ8_0 : Format::kQ4_1);
}

// A layer's intermediate results, allocated once for every layer of a step; the expert_* ones hold
// an expert's rows of x (then its SwiGLU's), its gate/up output and its down output.
struct LayerBuffers {
  std::vector<float> x, wide, attended, projected, expert_in, expert_wide, expert_out;

  void fit(int64_t rows, int64_t dim, int64_t intermediate, int64_t wide_features, int64_t attended_features) {
    x.resize(rows * std::max(dim, intermediate));
    wide.resize(rows * wide_features);
    attended.resize(rows * attended_features);
    projected.resize(rows * dim);
  }
};

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

// Where each of a layer's weights sits in the list decode_layer takes; a slot a layer does without
// holds an empty tensor. Norms, biases and sinks are float32 vectors, the projections packed (Q4_1,
// Q8_0 or MXFP4: `projection`). kAttentionOutNorm and kMlpOutNorm: Gemma 3's norms of attention's and
// the MLP's outputs; kActivation: GPT-OSS's clamped SwiGLU (alpha, limit). From kMlp, a dense MLP's
// gate_up, its bias, down and its bias (kDenseMlpWeights); or a mixture of experts': its router
// [experts, dim] and the router's bias, its routing (int64 top_k and renormalize), the experts'
// gate_up biases [experts, 2 width] and down biases [experts, dim] (or empty), then each expert's
// gate_up and down (kMoeHeaderWeights, then two per expert).
enum LayerSlot : int64_t {
  kInputNorm, kQkv, kQkvBias, kO, kOBias, kMlpNorm, kQNorm, kKNorm, kSinks, kAttentionOutNorm, kMlpOutNorm,
  kActivation, kMlp
};
constexpr int64_t kDenseMlpWeights = 4, kMoeHeaderWeights = 5;

// How many of `weights`, from `first`, belong to one layer: the router (a float32 matrix where a dense
// MLP has its packed gate_up) says how many experts follow.
int64_t layer_weight_count(at::TensorList weights, int64_t first) {
  TORCH_CHECK(first + kMlp + kDenseMlpWeights <= static_cast<int64_t>(weights.size()),
              "decode_layer: a layer takes ", kMlp + kDenseMlpWeights, " weights or more");
  const at::Tensor& mlp = weights[first + kMlp];
  const bool moe = mlp.scalar_type() == at::kFloat && mlp.dim() == 2;
  return kMlp + (moe ? kMoeHeaderWeights + 2 * mlp.size(0) : kDenseMlpWeights);
}

// A float32 vector of n (a norm, bias or the sinks) as a pointer; nullptr where it is empty.
const float* optional_vector(const at::Tensor& t, int64_t n, const char* what) {
  if (t.numel() == 0) return nullptr;
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == n, "decode_layer: ", what,
              " must be contiguous float32 [", n, "], or empty");
  return t.data_ptr<float>();
}

const float* required_vector(const at::Tensor& t, int64_t n, const char* what) {
  const float* v = optional_vector(t, n, what);
  TORCH_CHECK(v != nullptr, "decode_layer: the layer needs its ", what);
  return v;
}

// A router's score: a row of x against an expert's row of its weight, vectorized (gpt-oss-20b scores
// 32 experts of 2880 a row and layer).
float router_dot(const float* x, const float* w, int64_t dim, bool avx2) {
#ifdef HYPERSERVE_X86
  if (avx2 && dim % 8 == 0) return dot_avx2(x, w, dim);
#endif
  return dot_portable(x, w, dim);
}

// h [rows, dim] += the mixture of experts' output for x [rows, dim] (normed): each row's router
// scores (router [experts, dim] float32, plus its bias) through a softmax, its top_k experts (their
// weights renormalised to sum to one where asked), then each chosen expert (gate_up and down packed as
// the dense MLP's, with their biases) once over all of its rows, in expert order, rows in row order:
// the order the PyTorch layer (layers/moe.py) adds them in. `mlp`: the layer's weights from kMlp.
void moe_mlp(const float* x, int64_t rows, int64_t dim, at::TensorList mlp, const Activation& act, float* h,
             LayerBuffers& buffers, Isa isa, bool avx2) {
  const at::Tensor &router = mlp[0], &routing = mlp[2];
  const at::TensorList experts = mlp.slice(kMoeHeaderWeights);
  const int64_t num_experts = router.size(0);
  TORCH_CHECK(router.is_contiguous() && router.size(1) == dim && routing.scalar_type() == at::kLong &&
                  routing.numel() == 2 && static_cast<int64_t>(experts.size()) == 2 * num_experts,
              "decode_layer: a mixture of experts takes its router [experts, dim] and its bias, its routing "
              "(top_k, renormalize), its experts' biases and each expert's gate_up and down");
  const int64_t top_k = routing.data_ptr<int64_t>()[0];
  const bool renormalize = routing.data_ptr<int64_t>()[1] != 0;
  TORCH_CHECK(top_k >= 1 && top_k <= num_experts, "decode_layer: top_k out of range");
  const float* router_bias = optional_vector(mlp[1], num_experts, "router bias");
  std::vector<float> scores(rows * num_experts);
  const float* gate = router.data_ptr<float>();
  parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* row = scores.data() + r * num_experts;
      float top = -INFINITY, total = 0.f;
      for (int64_t e = 0; e < num_experts; ++e) {
        row[e] = router_dot(x + r * dim, gate + e * dim, dim, avx2) + (router_bias != nullptr ? router_bias[e] : 0.f);
        top = std::max(top, row[e]);
      }
      for (int64_t e = 0; e < num_experts; ++e) total += row[e] = std::exp(row[e] - top);
      for (int64_t e = 0; e < num_experts; ++e) row[e] /= total;
    }
  });
  // each expert's (row, weight) pairs, rows in order
  std::vector<std::vector<std::pair<int64_t, float>>> chosen(num_experts);
  std::vector<int64_t> order(num_experts);
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = scores.data() + r * num_experts;
    for (int64_t e = 0; e < num_experts; ++e) order[e] = e;
    std::partial_sort(order.begin(), order.begin() + top_k, order.end(),
                      [&](int64_t a, int64_t b) { return row[a] > row[b] || (row[a] == row[b] && a < b); });
    float kept = 0.f;
    for (int64_t i = 0; i < top_k; ++i) kept += row[order[i]];
    for (int64_t i = 0; i < top_k; ++i) {
      chosen[order[i]].emplace_back(r, renormalize ? row[order[i]] / kept : row[order[i]]);
    }
  }
  // the experts' biases, [experts, 2 width] and [experts, dim] (or empty: none)
  const at::Tensor &gate_up_biases = mlp[3], &down_biases = mlp[4];
  for (const at::Tensor* b : {&gate_up_biases, &down_biases}) {
    TORCH_CHECK(b->numel() == 0 || (b->scalar_type() == at::kFloat && b->is_contiguous() && b->dim() == 2 &&
                                    b->size(0) == num_experts),
                "decode_layer: the experts' biases must be contiguous float32 [experts, features], or empty");
  }
  float* sums = buffers.projected.data();  // [rows, dim], free once attention's output is added
  std::fill_n(sums, rows * dim, 0.f);
  for (int64_t e = 0; e < num_experts; ++e) {
    const int64_t n = static_cast<int64_t>(chosen[e].size());
    if (n == 0) continue;
    const QuantizedWeight gate_up = projection(experts[2 * e], dim);
    const int64_t width = gate_up.out_features / 2;
    const QuantizedWeight down = projection(experts[2 * e + 1], width);
    TORCH_CHECK(down.out_features == dim && (gate_up_biases.numel() == 0 || gate_up_biases.size(1) == 2 * width) &&
                    (down_biases.numel() == 0 || down_biases.size(1) == dim),
                "decode_layer: an expert's down projection (and bias) must give dim features");
    std::vector<float>&in = buffers.expert_in, &wide = buffers.expert_wide, &out = buffers.expert_out;
    in.resize(n * std::max(dim, width)), wide.resize(n * 2 * width), out.resize(n * dim);
    for (int64_t i = 0; i < n; ++i) std::copy_n(x + chosen[e][i].first * dim, dim, in.data() + i * dim);
    quantized_matmul(gate_up, in.data(), n, wide.data(), isa);
    add_bias(wide.data(), gate_up_biases.numel() ? gate_up_biases.data_ptr<float>() + e * 2 * width : nullptr, n,
             2 * width);
    gated_rows(wide.data(), n, width, in.data(), avx2, act);
    quantized_matmul(down, in.data(), n, out.data(), isa);
    add_bias(out.data(), down_biases.numel() ? down_biases.data_ptr<float>() + e * dim : nullptr, n, dim);
    for (int64_t i = 0; i < n; ++i) {
      const auto [r, weight] = chosen[e][i];
      for (int64_t j = 0; j < dim; ++j) sums[r * dim + j] += weight * out[i * dim + j];
    }
  }
  add_rows(h, sums, rows, dim);
}

// hidden [rows, dim] (float32, updated in place) through one Llama decoder layer, one new token
// per row. weights: the layer's, in the slots of LayerSlot. K/V caches are [slots, kv_heads, head_dim]
// in float32, bfloat16 or float16; token t of row r lives at slot
// block_tables[r][t / block_size] * block_size + t % block_size; with batch.window, row r attends
// to its last `window` positions only. lora: for each adapter of the step, A and B (as LoRAWeights
// says) of qkv, o, gate_up and down; lora_rows: each row's adapter, an index into them (-1: none).
// `gelu`: the MLP gates with GELU (tanh) rather than SiLU (Gemma's). The batch is checked already.
void run_decode_layer(at::Tensor hidden, at::TensorList weights, const at::Tensor& cos, const at::Tensor& signed_sin,
                      at::Tensor key_cache, at::Tensor value_cache, const DecodeBatch& batch, int64_t num_heads,
                      int64_t num_kv_heads, double eps, double scale, at::TensorList lora,
                      const at::Tensor& lora_rows, LayerBuffers& buffers, bool gelu = false) {
  const int64_t count = layer_weight_count(weights, 0);
  const bool moe = count != kMlp + kDenseMlpWeights;
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == count,
              "decode_layer: expected the layer's weights in LayerSlot's order, then its dense MLP or mixture "
              "of experts");
  TORCH_CHECK(hidden.scalar_type() == at::kFloat && hidden.is_contiguous() && hidden.dim() == 2,
              "decode_layer: hidden must be contiguous float32 [rows, dim]");
  TORCH_CHECK(key_cache.sizes() == value_cache.sizes() && key_cache.scalar_type() == value_cache.scalar_type() &&
                  key_cache.is_contiguous() && value_cache.is_contiguous() && key_cache.dim() == 3 &&
                  key_cache.size(1) == num_kv_heads && num_kv_heads > 0 && num_heads % num_kv_heads == 0,
              "decode_layer: K/V caches must be contiguous [slots, kv_heads, head_dim] of one dtype");
  const int64_t rows = hidden.size(0), dim = hidden.size(1), head_dim = key_cache.size(2);
  const int64_t qkv_features = (num_heads + 2 * num_kv_heads) * head_dim;
  const float* input_norm = required_vector(weights[kInputNorm], dim, "input norm");
  const float* mlp_norm = required_vector(weights[kMlpNorm], dim, "norm before the MLP");
  const float* attention_out_norm = optional_vector(weights[kAttentionOutNorm], dim, "attention's output norm");
  const float* mlp_out_norm = optional_vector(weights[kMlpOutNorm], dim, "the MLP's output norm");
  const float* q_norm = optional_vector(weights[kQNorm], head_dim, "q norm");
  const float* k_norm = optional_vector(weights[kKNorm], head_dim, "k norm");
  TORCH_CHECK((q_norm == nullptr) == (k_norm == nullptr), "decode_layer: q and k norms come together");
  const float* qkv_bias = optional_vector(weights[kQkvBias], qkv_features, "qkv bias");
  const float* o_bias = optional_vector(weights[kOBias], dim, "o bias");
  DecodeBatch attending = batch;
  attending.sinks = optional_vector(weights[kSinks], num_heads, "sinks");
  Activation act{gelu};
  if (weights[kActivation].numel() > 0) {
    const float* limits = required_vector(weights[kActivation], 2, "activation (alpha, limit)");
    act.alpha = limits[0], act.limit = limits[1];
    TORCH_CHECK(act.limit > 0.f && !gelu, "decode_layer: the clamped SwiGLU needs a positive limit, and SiLU");
  }
  const QuantizedWeight qkv = projection(weights[kQkv], dim);
  const QuantizedWeight o = projection(weights[kO], num_heads * head_dim);
  QuantizedWeight gate_up{}, down{};
  const float *gate_up_bias = nullptr, *down_bias = nullptr;
  int64_t intermediate = 0;  // the dense MLP's; each expert's weights are read as it runs
  if (!moe) {
    gate_up = projection(weights[kMlp], dim);
    intermediate = gate_up.out_features / 2;
    gate_up_bias = optional_vector(weights[kMlp + 1], 2 * intermediate, "gate_up bias");
    down = projection(weights[kMlp + 2], intermediate);
    down_bias = optional_vector(weights[kMlp + 3], dim, "down bias");
  }
  TORCH_CHECK(head_dim % 2 == 0 && qkv.out_features == qkv_features && o.out_features == dim &&
                  (moe || down.out_features == dim),
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
  buffers.fit(rows, dim, intermediate, std::max(qkv_features, 2 * intermediate), num_heads * head_dim);
  std::vector<float>&x = buffers.x, &wide = buffers.wide, &attended = buffers.attended,
                     &projected = buffers.projected;

  rms_norm(h, input_norm, rows, dim, static_cast<float>(eps), x.data());
  quantized_matmul(qkv, x.data(), rows, wide.data(), isa);
  add_bias(wide.data(), qkv_bias, rows, qkv_features);
  lora_add(lora_qkv, lora_dtype, row_adapter, x.data(), rows, dim, wide.data(), qkv_features, qkv_offsets, avx2);
  if (q_norm != nullptr) {  // in place: each head of q, then of k, is a row of head_dim
    for (int64_t r = 0; r < rows; ++r) {
      float* q = wide.data() + r * qkv_features;
      rms_norm(q, q_norm, num_heads, head_dim, static_cast<float>(eps), q);
      float* k = q + num_heads * head_dim;
      rms_norm(k, k_norm, num_kv_heads, head_dim, static_cast<float>(eps), k);
    }
  }
  const auto attend_all = [&](auto* keys, auto* values) {
    decode_attention(wide.data(), rows, num_heads, num_kv_heads, head_dim, cos.data_ptr<float>(),
                     signed_sin.data_ptr<float>(), static_cast<float>(scale), keys, values, attending,
                     attended.data(), avx2);
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
  add_bias(projected.data(), o_bias, rows, dim);
  lora_add(lora_o, lora_dtype, row_adapter, attended.data(), rows, num_heads * head_dim, projected.data(), dim,
           {0, dim}, avx2);
  const auto add_output = [&](const float* norm) {  // h += projected, through its output norm if any
    if (norm != nullptr) rms_norm(projected.data(), norm, rows, dim, static_cast<float>(eps), projected.data());
    add_rows(h, projected.data(), rows, dim);
  };
  add_output(attention_out_norm);

  rms_norm(h, mlp_norm, rows, dim, static_cast<float>(eps), x.data());
  if (moe) {
    for (const std::vector<LoRAWeights>* adapters : {&lora_gate_up, &lora_down}) {
      for (const LoRAWeights& w : *adapters) TORCH_CHECK(w.a == nullptr, "decode_layer: experts take no LoRA");
    }
    TORCH_CHECK(mlp_out_norm == nullptr, "decode_layer: a mixture of experts takes no output norm");
    return moe_mlp(x.data(), rows, dim, weights.slice(kMlp), act, h, buffers, isa, avx2);
  }
  quantized_matmul(gate_up, x.data(), rows, wide.data(), isa);
  add_bias(wide.data(), gate_up_bias, rows, 2 * intermediate);
  lora_add(lora_gate_up, lora_dtype, row_adapter, x.data(), rows, dim, wide.data(), 2 * intermediate,
           {0, intermediate, 2 * intermediate}, avx2);
  gated_rows(wide.data(), rows, intermediate, x.data(), avx2, act);
  quantized_matmul(down, x.data(), rows, projected.data(), isa);
  add_bias(projected.data(), down_bias, rows, dim);
  lora_add(lora_down, lora_dtype, row_adapter, x.data(), rows, intermediate, projected.data(), dim, {0, dim}, avx2);
  add_output(mlp_out_norm);
}

// decode_layer as an op: checks the batch, then runs the layer. sliding_window: the layer's (0: none);
// softcap: its cap on the attention scores (0: none).
void decode_layer(at::Tensor hidden, at::TensorList weights, const at::Tensor& cos, const at::Tensor& signed_sin,
                  at::Tensor key_cache, at::Tensor value_cache, const at::Tensor& slots, const at::Tensor& block_tables,
                  const at::Tensor& lengths, int64_t block_size, int64_t num_heads, int64_t num_kv_heads, double eps,
                  double scale, at::TensorList lora, const at::Tensor& lora_rows, int64_t sliding_window, bool gelu,
                  double softcap) {
  TORCH_CHECK(hidden.dim() == 2, "decode_layer: hidden must be contiguous float32 [rows, dim]");
  TORCH_CHECK(sliding_window >= 0, "decode_layer: sliding_window must be 0 (none) or positive");
  TORCH_CHECK(softcap >= 0, "decode_layer: softcap must be 0 (none) or positive");
  DecodeBatch batch = checked_batch(slots, block_tables, lengths, hidden.size(0), block_size, key_cache.size(0));
  batch.window = sliding_window;
  batch.softcap = static_cast<float>(softcap);
  LayerBuffers buffers;
  run_step([&] {
    run_decode_layer(hidden, weights, cos, signed_sin, key_cache, value_cache, batch, num_heads, num_kv_heads, eps,
                     scale, lora, lora_rows, buffers, gelu);
  });
}

// Every layer of a model through decode_layer in one call, without LoRA: weights holds each layer's
// (as decode_layer takes them) in turn, key_caches and value_caches one per layer. One dispatch from Python per step rather
// than one per layer.
void decode_layers(at::Tensor hidden, at::TensorList weights, const at::Tensor& cos, const at::Tensor& signed_sin,
                   at::TensorList key_caches, at::TensorList value_caches, const at::Tensor& slots,
                   const at::Tensor& block_tables, const at::Tensor& lengths, int64_t block_size, int64_t num_heads,
                   int64_t num_kv_heads, double eps, double scale) {
  const size_t layers = key_caches.size();
  std::vector<int64_t> first{0};  // where each layer's weights start
  for (size_t i = 0; i < layers; ++i) first.push_back(first.back() + layer_weight_count(weights, first.back()));
  TORCH_CHECK(layers > 0 && value_caches.size() == layers && first.back() == static_cast<int64_t>(weights.size()) &&
                  hidden.dim() == 2,
              "decode_layers: each layer's weights (as decode_layer takes them) and one K and V cache per layer");
  for (size_t i = 0; i < layers; ++i) {
    TORCH_CHECK(key_caches[i].size(0) == key_caches[0].size(0), "decode_layers: every layer's cache has one size");
  }
  const DecodeBatch batch =
      checked_batch(slots, block_tables, lengths, hidden.size(0), block_size, key_caches[0].size(0));
  LayerBuffers buffers;
  run_step([&] {
    for (size_t i = 0; i < layers; ++i) {
      run_decode_layer(hidden, weights.slice(first[i], first[i + 1] - first[i]), cos, signed_sin, key_caches[i], value_caches[i], batch,
                       num_heads, num_kv_heads, eps, scale, {}, at::Tensor(), buffers);
    }
  });
}

}  // namespace
