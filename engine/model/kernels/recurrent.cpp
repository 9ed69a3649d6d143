// The recurrent layers of hybrid models on the CPU: a causal depthwise convolution, Gated
// DeltaNet's gated delta rule and Mamba-2's selective state space recurrence, each over a
// step's packed sequences, each sequence continuing from its state slot.
//
// Shapes (T packed rows; sequence b owns rows [query_start[b], query_start[b + 1])):
//   causal_conv       x [T, C] (fp32 or bf16), weight [K, C] fp32 (tap-major), bias [C] or
//                     none, conv states [L, S, K - 1, C] fp32 -> [T, C] fp32, before any
//                     activation: out[t] = bias + sum_k weight[k] * in[t - K + 1 + k], where
//                     the inputs before the sequence's first row come from its window.
//   gated_delta_rule  q, k [T, Hk, Dk], v [T, Hv, Dv], g, beta [T, Hv], all fp32 (q, k
//                     normalized and q scaled by the caller), ssm [L, S, Hv, Dk, Dv] fp32
//                     -> [T, Hv, Dv]: value head h reads key head h / (Hv / Hk); per row,
//                     S *= exp(g); delta = beta (v - k^T S); S += k delta^T; out = q^T S.
//   ssd_scan          x [T, H, P], dt [T, H], a [H], b, c [T, G, N], d [H], all fp32, ssm
//                     [L, S, H, N, P] fp32 -> [T, H, P]: head h reads group h / (H / G);
//                     per row, S = exp(dt a) S + b (dt x)^T; out = c^T S + d x.
// Each op reads sequence b's state of layer `layer` from slot sources[b] (-1: zeros) and
// writes its state after its last row to slot slots[b]; for every i with checkpoint_rows[i]
// among b's rows it also copies the state after that row to slot checkpoint_slots[i] (a
// negative row is padding). The caller guarantees that no slot a sequence reads is written
// by another sequence of the step (a sequence may read and write its own).
//
// Invariance. A row's result depends only on its inputs and the state before it, never on
// how the sequence was split into steps or what else runs: every row is computed by the
// same operations in the same order, token after token (no chunked form whose blocks
// would follow the step's boundaries), so a prefix resumed from a checkpoint, a chunked
// prefill and a recomputation after preemption give the bits of one whole prefill.
//
// Layout and work. The matrices are walked in strips of W lanes along their last axis
// (Dv, P): the lanes never meet, so a strip's state (rows x W fp32, 8 KiB for 128 rows of
// 16) stays in L1 across all of the sequence's rows of the step, and the sums over rows
// (k^T S, q^T S, c^T S) are lane-wise, with no horizontal reduction. Work items are
// (sequence, head), each walking the head's strips in turn (a decode step at batch 8
// read and wrote Qwen3.5-0.8B's states at 24.6 GB/s so, 20.1 with an item per strip),
// shared among torch's OpenMP threads; the recurrence of one strip is sequential by
// nature, about three fused multiply-adds per state element and row. The convolution's
// rows need no earlier output, so its items are runs of rows.

#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

// W fp32 lanes as one GCC vector (split into the target's registers), with the 16-bit and
// 32-bit integer vectors of as many lanes that widen bf16 values. Spelled out per width:
// GCC drops a vector_size that depends on a template parameter.
template <int W>
struct LanesOf;
#define PAGEDSERVE_LANES(W)                                                     \
  template <>                                                                   \
  struct LanesOf<W> {                                                           \
    typedef float type __attribute__((vector_size(W * sizeof(float))));         \
    typedef uint16_t halves __attribute__((vector_size(W * sizeof(uint16_t)))); \
    typedef uint32_t words __attribute__((vector_size(W * sizeof(uint32_t))));  \
  };
PAGEDSERVE_LANES(16)
PAGEDSERVE_LANES(8)
PAGEDSERVE_LANES(4)
#undef PAGEDSERVE_LANES
template <int W>
using Lanes = typename LanesOf<W>::type;

template <int W>
inline Lanes<W> load(const float* p) {
  Lanes<W> v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// W bf16 values widened to fp32: a bf16 value is the upper half of the fp32 value with
// the same bits.
template <int W>
inline Lanes<W> load(const at::BFloat16* p) {
  typename LanesOf<W>::halves halves;
  std::memcpy(&halves, p, sizeof(halves));
  const auto words = __builtin_convertvector(halves, typename LanesOf<W>::words) << 16;
  Lanes<W> v;
  std::memcpy(&v, &words, sizeof(v));
  return v;
}

template <int W>
inline void store(float* p, Lanes<W> v) {
  std::memcpy(p, &v, sizeof(v));
}

template <int W>
inline Lanes<W> splat(float x) {
  return Lanes<W>{} + x;
}

// What every op shares: the step's sequences and checkpoints, and the state tensor.
struct Slots {
  std::vector<int64_t> starts;   // query_start
  std::vector<int64_t> slots;    // where each sequence leaves its state
  std::vector<int64_t> sources;  // where it reads it from (-1: zeros)
  std::vector<std::pair<int64_t, int64_t>> checkpoints;  // (row, slot), rows ascending

  Slots(const torch::Tensor& query_start, const torch::Tensor& slots_,
        const torch::Tensor& sources_, const torch::Tensor& checkpoint_rows,
        const torch::Tensor& checkpoint_slots) {
    auto as_vector = [](const torch::Tensor& t) {
      TORCH_CHECK(t.dim() == 1 && t.device().is_cpu(), "slot arrays are 1-d CPU tensors");
      auto c = t.to(torch::kInt64).contiguous();
      return std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
    };
    starts = as_vector(query_start);
    slots = as_vector(slots_);
    sources = as_vector(sources_);
    TORCH_CHECK(starts.size() == slots.size() + 1 && sources.size() == slots.size(),
                "query_start needs one entry more than slots and sources");
    auto rows = as_vector(checkpoint_rows), targets = as_vector(checkpoint_slots);
    TORCH_CHECK(rows.size() == targets.size(), "checkpoint rows and slots differ in length");
    for (size_t i = 0; i < rows.size(); ++i)
      if (rows[i] >= 0) checkpoints.emplace_back(rows[i], targets[i]);
    std::sort(checkpoints.begin(), checkpoints.end());
  }

  int64_t num_seqs() const { return static_cast<int64_t>(slots.size()); }

  // The first checkpoint at or after `row`.
  size_t first_checkpoint(int64_t row) const {
    return std::lower_bound(checkpoints.begin(), checkpoints.end(), std::make_pair(row, int64_t(-1))) -
           checkpoints.begin();
  }
};

void check_state(const torch::Tensor& state, int64_t layer, const Slots& s, int64_t dims) {
  TORCH_CHECK(state.scalar_type() == torch::kFloat32 && state.is_contiguous() &&
                  state.device().is_cpu() && state.dim() == dims,
              "a state tensor is a contiguous fp32 CPU tensor of ", dims, " dimensions");
  TORCH_CHECK(layer >= 0 && layer < state.size(0), "layer out of range");
  for (int64_t b = 0; b < s.num_seqs(); ++b)
    TORCH_CHECK(s.slots[b] >= 0 && s.slots[b] < state.size(1) && s.sources[b] < state.size(1),
                "state slot out of range");
  for (const auto& [row, slot] : s.checkpoints)
    TORCH_CHECK(slot >= 0 && slot < state.size(1) && row < s.starts.back(),
                "checkpoint out of range");
}

// Runs f(item) for items [0, n) on torch's OpenMP threads.
template <typename F>
void parallel_items(int64_t n, const F& f) {
  const int threads = static_cast<int>(std::min<int64_t>(at::get_num_threads(), n));
  if (threads <= 1) {  // no parallel region to enter (a decode step's convolution)
    for (int64_t item = 0; item < n; ++item) f(item);
    return;
  }
#pragma omp parallel for schedule(dynamic) num_threads(threads)
  for (int64_t item = 0; item < n; ++item) f(item);
}

// The widest strip (16, 8 or 4 lanes) that divides `size`; 0 if none does.
int strip_width(int64_t size) { return size % 16 == 0 ? 16 : size % 8 == 0 ? 8 : size % 4 == 0 ? 4 : 0; }

// ---- causal convolution --------------------------------------------------------------
//
// An output row reads only the K inputs up to it, not earlier outputs: rows are computed
// in parallel, each channel vector with the same operations in the same order (the taps
// from the oldest input to its own). Each sequence's window is copied out of its slot
// first (a sequence may leave its state where it read it), the new windows and the
// checkpoints' written last, from the inputs.

constexpr int64_t kConvRows = 16;  // rows of one work item

template <int W, typename T>
struct ConvInputs {
  const T* x;
  const float* windows;  // [B, K - 1, C]: each sequence's inputs before its first row
  int64_t C, taps;

  // The vector of channels [c0, c0 + W) of sequence b's input row j (negative: from its
  // window), whose first row is packed row `first`.
  Lanes<W> at(int64_t b, int64_t first, int64_t j, int64_t c0) const {
    if (j < 0) return load<W>(windows + (b * taps + taps + j) * C + c0);
    return load<W>(x + (first + j) * C + c0);
  }
};

template <int W, typename T>
void conv_rows(const ConvInputs<W, T>& in, const float* weight, const float* bias, float* out,
               int64_t b, int64_t first, int64_t r0, int64_t r1) {
  for (int64_t j = r0; j < r1; ++j) {
    for (int64_t c0 = 0; c0 < in.C; c0 += W) {
      Lanes<W> acc = bias ? load<W>(bias + c0) : Lanes<W>{};
      for (int64_t k = 0; k <= in.taps; ++k)
        acc += load<W>(weight + k * in.C + c0) * in.at(b, first, j - in.taps + k, c0);
      store<W>(out + (first + j) * in.C + c0, acc);
    }
  }
}

// Copies sequence b's K - 1 inputs up to its row `last` (a row index within the sequence,
// -1: before its first row) into `target`, [K - 1, C].
template <int W, typename T>
void save_window(const ConvInputs<W, T>& in, int64_t b, int64_t first, int64_t last, float* target) {
  for (int64_t k = 0; k < in.taps; ++k)
    for (int64_t c0 = 0; c0 < in.C; c0 += W)
      store<W>(target + k * in.C + c0, in.at(b, first, last - in.taps + 1 + k, c0));
}

template <int W, typename T>
void conv_all(const torch::Tensor& x, const float* weight, const float* bias, float* conv_layer,
              float* out, int64_t K, int64_t slot_stride, const Slots& s) {
  const int64_t C = x.size(1), taps = K - 1, B = s.num_seqs();
  // Kept from call to call: a fresh one would fault its pages in at every call.
  thread_local std::vector<float> windows;
  windows.resize(std::max<int64_t>(B * taps * C, 1));
  for (int64_t b = 0; b < B; ++b) {
    float* window = windows.data() + b * taps * C;
    if (s.sources[b] >= 0)
      std::memcpy(window, conv_layer + s.sources[b] * slot_stride, taps * C * sizeof(float));
    else
      std::fill(window, window + taps * C, 0.f);
  }
  const ConvInputs<W, T> in{x.data_ptr<T>(), windows.data(), C, taps};
  std::vector<std::pair<int64_t, int64_t>> items;  // (sequence, first row of the item)
  for (int64_t b = 0; b < B; ++b)
    for (int64_t r = 0; r < s.starts[b + 1] - s.starts[b]; r += kConvRows) items.emplace_back(b, r);
  parallel_items(static_cast<int64_t>(items.size()), [&](int64_t item) {
    const auto [b, r0] = items[item];
    const int64_t rows = s.starts[b + 1] - s.starts[b];
    conv_rows<W, T>(in, weight, bias, out, b, s.starts[b], r0, std::min(r0 + kConvRows, rows));
  });
  for (int64_t b = 0; b < B; ++b) {
    const int64_t first = s.starts[b], rows = s.starts[b + 1] - first;
    for (size_t i = s.first_checkpoint(first); i < s.checkpoints.size() && s.checkpoints[i].first < first + rows; ++i)
      save_window<W, T>(in, b, first, s.checkpoints[i].first - first,
                        conv_layer + s.checkpoints[i].second * slot_stride);
    save_window<W, T>(in, b, first, rows - 1, conv_layer + s.slots[b] * slot_stride);
  }
}

torch::Tensor causal_conv(torch::Tensor x, torch::Tensor weight, std::optional<torch::Tensor> bias,
                          torch::Tensor conv, int64_t layer, torch::Tensor query_start,
                          torch::Tensor slots, torch::Tensor sources,
                          torch::Tensor checkpoint_rows, torch::Tensor checkpoint_slots) {
  const Slots s(query_start, slots, sources, checkpoint_rows, checkpoint_slots);
  check_state(conv, layer, s, 4);
  x = x.contiguous();
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16),
              "x is [T, C] fp32 or bf16");
  const int64_t C = x.size(1), K = weight.size(0);
  TORCH_CHECK(weight.scalar_type() == torch::kFloat32 && weight.is_contiguous() && weight.dim() == 2 &&
                  weight.size(1) == C && K >= 1,
              "weight is [K, C] fp32, contiguous");
  TORCH_CHECK(conv.size(2) == K - 1 && conv.size(3) == C, "conv states are [L, S, K - 1, C]");
  TORCH_CHECK(s.starts.back() == x.size(0), "query_start does not cover x's rows");
  const float* bias_ptr = nullptr;
  torch::Tensor bias_f;
  if (bias.has_value()) {
    bias_f = bias->to(torch::kFloat32).contiguous();
    bias_ptr = bias_f.data_ptr<float>();
  }
  auto out = torch::empty({x.size(0), C}, x.options().dtype(torch::kFloat32));
  float* conv_layer = conv.data_ptr<float>() + layer * conv.stride(0);
  const int64_t slot_stride = conv.stride(1);
  const float* w = weight.data_ptr<float>();
  const int width = strip_width(C);
  TORCH_CHECK(width, "channels must be a multiple of 4");
  const bool bf16 = x.scalar_type() == torch::kBFloat16;
  auto run = [&](auto lanes) {
    constexpr int L = decltype(lanes)::value;
    if (bf16)
      conv_all<L, at::BFloat16>(x, w, bias_ptr, conv_layer, out.data_ptr<float>(), K, slot_stride, s);
    else
      conv_all<L, float>(x, w, bias_ptr, conv_layer, out.data_ptr<float>(), K, slot_stride, s);
  };
  if (width == 16) run(std::integral_constant<int, 16>{});
  else if (width == 8) run(std::integral_constant<int, 8>{});
  else run(std::integral_constant<int, 4>{});
  return out;
}

// ---- the gated delta rule and the SSD recurrence -------------------------------------
//
// Both walk a strip of a [rows, lanes] state (Gated DeltaNet: rows Dk, lanes Dv; Mamba-2:
// rows N, lanes P), kept in `state`, from the sequence's source slot to its slot.

constexpr int64_t kMaxRows = 512;

template <int W>
struct Strip {
  Lanes<W> rows[kMaxRows];
  int64_t num_rows;
  int64_t stride;  // floats between a state's rows

  void load_from(const float* matrix) {
    for (int64_t i = 0; i < num_rows; ++i)
      rows[i] = matrix ? load<W>(matrix + i * stride) : splat<W>(0.f);
  }
  void store_to(float* matrix) const {
    for (int64_t i = 0; i < num_rows; ++i) store<W>(matrix + i * stride, rows[i]);
  }
};

// sum_i weights[i] * update(row i, i) over the strip's rows, storing each updated row
// back where `write`; the rows are summed in four interleaved runs (i mod 4) added
// pairwise at the end: four chains of fused multiply-adds in registers, in one fixed
// order for every row count.
template <int W, typename Update>
inline Lanes<W> sum_rows(Strip<W>& st, const float* weights, const Update& update, bool write) {
  Lanes<W> s0{}, s1{}, s2{}, s3{};
  int64_t i = 0;
  for (; i + 4 <= st.num_rows; i += 4) {
    const Lanes<W> r0 = update(st.rows[i], i), r1 = update(st.rows[i + 1], i + 1);
    const Lanes<W> r2 = update(st.rows[i + 2], i + 2), r3 = update(st.rows[i + 3], i + 3);
    if (write) {
      st.rows[i] = r0;
      st.rows[i + 1] = r1;
      st.rows[i + 2] = r2;
      st.rows[i + 3] = r3;
    }
    s0 += weights[i] * r0;
    s1 += weights[i + 1] * r1;
    s2 += weights[i + 2] * r2;
    s3 += weights[i + 3] * r3;
  }
  for (; i < st.num_rows; ++i) {
    const Lanes<W> r = update(st.rows[i], i);
    if (write) st.rows[i] = r;
    s0 += weights[i] * r;
  }
  return (s0 + s1) + (s2 + s3);
}

// The state matrix of `head` in `slot` of one layer's states, at strip offset `lane0`.
inline float* matrix(float* layer_states, int64_t slot, int64_t head, int64_t slot_stride,
                     int64_t head_stride, int64_t lane0) {
  return layer_states + slot * slot_stride + head * head_stride + lane0;
}

template <int W>
void delta_item(const float* q, const float* k, const float* v, const float* g,
                const float* beta, float* layer_states, float* out, int64_t Hk, int64_t Hv,
                int64_t Dk, int64_t Dv, int64_t slot_stride, const Slots& s, int64_t b,
                int64_t h, int64_t j) {
  Strip<W> st;
  st.num_rows = Dk;
  st.stride = Dv;
  const int64_t head_stride = Dk * Dv, lane0 = j * W, kh = h / (Hv / Hk);
  const int64_t source = s.sources[b];
  st.load_from(source >= 0 ? matrix(layer_states, source, h, slot_stride, head_stride, lane0) : nullptr);
  size_t next = s.first_checkpoint(s.starts[b]);
  for (int64_t t = s.starts[b]; t < s.starts[b + 1]; ++t) {
    const float* qt = q + (t * Hk + kh) * Dk;
    const float* kt = k + (t * Hk + kh) * Dk;
    const float decay = std::exp(g[t * Hv + h]);
    // k^T (decay S), as decay (k^T S): one pass over the strip reads it, one updates it.
    const Lanes<W> kv = sum_rows(st, kt, [](Lanes<W> row, int64_t) { return row; }, false) * decay;
    const Lanes<W> delta = (load<W>(v + (t * Hv + h) * Dv + lane0) - kv) * beta[t * Hv + h];
    const Lanes<W> o = sum_rows(
        st, qt, [&](Lanes<W> row, int64_t i) { return row * decay + kt[i] * delta; }, true);
    store<W>(out + (t * Hv + h) * Dv + lane0, o);
    for (; next < s.checkpoints.size() && s.checkpoints[next].first == t; ++next)
      st.store_to(matrix(layer_states, s.checkpoints[next].second, h, slot_stride, head_stride, lane0));
  }
  st.store_to(matrix(layer_states, s.slots[b], h, slot_stride, head_stride, lane0));
}

torch::Tensor gated_delta_rule(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor g,
                               torch::Tensor beta, torch::Tensor ssm, int64_t layer,
                               torch::Tensor query_start, torch::Tensor slots,
                               torch::Tensor sources, torch::Tensor checkpoint_rows,
                               torch::Tensor checkpoint_slots) {
  const Slots s(query_start, slots, sources, checkpoint_rows, checkpoint_slots);
  check_state(ssm, layer, s, 5);
  for (auto* t : {&q, &k, &v, &g, &beta}) {
    TORCH_CHECK(t->scalar_type() == torch::kFloat32, "gated_delta_rule takes fp32 inputs");
    *t = t->contiguous();
  }
  const int64_t T = v.size(0), Hv = v.size(1), Dv = v.size(2), Hk = k.size(1), Dk = k.size(2);
  TORCH_CHECK(q.sizes() == k.sizes() && q.size(0) == T && Hv % Hk == 0, "q, k [T, Hk, Dk]; v [T, Hv, Dv]");
  TORCH_CHECK(g.size(0) == T && g.size(1) == Hv && beta.sizes() == g.sizes(), "g, beta [T, Hv]");
  TORCH_CHECK(ssm.size(2) == Hv && ssm.size(3) == Dk && ssm.size(4) == Dv && Dk <= kMaxRows,
              "ssm states are [L, S, Hv, Dk, Dv], Dk <= 512");
  TORCH_CHECK(s.starts.back() == T, "query_start does not cover the rows");
  const int width = strip_width(Dv);
  TORCH_CHECK(width, "the value head size must be a multiple of 4");
  auto out = torch::empty({T, Hv, Dv}, v.options());
  float* states = ssm.data_ptr<float>() + layer * ssm.stride(0);
  auto run = [&](auto lanes) {
    constexpr int L = decltype(lanes)::value;
    const int64_t strips = Dv / L;
    parallel_items(s.num_seqs() * Hv, [&](int64_t item) {
      for (int64_t j = 0; j < strips; ++j)
        delta_item<L>(q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(),
                      g.data_ptr<float>(), beta.data_ptr<float>(), states, out.data_ptr<float>(),
                      Hk, Hv, Dk, Dv, ssm.stride(1), s, item / Hv, item % Hv, j);
    });
  };
  if (width == 16) run(std::integral_constant<int, 16>{});
  else if (width == 8) run(std::integral_constant<int, 8>{});
  else run(std::integral_constant<int, 4>{});
  return out;
}

template <int W>
void ssd_item(const float* x, const float* dt, const float* a, const float* bm,
              const float* cm, const float* d, float* layer_states, float* out, int64_t H,
              int64_t P, int64_t G, int64_t N, int64_t slot_stride, const Slots& s, int64_t b,
              int64_t h, int64_t j) {
  Strip<W> st;
  st.num_rows = N;
  st.stride = P;
  const int64_t head_stride = N * P, lane0 = j * W, group = h / (H / G);
  const int64_t source = s.sources[b];
  st.load_from(source >= 0 ? matrix(layer_states, source, h, slot_stride, head_stride, lane0) : nullptr);
  size_t next = s.first_checkpoint(s.starts[b]);
  for (int64_t t = s.starts[b]; t < s.starts[b + 1]; ++t) {
    const float step = dt[t * H + h];
    const float decay = std::exp(step * a[h]);
    const Lanes<W> xt = load<W>(x + (t * H + h) * P + lane0);
    const Lanes<W> u = xt * step;
    const float* bt = bm + (t * G + group) * N;
    const float* ct = cm + (t * G + group) * N;
    const Lanes<W> y = sum_rows(
        st, ct, [&](Lanes<W> row, int64_t n) { return row * decay + bt[n] * u; }, true);
    store<W>(out + (t * H + h) * P + lane0, y + d[h] * xt);
    for (; next < s.checkpoints.size() && s.checkpoints[next].first == t; ++next)
      st.store_to(matrix(layer_states, s.checkpoints[next].second, h, slot_stride, head_stride, lane0));
  }
  st.store_to(matrix(layer_states, s.slots[b], h, slot_stride, head_stride, lane0));
}

torch::Tensor ssd_scan(torch::Tensor x, torch::Tensor dt, torch::Tensor a, torch::Tensor b,
                       torch::Tensor c, torch::Tensor d, torch::Tensor ssm, int64_t layer,
                       torch::Tensor query_start, torch::Tensor slots, torch::Tensor sources,
                       torch::Tensor checkpoint_rows, torch::Tensor checkpoint_slots) {
  const Slots s(query_start, slots, sources, checkpoint_rows, checkpoint_slots);
  check_state(ssm, layer, s, 5);
  for (auto* t : {&x, &dt, &a, &b, &c, &d}) {
    TORCH_CHECK(t->scalar_type() == torch::kFloat32, "ssd_scan takes fp32 inputs");
    *t = t->contiguous();
  }
  const int64_t T = x.size(0), H = x.size(1), P = x.size(2), G = b.size(1), N = b.size(2);
  TORCH_CHECK(dt.size(0) == T && dt.size(1) == H && a.numel() == H && d.numel() == H,
              "dt [T, H], a and d [H]");
  TORCH_CHECK(b.sizes() == c.sizes() && b.size(0) == T && H % G == 0, "b, c [T, G, N]");
  TORCH_CHECK(ssm.size(2) == H && ssm.size(3) == N && ssm.size(4) == P && N <= kMaxRows,
              "ssm states are [L, S, H, N, P], N <= 512");
  TORCH_CHECK(s.starts.back() == T, "query_start does not cover the rows");
  const int width = strip_width(P);
  TORCH_CHECK(width, "the head size must be a multiple of 4");
  auto out = torch::empty({T, H, P}, x.options());
  float* states = ssm.data_ptr<float>() + layer * ssm.stride(0);
  auto run = [&](auto lanes) {
    constexpr int L = decltype(lanes)::value;
    const int64_t strips = P / L;
    parallel_items(s.num_seqs() * H, [&](int64_t item) {
      for (int64_t j = 0; j < strips; ++j)
        ssd_item<L>(x.data_ptr<float>(), dt.data_ptr<float>(), a.data_ptr<float>(),
                    b.data_ptr<float>(), c.data_ptr<float>(), d.data_ptr<float>(), states,
                    out.data_ptr<float>(), H, P, G, N, ssm.stride(1), s, item / H, item % H, j);
    });
  };
  if (width == 16) run(std::integral_constant<int, 16>{});
  else if (width == 8) run(std::integral_constant<int, 8>{});
  else run(std::integral_constant<int, 4>{});
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {}

// The ops the recurrent layers call, eager and compiled alike (`kernels.recurrent`
// registers their fakes): each mutates its state tensor, passed whole with a layer index
// (Inductor mishandles an op that mutates views of one base, see `paged_attention.py`).
TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def(
      "causal_conv(Tensor x, Tensor weight, Tensor? bias, Tensor(a!) conv, int layer, "
      "Tensor query_start, Tensor slots, Tensor sources, Tensor checkpoint_rows, "
      "Tensor checkpoint_slots) -> Tensor");
  m.def(
      "gated_delta_rule(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(a!) ssm, "
      "int layer, Tensor query_start, Tensor slots, Tensor sources, Tensor checkpoint_rows, "
      "Tensor checkpoint_slots) -> Tensor");
  m.def(
      "ssd_scan(Tensor x, Tensor dt, Tensor a, Tensor b, Tensor c, Tensor d, Tensor(a!) ssm, "
      "int layer, Tensor query_start, Tensor slots, Tensor sources, Tensor checkpoint_rows, "
      "Tensor checkpoint_slots) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedserve, CPU, m) {
  m.impl("causal_conv", &causal_conv);
  m.impl("gated_delta_rule", &gated_delta_rule);
  m.impl("ssd_scan", &ssd_scan);
}
