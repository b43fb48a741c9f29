// CUDA backend of pad_kernels.verify_block, free of torch headers (plain nvcc compiles it in seconds).
// Kernel 1: one thread block per (row, position): threads scan the vocabulary with the online softmax of
// pad/verify_math.h and merge their states in shared memory. Kernel 2: one thread block per row: the
// folded classifier (threads over its D units), the accepted prefix, and the correction/bonus token
// (a block-wide exponential race in sampling). The math is the same header the CPU backend runs.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "pad/verify_math.h"
#include "verify_block_cuda.h"

namespace {

constexpr int kThreads = 256;
constexpr int kFeatures = 2;

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ float scaled(const T* x, int64_t v, float temperature) {
  const float f = to_float(x[v]);
  return temperature > 0.0f ? f / temperature : f;
}

template <typename T>
__global__ void position_stats_kernel(const T* __restrict__ logits,         // [B, K+1, V]
                                      const int64_t* __restrict__ drafts,   // [B, K]
                                      float* entropy, int64_t* argmax,      // [B, K+1]
                                      float* top3_entropy,                  // [B, K+1]
                                      float* token_prob,                    // [B, K]
                                      float* row_max, float* row_sum,       // [B, K+1]
                                      int64_t K, int64_t V, float temperature) {
  __shared__ pad::RowStats partial[kThreads];
  const int64_t pos = blockIdx.x, K1 = K + 1, b = pos / K1, i = pos % K1;
  const T* x = logits + pos * V;
  pad::RowStats s = pad::row_empty();
  for (int64_t v = threadIdx.x; v < V; v += blockDim.x) pad::row_push(s, scaled(x, v, temperature), v);
  partial[threadIdx.x] = s;
  __syncthreads();
  for (int stride = blockDim.x / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) partial[threadIdx.x] = pad::row_merge(partial[threadIdx.x], partial[threadIdx.x + stride]);
    __syncthreads();
  }
  if (threadIdx.x != 0) return;
  const pad::RowStats t = partial[0];
  entropy[pos] = pad::row_entropy(t);
  top3_entropy[pos] = pad::row_top3_entropy(t);
  argmax[pos] = t.argmax;
  row_max[pos] = t.max;
  row_sum[pos] = t.sum;
  if (i < K) {
    const int64_t d = drafts[b * K + i];
    token_prob[b * K + i] = pad::in_vocab(d, V) ? pad::row_prob(t, scaled(x, d, temperature)) : NAN;
  }
}

template <typename T, typename H>
__global__ void accept_kernel(const T* __restrict__ logits, const int64_t* __restrict__ drafts,
                              const H* __restrict__ hidden,  // [B, K+1, Hdim]
                              const float* w1, const float* b1, const float* w2, const float* b2,  // [Hdim+2, D], [D], [D], []
                              const float* draft_probs, const float* uniforms, const float* exponentials,
                              const float* entropy, const float* top3_entropy, const int64_t* argmax,
                              const float* token_prob, const float* row_max, const float* row_sum,
                              float* pivot_prob, bool* accepted, bool* pivot_accepted, int64_t* num_accepted,
                              int64_t* next_token, int64_t K, int64_t V, int64_t Hdim, int64_t D, float sigma,
                              float floor_, float temperature, pad::Rule rule, const int64_t* num_drafts) {
  __shared__ float red[kThreads];
  __shared__ pad::Race races[kThreads];
  __shared__ int64_t n_shared;
  const int64_t k_row = pad::row_drafts(num_drafts, blockIdx.x, K);
  const int64_t b = blockIdx.x, K1 = K + 1;
  const bool has_clf = w1 != nullptr, sampling = temperature > 0.0f;

  // 1. Pivot probabilities: thread j owns unit j of the hidden layer.
  for (int64_t i = 0; i < K; ++i) {
    float part = 0.0f;
    if (has_clf) {
      const H* h = hidden + (b * K1 + i) * Hdim;
      const float f[kFeatures] = {token_prob[b * K + i], entropy[b * K1 + i]};
      for (int64_t j = threadIdx.x; j < D; j += blockDim.x) {
        float acc = b1[j];
        for (int64_t k = 0; k < Hdim; ++k) acc += to_float(h[k]) * w1[k * D + j];
        for (int k = 0; k < kFeatures; ++k) acc += f[k] * w1[(Hdim + k) * D + j];
        part += w2[j] * fmaxf(acc, 0.0f);
      }
    }
    red[threadIdx.x] = part;
    __syncthreads();
    for (int stride = blockDim.x / 2; stride > 0; stride /= 2) {
      if (threadIdx.x < stride) red[threadIdx.x] += red[threadIdx.x + stride];
      __syncthreads();
    }
    if (threadIdx.x == 0) pivot_prob[b * K + i] = has_clf ? 1.0f / (1.0f + expf(-(red[0] + *b2))) : 1.0f;
    __syncthreads();
  }

  // 2. The accepted prefix (one thread: K is small).
  if (threadIdx.x == 0) {
    const int64_t n = pad::accept_row(b, K, V, drafts, argmax, token_prob, pivot_prob, draft_probs, uniforms,
                                      sampling, has_clf, sigma, floor_, rule, entropy, top3_entropy, k_row,
                                      accepted, pivot_accepted);
    num_accepted[b] = n;
    n_shared = n;
    if (!sampling) next_token[b] = argmax[b * K1 + n];
  }
  __syncthreads();
  if (!sampling) return;

  // 3. Sampling: the correction (or bonus) token by a block-wide exponential race over the residual.
  const int64_t n = n_shared, pos = b * K1 + n;
  const pad::RowStats s{row_max[pos], row_sum[pos], 0.0f, 0, -INFINITY, -INFINITY};
  const T* x = logits + pos * V;
  const float* q = n < k_row ? draft_probs + (b * K + n) * V : nullptr;  // past the row's drafts q is 0
  const float* e = exponentials + b * V;
  pad::Race race = pad::race_empty();
  for (int64_t v = threadIdx.x; v < V; v += blockDim.x)
    pad::race_push(race, pad::row_prob(s, scaled(x, v, temperature)), q ? q[v] : 0.0f, e[v], v);
  races[threadIdx.x] = race;
  __syncthreads();
  for (int stride = blockDim.x / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) races[threadIdx.x] = pad::race_merge(races[threadIdx.x], races[threadIdx.x + stride]);
    __syncthreads();
  }
  if (threadIdx.x == 0) next_token[b] = pad::race_winner(races[0]);
}

template <typename T, typename H>
cudaError_t launch(const pad_cuda::VerifyArgs& a, cudaStream_t stream) {
  const T* logits = static_cast<const T*>(a.logits);
  const int64_t K1 = a.K + 1;
  position_stats_kernel<T><<<a.B * K1, kThreads, 0, stream>>>(logits, a.drafts, a.entropy, a.argmax,
                                                               a.top3_entropy, a.token_prob, a.row_max, a.row_sum,
                                                               a.K, a.V, a.temperature);
  accept_kernel<T, H><<<a.B, kThreads, 0, stream>>>(
      logits, a.drafts, static_cast<const H*>(a.hidden), a.w1, a.b1, a.w2, a.b2, a.draft_probs, a.uniforms,
      a.exponentials, a.entropy, a.top3_entropy, a.argmax, a.token_prob, a.row_max, a.row_sum, a.pivot_prob,
      a.accepted, a.pivot_accepted, a.num_accepted, a.next_token, a.K, a.V, a.H, a.D, a.sigma, a.floor_,
      a.temperature, a.rule, a.num_drafts);
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
  switch (a.logits_dtype) {
    case DType::kFloat32: return launch_hidden<float>(a, stream);
    case DType::kFloat16: return launch_hidden<__half>(a, stream);
    case DType::kBFloat16: return launch_hidden<__nv_bfloat16>(a, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace pad_cuda
