// Torch-free interface between the CUDA kernels (verify_block.cu) and their torch binding.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "pad/verify_math.h"

namespace pad_cuda {

enum class DType { kFloat32, kFloat16, kBFloat16 };

// Device pointers of one verification block; optional inputs are nullptr (w1 == nullptr: no classifier).
struct VerifyArgs {
  const void* logits;  // [B, K+1, V], or [R, V] read through logit_rows
  DType logits_dtype;
  const int64_t* drafts;  // [B, K]
  const void* hidden;     // [B, K+1, H]
  DType hidden_dtype;
  const float *w1, *b1, *w2, *b2;  // [H+2, D], [D], [D], [] (b2 stays on the device: no sync)
  const float* clf_bias;           // [B, K, D] per-position additions to b1, or nullptr
  const float *draft_probs, *uniforms, *exponentials;  // [B, K, V], [B, K], [B, V]
  float *entropy, *token_prob, *pivot_prob;            // [B, K+1], [B, K], [B, K]
  int64_t* argmax;                                     // [B, K+1]
  bool *accepted, *pivot_accepted;                     // [B, K]
  int64_t *num_accepted, *next_token;                  // [B]
  float* top3_entropy;                                 // [B, K+1]
  const int64_t* num_drafts;                           // [B] or nullptr (every row drafted K)
  const void* draft_logits;                            // [B, K, V] of logits_dtype, or nullptr
  float* divergence;                                   // [B, K]
  const float* row_rules;                              // [B, 6] (pad::row_rule) or nullptr: the call's rule
  const int64_t* logit_rows;                           // [B, K+1] rows of logits [R, V] (-1: none) or nullptr
  void* scratch;                                       // scratch_bytes(B, K, splits, race_splits), 8-aligned
  int64_t B, K, V, H, D;
  int64_t splits, split_len;            // vocabulary slices per position (kernels 1-2), 1 <= splits <= 65535
  int64_t race_splits, race_split_len;  // slices of the sampling draw (kernel 3)
  float sigma, floor_, temperature;
  pad::Rule rule;
};

// Threads per block of every kernel: the CPU emulation of the kernels reduces in the same tree.
constexpr int kThreads = 256;

// The kernels' scratch, carved from one buffer: slice states, each position's merged state, the draw's
// slice races, and per row the count of finished draw slices.
struct Scratch {
  pad::RowStats* parts;   // [B, K+1, splits]
  pad::RowStats* stats;   // [B, K+1]
  pad::Race* race_parts;  // [B, race_splits]
  unsigned* races_done;   // [B]
};

inline size_t scratch_bytes(int64_t B, int64_t K, int64_t splits, int64_t race_splits) {
  return sizeof(pad::RowStats) * B * (K + 1) * (splits + 1) + sizeof(pad::Race) * B * race_splits +
         sizeof(unsigned) * B;
}

inline Scratch scratch_layout(void* base, int64_t B, int64_t K, int64_t splits, int64_t race_splits) {
  Scratch s;
  s.parts = static_cast<pad::RowStats*>(base);
  s.stats = s.parts + B * (K + 1) * splits;
  s.race_parts = reinterpret_cast<pad::Race*>(s.stats + B * (K + 1));
  s.races_done = reinterpret_cast<unsigned*>(s.race_parts + B * race_splits);
  return s;
}

cudaError_t verify_block(const VerifyArgs& args, cudaStream_t stream);

}  // namespace pad_cuda
