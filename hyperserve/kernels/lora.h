// LoRA adapters on a projection of the decode step, each row its own adapter.

#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

#include "isa.h"
#include "step_team.h"

namespace {

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

}  // namespace
