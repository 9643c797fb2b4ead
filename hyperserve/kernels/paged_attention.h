// Attention of one new token per sequence over its paged K/V, and the elementwise pieces of a layer
// (exp, SiLU, rotary embedding) that the decoder layer shares with it.

#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "isa.h"
#include "step_team.h"

namespace {

// ---- attention of one new token per sequence over its paged K/V ----

#ifdef HYPERSERVE_X86
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

// A sequence's cache slots in token order, from token t on: no division per token, whose latency
// once made up most of the attention's time.
struct SlotCursor {
  const int64_t* block_table;
  int64_t block_size, block, offset;

  SlotCursor(const int64_t* table, int64_t size, int64_t t)
      : block_table(table), block_size(size), block(t / size), offset(t % size) {}

  int64_t next() {
    const int64_t slot = block_table[block] * block_size + offset;
    if (++offset == block_size) offset = 0, ++block;
    return slot;
  }
};

struct PagedKV {  // one layer's cache, [slots, kv_heads, head_dim], and one sequence's block table
  int64_t block_size, num_kv_heads, head_dim;
  const int64_t* block_table;

  SlotCursor slots_from(int64_t t) const { return SlotCursor(block_table, block_size, t); }

  // fn(t, offset of token t's vector) for t in 0..length-1.
  template <typename Fn>
  void for_each_token(int64_t length, int64_t kv_head, Fn fn) const {
    SlotCursor slots = slots_from(0);
    for (int64_t t = 0; t < length; ++t) fn(t, (slots.next() * num_kv_heads + kv_head) * head_dim);
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

constexpr int kScoredTogether = 3;  // tokens scored together: 3 x G sums, G queries and a key in registers
constexpr int64_t kScorePitch = kAttentionSpan + 4;  // a head's scores in the span buffer (4-float stores)
constexpr int64_t kKeysAhead = 32;  // tokens between a key's prefetch and its use: ~2 blocks ahead

// Three 8-lane sums -> [sum a, sum b, sum c, sum c], each reduced by the same tree.
AVX2 inline __m128 hsum3(__m256 a, __m256 b, __m256 c) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, c));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

template <typename T>
inline void prefetch_vector(const T* p, int64_t bytes) {
  for (int64_t line = 0; line < bytes; line += 64) __builtin_prefetch(reinterpret_cast<const char*>(p) + line);
}

// One span [begin, end) of G query heads that share one K/V head (G <= kMaxHeadsPerTask), head_dim
// a multiple of 64: q [G, D] -> for each head its scores' largest value (`best`), the sum of exp(score - best)
// (`total`) and the unnormalised sum of exp(score - best) * v (`out` [G, D]); combine_spans makes
// one output of a sequence's spans. Keys are scored three tokens at a time, each score one sum over
// D reduced by a fixed tree, so no reduction waits on another and a score depends on nothing but its
// query and key; each cached vector is widened once for the G heads. A K/V head's vectors are one
// part of each token's record (a third for SmolLM2), a stride the hardware prefetchers follow
// poorly: keys are fetched kKeysAhead tokens ahead, and each token's value as its key is scored, for
// the pass over values (SmolLM2 after 4,000 tokens: 11.4-14.4 -> 9.3 ms a step). A head's numbers do
// not depend on G.
template <typename T, int G>
AVX2 void attend_span_avx2(const float* q, const T* keys, const T* values, const PagedKV& kv, int64_t begin,
                           int64_t end, int64_t kv_head, float* scores, float* out, float* best, float* total) {
  const int64_t d = kv.head_dim, stride = kv.num_kv_heads * d, span = end - begin, bytes = d * sizeof(T);
  const T* key_base = keys + kv_head * d;
  const T* value_base = values + kv_head * d;
  SlotCursor cursor = kv.slots_from(begin), ahead = kv.slots_from(begin);
  for (int64_t t = begin; t < std::min(end, begin + kKeysAhead); ++t) {
    prefetch_vector(key_base + ahead.next() * stride, bytes);
  }
  __m128 largest[G];
  for (int g = 0; g < G; ++g) largest[g] = _mm_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t t = begin; t < end; t += kScoredTogether) {
    const T* k[kScoredTogether];
    for (int i = 0; i < kScoredTogether; ++i) {
      if (t + i >= end) {  // past the span: score the last token again (those lanes are never read)
        k[i] = k[i - 1];
        continue;
      }
      const int64_t slot = cursor.next();
      k[i] = key_base + slot * stride;
      prefetch_vector(value_base + slot * stride, bytes);
      if (t + i + kKeysAhead < end) prefetch_vector(key_base + ahead.next() * stride, bytes);
    }
    __m256 acc[G][kScoredTogether];
    for (int g = 0; g < G; ++g)
      for (int i = 0; i < kScoredTogether; ++i) acc[g][i] = _mm256_setzero_ps();
    for (int64_t j = 0; j < d; j += 8) {
      __m256 query[G];
      for (int g = 0; g < G; ++g) query[g] = _mm256_loadu_ps(q + g * d + j);
      for (int i = 0; i < kScoredTogether; ++i) {
        const __m256 key = load8(k[i] + j);
        for (int g = 0; g < G; ++g) acc[g][i] = _mm256_fmadd_ps(query[g], key, acc[g][i]);
      }
    }
    static_assert(kScoredTogether == 3, "hsum3 reduces three tokens' sums");
    for (int g = 0; g < G; ++g) {  // lanes past the span repeat a score of it, so the maximum holds
      const __m128 three = hsum3(acc[g][0], acc[g][1], acc[g][2]);
      _mm_storeu_ps(scores + g * kScorePitch + t - begin, three);
      largest[g] = _mm_max_ps(largest[g], three);
    }
  }
  for (int g = 0; g < G; ++g) {
    float* own = scores + g * kScorePitch;
    __m128 m = _mm_max_ps(largest[g], _mm_movehl_ps(largest[g], largest[g]));
    best[g] = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
    int64_t i = 0;
    total[g] = exp_shifted_avx2(own, span, best[g], i);
    for (; i < span; ++i) total[g] += own[i] = std::exp(own[i] - best[g]);
  }
  // 8 x kVectors output values per head at a time: G x kVectors sums, G weights and one value
  // vector fill at most the 16 registers (more spilled a sum, and its latency through memory)
  constexpr int kVectors = G == 1 ? 8 : 4;
  for (int64_t c = 0; c < d; c += 8 * kVectors) {
    __m256 acc[G][kVectors];
    for (int g = 0; g < G; ++g)
      for (int j = 0; j < kVectors; ++j) acc[g][j] = _mm256_setzero_ps();
    SlotCursor slots = kv.slots_from(begin);
    for (int64_t t = begin; t < end; ++t) {
      const T* v = value_base + slots.next() * stride + c;
      __m256 weight[G];
      for (int g = 0; g < G; ++g) weight[g] = _mm256_set1_ps(scores[g * kScorePitch + t - begin]);
      for (int j = 0; j < kVectors; ++j) {
        const __m256 value = load8(v + 8 * j);
        for (int g = 0; g < G; ++g) acc[g][j] = _mm256_fmadd_ps(weight[g], value, acc[g][j]);
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
template <typename T, typename Dot, typename Axpy>
void attend_with(Dot dot, Axpy axpy, const float* q, const T* keys, const T* values, const PagedKV& kv,
                 int64_t length, int64_t kv_head, float* scores, float* out, bool avx2) {
  const int64_t d = kv.head_dim;
  kv.for_each_token(length, kv_head, [&](int64_t t, int64_t offset) { scores[t] = dot(q, keys + offset, d); });
  const float best = *std::max_element(scores, scores + length);
  const float total = exp_shifted(scores, length, best, avx2);
  std::fill(out, out + d, 0.f);
  kv.for_each_token(length, kv_head,
                    [&](int64_t t, int64_t offset) { axpy(scores[t] / total, values + offset, out, d); });
}

template <typename T>
void attend(const float* q, const T* keys, const T* values, const PagedKV& kv, int64_t length, int64_t kv_head,
            float* scores, float* out, bool avx2) {
#ifdef HYPERSERVE_X86
  if (avx2) return attend_with(dot_avx2<T>, axpy_avx2<T>, q, keys, values, kv, length, kv_head, scores, out, avx2);
#endif
  attend_with(dot_portable<T>, axpy_portable<T>, q, keys, values, kv, length, kv_head, scores, out, avx2);
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
          const int64_t first = kv_head * group + k * per_task;
          const int64_t heads = std::min(per_task, kv_head * group + group - first);
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
      float scores[kMaxHeadsPerTask * kScorePitch];
      float out_g[kMaxHeadsPerTask * kMaxAttentionHeadDim], best[kMaxHeadsPerTask], total[kMaxHeadsPerTask];
      for (int64_t i = begin; i < end; ++i) {
        const Task& task = tasks[i];
        const int64_t length = batch.lengths[task.row];
        const int64_t from = task.span * kAttentionSpan, to = std::min(length, from + kAttentionSpan);
        const PagedKV kv{batch.block_size, num_kv_heads, head_dim, batch.block_tables + task.row * batch.max_blocks};
        const float* q = qkv + task.row * width + task.first_head * head_dim;
        static_assert(kMaxHeadsPerTask == 3, "one case per head count");
        const auto span = task.heads == 3 ? attend_span_avx2<T, 3>
                          : task.heads == 2 ? attend_span_avx2<T, 2> : attend_span_avx2<T, 1>;
        span(q, keys, values, kv, from, to, task.kv_head, scores, out_g, best, total);
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

}  // namespace
