// Small-batch float32 linear layers for the CPU: y (M, N) = x (M, K) @ W^T (+ bias), with W
// packed once (float32; for a draft's weights bfloat16, widened in registers, or int8 with a
// scale per output feature, applied once to each output) into
// panels of 16 output features, (ceil(N / 16), K, 16): for each k, a panel's 16 weights are
// one AVX-512 vector (two AVX2 ones), so a register tile of R rows x P panels takes one
// broadcast per row and P * 16 / VL vector loads per k. Work is split over groups of P
// panels, so both cores share even a one-row product (MKL runs those on one).
//
// The tile is sized to the registers the CPU has (VL floats a vector): with AVX-512, 4 rows
// x 4 panels (16 of 32 registers hold the accumulators), and where more than 4 rows are left,
// 5-8 rows x 2 panels (wide_fn: as many accumulators, each weight loaded once for all the
// rows); without it, 6 rows x 1 panel (12 of the 16 AVX2 registers). Vector types are the machine's width: a 64-byte type on a CPU
// without 64-byte registers lived on the stack, every multiply-add a load and a store, and
// the kernel ran 4.5-18x slower than torch's linear (an AVX2 AMD EPYC, GCC 12).
//
// Every output element is one fused multiply-add chain over k in order, whatever M, the
// tile, the vector width or the thread that computes it: a row's result does not depend on
// the batch it was computed in (verification of k + 1 tokens gives the logits one-token
// decoding would).
#include <torch/extension.h>
#include "thread_pool.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include <immintrin.h>

#include "vec_math.h"

namespace {

using adaspec::VL;  // floats per vector register (vec_math.h: 16 with AVX-512, else 8)
typedef adaspec::vecf vec;

constexpr int64_t LANES = 16;  // output features per panel (the packed layout)
constexpr int64_t PANELS = VL == 16 ? 4 : 1;  // panels per column group and tile
constexpr int64_t ROWS = VL == 16 ? 4 : 6;    // rows per register tile
constexpr int64_t WIDE_ROWS = VL == 16 ? 8 : 0;  // rows per tile of 2 panels past ROWS (none without AVX-512)
constexpr int64_t SUB = LANES / VL;  // vectors per panel

inline vec load(const float* p) { return adaspec::loadv(p); }

// VL int8 weights as floats (exact: every int8 is a float): sign-extended, then converted, one
// instruction each. (GCC's generic vector conversion of 16 bytes made the kernel 5-7x slower.)
inline vec load(const int8_t* p) {
#if defined(__AVX512F__)
  return (vec)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
  return (vec)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#endif
}

// VL bfloat16 weights (their bits) as floats: a bfloat16 is the upper half of a float (zero-extended
// and shifted: one instruction each, as the generic vector conversion was not).
inline vec load(const uint16_t* p) {
#if defined(__AVX512F__)
  return (vec)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
#else
  return (vec)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16);
#endif
}

// Rows [0, R) of x against panels [0, P) starting at wp (float32, bfloat16 or int8 weights, W);
// columns beyond `cols` are dropped. Vector v of the tile covers columns v * VL .. v * VL + VL - 1.
// int8 weights: each output is scale * (its sum over k of x * q) + bias, the scale the tile's
// columns' (`scale`, padded to whole panels).
template <int R, int P, typename W>
void tile(const float* x, int64_t K, const W* wp, const float* bias, const float* scale, float* y, int64_t ldy,
          int64_t cols) {
  constexpr bool QUANT = std::is_same_v<W, int8_t>;
  constexpr int V = P * SUB;  // vectors per row
  // acc must stay in registers: its loops are unrolled and its address is never taken (the
  // bias and the stores go through copies). GCC 12 kept an addressed acc on the stack, one
  // load and store per multiply-add: 10x slower.
  vec acc[R][V];
  [[maybe_unused]] vec bv[V];  // int8: the bias, added after the scale
#pragma GCC unroll 8
  for (int v = 0; v < V; ++v) {
    float lanes[VL] = {};
    if (bias != nullptr) {
      for (int64_t l = 0; l < VL && v * VL + l < cols; ++l) lanes[l] = bias[v * VL + l];
    }
    const vec b = load(lanes);
    if constexpr (QUANT) bv[v] = b;
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[r][v] = QUANT ? vec{} : b;
  }
  for (int64_t k = 0; k < K; ++k) {
    vec w[V];
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) w[v] = load(wp + ((v / SUB) * K + k) * LANES + (v % SUB) * VL);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const float xv = x[r * K + k];
#pragma GCC unroll 8
      for (int v = 0; v < V; ++v) acc[r][v] += xv * w[v];
    }
  }
  [[maybe_unused]] vec sv[V];
  if constexpr (QUANT) {
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) sv[v] = load(scale + v * VL);
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) {
      const int64_t n = std::min<int64_t>(VL, cols - v * VL);
      if (n <= 0) break;
      vec out = acc[r][v];
      if constexpr (QUANT) out = out * sv[v] + bv[v];
      if (n == VL) {
        adaspec::storev(y + r * ldy + v * VL, out);  // one vector store
      } else {
        std::memcpy(y + r * ldy + v * VL, &out, n * sizeof(float));
      }
    }
  }
}

template <typename W>
using TileFn = void (*)(const float*, int64_t, const W*, const float*, const float*, float*, int64_t, int64_t);

template <int R, typename W>
TileFn<W> tile_for_panels(int64_t p) {
  static_assert(PANELS == 1 || PANELS == 4, "tiles are instantiated for 1 or 4 panels");
  if constexpr (PANELS == 1) {
    return &tile<R, 1, W>;
  } else {
    switch (p) {
      case 1: return &tile<R, 1, W>;
      case 2: return &tile<R, 2, W>;
      case 3: return &tile<R, 3, W>;
      default: return &tile<R, 4, W>;
    }
  }
}

template <typename W>
TileFn<W> tile_fn(int64_t rows, int64_t panels) {
  static_assert(ROWS == 4 || ROWS == 6, "tiles are instantiated for 4 or 6 rows");
  switch (rows) {
    case 1: return tile_for_panels<1, W>(panels);
    case 2: return tile_for_panels<2, W>(panels);
    case 3: return tile_for_panels<3, W>(panels);
    case 4: return tile_for_panels<4, W>(panels);
    default:
      if constexpr (ROWS == 4) {
        return tile_for_panels<4, W>(panels);
      } else {
        return rows == 5 ? tile_for_panels<5, W>(panels) : tile_for_panels<6, W>(panels);
      }
  }
}

// With AVX-512, 5-8 rows go in one pass too: R rows x 2 panels (at most 16 accumulators), each
// weight vector loaded once for all R rows. Four-row tiles over 4 panels had streamed a column
// group's weights once per 4 rows: a fifth row cost a second pass over them.
template <int R, typename W>
TileFn<W> wide_for_panels(int64_t p) {
  return p == 1 ? &tile<R, 1, W> : &tile<R, 2, W>;
}

template <typename W>
TileFn<W> wide_fn(int64_t rows, int64_t panels) {
  switch (rows) {
    case 5: return wide_for_panels<5, W>(panels);
    case 6: return wide_for_panels<6, W>(panels);
    case 7: return wide_for_panels<7, W>(panels);
    default: return wide_for_panels<8, W>(panels);
  }
}

template <typename W>
void linear_panels(const float* xp, const W* wp, const float* bp, const float* sp, float* yp, int64_t M, int64_t K,
                   int64_t N, int64_t np) {
  const int64_t groups = (np + PANELS - 1) / PANELS;
  adaspec::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t p0 = g * PANELS, panels = std::min(PANELS, np - p0);
      const int64_t col0 = p0 * LANES, cols = std::min(panels * LANES, N - col0);
      int64_t m = 0;
      if constexpr (WIDE_ROWS > 0) {
        for (; M - m > ROWS; m += std::min(WIDE_ROWS, M - m)) {  // 5-8 rows at a time, 2 panels a tile
          const int64_t rows = std::min(WIDE_ROWS, M - m);
          for (int64_t p = 0; p < panels; p += 2) {
            const int64_t c = col0 + p * LANES;
            wide_fn<W>(rows, std::min<int64_t>(2, panels - p))(xp + m * K, K, wp + (p0 + p) * K * LANES,
                                                               bp ? bp + c : nullptr, sp ? sp + c : nullptr,
                                                               yp + m * N + c, N, std::min(2 * LANES, cols - p * LANES));
          }
        }
      }
      for (; m < M; m += ROWS) {
        const int64_t rows = std::min(ROWS, M - m);
        tile_fn<W>(rows, panels)(xp + m * K, K, wp + p0 * K * LANES, bp ? bp + col0 : nullptr,
                                 sp ? sp + col0 : nullptr, yp + m * N + col0, N, cols);
      }
    }
  });
}

}  // namespace

// (N, K) weight -> (ceil(N / 16), K, 16) panels, zero-padded past N, of its dtype: float32,
// or bfloat16 or int8 (a half or a quarter of the bytes to stream; a draft model's weights, whose
// rounding changes only which tokens are proposed, never what verification emits; int8 panels
// hold a quantised weight, models/kernels.py quantise_rows, and take its scales).
torch::Tensor pack_linear_weight(const torch::Tensor& w) {
  const auto type = w.scalar_type();
  TORCH_CHECK(w.dim() == 2 && (type == torch::kFloat32 || type == torch::kBFloat16 || type == torch::kChar) &&
                  w.device().is_cpu(),
              "weight must be a 2-D float32, bfloat16 or int8 CPU tensor");
  const int64_t N = w.size(0), K = w.size(1), np = (N + LANES - 1) / LANES;
  auto padded = torch::zeros({np * LANES, K}, w.options());
  padded.narrow(0, 0, N).copy_(w);
  return padded.view({np, LANES, K}).transpose(1, 2).contiguous();
}

torch::Tensor packed_linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t N,
                            const c10::optional<torch::Tensor>& bias, const c10::optional<torch::Tensor>& scale) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous() && x.device().is_cpu(),
              "x must be a contiguous 2-D float32 CPU tensor");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == LANES && packed.size(1) == x.size(1) && packed.is_contiguous(),
              "packed weight does not match x: expected (ceil(N/16), ", x.size(1), ", 16)");
  TORCH_CHECK(packed.size(0) * LANES >= N && N > packed.size(0) * LANES - LANES, "N does not match the packed weight");
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N && bias->is_contiguous() && bias->scalar_type() == torch::kFloat32,
                "bias must be N contiguous floats");
    bp = bias->data_ptr<float>();
  }
  const int64_t M = x.size(0), K = x.size(1), np = packed.size(0);
  const bool quantised = packed.scalar_type() == torch::kChar;
  const bool scaled = scale.has_value() && scale->defined();
  TORCH_CHECK(quantised == scaled, quantised ? "int8 packed weights need their scales"
                                             : "scales go only with int8 packed weights");
  if (scaled) {
    TORCH_CHECK(scale->numel() == np * LANES && scale->is_contiguous() && scale->scalar_type() == torch::kFloat32,
                "scale must be ceil(N/16) * 16 contiguous floats");
  }
  auto y = torch::empty({M, N}, x.options());
  if (quantised) {
    linear_panels(x.data_ptr<float>(), packed.data_ptr<int8_t>(), bp, scale->data_ptr<float>(), y.data_ptr<float>(),
                  M, K, N, np);
  } else if (packed.scalar_type() == torch::kBFloat16) {
    linear_panels(x.data_ptr<float>(), reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()), bp,
                  nullptr, y.data_ptr<float>(), M, K, N, np);
  } else {
    TORCH_CHECK(packed.scalar_type() == torch::kFloat32, "packed weight must be float32, bfloat16 or int8");
    linear_panels(x.data_ptr<float>(), packed.data_ptr<float>(), bp, nullptr, y.data_ptr<float>(), M, K, N, np);
  }
  return y;
}
