// CUDA backend of pad_kernels.verify_block, free of torch headers (plain nvcc compiles it in seconds).
// Kernel 1, grid (row x position, S): each thread block scans one of S slices of the vocabulary with the
// online softmax of pad/verify_math.h (flash-decoding's split: at B = 1 the K + 1 positions alone would
// leave most of a GPU idle) and writes the slice's state (with the draft's logits also the draft's softmax
// and the cross term of KL(p || q); for topk the count of tokens ranked above the draft token). Kernel 2, one thread block per row: merges the S
// states of each position exactly (ties keep the lowest index), the folded classifier as a tiled product
// over the row's positions (each W1 weight read once per 16 positions), and the accepted prefix. Kernel 3
// (sampling only), grid (row, S): the exponential race over the residual at the row's first rejection,
// one slice per block; the last block of a row to finish merges the S races. The per-thread math is the
// header's, which the CPU extension runs in the same order (emulate_cuda_verify) for the tests.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "pad/verify_math.h"
#include "verify_block_cuda.h"

namespace {

using pad_cuda::kThreads;

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
struct ScaledLogits {  // x_at(v): logit v of one position, divided by the temperature when sampling
  const T* x;
  float temperature;
  __device__ float operator()(int64_t v) const {
    const float f = to_float(x[v]);
    return temperature > 0.0f ? f / temperature : f;
  }
};

struct MergeStats {
  __device__ pad::RowStats operator()(const pad::RowStats& a, const pad::RowStats& b) const { return pad::row_merge(a, b); }
};
struct MergeRaces {
  __device__ pad::Race operator()(const pad::Race& a, const pad::Race& b) const { return pad::race_merge(a, b); }
};

// The tree of the header: every thread gets the block's value; `shared` is free again on return.
template <typename V, typename Merge>
__device__ V block_reduce(V* shared, const V& mine, Merge merge) {
  shared[threadIdx.x] = mine;
  __syncthreads();
  for (int stride = blockDim.x / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) shared[threadIdx.x] = merge(shared[threadIdx.x], shared[threadIdx.x + stride]);
    __syncthreads();
  }
  const V all = shared[0];
  __syncthreads();
  return all;
}

template <typename T>
__global__ void __launch_bounds__(kThreads) split_stats_kernel(const T* __restrict__ logits,  // [B, K+1, V] / [R, V]
                                                               const T* __restrict__ draft_logits,  // [B, K, V] or null
                                                               const int64_t* __restrict__ drafts,  // [B, K]
                                                               const int64_t* logit_rows,  // [B, K+1] or null
                                                               const float* row_rules,     // [B, 6] or null
                                                               pad::RowStats* parts,          // [B, K+1, S] out
                                                               int64_t K, int64_t V, int64_t split_len,
                                                               float temperature, pad::Rule rule) {
  __shared__ pad::RowStats shared[kThreads];
  const int64_t pos = blockIdx.x, sp = blockIdx.y, S = gridDim.y, b = pos / (K + 1), i = pos % (K + 1);
  const int64_t row = pad::logit_row(logit_rows, b, i, K);
  if (row < 0) {  // no logits here: the whole block leaves before any barrier
    if (threadIdx.x == 0) parts[pos * S + sp] = pad::row_empty();
    return;
  }
  const ScaledLogits<T> x{logits + row * V, temperature};
  const bool has_draft = i < K && draft_logits != nullptr;
  const ScaledLogits<T> y{has_draft ? draft_logits + (b * K + i) * V : nullptr, temperature};
  const int64_t d = i < K ? drafts[b * K + i] : -1;
  // topk: the tokens ranked above d
  const bool rank = pad::row_rule(row_rules, b, rule, 0.0f, false).rule.kind == pad::kRuleTopk && pad::in_vocab(d, V);
  const pad::RowStats s = block_reduce(
      shared, pad::thread_row_stats(x, y, has_draft, rank ? d : -1, rank ? x(d) : 0.0f,
                                    pad::vocab_slice(sp, split_len, V), threadIdx.x, blockDim.x), MergeStats{});
  if (threadIdx.x == 0) parts[pos * S + sp] = s;
}

template <typename T, typename H>
__global__ void __launch_bounds__(kThreads) accept_kernel(
    const T* __restrict__ logits, const int64_t* __restrict__ drafts,
    const H* __restrict__ hidden,  // [B, K+1, Hdim]
    const float* w1, const float* b1, const float* w2, const float* b2,  // [Hdim+2, D], [D], [D], []
    const float* clf_bias,  // [B, K, D] or nullptr
    const float* draft_probs, const float* uniforms, const pad::RowStats* parts, int64_t S,
    float* entropy, float* top3_entropy, int64_t* argmax, float* token_prob, float* divergence,
    bool has_draft_logits, pad::RowStats* stats_out,
    float* pivot_prob, bool* accepted, bool* pivot_accepted, int64_t* num_accepted, int64_t* next_token,
    unsigned* races_done, int64_t K, int64_t V, int64_t Hdim, int64_t D, float sigma, float floor_,
    float temperature, pad::Rule rule, const int64_t* num_drafts, const float* row_rules, const int64_t* logit_rows) {
  __shared__ pad::RowStats shared[kThreads];
  __shared__ float h[pad::kTile][pad::kHChunk];
  __shared__ float red[pad::kTile][kThreads];
  const int64_t b = blockIdx.x, K1 = K + 1, t = threadIdx.x, threads = blockDim.x;
  const bool has_clf = w1 != nullptr, sampling = temperature > 0.0f;

  // 0. Each position's state from its S slices.
  for (int64_t i = 0; i < K1; ++i) {
    const int64_t pos = b * K1 + i, row = pad::logit_row(logit_rows, b, i, K);
    const pad::RowStats s = block_reduce(shared, pad::thread_slice_stats(parts + pos * S, S, t, threads), MergeStats{});
    if (t != 0) continue;
    stats_out[pos] = s;
    if (row < 0) {  // no logits here (past the row's drafts)
      entropy[pos] = top3_entropy[pos] = NAN;
      argmax[pos] = -1;
      if (i < K) {
        token_prob[b * K + i] = NAN;
        divergence[b * K + i] = -1.0f;
      }
      continue;
    }
    entropy[pos] = pad::row_entropy(s);
    top3_entropy[pos] = pad::row_top3_entropy(s);
    argmax[pos] = s.argmax;
    if (i < K) {
      const int64_t d = drafts[b * K + i];
      token_prob[b * K + i] = pad::in_vocab(d, V) ? pad::row_prob(s, ScaledLogits<T>{logits + row * V, temperature}(d)) : NAN;
      divergence[b * K + i] = has_draft_logits ? pad::row_divergence(s) : -1.0f;
    }
  }
  __syncthreads();  // thread 0's features are read by every thread below

  // 1. Pivot probabilities, kTile positions at a time (has_clf is the same for every thread: the barriers
  // inside are reached by all).
  if (!has_clf)
    for (int64_t i = t; i < K; i += threads) pivot_prob[b * K + i] = 1.0f;
  for (int64_t i0 = 0; has_clf && i0 < K; i0 += pad::kTile) {
    const int np = K - i0 < pad::kTile ? static_cast<int>(K - i0) : pad::kTile;
    float part[pad::kTile] = {};
    for (int64_t j0 = 0; j0 < D; j0 += threads) {  // every thread runs the same iterations
      const int64_t j = j0 + t;
      float acc[pad::kTile];
      const float* bias = clf_bias != nullptr ? clf_bias + (b * K + i0) * D : nullptr;  // the tile's rows
      if (j < D) pad::clf_unit_begin(acc, b1, bias, np, D, j);
      for (int64_t k0 = 0; k0 < Hdim; k0 += pad::kHChunk) {
        const int nk = Hdim - k0 < pad::kHChunk ? static_cast<int>(Hdim - k0) : pad::kHChunk;
        for (int e = t; e < pad::kTile * pad::kHChunk; e += threads) {  // stage hidden[i0 .., k0 ..] as fp32
          const int p = e / pad::kHChunk, k = e % pad::kHChunk;
          h[p][k] = p < np && k < nk ? to_float(hidden[(b * K1 + i0 + p) * Hdim + k0 + k]) : 0.0f;
        }
        __syncthreads();
        if (j < D) pad::clf_unit_chunk(acc, h, nk, w1 + k0 * D, D, j);
        __syncthreads();
      }
      if (j < D) pad::clf_unit_end(part, acc, np, token_prob + b * K + i0, entropy + b * K1 + i0, w1 + Hdim * D, w2, D, j);
    }
    for (int p = 0; p < pad::kTile; ++p) red[p][t] = part[p];
    __syncthreads();
    for (int stride = threads / 2; stride > 0; stride /= 2) {
      if (t < stride)
        for (int p = 0; p < pad::kTile; ++p) red[p][t] += red[p][t + stride];
      __syncthreads();
    }
    if (t < np) pivot_prob[b * K + i0 + t] = pad::sigmoid(red[t][0] + *b2);
    __syncthreads();
  }
  __syncthreads();
  for (int64_t i = t; i < K; i += threads)  // positions without logits have no pivot probability
    if (pad::logit_row(logit_rows, b, i, K) < 0) pivot_prob[b * K + i] = NAN;
  __syncthreads();  // pivot_prob is read by thread 0

  // 2. The accepted prefix (one thread: K is small).
  if (t != 0) return;
  const pad::RowRule rr = pad::row_rule(row_rules, b, rule, sigma, sampling);
  const int64_t n = pad::accept_row(b, K, V, drafts, argmax, token_prob, pivot_prob, draft_probs, logit_rows,
                                    uniforms, has_clf, rr, floor_, entropy, top3_entropy, stats_out, divergence,
                                    pad::row_drafts(num_drafts, b, K), accepted, pivot_accepted);
  num_accepted[b] = n;
  if (sampling) races_done[b] = 0;  // kernel 3 counts its finished slices here (stream order: it runs after)
  const int64_t row = pad::logit_row(logit_rows, b, n, K);
  if (row < 0 || !rr.sampled) next_token[b] = row < 0 ? -1 : argmax[b * K1 + n];  // no row: the caller's token
}

template <typename T>
__global__ void __launch_bounds__(kThreads) draw_kernel(
    const T* __restrict__ logits, const float* draft_probs, const float* exponentials,
    const int64_t* num_accepted, const int64_t* num_drafts, const pad::RowStats* stats,  // [B, K+1]
    pad::Race* race_parts,  // [B, S] scratch
    unsigned* races_done,   // [B], 0 on entry
    int64_t* next_token, int64_t K, int64_t V, int64_t split_len, float temperature,
    const float* row_rules, const int64_t* logit_rows) {
  __shared__ pad::Race shared[kThreads];
  __shared__ bool last;
  const int64_t b = blockIdx.x, sp = blockIdx.y, S = gridDim.y, t = threadIdx.x, threads = blockDim.x;
  const int64_t n = num_accepted[b], pos = b * (K + 1) + n, row = pad::logit_row(logit_rows, b, n, K);
  // A greedy row of a sampled call, or no logits there: kernel 2 wrote its token (the whole block leaves).
  if (row < 0 || (row_rules != nullptr && row_rules[b * 6 + 5] == 0.0f)) return;
  const pad::RowStats s = stats[pos];
  // Past the row's drafts q is 0: the bonus token is drawn from p.
  const int64_t q_row = logit_rows == nullptr ? b * K + n : row;
  const float* q = n < pad::row_drafts(num_drafts, b, K) ? draft_probs + q_row * V : nullptr;
  const pad::Race r = block_reduce(
      shared, pad::thread_race(s, ScaledLogits<T>{logits + row * V, temperature}, q, exponentials + b * V,
                               pad::vocab_slice(sp, split_len, V), t, threads),
      MergeRaces{});
  if (t == 0) {
    race_parts[b * S + sp] = r;
    __threadfence();  // the part is visible to the whole GPU before this block counts itself done
    last = atomicAdd(races_done + b, 1u) == S - 1;
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  pad::Race mine = pad::race_empty();
  for (int64_t p = t; p < S; p += threads) {  // L2 reads (__ldcg): other blocks wrote these parts
    const pad::Race* src = race_parts + b * S + p;
    pad::Race part;
    part.residual_sum = __ldcg(&src->residual_sum);
    part.best_r = __ldcg(&src->best_r);
    part.best_p = __ldcg(&src->best_p);
    part.arg_r = __ldcg(reinterpret_cast<const long long*>(&src->arg_r));
    part.arg_p = __ldcg(reinterpret_cast<const long long*>(&src->arg_p));
    mine = pad::race_merge(mine, part);
  }
  const pad::Race all = block_reduce(shared, mine, MergeRaces{});
  if (t == 0) {
    next_token[b] = pad::race_winner(all);
    races_done[b] = 0;
  }
}

template <typename T, typename H>
cudaError_t launch(const pad_cuda::VerifyArgs& a, cudaStream_t stream) {
  const T* logits = static_cast<const T*>(a.logits);
  const int64_t K1 = a.K + 1;
  pad_cuda::Scratch s = pad_cuda::scratch_layout(a.scratch, a.B, a.K, a.splits, a.race_splits);
  if (a.B * K1 == 0) return cudaSuccess;
  split_stats_kernel<T><<<dim3(a.B * K1, a.splits), kThreads, 0, stream>>>(
      logits, static_cast<const T*>(a.draft_logits), a.drafts, a.logit_rows, a.row_rules, s.parts, a.K, a.V,
      a.split_len, a.temperature, a.rule);
  accept_kernel<T, H><<<a.B, kThreads, 0, stream>>>(
      logits, a.drafts, static_cast<const H*>(a.hidden), a.w1, a.b1, a.w2, a.b2, a.clf_bias, a.draft_probs, a.uniforms,
      s.parts,
      a.splits, a.entropy, a.top3_entropy, a.argmax, a.token_prob, a.divergence, a.draft_logits != nullptr, s.stats,
      a.pivot_prob, a.accepted,
      a.pivot_accepted, a.num_accepted, a.next_token, s.races_done, a.K, a.V, a.H, a.D, a.sigma, a.floor_,
      a.temperature, a.rule, a.num_drafts, a.row_rules, a.logit_rows);
  if (a.temperature > 0.0f)
    draw_kernel<T><<<dim3(a.B, a.race_splits), kThreads, 0, stream>>>(
        logits, a.draft_probs, a.exponentials, a.num_accepted, a.num_drafts, s.stats, s.race_parts,
        s.races_done, a.next_token, a.K, a.V, a.race_split_len, a.temperature, a.row_rules, a.logit_rows);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_hidden(const pad_cuda::VerifyArgs& a, cudaStream_t stream) {
  switch (a.hidden_dtype) {
    case pad_cuda::DType::kFloat32: return launch<T, float>(a, stream);
    case pad_cuda::DType::kFloat16: return launch<T, __half>(a, stream);
    case pad_cuda::DType::kBFloat16: return launch<T, __nv_bfloat16>(a, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace

namespace pad_cuda {

cudaError_t verify_block(const VerifyArgs& a, cudaStream_t stream) {
  if (a.splits < 1 || a.splits > 65535 || a.race_splits < 1 || a.race_splits > 65535) return cudaErrorInvalidValue;
  switch (a.logits_dtype) {
    case DType::kFloat32: return launch_hidden<float>(a, stream);
    case DType::kFloat16: return launch_hidden<__half>(a, stream);
    case DType::kBFloat16: return launch_hidden<__nv_bfloat16>(a, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace pad_cuda
