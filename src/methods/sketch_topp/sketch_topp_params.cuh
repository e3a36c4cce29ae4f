// sketch_topp's GPU parameters (src/methods/sketch_topp/sketch_topp.cu has the design): the
// constants of its fixed-point weights, thresholds and histogram, and SketchParams, the
// device pointers and sizes its kernels share. Not installed.
#pragma once

#include "core/check.h"
#include "cumulus/kernels/sketch.h"
#include "cumulus/methods/cuda_methods.h"
#include "kernels/cuda/cuda_internal.cuh"

namespace cumulus::cuda {
namespace {

constexpr int kMaxGroup = kSketchToppMaxGroup;  // query heads per kv head the kernels hold in registers
constexpr int kThresholds = 2049;  // thresholds kmax 2^(-m/64), m = 0 .. 2048 (32 octaves)
constexpr int kBinBelow = 2049;    // keys below kmax 2^-32 (and zero)
constexpr int kBins = 2050;
// Weights (each <= 1, and a head's sum over all tokens 1 up to rounding) in fixed point,
// 2^-31 units: any bin's or list's sum fits 32 bits, so the shared histogram adds with
// 32-bit integer atomics and the global one with 64-bit atomics that carry two such sums;
// integer sums do not depend on the order of the adds.
constexpr float kFixF = 2147483648.0f;  // 2^31
constexpr double kFix = 2147483648.0;
constexpr float kSketchRange = 6.0e4f;          // src/kernels/ref/sketch.cpp's clamp of normalised values
constexpr int kWeightsThreads = 256;
constexpr int kHistThreads = 512;
constexpr int kGroupTokens = 64;       // tokens per maximum of the 16-bit logits
constexpr float kLogitUnit = 1024.0f;  // 16-bit logits: s = m64 + q / kLogitUnit
constexpr int kTokensPerWarpStep = 64;  // tokens a warp estimates per step of the weights pass (4 mma blocks)

// Everything the kernels of one decoder share (device pointers; plain data).
struct SketchParams {
  DeviceKvView kv;
  int group = 1, n_q = 0;
  // The sketch, per list l = seq * n_kv_heads + h:
  uint8_t* codes = nullptr;   // [L][blocks][head_dim / 8][16][4]
  uint16_t* off = nullptr;    // [L][ts] f16 bits
  uint16_t* step = nullptr;   // [L][ts] f16 bits
  float* center = nullptr;    // [L][head_dim]
  float* scale = nullptr;     // [L][head_dim]
  int32_t* sk_n = nullptr;    // [L] tokens encoded
  size_t codes_stride = 0;    // bytes of codes per list
  int ts = 0;                 // token stride: max_tokens rounded up to 64
  // Step scratch:
  int16_t* logits = nullptr;            // [L][ts][G] q = round((s - m64) * 1024), in [-32767, 0]
  float* gmax = nullptr;                // [L][ts / 64][G] m64: the largest s of each 64-token group
  float* part_m = nullptr;              // [L][n_chunks1][G]
  float* part_s = nullptr;              // [L][n_chunks1][G]
  uint16_t* cbin = nullptr;             // [L][ts] threshold bin of each token
  // [L][kBins][(G + 2) / 2]: the G weight sums and the token count of each bin, two 32-bit values
  // to a 64-bit word (value 2k low, 2k + 1 high); zero between steps.
  unsigned long long* hist = nullptr;
  uint32_t* ticket = nullptr;           // [L] zero between steps
  int32_t* thr = nullptr;               // [L] the chosen bin m* (tokens with c(t) <= m* are the union)
  int32_t* dense = nullptr;             // [L] 1: every token
  float* st_M = nullptr;                // [L][G] largest logit
  double* st_S = nullptr;               // [L][G] sum of exp(s - M)
  double* st_T = nullptr;               // [L][G] sum of the normalised weights (~1)
  double* st_U = nullptr;               // [L][G] ... over the union
  double* vsum = nullptr;               // [L][head_dim] sum of the value rows of tokens [0, vs_n) (rest_mean)
  int32_t* vs_n = nullptr;              // [L]
  // Options:
  float attn_scale = 0;
  double cp = 0.92, dense_above = 0.5;
  int sinks = 4, recent = 64, min_context = 1024, force_dense = 0;
  int chunk1 = 512, n_chunks1 = 1, chunk2 = 1024;
};

}  // namespace
}  // namespace cumulus::cuda
