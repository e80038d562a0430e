// Launchers of the ds4_attn extension (mHC, sparse MQA decode attention, lightning-indexer scores)
// over raw pointers + a cudaStream_t: implemented in the .cu files of this folder (CUDA headers
// only), called by attn_bindings.cpp. Each returns the launch's cudaError_t.
#pragma once
#include <cuda_runtime.h>
#include <stdint.h>

namespace ds4_attn {

// ---- mHC (spec §4) -------------------------------------------------------------------------------
// Partials of mix = fn . vec(h) and of sum(vec(h)^2) for each token, K = hc*D split over nsplit
// blocks: part [N, nsplit, mix + 1] fp32 (last entry = sum of squares). h is bf16 (h_f32 = false)
// or fp32, [N, hc, D] contiguous; fn fp32 [mix, K] contiguous. mix <= 80.
int hc_nsplit(int K);
cudaError_t launch_hc_partials(const void* h, bool h_f32, const float* fn, int N, int K, int mix, int nsplit,
                               float* part, cudaStream_t st);
// Finish: reduce partials, r = rsqrt(mean(v^2) + norm_eps), mixes m = partial * r; then
//  head = false (hc_pre): pre = sigmoid(m[:n]*scale[0] + base[:n]) + hc_eps,
//     post = 2 sigmoid(m[n:2n]*scale[1] + base[n:2n]), comb = Sinkhorn(m[2n:]*scale[2] + base[2n:]);
//  head = true (hc_head): pre = sigmoid(m*scale[0] + base) + hc_eps (mix == n);
// x[t, :] = sum_j pre[j] * h[t, j, :] (fp32, written in h's dtype). post [N, n], comb [N, n, n] f32.
cudaError_t launch_hc_finish(const void* h, bool h_f32, const float* part, int N, int n, int D, int mix, int nsplit,
                             const float* scale, const float* base, int iters, float hc_eps, float norm_eps,
                             bool head, void* x, float* post, float* comb, cudaStream_t st);
// out[t, k, :] = post[t, k] * x[t, :] + sum_j comb[t, j, k] * res[t, j, :]  (fp32, written in res's dtype)
cudaError_t launch_hc_post(const void* x, bool x_f32, const void* res, bool res_f32, const float* post,
                           const float* comb, int N, int n, int D, void* out, cudaStream_t st);

// ---- sparse MQA attention (spec §5.7), flash-decoding over key chunks ----------------------------
// Rows r = b*S + s (one query each, H heads of D dims, bf16). Keys = kv[b] (K rows) followed by
// sel[b, s] (P rows), bf16, D contiguous. valid / sel_valid are bytes (bool).
struct SparseArgs {
  const void* q = nullptr;          // [B, S, H, D] contiguous
  const void* kv = nullptr;         // row (b, k) at kv + b*kv_b + k*kv_r   (elements)
  long kv_b = 0, kv_r = 0;
  const uint8_t* valid = nullptr;   // (b, s, k) at valid + b*valid_b + s*valid_s + k
  long valid_b = 0, valid_s = 0;
  const void* sel = nullptr;        // row (b, s, p) at sel + b*sel_b + s*sel_s + p*sel_r (nullptr: P = 0)
  long sel_b = 0, sel_s = 0, sel_r = 0;
  const uint8_t* sel_valid = nullptr;
  long sv_b = 0, sv_s = 0;
  const float* sink = nullptr;      // [H]
  int B = 0, S = 1, H = 0, D = 0, K = 0, P = 0;
  float scale = 1.f;
};
int sparse_keys_per_block();
// workspace: opart fp32 [B*S, nsplit, H, D], ml fp32 [B*S, nsplit, H, 2]; out bf16 [B, S, H, D].
cudaError_t launch_sparse_attn(const SparseArgs& a, int nsplit, float* opart, float* ml, void* out, cudaStream_t st);

// ---- lightning indexer scores (spec §5.5) ---------------------------------------------------------
// out[r, t] = sum_h w[r, h] * ReLU(q[r, h] . keys[b, t]),  r = b*S + s; q bf16 [B, S, H, d] contiguous,
// w fp32 [B, S, H] contiguous, keys bf16 rows at keys + b*k_b + t*k_r (d contiguous).
// bf16 = true reproduces the reference's BF16 einsum / ReLU / product (sum in fp32, one rounding) and
// writes bf16; else fp32 throughout and fp32 out.
cudaError_t launch_indexer_scores(const void* q, const float* w, const void* keys, long k_b, long k_r, int B, int S,
                                  int H, int d, int T, bool bf16, void* out, cudaStream_t st);

}  // namespace ds4_attn
