// A batch's keep set compiled: controller/decision.py's `rank_best` (the ranking of every
// candidate draft and the best prefix of it), for the numpy rule that batches of more than
// a few sequences decide with, several times a step when the early stop asks.
//
// Why compiled: at batch 32-256 the rule's argsort, cumulative sums and temporaries took
// 0.07-0.11 ms a call between two forward passes, about half of the controller's time.
//
// Same answers as the numpy, bit for bit: the same int64 keys and sums, a stable sort
// (ties in index order, j-major), IEEE double division of integers below 2^53, the
// min_gain divisors by repeated multiplication, and the first of equal scores
// (tests/test_decision.py compares both).
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <vector>

#include <pybind11/numpy.h>

namespace py = pybind11;

namespace {

constexpr int CONF_BITS = 12;  // controller/decision.py
constexpr int64_t CONF_ONE = int64_t(1) << CONF_BITS;
constexpr int RATIO_BITS = 24;
using I64 = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

// a: (n, k) quantised path probabilities, 0 where a draft may not be kept; the key of
// candidate (i, j) is a (mode 0), a << RATIO_BITS // (s + ctx_i) (mode 1) or
// a * d - e0 * CONF_ONE * ctx_i (mode 2). f: the validation time by added tokens, head: the
// step's other time. Returns (keep per sequence, kept count, score, E and T of the best prefix).
py::tuple rank_best(I64 a, int mode, int64_t s, int64_t d, int64_t e0, I64 ctx, I64 f, int64_t head,
                    int64_t per_token, double min_gain) {
  if (a.ndim() != 2) throw py::value_error("path probabilities must be an (n, k) array");
  const auto A = a.unchecked<2>();
  const auto C = ctx.unchecked<1>();
  const auto F = f.unchecked<1>();
  const int64_t n = A.shape(0), k = A.shape(1);
  if (C.shape(0) != n) throw py::value_error("ctx must hold one context length per sequence");
  std::vector<int64_t> idx, key(size_t(n * k));
  idx.reserve(size_t(n * k));
  for (int64_t j = 0; j < k; ++j) {
    for (int64_t i = 0; i < n; ++i) {
      const int64_t v = A(i, j);
      if (v <= 0) continue;
      const int64_t at = j * n + i;
      idx.push_back(at);
      key[at] = mode == 0 ? v : (mode == 1 ? (v << RATIO_BITS) / (s + C(i)) : v * d - e0 * CONF_ONE * C(i));
    }
  }
  std::stable_sort(idx.begin(), idx.end(), [&](int64_t x, int64_t y) { return key[x] > key[y]; });
  const int64_t live = int64_t(idx.size());
  if (F.shape(0) < live + 1) throw py::value_error("f is shorter than the candidates");
  int64_t e = n * CONF_ONE, cum_ctx = 0, best = 0, best_e = 0, best_t = 0;
  double best_score = 0.0, divisor = 1.0;
  const double scale = 1.0 + min_gain;
  for (int64_t c = 0; c <= live; ++c) {
    const int64_t t = head + F(c) + cum_ctx + ((per_token * e) >> CONF_BITS);
    double score = double(e) / double(std::max<int64_t>(t, 1));
    if (min_gain != 0.0) {
      score = score / divisor;
      divisor *= scale;
    }
    if (c == 0 || score > best_score) {
      best = c, best_score = score, best_e = e, best_t = t;
    }
    if (c < live) {
      const int64_t at = idx[size_t(c)];
      e += A(at % n, at / n);
      cum_ctx += C(at % n);
    }
  }
  py::array_t<int64_t> keep(n);
  auto K = keep.mutable_unchecked<1>();
  for (int64_t i = 0; i < n; ++i) K(i) = 0;
  for (int64_t c = 0; c < best; ++c) K(idx[size_t(c)] % n) += 1;
  return py::make_tuple(keep, best, best_score, best_e, best_t);
}

}  // namespace

void bind_rank(py::module& m) {
  m.def("rank_best", &rank_best, "a batch's ranked candidates and their best prefix (controller/decision.py)",
        py::arg("a"), py::arg("mode"), py::arg("s"), py::arg("d"), py::arg("e0"), py::arg("ctx"), py::arg("f"),
        py::arg("head"), py::arg("per_token"), py::arg("min_gain"));
}
