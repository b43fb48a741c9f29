// Torch-free interface between the CUDA kernels (verify_block.cu) and their torch binding.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "pad/verify_math.h"

namespace pad_cuda {

enum class DType { kFloat32, kFloat16, kBFloat16 };

// Device pointers of one verification block; optional inputs are nullptr (w1 == nullptr: no classifier).
struct VerifyArgs {
  const void* logits;  // [B, K+1, V]
  DType logits_dtype;
  const int64_t* drafts;  // [B, K]
  const void* hidden;     // [B, K+1, H]
  DType hidden_dtype;
  const float *w1, *b1, *w2, *b2;  // [H+2, D], [D], [D], [] (b2 stays on the device: no sync)
  const float *draft_probs, *uniforms, *exponentials;  // [B, K, V], [B, K], [B, V]
  float *entropy, *token_prob, *pivot_prob;            // [B, K+1], [B, K], [B, K]
  int64_t* argmax;                                     // [B, K+1]
  bool *accepted, *pivot_accepted;                     // [B, K]
  int64_t *num_accepted, *next_token;                  // [B]
  float* top3_entropy;                                 // [B, K+1]
  const int64_t* num_drafts;                           // [B] or nullptr (every row drafted K)
  float *row_max, *row_sum;                            // [B, K+1] scratch
  int64_t B, K, V, H, D;
  float sigma, floor_, temperature;
  pad::Rule rule;
};

cudaError_t verify_block(const VerifyArgs& args, cudaStream_t stream);

}  // namespace pad_cuda
