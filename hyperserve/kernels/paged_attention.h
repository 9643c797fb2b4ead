// Attention of each new token over its sequence's paged K/V (alone, or in tiles of a sequence's
// consecutive tokens), and the elementwise pieces of a layer (exp, SiLU, rotary embedding) that the
// decoder layer shares with it.

#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
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

AVX2 void gelu_mul_avx2(const float* gate, const float* up, float* out, int64_t n, int64_t& j) {
  const __m256 one = _mm256_set1_ps(1.f), minus_k2 = _mm256_set1_ps(-2.f * 0.7978845608f);
  const __m256 cubic = _mm256_set1_ps(0.044715f);
  for (; j + 8 <= n; j += 8) {
    const __m256 x = _mm256_loadu_ps(gate + j);
    const __m256 u = _mm256_fmadd_ps(_mm256_mul_ps(cubic, x), _mm256_mul_ps(x, x), x);  // x + 0.044715 x^3
    const __m256 sigmoid = _mm256_div_ps(one, _mm256_add_ps(one, exp_avx2(_mm256_mul_ps(minus_k2, u))));
    _mm256_storeu_ps(out + j, _mm256_mul_ps(_mm256_mul_ps(x, sigmoid), _mm256_loadu_ps(up + j)));
  }
}

AVX2 void clamped_swiglu_mul_avx2(const float* gate, const float* up, float* out, int64_t n, float alpha, float limit,
                                  int64_t& j) {
  const __m256 one = _mm256_set1_ps(1.f), high = _mm256_set1_ps(limit), low = _mm256_set1_ps(-limit);
  const __m256 minus_alpha = _mm256_set1_ps(-alpha);
  for (; j + 8 <= n; j += 8) {
    const __m256 g = _mm256_min_ps(_mm256_loadu_ps(gate + j), high);
    const __m256 u = _mm256_max_ps(_mm256_min_ps(_mm256_loadu_ps(up + j), high), low);
    const __m256 sigmoid = _mm256_div_ps(one, _mm256_add_ps(one, exp_avx2(_mm256_mul_ps(minus_alpha, g))));
    _mm256_storeu_ps(out + j, _mm256_mul_ps(_mm256_mul_ps(g, sigmoid), _mm256_add_ps(u, one)));
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
  float softcap = 0.f;  // scores capped to softcap * tanh(score / softcap) (Gemma 2); 0: not capped

  SlotCursor slots_from(int64_t t) const { return SlotCursor(block_table, block_size, t); }

  // fn(i, offset of token begin + i's vector) for the tokens begin..end-1.
  template <typename Fn>
  void for_each_token(int64_t begin, int64_t end, int64_t kv_head, Fn fn) const {
    SlotCursor slots = slots_from(begin);
    for (int64_t t = begin; t < end; ++t) fn(t - begin, (slots.next() * num_kv_heads + kv_head) * head_dim);
  }
};

// Gemma 2's cap on n scores and on their largest, `best` (tanh keeps their order): s = cap * tanh(s / cap).
// cap 0: none.
inline void cap_scores(float* scores, int64_t n, float& best, float cap) {
  if (cap <= 0.f) return;
  for (int64_t i = 0; i < n; ++i) scores[i] = cap * std::tanh(scores[i] / cap);
  best = cap * std::tanh(best / cap);
}

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

// out[j] = gelu(gate[j]) * up[j] for j < n, GELU's tanh approximation (Gemma's MLP), written as
// x * sigmoid(2 u) with u = sqrt(2 / pi) (x + 0.044715 x^3), since 0.5 (1 + tanh u) = sigmoid(2 u).
void gelu_mul(const float* gate, const float* up, float* out, int64_t n, bool avx2) {
  constexpr float k2 = 2.f * 0.7978845608f, cubic = 0.044715f;
  int64_t j = 0;
#ifdef HYPERSERVE_X86
  if (avx2) gelu_mul_avx2(gate, up, out, n, j);
#endif
  for (; j < n; ++j) {
    const float x = gate[j];
    out[j] = x / (1.f + std::exp(-k2 * (x + cubic * x * x * x))) * up[j];
  }
}

// out[j] = g sigmoid(alpha g) (u + 1) for j < n, g = gate[j] clamped above at limit and u = up[j] to
// [-limit, limit]: GPT-OSS's SwiGLU (models/gpt_oss.py's ClampedSwiGLU).
void clamped_swiglu_mul(const float* gate, const float* up, float* out, int64_t n, float alpha, float limit,
                        bool avx2) {
  int64_t j = 0;
#ifdef HYPERSERVE_X86
  if (avx2) clamped_swiglu_mul_avx2(gate, up, out, n, alpha, limit, j);
#endif
  for (; j < n; ++j) {
    const float g = std::min(gate[j], limit), u = std::clamp(up[j], -limit, limit);
    out[j] = g / (1.f + std::exp(-alpha * g)) * (u + 1.f);
  }
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

// scores[i] = exp(scores[i] - best) for i < n; returns their sum, in the same order for any caller.
AVX2 inline float exp_scores(float* scores, int64_t n, float best) {
  int64_t i = 0;
  float total = exp_shifted_avx2(scores, n, best, i);
  for (; i < n; ++i) total += scores[i] = std::exp(scores[i] - best);
  return total;
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
    best[g] = hmax(largest[g]);
    cap_scores(own, span, best[g], kv.softcap);
    total[g] = exp_scores(own, span, best[g]);
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

// ---- rows of one sequence at consecutive positions, attending together ----
//
// A prefill chunk's tokens, or a verify step's k + 1, each attend to the same cached K/V (all but
// the last few positions). Row by row, each row widened every key and value again for its few query
// heads, and an 8,000-token prompt took a task per row, K/V head and span. A tile of up to
// kTileQueries queries (rows x the K/V head's query heads) widens a span's keys and values to
// float32 once, a chunk at a time, and scores and weighs them from L1 (AVX2 code paths, 2-core
// Intel VM: an 8,000-token prefill 1.31x as fast; attention had taken half of a 2,048-token one).
// Each (query, token) score, the softmax and each output lane are the same chains of multiply-adds
// in the same order as attend_span_avx2's, with the same reduction tree, so a token's numbers do
// not depend on whether it was computed in a tile or alone (weights past a query's context are 0,
// and adding 0 leaves a sum's bits as they are).
constexpr int64_t kTileQueries = 54;  // SmolLM2: 18 rows of its 3 query heads a K/V head (a verify step's 17)
constexpr int64_t kMinTileRows = 4;   // a run is split among the threads into tiles no smaller

constexpr int64_t kTilePitch = kAttentionSpan + 8;  // a query's scores in a tile (8-float stores)
constexpr int64_t kChunkFloats = 4096;  // a chunk of widened keys or values: 16 KB, in L1 while it is used

// Eight 8-lane sums -> [sum a, ..., sum h], each reduced by hsum3's tree: ((0+1)+(2+3))+((4+5)+(6+7)).
AVX2 inline __m256 hsum8(const __m256 (&v)[8]) {
  const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 efgh = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(abcd, efgh, 0x20), _mm256_permute2f128_ps(abcd, efgh, 0x31));
}

// Q queries (1, 2, 4 or 8) against `tokens` widened keys [tokens, d] -> scores[m * kTilePitch + t], 8 / Q
// tokens at a time (the last group repeats its last token, whose lanes are never read).
template <int Q>
AVX2 void score_tile(const float* const* queries, const float* keys, int64_t d, int64_t tokens, float* scores) {
  static_assert(8 % Q == 0, "eight sums a reduction");
  constexpr int kTokens = 8 / Q;
  for (int64_t t = 0; t < tokens; t += kTokens) {
    const float* k[kTokens];
    for (int i = 0; i < kTokens; ++i) k[i] = keys + std::min(t + i, tokens - 1) * d;
    __m256 acc[8];
    for (int a = 0; a < 8; ++a) acc[a] = _mm256_setzero_ps();
    for (int64_t j = 0; j < d; j += 8) {
      for (int m = 0; m < Q; ++m) {
        const __m256 query = _mm256_loadu_ps(queries[m] + j);
        for (int i = 0; i < kTokens; ++i) {
          acc[m * kTokens + i] = _mm256_fmadd_ps(query, _mm256_loadu_ps(k[i] + j), acc[m * kTokens + i]);
        }
      }
    }
    const __m256 sums = hsum8(acc);
    if constexpr (Q == 1) {
      _mm256_storeu_ps(scores + t, sums);
    } else {
      _mm_storeu_ps(scores + t, _mm256_castps256_ps128(sums));
      _mm_storeu_ps(scores + kTilePitch + t, _mm256_extractf128_ps(sums, 1));
    }
  }
}

// outs[m] [d] (+)= sum over t < tokens of weights[m * kTilePitch + t] * values[t], 32 lanes at a time:
// `first` starts the sums at 0, otherwise they go on from outs.
template <int Q>
AVX2 void weigh_tile(const float* weights, const float* values, int64_t d, int64_t tokens, bool first,
                     float* const* outs) {
  constexpr int kVectors = 4;
  for (int64_t c = 0; c < d; c += 8 * kVectors) {
    __m256 acc[Q][kVectors];
    for (int m = 0; m < Q; ++m)
      for (int j = 0; j < kVectors; ++j) acc[m][j] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(outs[m] + c + 8 * j);
    for (int64_t t = 0; t < tokens; ++t) {
      __m256 v[kVectors];
      for (int j = 0; j < kVectors; ++j) v[j] = _mm256_loadu_ps(values + t * d + c + 8 * j);
      for (int m = 0; m < Q; ++m) {
        const __m256 weight = _mm256_set1_ps(weights[m * kTilePitch + t]);
        for (int j = 0; j < kVectors; ++j) acc[m][j] = _mm256_fmadd_ps(weight, v[j], acc[m][j]);
      }
    }
    for (int m = 0; m < Q; ++m)
      for (int j = 0; j < kVectors; ++j) _mm256_storeu_ps(outs[m] + c + 8 * j, acc[m][j]);
  }
}

// kernel(Q, m) over queries [m, count): Max at a time, then fewer.
template <int Max, typename Kernel>
AVX2 void in_groups(int64_t count, const Kernel& kernel, int64_t m = 0) {
  for (; m + Max <= count; m += Max) kernel(std::integral_constant<int, Max>(), m);
  if constexpr (Max > 1) in_groups<Max - 1>(count, kernel, m);
}

struct AttentionTile {  // queries of one K/V head over one span [begin, ...): query m sees tokens[m] of it
  const float* const* queries;
  const int64_t* tokens;
  int64_t count, begin, kv_head;
  float* const* outs;  // query m's unnormalised output [D], then its largest score and its sum of exps
};

// A tile's keys and then its values, fetched kTileFetchAhead tokens ahead of their widening: read
// just before use, a K/V head's strided vectors came from memory at a third of what one row's span
// (kKeysAhead) reads.
constexpr int64_t kTileFetchAhead = 64;

template <typename T>
struct TileFetch {
  const T* heads[2];  // the K/V head's keys, values
  const PagedKV& kv;
  int64_t begin, tokens, issued = 0;  // of 2 * tokens: the keys', then the values'
  SlotCursor cursor;

  TileFetch(const T* const (&passes)[2], const PagedKV& paged, int64_t from, int64_t count)
      : heads{passes[0], passes[1]}, kv(paged), begin(from), tokens(count), cursor(paged.slots_from(from)) {}

  void until(int64_t end) {  // every vector before `end` of the two passes fetched
    for (end = std::min(end, 2 * tokens); issued < end; ++issued) {
      if (issued == tokens) cursor = kv.slots_from(begin);
      prefetch_vector(heads[issued >= tokens] + cursor.next() * kv.num_kv_heads * kv.head_dim,
                      kv.head_dim * sizeof(T));
    }
  }
};

// The next `count` tokens' vectors of a K or V head (`base`) from the cursor on, widened into
// `wide`; `done` of the tile's two passes come before them.
template <typename T>
AVX2 void widen(const T* base, const PagedKV& kv, SlotCursor& cursor, int64_t count, float* wide, TileFetch<T>& fetch,
                int64_t done) {
  const int64_t d = kv.head_dim, stride = kv.num_kv_heads * d;
  for (int64_t t = 0; t < count; ++t) {
    fetch.until(done + t + kTileFetchAhead);
    const T* vector = base + cursor.next() * stride;
    for (int64_t j = 0; j < d; j += 8) _mm256_storeu_ps(wide + t * d + j, load8(vector + j));
  }
}

// The tile's keys and values are widened a chunk at a time, each chunk used by every query while it
// is in L1: the scores of all tokens first, then the weighted values.
template <typename T>
AVX2 void attend_tile_avx2(const AttentionTile& tile, const T* keys, const T* values, const PagedKV& kv) {
  const int64_t d = kv.head_dim, chunk = std::max<int64_t>(8, kChunkFloats / d);
  const int64_t tokens = *std::max_element(tile.tokens, tile.tokens + tile.count);
  // One buffer a thread: the widened chunk, then the scores. As two vectors, each resized on its own,
  // a 17-row step after a longer tile's took 17 rather than 13.7 ms, and stayed there (their placement
  // against each other, 4K aliasing of the chunk's loads and the scores' stores the likely cause).
  thread_local std::vector<float> buffer;
  const size_t wide_floats = chunk * d, floats = wide_floats + tile.count * kTilePitch;
  if (buffer.size() < floats) buffer.resize(std::max<size_t>(floats, kChunkFloats + kTileQueries * kTilePitch));
  float* const wide = buffer.data();
  float* const scores = wide + wide_floats;
  const T* const heads[2] = {keys + tile.kv_head * d, values + tile.kv_head * d};
  TileFetch<T> fetch(heads, kv, tile.begin, tokens);
  SlotCursor cursor = kv.slots_from(tile.begin);
  for (int64_t t = 0; t < tokens; t += chunk) {
    const int64_t n = std::min(chunk, tokens - t);
    widen(heads[0], kv, cursor, n, wide, fetch, t);
    in_groups<2>(tile.count, [&](auto q, int64_t m) {
      score_tile<decltype(q)::value>(tile.queries + m, wide, d, n, scores + m * kTilePitch + t);
    });
  }
  for (int64_t m = 0; m < tile.count; ++m) {
    float* own = scores + m * kTilePitch;
    const int64_t n = tile.tokens[m];
    __m256 largest = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    int64_t t = 0;
    for (; t + 8 <= n; t += 8) largest = _mm256_max_ps(largest, _mm256_loadu_ps(own + t));
    float best = hmax(largest);
    for (; t < n; ++t) best = std::max(best, own[t]);
    cap_scores(own, n, best, kv.softcap);
    tile.outs[m][d] = best;
    tile.outs[m][d + 1] = exp_scores(own, n, best);
    std::fill(own + n, own + tokens, 0.f);
  }
  cursor = kv.slots_from(tile.begin);
  for (int64_t t = 0; t < tokens; t += chunk) {
    const int64_t n = std::min(chunk, tokens - t);
    widen(heads[1], kv, cursor, n, wide, fetch, tokens + t);
    in_groups<2>(tile.count, [&](auto q, int64_t m) {
      weigh_tile<decltype(q)::value>(scores + m * kTilePitch + t, wide, d, n, t == 0, tile.outs + m);
    });
  }
}

// out [D] = the softmax-weighted sum over a head's spans (each: out [D], best, total, `pitch`
// floats apart), combined in span order; `sink`: the head's sink logit, a score without a value in
// the softmax (-inf: none).
void combine_spans(const float* spans, int64_t count, int64_t pitch, int64_t d, const float* best,
                   const float* total, float sink, float* out) {
  float top = std::max(sink, best[0]);
  for (int64_t s = 1; s < count; ++s) top = std::max(top, best[s * pitch]);
  float denominator = std::exp(sink - top);
  std::fill(out, out + d, 0.f);
  for (int64_t s = 0; s < count; ++s) {
    const float weight = std::exp(best[s * pitch] - top);
    denominator += weight * total[s * pitch];
    for (int64_t j = 0; j < d; ++j) out[j] += weight * spans[s * pitch + j];
  }
  for (int64_t j = 0; j < d; ++j) out[j] /= denominator;
}
#endif

// q [D] (rotated, scaled) of one head against positions begin..end-1 -> out [D]: scores, softmax
// (with the head's sink logit, -inf: none), weighted sum of values. `scores` has room for end - begin
// floats.
template <typename T, typename Dot, typename Axpy>
void attend_with(Dot dot, Axpy axpy, const float* q, const T* keys, const T* values, const PagedKV& kv,
                 int64_t begin, int64_t end, int64_t kv_head, float sink, float* scores, float* out, bool avx2) {
  const int64_t d = kv.head_dim, length = end - begin;
  kv.for_each_token(begin, end, kv_head,
                    [&](int64_t i, int64_t offset) { scores[i] = dot(q, keys + offset, d); });
  float best = *std::max_element(scores, scores + length);
  cap_scores(scores, length, best, kv.softcap);
  best = std::max(best, sink);
  const float total = exp_shifted(scores, length, best, avx2) + std::exp(sink - best);
  std::fill(out, out + d, 0.f);
  kv.for_each_token(begin, end, kv_head,
                    [&](int64_t i, int64_t offset) { axpy(scores[i] / total, values + offset, out, d); });
}

template <typename T>
void attend(const float* q, const T* keys, const T* values, const PagedKV& kv, int64_t begin, int64_t end,
            int64_t kv_head, float sink, float* scores, float* out, bool avx2) {
#ifdef HYPERSERVE_X86
  if (avx2) {
    return attend_with(dot_avx2<T>, axpy_avx2<T>, q, keys, values, kv, begin, end, kv_head, sink, scores, out,
                       avx2);
  }
#endif
  attend_with(dot_portable<T>, axpy_portable<T>, q, keys, values, kv, begin, end, kv_head, sink, scores, out,
              avx2);
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
  int64_t window = 0;  // a sliding window: each token attends to its last `window` positions (0: all)
  float softcap = 0.f;  // the attention scores' cap (Gemma 2's; 0: none)
  const float* sinks = nullptr;  // each query head's sink logit (GPT-OSS's; nullptr: none)

  // The first position token r attends to.
  int64_t first(int64_t r) const { return window > 0 ? std::max<int64_t>(0, lengths[r] - window) : 0; }
  float sink(int64_t head) const { return sinks != nullptr ? sinks[head] : -INFINITY; }
};

// qkv [rows, (H + 2 Hkv) D] -> out [rows, H D]: rotates q and k, stores k and v at each token's
// slot, then attends every query head over its sequence's cached K/V.
template <typename T>
void decode_attention(float* qkv, int64_t rows, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                      const float* cos, const float* signed_sin, float scale, T* keys, T* values,
                      const DecodeBatch& batch, float* out, bool avx2) {
  const int64_t width = (num_heads + 2 * num_kv_heads) * head_dim, kv_width = num_kv_heads * head_dim;
  parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {  // each row writes its own slot
    for (int64_t r = begin; r < end; ++r) {
      float* q = qkv + r * width;
      rotate(q, num_heads + num_kv_heads, head_dim, cos + r * head_dim, signed_sin + r * head_dim);
      const float* k = q + num_heads * head_dim;
      for (int64_t j = 0; j < kv_width; ++j) {
        keys[batch.slots[r] * kv_width + j] = static_cast<T>(k[j]);
        values[batch.slots[r] * kv_width + j] = static_cast<T>(k[kv_width + j]);
      }
      for (int64_t j = 0; j < num_heads * head_dim; ++j) q[j] *= scale;
    }
  });
#ifdef HYPERSERVE_X86
  if (avx2 && head_dim % 64 == 0) {
    // Tasks of one span of a K/V head's context each: for a row alone, up to 3 of the query heads
    // sharing the K/V head (even one row's 3 K/V heads of 3 query heads, SmolLM2, make several tasks
    // once its context passes one span); for a run of rows of one sequence at consecutive positions,
    // a tile of rows and all those query heads.
    const int64_t group = num_heads / num_kv_heads;
    const int64_t per_task = std::min(kMaxHeadsPerTask, group);
    const int64_t tile_rows = std::max<int64_t>(2, kTileQueries / group);
    const int64_t pitch = head_dim + 2;  // a span's floats for one head: out, best, total
    struct Task { int64_t row, rows, kv_head, first_head, heads, span; };  // rows > 1: a tile, all heads
    std::vector<Task> tasks;
    std::vector<int64_t> first_slot(rows * num_heads);  // each (row, head): its first span's partials
    int64_t slots = 0;
    for (int64_t i = 0; i < rows * num_heads; ++i) {
      first_slot[i] = slots;
      slots += spans_of(batch.lengths[i / num_heads]);
    }
    // row r + 1 is row r's sequence one token on, both seeing their context from its start (a tile's
    // rows share each span's first position)
    const auto continues = [&](int64_t r) {
      const int64_t* table = batch.block_tables + r * batch.max_blocks;
      const int64_t blocks = (batch.lengths[r] + batch.block_size - 1) / batch.block_size;
      return batch.lengths[r + 1] == batch.lengths[r] + 1 && batch.first(r + 1) == 0 &&
             std::equal(table, table + blocks, table + batch.max_blocks);
    };
    for (int64_t r = 0, end = 0; r < rows; r = end) {
      for (end = r + 1; end < rows && continues(end - 1); ++end) {}
      // The run in tiles of even size. Where its K/V heads and spans make fewer than two tasks a
      // thread, at least one tile per thread once they would hold kMinTileRows (a verify step's 17
      // rows in one tile would leave one thread with two of SmolLM2's 3 K/V heads, the other with
      // one); with more, as few tiles as hold it, since each tile widens its span's K/V again.
      const int64_t run = end - r, threads = at::get_num_threads();
      const bool few_tasks = num_kv_heads * spans_of(batch.lengths[end - 1]) < 2 * threads;
      const int64_t tiles = std::max((run + tile_rows - 1) / tile_rows,
                                     few_tasks ? std::min<int64_t>(threads, run / kMinTileRows) : 1);
      for_each_even_part(run, tiles, [&](int64_t offset, int64_t count) {
        const int64_t first = r + offset, last = first + count - 1;
        for (int64_t kv_head = 0; kv_head < num_kv_heads; ++kv_head) {  // spans from the window's on
          for (int64_t sp = batch.first(last) / kAttentionSpan; sp < spans_of(batch.lengths[last]); ++sp) {
            if (count > 1) {
              tasks.push_back({first, count, kv_head, kv_head * group, group, sp});
              continue;
            }
            for (int64_t head = kv_head * group; head < (kv_head + 1) * group; head += per_task) {
              tasks.push_back({first, 1, kv_head, head, std::min(per_task, (kv_head + 1) * group - head), sp});
            }
          }
        }
      });
    }
    TORCH_CHECK(head_dim <= kMaxAttentionHeadDim, "decode_layer: head_dim above ", kMaxAttentionHeadDim);
    // kept between calls (a fresh buffer per layer would be page-faulted in every time); it grows to the
    // largest step's rows x spans x heads x (D + 2) floats: 39 MB for a 512-token chunk at 8,000 of context
    thread_local std::vector<float> partials;
    if (static_cast<int64_t>(partials.size()) < slots * pitch) partials.resize(slots * pitch);
    float* parts = partials.data();
    const auto part = [&](int64_t row, int64_t head, int64_t span) {
      return parts + (first_slot[row * num_heads + head] + span) * pitch;
    };
    parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
      float scores[kMaxHeadsPerTask * kScorePitch];
      float out_g[kMaxHeadsPerTask * kMaxAttentionHeadDim], best[kMaxHeadsPerTask], total[kMaxHeadsPerTask];
      std::vector<const float*> queries;
      std::vector<float*> outs;
      std::vector<int64_t> tokens;
      for (int64_t i = begin; i < end; ++i) {
        const Task& task = tasks[i];
        const int64_t last = task.row + task.rows - 1;
        const int64_t from = task.span * kAttentionSpan;
        const PagedKV kv{batch.block_size, num_kv_heads, head_dim, batch.block_tables + last * batch.max_blocks,
                         batch.softcap};
        if (task.rows > 1) {  // the tile's rows whose context reaches this span, each with all the heads
          queries.clear(), outs.clear(), tokens.clear();
          for (int64_t r = task.row; r <= last; ++r) {
            if (batch.lengths[r] <= from) continue;
            for (int64_t h = task.first_head; h < task.first_head + task.heads; ++h) {
              queries.push_back(qkv + r * width + h * head_dim);
              outs.push_back(part(r, h, task.span));
              tokens.push_back(std::min(batch.lengths[r], from + kAttentionSpan) - from);
            }
          }
          const AttentionTile tile{queries.data(), tokens.data(), static_cast<int64_t>(queries.size()), from,
                                   task.kv_head, outs.data()};
          attend_tile_avx2(tile, keys, values, kv);
          continue;
        }
        const int64_t to = std::min(batch.lengths[task.row], from + kAttentionSpan);
        const int64_t begin = std::max(from, batch.first(task.row));
        const float* q = qkv + task.row * width + task.first_head * head_dim;
        static_assert(kMaxHeadsPerTask == 3, "one case per head count");
        const auto span = task.heads == 3 ? attend_span_avx2<T, 3>
                          : task.heads == 2 ? attend_span_avx2<T, 2> : attend_span_avx2<T, 1>;
        span(q, keys, values, kv, begin, to, task.kv_head, scores, out_g, best, total);
        for (int64_t g = 0; g < task.heads; ++g) {
          float* own = part(task.row, task.first_head + g, task.span);
          std::copy(out_g + g * head_dim, out_g + (g + 1) * head_dim, own);
          own[head_dim] = best[g];
          own[head_dim + 1] = total[g];
        }
      }
    });
    parallel_for(0, rows * num_heads, 8, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t r = i / num_heads, skipped = batch.first(r) / kAttentionSpan;  // before the window
        const float* first = parts + (first_slot[i] + skipped) * pitch;
        combine_spans(first, spans_of(batch.lengths[r]) - skipped, pitch, head_dim, first + head_dim,
                      first + head_dim + 1, batch.sink(i % num_heads), out + i * head_dim);
      }
    });
    return;
  }
#endif
  const bool vectorized = avx2 && head_dim % 8 == 0;
  parallel_for(0, rows * num_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(*std::max_element(batch.lengths, batch.lengths + rows));
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = i / num_heads, h = i % num_heads;
      const PagedKV kv{batch.block_size, num_kv_heads, head_dim, batch.block_tables + r * batch.max_blocks,
                       batch.softcap};
      attend<T>(qkv + r * width + h * head_dim, keys, values, kv, batch.first(r), batch.lengths[r],
                h / (num_heads / num_kv_heads), batch.sink(h), scores.data(), out + i * head_dim, vectorized);
    }
  });
}

}  // namespace
