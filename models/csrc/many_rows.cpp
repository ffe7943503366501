// A large batch's adaptive step on the logistic estimate, compiled: controller/step.py's
// early stops and keep set (SpecStep._many_rows), on rank.cpp's decisions.
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include "decide.h"

namespace py = pybind11;

namespace {

constexpr int64_t UNITS_PER_MS = 10000;  // controller/time_model.py: the decision's time unit is 100 ns
using I64 = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

// A large batch's adaptive step on the logistic estimate, compiled as batch 1's OneRow: it
// reads the draft loop's (budget, n) buffers of top probabilities and margins itself, makes
// each drafted position's estimates and path column once, and answers the early stop after
// draft j (next_at) and the keep set after m drafts (keep_explored) in one call each. The same
// functions as logistic_column, path_column, worth_drafting and decide_cols, so the same
// answers; what it saves is the Python between them (60 us a question at batch 32).
class ManyRows {
 public:
  // kv: each sequence's context length, b2 the time model's context coefficient (ms per
  // validated token per context token): each sequence's context cost per validated token is
  // b2 kv in time units, rounded half to even (decision.py's step_costs). fixed: the step's
  // fixed time terms in units (StepCosts.fixed); draft[m]: the draft time of m draft steps
  // in units, m = 0..budget + 1. rates[j]: position j's conditional acceptance for a draft
  // not yet made (the early stop's guess). lam: the early stop's rate (rank.cpp's Costs), < 0: Theta's.
  ManyRows(I64 cap, I64 kv, double b2, I64 f, int64_t fixed, const std::vector<int64_t>& draft,
           const std::vector<double>& rates, int64_t per_token, double min_gain, int rounds,
           std::shared_ptr<LogisticWeights> weights, py::array_t<double> top, py::array_t<double> margin,
           double lam = -1.0)
      : n_(cap.size()), cap_(cap.data(), cap.data() + cap.size()), f_(f.data(), f.data() + f.size()), rounds_(rounds),
        weights_(std::move(weights)), top_(std::move(top)), margin_(std::move(margin)) {
    if (kv.size() != n_) throw py::value_error("ManyRows: cap and kv must hold one value per sequence");
    for (const auto* a : {&top_, &margin_}) {
      if (a->ndim() != 2 || a->shape(1) != n_ || a->shape(0) != top_.shape(0) ||
          a->strides(1) != sizeof(double) || a->strides(0) != n_ * int64_t(sizeof(double)))
        throw py::value_error("ManyRows: top and margin must be equal (budget, n) float64 arrays with contiguous rows");
    }
    if (!weights_) throw py::value_error("ManyRows needs the logistic weights");
    rows_ = top_.shape(0);
    // the same doubles as numpy's rint(b2 * kv * UNITS_PER_MS): two products, rounded half to even
    int64_t sum = 0;
    ctx_.resize(size_t(n_));
    for (int64_t i = 0; i < n_; ++i) {
      ctx_[size_t(i)] = int64_t(std::nearbyint(b2 * double(kv.data()[i]) * double(UNITS_PER_MS)));
      sum += ctx_[size_t(i)];
    }
    const bool uniform = n_ == 0 || std::all_of(ctx_.begin(), ctx_.end(), [&](int64_t c) { return c == ctx_[0]; });
    for (int64_t d : draft) heads_.push_back(d + fixed + sum);
    for (double r : rates) rates_q_.push_back(quantize_estimate(r));
    costs_ = Costs{ctx_.data(), f_.data(), int64_t(f_.size()), per_token, min_gain, uniform, lam};
  }

  // After j drafts: is draft j + 1 worth drafting?
  bool next_at(int64_t j) {
    if (j < 1 || j > rows_) throw py::index_error("ManyRows.next_at: no such row in the draft buffers");
    add_up_to(j);
    stop_.reset();
    stop_at_ = j;
    return worth_drafting_on(columns(j), n_, cap_.data(), rates_q_.at(size_t(j)), costs_, heads_.at(size_t(j)),
                             heads_.at(size_t(j + 1)), &stop_);
  }

  // The keep set after m drafts (the rule's, per sequence), and what the step validates: the
  // same but for the rows exploration verifies everything drafted (first, first + every, ..:
  // min(cap, m) each), as a list (SpecStep.keep's).
  py::tuple keep_explored(int64_t m, int64_t first, int64_t every) {
    if (first < 0 || every < 1) throw py::value_error("ManyRows.keep_explored: first >= 0 and every >= 1");
    const std::vector<int64_t> rule = decide(m);
    py::list out(n_);
    for (int64_t i = 0; i < n_; ++i) {
      const bool explored = i >= first && (i - first) % every == 0;
      out[size_t(i)] = explored ? std::min(cap_[size_t(i)], m) : rule[size_t(i)];
    }
    return py::make_tuple(py::array_t<int64_t>(n_, rule.data()), out);
  }

  int64_t drafts() const { return int64_t(cols_.size()); }
  const std::vector<int64_t>& ctx() const { return ctx_; }  // each sequence's context cost per token (units)
  bool uniform() const { return costs_.uniform; }

 private:
  // The rule's keep set after m drafts.
  std::vector<int64_t> decide(int64_t m) {
    if (m < 1 || m > rows_) throw py::index_error("ManyRows.keep_explored: no such row in the draft buffers");
    add_up_to(m);
    // where the early stop after m drafts said stop, its ranking without draft m + 1 is this one's first
    const Ranked* first = stop_at_ == m && stop_ ? &*stop_ : nullptr;
    return decide_cols_on(columns(m), n_, cap_.data(), costs_, heads_.at(size_t(m)), rounds_, first).keep;
  }

  // Positions' path columns up to j: the estimates (logistic_column's), then path_column's.
  void add_up_to(int64_t j) {
    std::vector<double> conf(static_cast<size_t>(n_));
    while (int64_t(cols_.size()) < j) {
      const int64_t r = int64_t(cols_.size());
      const std::vector<double>& w = weights_->w.at(size_t(r));
      const double* p = top_.data() + r * n_;
      const double* mg = margin_.data() + r * n_;
      for (int64_t i = 0; i < n_; ++i) conf[size_t(i)] = logistic_estimate(w, p[i], mg[i]);
      std::vector<int64_t> col(static_cast<size_t>(n_));
      path_column_on(conf.data(), r ? cols_.back().data() : nullptr, n_, col.data());
      cols_.push_back(std::move(col));
    }
  }

  Cols columns(int64_t j) const {
    Cols out;
    for (int64_t c = 0; c < j; ++c) out.push_back(cols_[size_t(c)].data());
    return out;
  }

  int64_t n_, rows_ = 0;
  std::vector<int64_t> cap_, ctx_, f_, heads_, rates_q_;
  int rounds_;
  std::shared_ptr<LogisticWeights> weights_;
  py::array_t<double> top_, margin_;  // the draft loop's buffers (held, not copied)
  Costs costs_{};
  std::vector<std::vector<int64_t>> cols_;  // path columns of the positions estimated so far
  std::optional<Ranked> stop_;  // the last early stop's ranking without its next draft, if it made one ...
  int64_t stop_at_ = 0;  // ... after this many drafts
};

}  // namespace

void bind_many_rows(py::module& m) {
  py::class_<ManyRows>(m, "ManyRows", "a large batch's early stop and keep set on the logistic estimate")
      .def(py::init<I64, I64, double, I64, int64_t, const std::vector<int64_t>&, const std::vector<double>&, int64_t,
                    double, int, std::shared_ptr<LogisticWeights>, py::array_t<double>, py::array_t<double>, double>(),
           py::arg("cap"), py::arg("kv"), py::arg("b2"), py::arg("f"), py::arg("fixed"), py::arg("draft"),
           py::arg("rates"), py::arg("per_token"), py::arg("min_gain"), py::arg("rounds"), py::arg("weights"),
           py::arg("top").noconvert(), py::arg("margin").noconvert(), py::arg("lam") = -1.0)
      .def("next_at", &ManyRows::next_at, py::arg("j"))
      .def("keep_explored", &ManyRows::keep_explored, py::arg("m"), py::arg("first"), py::arg("every"))
      .def_property_readonly("drafts", &ManyRows::drafts)
      .def_property_readonly("ctx", &ManyRows::ctx)
      .def_property_readonly("uniform", &ManyRows::uniform);
}
