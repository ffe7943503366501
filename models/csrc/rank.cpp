// A large batch's decisions compiled: the early stop (`worth_drafting`), the keep set
// (`decide_cols`) and the path columns (`path_column`) of controller/early_stop.py,
// decision.py and step.py. Both decisions rank every candidate draft and take the best
// prefix (`rank`, controller/decision.py's `rank_best`; exposed as rank_best so the tests
// compare the two directly), several times a step when the early stop asks.
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
#include <cmath>
#include <cstdint>
#include <optional>
#include <numeric>
#include <vector>

#include <pybind11/numpy.h>
#include <pybind11/stl.h>

namespace py = pybind11;

namespace {

constexpr int CONF_BITS = 12;  // controller/decision.py
constexpr int64_t CONF_ONE = int64_t(1) << CONF_BITS;
constexpr int RATIO_BITS = 24;
using I64 = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

struct Ranked {
  std::vector<int64_t> keep;
  int64_t count = 0, e = 0, t = 0;
  double score = 0.0;
};

// a: j-major quantised path probabilities (a[j * n + i] for sequence i's draft j), 0 where a
// draft may not be kept; the key of candidate (i, j) is a (mode 0), a << RATIO_BITS //
// (s + ctx_i) (mode 1) or a * d - e0 * CONF_ONE * ctx_i (mode 2). f: the validation time by
// added tokens, head: the step's other time.
Ranked rank(const int64_t* a, int64_t n, int64_t k, int mode, int64_t s, int64_t d, int64_t e0, const int64_t* ctx,
            const int64_t* f, int64_t f_len, int64_t head, int64_t per_token, double min_gain) {
  struct Cand {
    int64_t key, at;
  };
  std::vector<Cand> cands;
  cands.reserve(size_t(n * k));
  for (int64_t at = 0; at < n * k; ++at) {
    const int64_t v = a[at];
    if (v <= 0) continue;
    const int64_t c = ctx[at % n];
    cands.push_back({mode == 0 ? v : (mode == 1 ? (v << RATIO_BITS) / (s + c) : v * d - e0 * CONF_ONE * c), at});
  }
  // largest key first, ties in index order: a total order, so the result is the stable sort's
  std::sort(cands.begin(), cands.end(),
            [](const Cand& x, const Cand& y) { return x.key > y.key || (x.key == y.key && x.at < y.at); });
  std::vector<int64_t> idx(cands.size());
  for (size_t c = 0; c < cands.size(); ++c) idx[c] = cands[c].at;
  const int64_t live = int64_t(idx.size());
  if (f_len < live + 1) throw py::value_error("f is shorter than the candidates");
  Ranked best;
  int64_t e = n * CONF_ONE, cum_ctx = 0;
  double divisor = 1.0;
  const double scale = 1.0 + min_gain;
  for (int64_t c = 0; c <= live; ++c) {
    const int64_t t = head + f[c] + cum_ctx + ((per_token * e) >> CONF_BITS);
    double score = double(e) / double(std::max<int64_t>(t, 1));
    if (min_gain != 0.0) {
      score = score / divisor;
      divisor *= scale;
    }
    if (c == 0 || score > best.score) best.count = c, best.score = score, best.e = e, best.t = t;
    if (c < live) {
      const int64_t at = idx[size_t(c)];
      e += a[at];
      cum_ctx += ctx[at % n];
    }
  }
  best.keep.assign(size_t(n), 0);
  for (int64_t c = 0; c < best.count; ++c) best.keep[size_t(idx[size_t(c)] % n)] += 1;
  return best;
}

// decide_paths' first ranking: by a alone where every sequence costs the same, else by the
// ratio key, s the average marginal token cost over the live candidates.
Ranked rank_ratio(const std::vector<int64_t>& a, int64_t n, int64_t k, bool uniform, const int64_t* ctx,
                  const int64_t* f, int64_t f_len, int64_t head, int64_t per_token, double min_gain) {
  int64_t s = 0;
  if (!uniform) {
    int64_t live = 0;
    for (int64_t at = 0; at < n * k; ++at) live += a[size_t(at)] > 0;
    if (f_len < live + 1) throw py::value_error("f is shorter than the candidates");
    s = std::max<int64_t>((f[live] - f[0]) / std::max<int64_t>(live, 1), 1);
  }
  return rank(a.data(), n, k, uniform ? 0 : 1, s, 0, 0, ctx, f, f_len, head, per_token, min_gain);
}

std::vector<int64_t> jmajor(const I64& a) {
  if (a.ndim() != 2) throw py::value_error("path probabilities must be an (n, k) array");
  const auto A = a.unchecked<2>();
  const int64_t n = A.shape(0), k = A.shape(1);
  std::vector<int64_t> out(size_t(n * k));
  for (int64_t j = 0; j < k; ++j)
    for (int64_t i = 0; i < n; ++i) out[size_t(j * n + i)] = A(i, j);
  return out;
}

// controller/step.py's path columns: position j's quantised estimates times the path
// probabilities of position j - 1 (none for the first), as decision.py's quantize and path_probs.
py::array_t<int64_t> path_column(py::array_t<double, py::array::c_style | py::array::forcecast> conf,
                                 std::optional<I64> prev) {
  const int64_t n = conf.size();
  if (prev && prev->size() != n) throw py::value_error("the previous path column must be as long as the estimates");
  const double* c = conf.data();
  const int64_t* before = prev ? prev->data() : nullptr;
  py::array_t<int64_t> out(n);
  int64_t* o = out.mutable_data();
  for (int64_t i = 0; i < n; ++i) {
    const double r = std::nearbyint(c[i] * double(CONF_ONE));
    if (std::isnan(r)) throw py::value_error("an acceptance estimate is not a number");
    const int64_t q = r < 0 ? 0 : (r > double(CONF_ONE) ? CONF_ONE : int64_t(r));
    o[i] = before ? (before[i] * q) >> CONF_BITS : q;
  }
  return out;
}

// controller/decision.py's rank_best on an (n, k) array, for the tests. Returns (keep per
// sequence, kept count, score, E and T of the best prefix).
py::tuple rank_best(I64 a, int mode, int64_t s, int64_t d, int64_t e0, I64 ctx, I64 f, int64_t head,
                    int64_t per_token, double min_gain) {
  const std::vector<int64_t> aj = jmajor(a);
  const int64_t n = a.shape(0), k = a.shape(1);
  if (ctx.size() != n) throw py::value_error("ctx must hold one context length per sequence");
  const Ranked r = rank(aj.data(), n, k, mode, s, d, e0, ctx.data(), f.data(), f.size(), head, per_token, min_gain);
  return py::make_tuple(py::array_t<int64_t>(n, r.keep.data()), r.count, r.score, r.e, r.t);
}

std::vector<int64_t> capped_jmajor(const std::vector<I64>& cols, const I64& cap, size_t extra) {
  const int64_t j = int64_t(cols.size()), n = cap.size();
  const int64_t* caps = cap.data();
  std::vector<int64_t> a;
  a.reserve(size_t(j * n) + extra);
  for (int64_t c = 0; c < j; ++c) {
    if (cols[size_t(c)].size() != n) throw py::value_error("every column must hold one value per sequence");
    const int64_t* col = cols[size_t(c)].data();
    for (int64_t i = 0; i < n; ++i) a.push_back(c < caps[i] ? col[i] : 0);
  }
  return a;
}

// controller/decision.py's decide_cols: the keep set from the drafted positions' path
// probabilities before the caps, with decide_paths' Dinkelbach rounds. Returns (keep, score).
py::tuple decide_cols(const std::vector<I64>& cols, I64 cap, I64 ctx, I64 f, int64_t head, int64_t per_token,
                      double min_gain, bool uniform, int rounds) {
  const int64_t k = int64_t(cols.size()), n = cap.size();
  if (k == 0 || ctx.size() != n) throw py::value_error("cols, cap and ctx must describe the same sequences");
  const std::vector<int64_t> a = capped_jmajor(cols, cap, 0);
  Ranked best = rank_ratio(a, n, k, uniform, ctx.data(), f.data(), f.size(), head, per_token, min_gain);
  for (int r = 0; r < (uniform ? 0 : rounds); ++r) {
    const int64_t d = best.t * CONF_ONE - best.e * per_token;
    if (d <= 0) break;
    Ranked got = rank(a.data(), n, k, 2, 0, d, best.e, ctx.data(), f.data(), f.size(), head, per_token, min_gain);
    if (got.score <= best.score) break;
    best = std::move(got);
  }
  return py::make_tuple(py::array_t<int64_t>(n, best.keep.data()), best.score);
}

// controller/early_stop.py's worth_drafting_paths: cols, the j drafted positions' path
// probabilities before the caps; the next position at rate_q; the best keep set with it (at
// head_go) must keep a draft past j and beat the best without it (at head_stop).
bool worth_drafting(const std::vector<I64>& cols, I64 cap, int64_t rate_q, I64 ctx, I64 f, int64_t head_stop,
                    int64_t head_go, int64_t per_token, double min_gain, bool uniform) {
  const int64_t j = int64_t(cols.size()), n = cap.size();
  if (j == 0 || ctx.size() != n) throw py::value_error("cols, cap and ctx must describe the same sequences");
  const int64_t* caps = cap.data();
  std::vector<int64_t> a = capped_jmajor(cols, cap, size_t(n));
  const int64_t* last = cols.back().data();
  for (int64_t i = 0; i < n; ++i) a.push_back(j < caps[i] ? (last[i] * rate_q) >> CONF_BITS : 0);
  const Ranked go = rank_ratio(a, n, j + 1, uniform, ctx.data(), f.data(), f.size(), head_go, per_token, min_gain);
  if (*std::max_element(go.keep.begin(), go.keep.end()) <= j) return false;
  a.resize(size_t(j * n));  // j-major: the first j positions
  const Ranked stop = rank_ratio(a, n, j, uniform, ctx.data(), f.data(), f.size(), head_stop, per_token, min_gain);
  return go.score > stop.score;
}

}  // namespace

void bind_rank(py::module& m) {
  m.def("rank_best", &rank_best, "a batch's ranked candidates and their best prefix (controller/decision.py)",
        py::arg("a"), py::arg("mode"), py::arg("s"), py::arg("d"), py::arg("e0"), py::arg("ctx"), py::arg("f"),
        py::arg("head"), py::arg("per_token"), py::arg("min_gain"));
  m.def("path_column", &path_column, "a position's path probabilities (controller/step.py)", py::arg("conf"),
        py::arg("prev") = py::none());
  m.def("decide_cols", &decide_cols, "a large batch's keep set (controller/decision.py)", py::arg("cols"),
        py::arg("cap"), py::arg("ctx"), py::arg("f"), py::arg("head"), py::arg("per_token"), py::arg("min_gain"),
        py::arg("uniform"), py::arg("rounds"));
  m.def("worth_drafting", &worth_drafting, "a large batch's early stop (controller/early_stop.py)", py::arg("cols"),
        py::arg("cap"), py::arg("rate_q"), py::arg("ctx"), py::arg("f"), py::arg("head_stop"), py::arg("head_go"),
        py::arg("per_token"), py::arg("min_gain"), py::arg("uniform"));
}
