// Torch-free per-position and per-row math of the fused verification op, shared by the C++ CPU kernel
// and the CUDA kernel so that CPU tests exercise the arithmetic the GPU runs. The spec is
// pad_kernels/verify_ref.py; names follow its glossary (draft tokens d_i, target probs p, draft probs q).
#pragma once

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__CUDACC__)
#define PAD_HD __host__ __device__ __forceinline__
#else
#define PAD_HD inline __attribute__((always_inline))
#endif
#if defined(_OPENMP) && !defined(__CUDACC__)
#define PAD_SIMD _Pragma("omp simd")  // the CPU build: the loop's iterations are independent (no aliasing)
#else
#define PAD_SIMD
#endif

namespace pad {

// An exponential draw of exactly 0 would make 0/0 in the race; the reference clamps to the same value.
constexpr float kMinExponential = 1e-30f;

PAD_HD float bits_to_float(int32_t i) {
#if defined(__CUDA_ARCH__)
  return __int_as_float(i);
#else
  float f;
  memcpy(&f, &i, sizeof f);  // a union here keeps GCC from vectorizing the loops that call exp
  return f;
#endif
}

// exp(x) for x <= 0 without libm, branch-free so that compilers vectorize it (CPU) and the GPU runs the
// same instructions: Cephes' expf (two-part ln 2 range reduction, degree-5 polynomial; relative error
// below 1e-7 against fp64). Inputs below -87 give exp(-87) ~ 1.6e-38 instead of a denormal;
// exp(-inf) is exactly 0 and NaN propagates.
PAD_HD float exp_nonpositive(float x) {
  const float xc = x > -87.0f ? x : -87.0f;  // not fmaxf: GCC calls libm for it instead of vectorizing
  const float n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round(x / ln 2)
  float r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * (r * r) + r + 1.0f;
  const float e = y * bits_to_float((int32_t)(n + 127.0f) << 23);  // y * 2^n
  return x == -INFINITY ? 0.0f : (x != x ? x : e);
}

// Online softmax state of one position's (temperature-scaled) logits x_v, and, when the draft's logits y_v
// of the position are read in the same pass, the draft's softmax and the cross term of KL(p || q).
struct RowStats {
  double sum;      // sum of exp(x - max); fp64, as the CPU's chunk sums: a tree of fp32 adds near 1 lost 2 ulps of p
  double draft_sum;  // sum of exp(y - draft_max)
  int64_t argmax;  // lowest index attaining max (-1 while empty)
  int64_t above;   // tokens ranked above the draft token: x > x_d, or x == x_d at a lower index (topk)
  float max;       // running max of x
  float sum_dexp;  // sum of exp(x - max) * (x - max) over finite x (<= 0): entropy = log(sum) - sum_dexp / sum
  float second, third;  // the next two largest x (a tie with max counts as one of them); -inf while absent
  float draft_max;  // running max of y
  float cross;      // sum of exp(x - max) * (x - y) over finite x: KL(p || q) = cross / sum - lse(x) + lse(y)
};

PAD_HD RowStats row_empty() {
  return RowStats{0.0, 0.0, -1, 0, -INFINITY, 0.0f, -INFINITY, -INFINITY, -INFINITY, 0.0f};
}

// One term of the cross sum: e = exp(x - max) of a logit x, y the draft's logit there (x - y is +inf where
// the draft gives no mass and the target does, making the divergence +inf as in the reference).
PAD_HD float cross_term(float x, float y, float e) {
  if (x == -INFINITY) return 0.0f;
  return y == -INFINITY ? INFINITY : e * (x - y);
}

// Whether token v with logit x ranks above the draft token d with logit x_d (the argmax's tie rule).
PAD_HD bool ranks_above(float x, int64_t v, float x_d, int64_t d) { return x > x_d || (x == x_d && v < d); }

// Add exp(y - draft_max) of one draft logit to the draft's online softmax, raising the max first if needed.
PAD_HD void draft_push(RowStats& s, float y) {
  if (y > s.draft_max) {
    s.draft_sum = s.draft_max == -INFINITY ? 0.0 : s.draft_sum * exp_nonpositive(s.draft_max - y);
    s.draft_max = y;
  }
  s.draft_sum += exp_nonpositive(y == -INFINITY ? -INFINITY : y - s.draft_max);
}

// KL(p || q) of the position from a state that read both the target's and the draft's logits.
PAD_HD float row_divergence(const RowStats& s) {
  const float sum = static_cast<float>(s.sum);
  return s.cross / sum - (s.max + logf(sum)) + (s.draft_max + logf(static_cast<float>(s.draft_sum)));
}

// Keep the three largest of (top0 >= top1 >= top2) and x; NaN never enters.
PAD_HD void top3_push(float& top0, float& top1, float& top2, float x) {
  if (x > top0) {
    top2 = top1;
    top1 = top0;
    top0 = x;
  } else if (x > top1) {
    top2 = top1;
    top1 = x;
  } else if (x > top2) {
    top2 = x;
  }
}

// Rescale a state to a new, larger-or-equal max. A state with max -inf holds no mass: its sums become
// 0 (or stay NaN, so that NaN logits always surface in the entropy).
PAD_HD void row_rescale(RowStats& s, float new_max) {
  if (s.max == new_max) return;
  if (s.max == -INFINITY) {
    s.sum *= 0.0f;
    s.sum_dexp *= 0.0f;
    s.cross *= 0.0f;
  } else {
    const float delta = new_max - s.max;  // every x - max term shrinks by delta
    const float scale = exp_nonpositive(-delta);
    s.sum_dexp = scale * (s.sum_dexp - delta * static_cast<float>(s.sum));
    s.sum *= scale;
    s.cross *= scale;
  }
  s.max = new_max;
}

// Merge two states of disjoint index ranges (either order); ties keep the lower index.
PAD_HD RowStats row_merge(RowStats a, RowStats b) {
  const float m = fmaxf(a.max, b.max);
  int64_t arg;
  if (a.max > b.max || b.argmax < 0) arg = a.argmax;
  else if (b.max > a.max || a.argmax < 0) arg = b.argmax;
  else arg = a.argmax < b.argmax ? a.argmax : b.argmax;
  // The two largest of b's three join a's (b's max joins as a value; the larger max is m).
  float top0 = a.max, top1 = a.second, top2 = a.third;
  top3_push(top0, top1, top2, b.max);
  top3_push(top0, top1, top2, b.second);
  top3_push(top0, top1, top2, b.third);
  row_rescale(a, m);
  row_rescale(b, m);
  // The draft's softmax states against the larger of their maxima (an empty one holds no mass).
  const float dm = fmaxf(a.draft_max, b.draft_max);
  const double da = a.draft_max == -INFINITY ? 0.0 : a.draft_sum * exp_nonpositive(a.draft_max - dm);
  const double db = b.draft_max == -INFINITY ? 0.0 : b.draft_sum * exp_nonpositive(b.draft_max - dm);
  return RowStats{a.sum + b.sum, da + db, arg, a.above + b.above, m, a.sum_dexp + b.sum_dexp, top1, top2, dm,
                  a.cross + b.cross};
}

// Natural-log entropy; non-finite when the logits were (a row of only -inf gives -inf, as the reference).
PAD_HD float row_entropy(const RowStats& s) {
  const float sum = static_cast<float>(s.sum);
  if (sum == 0.0f) return -INFINITY;
  return logf(sum) - s.sum_dexp / sum;
}

// -sum p log p over the three largest probabilities of the full softmax (FLy's gate); zero mass adds 0.
PAD_HD float row_top3_entropy(const RowStats& s) {
  if (!(s.sum > 0.0f)) return s.sum != s.sum ? s.sum : 0.0f;  // NaN stays NaN; no mass: 0, as the reference
  const float log_sum = logf(static_cast<float>(s.sum));
  const float top[3] = {s.max, s.second, s.third};
  float h = 0.0f;
  for (int j = 0; j < 3; ++j) {
    if (top[j] == -INFINITY) continue;
    const float logp = (top[j] - s.max) - log_sum;
    h -= expf(logp) * logp;
  }
  return h;
}

// A draft token id outside [0, V) reads no memory: its p is NaN, which no rule accepts (verify_block
// raises for CPU tensors before a kernel runs; on a GPU that check would cost a host sync).
PAD_HD bool in_vocab(int64_t d, int64_t V) { return d >= 0 && d < V; }

// p(v) for a logit x of this position.
PAD_HD float row_prob(const RowStats& s, float x) {
  return x == -INFINITY ? 0.0f : exp_nonpositive(x - s.max) / static_cast<float>(s.sum);
}

// Folded pivot classifier on one position: sigmoid(w2 . relu(W1^T [h; f] + b1 + bias) + b2).
// h [H] (any type via load), f [F], w1 [H+F, D] row-major, b1 [D], bias [D] this position's addition to b1
// (what the caller folded in from inputs the op does not see) or nullptr, w2 [D]; acc [D] is scratch.
template <typename Load>
PAD_HD float pivot_prob(Load h_at, int64_t H, const float* f, int F, const float* w1, const float* b1,
                        const float* bias, const float* w2, float b2, int64_t D, float* acc) {
  for (int64_t j = 0; j < D; ++j) acc[j] = bias != nullptr ? b1[j] + bias[j] : b1[j];
  for (int64_t i = 0; i < H; ++i) {
    const float hi = h_at(i);
    const float* row = w1 + i * D;
    PAD_SIMD
    for (int64_t j = 0; j < D; ++j) acc[j] += hi * row[j];
  }
  for (int k = 0; k < F; ++k) {
    const float* row = w1 + (H + k) * D;
    for (int64_t j = 0; j < D; ++j) acc[j] += f[k] * row[j];
  }
  float score = b2;
  for (int64_t j = 0; j < D; ++j) score += w2[j] * fmaxf(acc[j], 0.0f);
  return 1.0f / (1.0f + expf(-score));
}

// Training-free relaxations of the exact rule (pad_kernels.AcceptRule; codes are RULES' order there).
enum RuleKind : int { kRuleExact = 0, kRuleTypical = 1, kRuleThreshold = 2, kRuleFly = 3, kRuleKl = 4, kRuleTopk = 5 };

struct Rule {
  int kind;
  float a, b;  // typical: epsilon, delta; threshold: tau; fly: gate, window; kl: epsilon, top1; topk: k, delta
};

// What a rule reads of one position besides p(d): the entropy, max p, KL(p || q) and d's rank in p.
struct PositionView {
  float entropy, top_prob, divergence;
  int64_t rank;
};

// Typical, threshold, kl or topk acceptance of a token the exact rule rejected (fly is decided over the
// row). A NaN p(d) (a draft id outside the vocabulary) is never accepted.
PAD_HD bool rule_override(const Rule& r, float p_draft, const PositionView& v) {
  if (r.kind == kRuleTypical) return p_draft > fminf(r.a, r.b * expf(-v.entropy));
  if (r.kind == kRuleThreshold) return p_draft >= r.a;
  if (r.kind == kRuleKl) return v.divergence <= r.a && v.top_prob < r.b && p_draft == p_draft;
  if (r.kind == kRuleTopk) return (float)v.rank < r.a && p_draft >= v.top_prob - r.b;
  return false;
}

// Exact-rule test of one draft token: greedy d == argmax; sampling u * q(d) <= p(d).
PAD_HD bool exact_accept(bool sampling, int64_t draft, int64_t argmax, float u, float q_draft, float p_draft) {
  return sampling ? u * q_draft <= p_draft : draft == argmax;
}

// Pivot override of a draft token the exact rule rejected.
PAD_HD bool pivot_override(bool has_classifier, float sigma, float floor_, float pivot_prob_, float p_draft) {
  return has_classifier && sigma > 0.0f && pivot_prob_ <= sigma && p_draft >= floor_;
}

// One row's acceptance: the call's rule, sigma and kind (greedy or sampled), or the row's own from row_rules
// [B, 6] (pad_kernels.ROW_RULE_COLUMNS: rule, a, b, sigma, exact_until, sampled); its first exact_until draft
// positions are decided by the exact rule alone.
struct RowRule {
  Rule rule;
  float sigma;
  int64_t exact_until;
  bool sampled;
};

PAD_HD RowRule row_rule(const float* row_rules, int64_t b, const Rule& rule, float sigma, bool sampling) {
  if (row_rules == nullptr) return RowRule{rule, sigma, 0, sampling};
  const float* r = row_rules + b * 6;
  return RowRule{Rule{static_cast<int>(r[0]), r[1], r[2]}, r[3], static_cast<int64_t>(r[4]),
                 sampling && r[5] != 0.0f};
}

// The logits row position (b, i) reads: its own of the [B, K+1, V] block, or logit_rows[b, i] of a [R, V]
// tensor (-1: the position has none).
PAD_HD int64_t logit_row(const int64_t* logit_rows, int64_t b, int64_t i, int64_t K) {
  return logit_rows == nullptr ? b * (K + 1) + i : logit_rows[b * (K + 1) + i];
}

// A row's own draft length: num_drafts[b] clamped to [0, K] (nullptr: K), a row that stopped drafting early.
PAD_HD int64_t row_drafts(const int64_t* num_drafts, int64_t b, int64_t K) {
  if (num_drafts == nullptr) return K;
  const int64_t n = num_drafts[b];
  return n < 0 ? 0 : (n > K ? K : n);
}

// FLy's window: draft i (0-based) is followed, inside the row's k_row drafts, by window - 1 drafts equal to
// the argmax (K is the block's stride).
PAD_HD bool fly_window_matches(int64_t b, int64_t i, int64_t K, int64_t k_row, int64_t window,
                               const int64_t* drafts, const int64_t* argmax) {
  if (i + window > k_row) return false;  // the window runs past the row's drafts: rejected in this block
  for (int64_t k = i + 1; k < i + window; ++k)
    if (drafts[b * K + k] != argmax[b * (K + 1) + k]) return false;
  return true;
}

// The accepted prefix of row b under its RowRule r: writes accepted / pivot_accepted [K] of the row, returns
// how many. Arrays are the whole batch's (drafts, token_prob, pivot_prob, uniforms, divergence [B, K];
// argmax, entropy, top3_entropy, stats [B, K+1]; draft_probs [B, K, V], or [R, V] read through logit_rows,
// read only when the row samples, at its own drafts).
PAD_HD int64_t accept_row(int64_t b, int64_t K, int64_t V, const int64_t* drafts, const int64_t* argmax,
                          const float* token_prob, const float* pivot_prob, const float* draft_probs,
                          const int64_t* logit_rows, const float* uniforms, bool has_classifier, const RowRule& r,
                          float floor_, const float* entropy, const float* top3_entropy, const RowStats* stats,
                          const float* divergence, int64_t k_row, bool* accepted, bool* pivot_accepted) {
  int64_t n = 0;
  bool open = true;
  const bool sampling = r.sampled;
  const Rule& rule = r.rule;
  for (int64_t i = 0; i < K; ++i) {
    const int64_t j = b * K + i, d = drafts[j], at = b * (K + 1) + i;
    const int64_t q_row = logit_rows == nullptr ? j : logit_rows[at];  // the draft's distribution there
    const float q = sampling && i < k_row && in_vocab(d, V) ? draft_probs[q_row * V + d] : 0.0f;
    const bool exact = exact_accept(sampling, d, argmax[at], sampling ? uniforms[j] : 0.0f, q, token_prob[j]);
    const PositionView view{entropy[at], row_prob(stats[at], stats[at].max), divergence[j], stats[at].above};
    const bool relaxed = i >= r.exact_until &&
                         (pivot_override(has_classifier, r.sigma, floor_, pivot_prob[j], token_prob[j]) ||
                          rule_override(rule, token_prob[j], view) ||
                          (rule.kind == kRuleFly && in_vocab(d, V) && top3_entropy[at] >= rule.a &&
                           fly_window_matches(b, i, K, k_row, (int64_t)rule.b, drafts, argmax)));
    open = open && i < k_row && (exact || relaxed);
    accepted[j] = open;
    pivot_accepted[j] = open && !exact;
    n += open;
  }
  return n;
}

// One candidate of the exponential race for the correction/bonus token: residual max(0, p - q) and the
// fallback p (used when the residual is all zero) are raced at once, keys r / e, lowest index on ties.
struct Race {
  float residual_sum;
  float best_r, best_p;  // best keys
  int64_t arg_r, arg_p;
};

PAD_HD Race race_empty() { return Race{0.0f, -1.0f, -1.0f, -1, -1}; }

PAD_HD void race_push(Race& r, float p, float q, float e, int64_t v) {
  const float res = fmaxf(p - q, 0.0f);
  const float ec = fmaxf(e, kMinExponential);
  r.residual_sum += res;
  const float kr = res / ec, kp = p / ec;  // divisions, as the reference, so keys round alike
  if (kr > r.best_r) { r.best_r = kr; r.arg_r = v; }
  if (kp > r.best_p) { r.best_p = kp; r.arg_p = v; }
}

PAD_HD Race race_merge(Race a, Race b) {  // a holds the lower indices
  Race out;
  out.residual_sum = a.residual_sum + b.residual_sum;
  const bool br = b.best_r > a.best_r || (b.best_r == a.best_r && b.arg_r >= 0 && (a.arg_r < 0 || b.arg_r < a.arg_r));
  const bool bp = b.best_p > a.best_p || (b.best_p == a.best_p && b.arg_p >= 0 && (a.arg_p < 0 || b.arg_p < a.arg_p));
  out.best_r = br ? b.best_r : a.best_r;
  out.arg_r = br ? b.arg_r : a.arg_r;
  out.best_p = bp ? b.best_p : a.best_p;
  out.arg_p = bp ? b.arg_p : a.arg_p;
  return out;
}

PAD_HD int64_t race_winner(const Race& r) { return r.residual_sum > 0.0f ? r.arg_r : r.arg_p; }

// ---- The CUDA backend's work per thread (csrc/cuda/verify_block.cu), also run on the CPU by
// emulate_cuda_verify (csrc/cpu/emulate_cuda.cpp) in the same order, so tests check the GPU's arithmetic.
// A thread block of T threads (T a power of 2) reduces one value per thread as a tree: thread t takes
// t + stride for stride = T/2, T/4, ..., 1.

// Slice sp of the vocabulary when it is cut into slices of split_len logits: [lo, hi), maybe empty.
struct Slice {
  int64_t lo, hi;
};

PAD_HD Slice vocab_slice(int64_t sp, int64_t split_len, int64_t V) {
  const int64_t lo = sp * split_len < V ? sp * split_len : V;
  return Slice{lo, lo + split_len < V ? lo + split_len : V};
}

// Thread t of T over a slice: logits lo + t, lo + t + T, ... (x_at(v): the scaled logit v), kGroup at a
// time: the group's max first, so the running sums are rescaled at most once per group (each rescale
// rounds; one per logit cost the GPU path 4 ulps of p_target), and kGroup loads are in flight at once.
constexpr int kGroup = 8;

// With the draft's logits (y_at, has_draft) the same pass adds the draft's softmax and the cross term of
// the divergence; with a draft token d >= 0 (logit x_d) it counts the tokens ranked above it.
template <typename Load, typename DraftLoad>
PAD_HD RowStats thread_row_stats(Load x_at, DraftLoad y_at, bool has_draft, int64_t d, float x_d, Slice s, int64_t t,
                                 int64_t T) {
  RowStats r = row_empty();
  for (int64_t v0 = s.lo + t; v0 < s.hi; v0 += kGroup * T) {
    float x[kGroup];
    for (int g = 0; g < kGroup; ++g) x[g] = v0 + g * T < s.hi ? x_at(v0 + g * T) : -INFINITY;
    if (d >= 0)
      for (int g = 0; g < kGroup; ++g) r.above += v0 + g * T < s.hi && ranks_above(x[g], v0 + g * T, x_d, d);
    float top0 = r.max, gmax = -INFINITY;
    int64_t garg = -1;
    for (int g = 0; g < kGroup; ++g) {
      top3_push(top0, r.second, r.third, x[g]);
      if (x[g] > gmax) {
        gmax = x[g];
        garg = v0 + g * T;
      }
    }
    // The argmax: the first index of a new maximum, or the group's first index while the row holds only
    // -inf (or NaN) so far, as torch's argmax.
    if (gmax > r.max) {
      row_rescale(r, gmax);
      r.argmax = garg;
    } else if (r.argmax < 0) {
      r.argmax = v0;
    }
    for (int g = 0; g < kGroup; ++g) {
      const float e = exp_nonpositive(x[g] == -INFINITY ? -INFINITY : x[g] - r.max);
      r.sum += e;
      r.sum_dexp += x[g] == -INFINITY ? 0.0f : e * (x[g] - r.max);
      if (has_draft && v0 + g * T < s.hi) {
        const float y = y_at(v0 + g * T);
        r.cross += cross_term(x[g], y, e);
        draft_push(r, y);
      }
    }
  }
  return r;
}

// Thread t of T over the S slice states of one position: slices t, t + T, ...
PAD_HD RowStats thread_slice_stats(const RowStats* parts, int64_t S, int64_t t, int64_t T) {
  RowStats r = row_empty();
  for (int64_t sp = t; sp < S; sp += T) r = row_merge(r, parts[sp]);
  return r;
}

// Thread t of T's part of the exponential race over a slice of one position (stats: its merged softmax
// state; q: the draft's probabilities there, nullptr for 0; e: the exponential draws of the row).
template <typename Load>
PAD_HD Race thread_race(const RowStats& stats, Load x_at, const float* q, const float* e, Slice s, int64_t t,
                        int64_t T) {
  Race r = race_empty();
  for (int64_t v = s.lo + t; v < s.hi; v += T) race_push(r, row_prob(stats, x_at(v)), q ? q[v] : 0.0f, e[v], v);
  return r;
}

// Thread t of T over the S slices' races of one row (race_merge decides ties by index, so any order).
PAD_HD Race thread_slice_races(const Race* parts, int64_t S, int64_t t, int64_t T) {
  Race r = race_empty();
  for (int64_t sp = t; sp < S; sp += T) r = race_merge(r, parts[sp]);
  return r;
}

// The classifier over a tile of up to kTile positions: thread t owns hidden units j = t, t + T, ... and
// reads each weight of W1 once per tile (not once per position). For one unit j:
//   clf_unit_begin   acc[p] = b1[j] + bias[p][j]  (bias [np, D] the tile's rows of the per-position bias, or none)
//   clf_unit_chunk   acc[p] += h[p][k] * W1[k0 + k, j] for the kHChunk hidden elements staged in h
//   clf_unit_end     part[p] += w2[j] * relu(acc[p] + p_target * W1[H, j] + entropy * W1[H + 1, j])
// then part[p] is summed over the threads as a tree; the same sums as pivot_prob in another order.
constexpr int kTile = 16;
constexpr int kHChunk = 32;

PAD_HD void clf_unit_begin(float* acc, const float* b1, const float* bias, int np, int64_t D, int64_t j) {
  for (int p = 0; p < kTile; ++p) acc[p] = bias != nullptr && p < np ? b1[j] + bias[p * D + j] : b1[j];
}

PAD_HD void clf_unit_chunk(float* acc, const float (*h)[kHChunk], int nk, const float* w1_chunk, int64_t D,
                           int64_t j) {  // w1_chunk = W1 + k0 * D
  for (int k = 0; k < nk; ++k) {
    const float w = w1_chunk[k * D + j];
    for (int p = 0; p < kTile; ++p) acc[p] += h[p][k] * w;
  }
}

PAD_HD void clf_unit_end(float* part, const float* acc, int np, const float* p_target, const float* entropy,
                         const float* w1_features, const float* w2, int64_t D, int64_t j) {  // w1_features = W1 + H * D
  for (int p = 0; p < kTile; ++p) {  // a constant trip count keeps acc and part in registers on the GPU
    if (p >= np) continue;
    float a = acc[p];
    a += p_target[p] * w1_features[j];
    a += entropy[p] * w1_features[D + j];
    part[p] += w2[j] * fmaxf(a, 0.0f);
  }
}

PAD_HD float sigmoid(float score) { return 1.0f / (1.0f + expf(-score)); }

}  // namespace pad
