// Batch 1's speculation decisions compiled: controller/one_row.py's OneRow (the early stop
// and the keep set, prefixes built up a draft at a time) and the logistic acceptance
// estimate (controller/estimators.py, LogisticCalibrator.estimate_one), term for term.
//
// Why compiled: between two forward passes, which stream the weights through the caches,
// the controller's Python finds its code and objects in memory, not cache; a decision that
// takes 10 us warm took 100-130 us there (batch 1, once or twice per step).
//
// Same answers as the Python, bit for bit, so ranks agree whichever they run: integers
// where the Python has ints, IEEE double division of integers below 2^53 (correctly
// rounded, as Python's int / int), the same libm log, log1p and exp, the same order of
// operations, and no fused multiply-adds (tests/test_one_row.py compares both).
#include <torch/extension.h>

#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <tuple>
#include <stdexcept>
#include <vector>

#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include "decide.h"

namespace py = pybind11;

void draft_top2_at(const torch::Tensor& logits, torch::Tensor& tokens, torch::Tensor& inputs, int64_t j);

namespace {

constexpr int CONF_BITS = 12;  // controller/decision.py
constexpr int64_t CONF_ONE = int64_t(1) << CONF_BITS;
constexpr double EPS = 1e-4;  // controller/estimators.py

// min(max(int(round(c * CONF_ONE)), 0), CONF_ONE): round half to even, as Python's round.
int64_t quantize(double c) {
  const double r = std::nearbyint(c * double(CONF_ONE));
  if (!std::isfinite(r)) throw py::value_error("an acceptance estimate is not a finite number");
  return r < 0 ? 0 : (r > double(CONF_ONE) ? CONF_ONE : int64_t(r));
}

// Python's min and max on floats (NaN handling included): max(a, b) is b only if b > a.
double py_max(double a, double b) { return b > a ? b : a; }
double py_min(double a, double b) { return b < a ? b : a; }

// The logistic estimate for one draft; w: (w0, w1, w2, w3) of its position.
#if defined(__clang__)
double logistic(const std::vector<double>& w, double p, double m) {
#pragma clang fp contract(off)
#else
__attribute__((optimize("fp-contract=off"))) double logistic(const std::vector<double>& w, double p, double m) {
#endif
  if (w.size() != 4) throw py::value_error("logistic weights come in fours (w0, w1, w2, w3)");
  p = py_min(py_max(p, EPS), 1 - EPS);
  m = py_min(py_max(m, EPS), 1.0);
  const double z = py_min(py_max(w[0] + w[1] * std::log(p) + w[2] * std::log1p(-p) + w[3] * std::log(m), -60.0), 60.0);
  return 1.0 / (1.0 + std::exp(-z));
}

// One term of the draft budget: (m, expected tokens, time without the context term, validated tokens).
using Term = std::tuple<int64_t, double, double, double>;

class OneRow {
 public:
  // f: f(1 + m) in time units for m = 0, 1, ..; per_token: o1; ctx: the sequence's context
  // cost per validated token; fixed: o0 plus the context cost of its one certain token;
  // weights: the logistic model (add_logistic), or None.
  OneRow(std::vector<int64_t> f, int64_t per_token, int64_t ctx, int64_t fixed, double min_gain, int64_t cap,
         std::shared_ptr<LogisticWeights> weights)
      : f_(std::move(f)), o_(per_token), ctx_(ctx), cap_(cap), min_gain_(min_gain), scale_(1.0 + min_gain),
        weights_(std::move(weights)) {
    e_.push_back(CONF_ONE);
    t_.push_back(fixed);
    div_.push_back(1.0);
  }

  // The draft budget's terms at batch 1 (controller/one_row.py, set_budget): terms[k] holds
  // (m, expected, time, verified) for m = 1..k.
  void set_budget(double b2, double base, int64_t fixed, std::vector<std::vector<Term>> terms, double scale,
                  double units_per_ms, bool by_rate) {
    b2_ = b2, base_ = base, fixed0_ = fixed, terms_ = std::move(terms), budget_scale_ = scale;
    units_per_ms_ = units_per_ms, by_rate_ = by_rate;
    has_budget_ = true;
  }

  // A new step (restart) and the draft budget's choice of 0..k draft steps: begin's in
  // controller/one_row.py, the same doubles in the same order.
  // row >= 0: the step's drafts go to rows row.. of the slab (watch_slab), which next_at and keep_at read
  // from then on, with no buffers of the step's own to watch.
  int64_t begin(int64_t kv, int64_t cap, int64_t k, int64_t row = -1) {
    if (!has_budget_ || k < 0 || k >= int64_t(terms_.size()))
      throw py::index_error("OneRow.begin: no budget terms for " + std::to_string(k) + " drafts");
    if (row >= 0) {
      if (!slab_rows_ || row + k > slab_rows_) throw py::index_error("OneRow.begin: rows past the watched slab");
      at_top_ = slab_top_.data() + row * slab_stride_, at_margin_ = slab_margin_.data() + row * slab_stride_;
      watched_rows_ = k, watched_stride_ = slab_stride_;
    }
    const double kv_ms = b2_ * double(kv);
    const int64_t ctx = int64_t(std::nearbyint(kv_ms * units_per_ms_));
    restart(ctx, fixed0_ + ctx, cap);
    const auto [best_m, best] = best_budget(terms_[size_t(k)], kv_ms);
    lam_ = by_rate_ ? best * double(CONF_ONE) / units_per_ms_ : -1.0;  // decision.rate_units
    return best_m;
  }

  // A new step of the same time model and logistic weights: no prefix but the empty one.
  void restart(int64_t ctx, int64_t fixed, int64_t cap) {
    ctx_ = ctx, cap_ = cap;
    e_.assign(1, CONF_ONE);
    t_.assign(1, fixed);
    div_.assign(1, 1.0);
    acc_ = CONF_ONE, drafts_ = 0, closed_ = false;
  }

  void add(double c) {
    ++drafts_;
    if (closed_ || drafts_ > cap_) {
      closed_ = true;
      return;
    }
    const int64_t acc = (acc_ * quantize(c)) >> CONF_BITS;
    if (acc <= 0) {
      closed_ = true;
      return;
    }
    acc_ = acc;
    e_.push_back(e_.back() + acc);
    t_.push_back(t_.back() + ctx_);
    div_.push_back(div_.back() * scale_);
  }

  // The next draft's logistic estimate, from its top probability p and margin m, added.
  void add_logistic(double p, double m) {
    if (!weights_) throw py::value_error("this OneRow was made without logistic weights");
    add(logistic(weights_->w.at(size_t(drafts_)), p, m));
  }

  std::pair<int64_t, double> best(int64_t d, int64_t upto) const {
    double best = theta(0, d);
    int64_t count = 0;
    const int64_t last = std::min<int64_t>(upto, int64_t(e_.size()) - 1);
    for (int64_t m = 1; m <= last; ++m) {
      const double th = theta(m, d);
      if (th > best) best = th, count = m;
    }
    return {count, best};
  }

  bool worth_drafting(int64_t d_stop, int64_t d_go, double rate) const {
    const int64_t j = drafts_;
    if (closed_ || j + 1 > cap_) return false;
    const int64_t acc = (acc_ * quantize(rate)) >> CONF_BITS;
    if (acc <= 0) return false;
    const int64_t e = e_.at(size_t(j)) + acc;
    const int64_t go_t = std::max<int64_t>(t_[j] + ctx_ + d_go + f_.at(size_t(j + 1)) + ((o_ * e) >> CONF_BITS), 1);
    double go = double(e) / double(go_t);
    if (min_gain_ != 0.0) go /= div_[j] * scale_;
    if (lam_ >= 0) {  // the best prefix with it is it, and worth more at the budget's rate than the best without it
      for (int64_t m = 0; m <= j; ++m)
        if (go <= theta(m, d_go)) return false;
      const auto [m, stop] = best(d_stop, j);
      return beats_at_rate(go, go_t, stop, total(m, d_stop), lam_);
    }
    for (int64_t m = 0; m <= j; ++m) {
      if (go <= theta(m, d_stop) || (d_go < d_stop && go <= theta(m, d_go))) return false;
    }
    return true;
  }

  // The step's draft times (units, by number of draft steps) and each position's rate for a
  // draft not yet made: what next and keep read (they change with the time model and calibration).
  void set_terms(std::vector<int64_t> draft_units, std::vector<double> rates) {
    draft_units_ = std::move(draft_units);
    rates_ = std::move(rates);
  }

  // Draft j (1-based: the step's j-th) arrived: add its logistic estimate and answer the early
  // stop: worth_drafting(draft time of j, of j + 1, the rate of position j).
  bool next(int64_t j, double p, double m) {
    if (drafts_ != j - 1) throw py::value_error("OneRow.next: drafts must arrive in order");
    add_logistic(p, m);
    return worth_drafting(draft_units_.at(size_t(j)), draft_units_.at(size_t(j + 1)), rates_.at(size_t(j)));
  }

  // The draft loop's (budget, n) buffers of top probabilities and margins, float64 with
  // contiguous rows (held, not copied): next_at(j) reads draft j's of row 0 itself, so the
  // early stop is one call between the draft's forward passes.
  void watch(py::array_t<double> top, py::array_t<double> margin) {
    check_watched(top, margin, "watch");
    top_ = top, margin_ = margin;
    at_top_ = top_.data(), at_margin_ = margin_.data();
    watched_rows_ = top.shape(0), watched_stride_ = top.shape(1);
  }
  // The policy's draft slab (SpecPolicy.draft_row): (rows, 1) columns that the steps beginning at a row of
  // them draft into, watched once for this OneRow's life instead of a step's buffers at every step.
  void watch_slab(py::array_t<double> top, py::array_t<double> margin) {
    check_watched(top, margin, "watch_slab");
    slab_top_ = top, slab_margin_ = margin;
    slab_rows_ = top.shape(0), slab_stride_ = top.shape(1);
  }
  bool next_at(int64_t j) {
    if (j < 1 || j > watched_rows_) throw py::index_error("OneRow.next_at: no such row in the watched buffers");
    const int64_t at = (j - 1) * watched_stride_;
    return next(j, at_top_[at], at_margin_[at]);
  }
  // draft_top2_at into position j of the draft loop's buffers, whose top probabilities and
  // margins must be the rows this OneRow reads (begin's slab rows, or the watched buffers),
  // then next_at(j + 1): the draft's confidence inputs and the early stop in one call
  // between two forward passes.
  bool draft_next(const torch::Tensor& logits, torch::Tensor& tokens, torch::Tensor& inputs, int64_t j) {
    if (j < 0 || j >= watched_rows_ || inputs.dim() != 3 || inputs.size(1) <= j || inputs.size(2) != 1 ||
        inputs.scalar_type() != torch::kFloat64)
      throw py::index_error("OneRow.draft_next: no such position in the watched buffers");
    const double* top = inputs.data_ptr<double>() + j * inputs.stride(1);
    if (top != at_top_ + j * watched_stride_ || top + inputs.stride(0) != at_margin_ + j * watched_stride_)
      throw py::value_error("OneRow.draft_next: inputs are not the buffers this OneRow reads");
    draft_top2_at(logits, tokens, inputs, j);
    return next_at(j + 1);
  }
  // The keep count after m drafts: best(draft time of m, m).
  int64_t keep(int64_t m) const { return best(draft_units_.at(size_t(m)), m).first; }
  // keep(m), the drafts not yet added read from the watched buffers first.
  int64_t keep_at(int64_t m) {
    if (m > watched_rows_) throw py::index_error("OneRow.keep_at: no such row in the watched buffers");
    for (int64_t j = drafts_; j < m; ++j) add_logistic(at_top_[j * watched_stride_], at_margin_[j * watched_stride_]);
    return keep(m);
  }

  int64_t drafts() const { return drafts_; }

 private:
#if defined(__clang__)
  std::pair<int64_t, double> best_budget(const std::vector<Term>& terms, double kv_ms) const {
#pragma clang fp contract(off)
#else
  __attribute__((optimize("fp-contract=off"))) std::pair<int64_t, double> best_budget(const std::vector<Term>& terms,
                                                                                    double kv_ms) const {
#endif
    int64_t best_m = 0;
    double best = 1.0 / (base_ + kv_ms);
    for (const auto& [m, expected, fixed, verified] : terms) {
      const double theta = expected / (fixed + verified * kv_ms);
      if (theta > best * budget_scale_) best_m = m, best = theta;
    }
    return {best_m, best};
  }

  int64_t total(int64_t m, int64_t d) const {
    return std::max<int64_t>(t_[m] + d + f_.at(size_t(m)) + ((o_ * e_[m]) >> CONF_BITS), 1);
  }

  double theta(int64_t m, int64_t d) const {
    const double th = double(e_[m]) / double(total(m, d));
    return min_gain_ != 0.0 ? th / div_[m] : th;
  }

  std::vector<int64_t> f_;
  int64_t o_, ctx_, cap_;
  double min_gain_, scale_;
  std::shared_ptr<LogisticWeights> weights_;
  std::vector<int64_t> draft_units_;
  std::vector<double> rates_;
  std::vector<int64_t> e_, t_;  // expected tokens (fixed point) and time terms of prefix m
  std::vector<double> div_;     // (1 + min_gain)^m
  int64_t acc_ = CONF_ONE, drafts_ = 0;
  bool closed_ = false;
  static void check_watched(const py::array_t<double>& top, const py::array_t<double>& margin, const char* name) {
    for (const auto* a : {&top, &margin}) {
      if (a->ndim() != 2 || a->shape(0) != top.shape(0) || a->shape(1) != top.shape(1) ||
          a->strides(1) != sizeof(double) || a->strides(0) != a->shape(1) * int64_t(sizeof(double)))
        throw py::value_error(std::string("OneRow.") + name +
                              ": top and margin must be equal (budget, n) float64 arrays with contiguous rows");
    }
  }
  py::array_t<double> top_, margin_;  // watched buffers
  py::array_t<double> slab_top_, slab_margin_;  // the watched slab (watch_slab)
  const double* at_top_ = nullptr;  // what next_at and keep_at read: the watched buffers, or the step's slab rows
  const double* at_margin_ = nullptr;
  int64_t watched_rows_ = 0, watched_stride_ = 0, slab_rows_ = 0, slab_stride_ = 0;
  double b2_ = 0.0, base_ = 0.0, budget_scale_ = 1.0, units_per_ms_ = 0.0;  // set_budget's
  int64_t fixed0_ = 0;
  std::vector<std::vector<Term>> terms_;
  bool has_budget_ = false, by_rate_ = false;
  double lam_ = -1.0;  // begin's: the early stop's rate (tokens per time unit), < 0: Theta's
};

}  // namespace

double logistic_estimate(const std::vector<double>& w, double p, double m) { return logistic(w, p, m); }

// logistic() over a column of drafts (a large batch's position): the same double per draft.
py::array_t<double> logistic_column(const std::vector<double>& w,
                                    py::array_t<double, py::array::c_style | py::array::forcecast> top,
                                    py::array_t<double, py::array::c_style | py::array::forcecast> margin) {
  if (top.ndim() != 1 || margin.ndim() != 1 || top.size() != margin.size())
    throw py::value_error("top probabilities and margins must be columns of the same length");
  const double* p = top.data();
  const double* mg = margin.data();
  py::array_t<double> out(top.size());
  double* o = out.mutable_data();
  for (py::ssize_t i = 0; i < top.size(); ++i) o[i] = logistic(w, p[i], mg[i]);
  return out;
}

void bind_one_row(py::module& m) {
  py::class_<LogisticWeights, std::shared_ptr<LogisticWeights>>(m, "LogisticWeights")
      .def(py::init<std::vector<std::vector<double>>>());
  py::class_<OneRow>(m, "OneRow", "batch 1's early stop and keep set (controller/one_row.py)")
      .def(py::init<std::vector<int64_t>, int64_t, int64_t, int64_t, double, int64_t,
                    std::shared_ptr<LogisticWeights>>(),
           py::arg("f"), py::arg("per_token"), py::arg("ctx"), py::arg("fixed"), py::arg("min_gain"), py::arg("cap"),
           py::arg("weights") = nullptr)
      .def("restart", &OneRow::restart, py::arg("ctx"), py::arg("fixed"), py::arg("cap"))
      .def("set_budget", &OneRow::set_budget, py::arg("b2"), py::arg("base"), py::arg("fixed"), py::arg("terms"),
           py::arg("scale"), py::arg("units_per_ms"), py::arg("by_rate") = false)
      .def("begin", &OneRow::begin, py::arg("kv"), py::arg("cap"), py::arg("k"), py::arg("row") = -1)
      .def("add", &OneRow::add)
      .def("add_logistic", &OneRow::add_logistic)
      .def("best", &OneRow::best)
      .def("worth_drafting", &OneRow::worth_drafting)
      .def("set_terms", &OneRow::set_terms, py::arg("draft_units"), py::arg("rates"))
      .def("next", &OneRow::next, py::arg("j"), py::arg("p"), py::arg("m"))
      .def("watch", &OneRow::watch, py::arg("top").noconvert(), py::arg("margin").noconvert())
      .def("watch_slab", &OneRow::watch_slab, py::arg("top").noconvert(), py::arg("margin").noconvert())
      .def("next_at", &OneRow::next_at, py::arg("j"))
      .def("draft_next", &OneRow::draft_next, py::arg("logits"), py::arg("tokens"), py::arg("inputs"), py::arg("j"))
      .def("keep", &OneRow::keep, py::arg("m"))
      .def("keep_at", &OneRow::keep_at, py::arg("m"))
      .def_property_readonly("drafts", &OneRow::drafts);
  m.def("logistic_estimate", &logistic, "the logistic acceptance estimate of one draft");
  m.def("logistic_column", &logistic_column, "the logistic acceptance estimates of a column of drafts",
        py::arg("w"), py::arg("top"), py::arg("margin"));
}
