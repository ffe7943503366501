// A large batch's adaptive step on the logistic estimate, compiled: controller/step.py's
// early stops and keep set (SpecStep._many_rows), on rank.cpp's decisions.
#include <torch/extension.h>

#include <cstdint>
#include <memory>
#include <vector>

#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include "decide.h"

namespace py = pybind11;

namespace {

using I64 = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

// A large batch's adaptive step on the logistic estimate, compiled as batch 1's OneRow: it
// reads the draft loop's (budget, n) buffers of top probabilities and margins itself, makes
// each drafted position's estimates and path column once, and answers the early stop after
// draft j (next_at) and the keep set after m drafts (keep_at) in one call each. The same
// functions as logistic_column, path_column, worth_drafting and decide_cols, so the same
// answers; what it saves is the Python between them (60 us a question at batch 32).
class ManyRows {
 public:
  // heads[m]: the step's time besides validation after m draft steps (draft time, fixed
  // cost and context), for m = 0..budget + 1; rates[j]: position j's conditional acceptance
  // for a draft not yet made (the early stop's guess).
  ManyRows(I64 cap, I64 ctx, I64 f, std::vector<int64_t> heads, const std::vector<double>& rates, int64_t per_token,
           double min_gain, bool uniform, int rounds, std::shared_ptr<LogisticWeights> weights,
           py::array_t<double> top, py::array_t<double> margin)
      : n_(cap.size()), cap_(cap.data(), cap.data() + cap.size()), ctx_(ctx.data(), ctx.data() + ctx.size()),
        f_(f.data(), f.data() + f.size()), heads_(std::move(heads)), rounds_(rounds), weights_(std::move(weights)),
        top_(std::move(top)), margin_(std::move(margin)) {
    if (ctx.size() != n_) throw py::value_error("ManyRows: cap and ctx must hold one value per sequence");
    for (const auto* a : {&top_, &margin_}) {
      if (a->ndim() != 2 || a->shape(1) != n_ || a->shape(0) != top_.shape(0) ||
          a->strides(1) != sizeof(double) || a->strides(0) != n_ * int64_t(sizeof(double)))
        throw py::value_error("ManyRows: top and margin must be equal (budget, n) float64 arrays with contiguous rows");
    }
    if (!weights_) throw py::value_error("ManyRows needs the logistic weights");
    rows_ = top_.shape(0);
    for (double r : rates) rates_q_.push_back(quantize_estimate(r));
    costs_ = Costs{ctx_.data(), f_.data(), int64_t(f_.size()), per_token, min_gain, uniform};
  }

  // After j drafts: is draft j + 1 worth drafting?
  bool next_at(int64_t j) {
    if (j < 1 || j > rows_) throw py::index_error("ManyRows.next_at: no such row in the draft buffers");
    add_up_to(j);
    return worth_drafting_on(columns(j), n_, cap_.data(), rates_q_.at(size_t(j)), costs_, heads_.at(size_t(j)),
                             heads_.at(size_t(j + 1)));
  }

  // The keep set after m drafts, per sequence.
  py::array_t<int64_t> keep_at(int64_t m) {
    if (m < 1 || m > rows_) throw py::index_error("ManyRows.keep_at: no such row in the draft buffers");
    add_up_to(m);
    const Ranked best = decide_cols_on(columns(m), n_, cap_.data(), costs_, heads_.at(size_t(m)), rounds_);
    return py::array_t<int64_t>(n_, best.keep.data());
  }

  int64_t drafts() const { return int64_t(cols_.size()); }

 private:
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
};

}  // namespace

void bind_many_rows(py::module& m) {
  py::class_<ManyRows>(m, "ManyRows", "a large batch's early stop and keep set on the logistic estimate")
      .def(py::init<I64, I64, I64, std::vector<int64_t>, const std::vector<double>&, int64_t, double, bool, int,
                    std::shared_ptr<LogisticWeights>, py::array_t<double>, py::array_t<double>>(),
           py::arg("cap"), py::arg("ctx"), py::arg("f"), py::arg("heads"), py::arg("rates"), py::arg("per_token"),
           py::arg("min_gain"), py::arg("uniform"), py::arg("rounds"), py::arg("weights"), py::arg("top").noconvert(),
           py::arg("margin").noconvert())
      .def("next_at", &ManyRows::next_at, py::arg("j"))
      .def("keep_at", &ManyRows::keep_at, py::arg("m"))
      .def_property_readonly("drafts", &ManyRows::drafts);
}
