// Launchers of the ds4_attn extension (mHC, sparse MQA decode attention, lightning-indexer scores)
// over raw pointers + a cudaStream_t: implemented in the .cu files of this folder (CUDA headers
// only), called by attn_bindings.cpp. Each returns the launch's cudaError_t.
#pragma once
#include <cuda_runtime.h>
#include <stdint.h>

#include "../sinkhorn_ride.h"

namespace ds4_attn {

// The current device's SM count (cached per device; 0 if it cannot be read).
inline int attn_sm_count() {
  static int count[64] = {0};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return 0;
  if (count[dev] == 0) cudaDeviceGetAttribute(&count[dev], cudaDevAttrMultiProcessorCount, dev);
  return count[dev];
}

// ---- mHC (spec §4) -------------------------------------------------------------------------------
// Partials of mix = fn . vec(h) and of sum(vec(h)^2) for each token, K = hc*D split over nsplit
// blocks: part [N, mix + 1, nsplit] fp32 (entry mix = sum of squares). h is bf16 (h_f32 = false)
// or fp32, [N, hc, D] contiguous; fn fp32 [mix, K] contiguous. mix <= 80.
int hc_nsplit(int K);
cudaError_t launch_hc_partials(const void* h, bool h_f32, const float* fn, int N, int K, int mix, int nsplit,
                               float* part, cudaStream_t st);
// The same partials of the streams that hc_post (below) produces from x, res, post, comb, which are
// also written to out ([N, n, D], res's dtype): a post followed by the next site's pre (K = n * D).
cudaError_t launch_hc_post_partials(const void* x, bool x_f32, const void* res, bool res_f32, const float* post,
                                    const float* comb, int N, int n, int D, void* out, const float* fn, int mix,
                                    int nsplit, float* part, cudaStream_t st);
// Finish: reduce partials, r = rsqrt(mean(v^2) + norm_eps), mixes m = partial * r; then
//  head = false (hc_pre): pre = sigmoid(m[:n]*scale[0] + base[:n]) + hc_eps,
//     post = 2 sigmoid(m[n:2n]*scale[1] + base[n:2n]), comb = Sinkhorn(m[2n:]*scale[2] + base[2n:]);
//  head = true (hc_head): pre = sigmoid(m*scale[0] + base) + hc_eps (mix == n);
// x[t, :] = sum_j pre[j] * h[t, j, :] (fp32, written in h's dtype). post [N, n], comb [N, n, n] f32.
// norm (bf16 / f32 [D], hc_pre only): x is then rounded to h's dtype and RMS-normed with that weight.
// iters = 0 (n = 1, 2, 4; also in the two folds' finishes below): comb gets the Sinkhorn's input logits
// m[2n:]*scale[2] + base[2n:] instead, and a later launch of the step finishes it (sinkhorn_ride.h: the sparse
// combine's ride, the router top-k's, or launch_hc_sinkhorn).
cudaError_t launch_hc_finish(const void* h, bool h_f32, const float* part, int N, int n, int D, int mix, int nsplit,
                             const float* scale, const float* base, int iters, float hc_eps, float norm_eps,
                             bool head, void* x, float* post, float* comb, const void* norm, bool norm_f32,
                             cudaStream_t st);
// hc_pre's finish with the block norm (bf16 h, n = 1, 2, 4; hc_router_fold_ok) that also computes the
// router's logits [N, E] fp32 = the bf16 normalised x . gate^T (gate bf16 [E, D], 16-byte aligned): the
// router fold (opt-in, DS4_HC_ROUTER=1; hc.cu). x, post, comb as launch_hc_finish writes them.
bool hc_router_fold_ok(int n, int D);
cudaError_t launch_hc_finish_router(const void* h, const float* part, int N, int n, int D, int mix, int nsplit,
                                    const float* scale, const float* base, int iters, float hc_eps, float norm_eps,
                                    void* x, float* post, float* comb, const void* norm, bool norm_f32,
                                    const void* gate, int E, float* logits, cudaStream_t st);
// hc_pre's finish with the block norm (bf16 h, n = 1, 2, 4; hc_proj_fold_ok: D % 128 == 0, D <= 4096) that also
// computes y [N, O] bf16 = the bf16 normalised x . W^T for an FP8 weight w (E4M3 [O, D], 16-byte aligned) with E8M0
// scales s [ceil(O / 128), s_ld] per 128 x 128 block: the projection fold (the attention's wq_a + wkv; hc.cu).
bool hc_proj_fold_ok(int n, int D);
cudaError_t launch_hc_finish_proj(const void* h, const float* part, int N, int n, int D, int mix, int nsplit,
                                  const float* scale, const float* base, int iters, float hc_eps, float norm_eps,
                                  void* x, float* post, float* comb, const void* norm, bool norm_f32, const void* w,
                                  const void* s, int s_ld, int O, void* y, cudaStream_t st);
// ride.comb [N, n, n] f32 as an iters = 0 finish wrote it -> its Sinkhorn in place, as a launch of its own (the
// finish's own arithmetic: the same bits as a finish with iters).
cudaError_t launch_hc_sinkhorn(const ds4::SinkhornRide& ride, int N, cudaStream_t st);
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
  // Decode mode (pos != nullptr, S == 1): validity comes from the row's position, not from masks.
  //   key k < K (the window ring of K slots) is valid iff k <= pos[b];
  //   extra key p < P is compressed entry e = sel_idx ? sel_idx[b*si_b + p] : p, read at
  //   sel + b*sel_b + e*sel_r and valid iff 0 <= e < (pos[b] + 1) / ratio.
  const int64_t* pos = nullptr;
  const int64_t* sel_idx = nullptr;
  long si_b = 0;
  int ratio = 1;
  // Combine: de-rotate the last R output dims at pos[b] (RoPE with -angle; R = 0: none), fp32 freqs [R/2].
  const float* freqs = nullptr;
  int R = 0;
  // Decode mode: q is the raw wq_b output; each block gives its 16 heads head_rope's per-head RMS
  // (unweighted, the factor rounded to bf16, eps qnorm_eps) and the RoPE of the last R dims at pos[b]
  // as it loads them (no separate head_rope launch).
  bool q_prep = false;
  float qnorm_eps = 0.f;
};
int sparse_nsplit(int keys);  // the splits (blocks per head tile) launch_sparse_attn takes for a row of keys
// workspace: opart fp32 [B*S, nsplit, H, D], ml fp32 [B*S, nsplit, H, 2]; out bf16 [B, S, H, D].
// ride (decode mode only, comb [B, n, n]): the combine launch also finishes each row's mHC Sinkhorn in place.
cudaError_t launch_sparse_attn(const SparseArgs& a, int nsplit, float* opart, float* ml, void* out, cudaStream_t st,
                               const ds4::SinkhornRide& ride = ds4::SinkhornRide{});

// ---- lightning indexer scores (spec §5.5) ---------------------------------------------------------
// out[r, t] = sum_h w_scale * w[r, h] * ReLU(q[r, h] . keys[b, t]),  r = b*S + s; q bf16 [B, S, H, d]
// contiguous, w fp32 (w_bf16: bf16) [B, S, H] contiguous, keys bf16 rows at keys + b*k_b + t*k_r (d contiguous).
// bf16 = true reproduces the reference's BF16 einsum / ReLU / product (sum in fp32, one rounding) and
// writes bf16 (out_f32: writes those bf16 values as fp32, for a top-k that reads fp32: no cast launch between);
// else fp32 throughout and fp32 out.
// pos (optional, S == 1): entries t >= (pos[b] + 1) / ratio are not visible yet and score -inf.
// rope_freqs (optional, with pos; R = 2 len(freqs) <= min(d, 256)): q is taken before its interleaved RoPE
// of the last R dims at pos, which the kernel applies as ds4_attn's head_rope (norm off) does.
// q_fp4 (with rope_freqs, numerics=qat; hadamard_fp4_ok(d)): after its RoPE the staged q also gets the reference's
// Hadamard + FP4 simulation (launch_hadamard_fp4's bits).
// skip_k > 0 (with pos; the scores' consumer is launch_topk with k = skip_k and the same pos / ratio): rows with at
// most skip_k visible entries (and T >= skip_k) are left unwritten, since that top-k selects all of them unread.
cudaError_t launch_indexer_scores(const void* q, const void* w, bool w_bf16, float w_scale, const void* keys, long k_b,
                                  long k_r, int B, int S, int H, int d, int T, bool bf16, const int64_t* pos, int ratio,
                                  const float* rope_freqs, int R, void* out, cudaStream_t st, int skip_k = 0,
                                  bool q_fp4 = false, bool out_f32 = false);

// ---- top-k (topk.cu) ------------------------------------------------------------------------------
// out[b, :k] = indices of the k largest of scores[b, :T] (fp32, contiguous rows), unsorted; ties at the
// k-th value are taken lowest index first. One block per row up to 32768 entries; longer rows (the wide form, up to
// topk_max_len()) spread over up to 64 blocks of 8192 entries that meet at grid barriers, where topk_ok(B, T) says
// they fit at once (B <= 16 rows, B x blocks <= the SM count); one wide launch at a time per device.
// pos (optional, int64 [B]): entries t >= (pos[b] + 1) / ratio are -inf and only the first
// max((pos[b] + 1) / ratio, k) entries are read (same result).
int topk_max_len();
bool topk_ok(int B, int T);
cudaError_t launch_topk(const float* scores, int B, int T, int k, const int64_t* pos, int ratio, int64_t* out,
                        cudaStream_t st);
// The wide form at any T it takes (topk_wide_ok: B x ceil(T / 8192) blocks fit), e.g. below 32768 entries (the probe).
bool topk_wide_ok(int B, int T);
cudaError_t launch_topk_wide(const float* scores, int B, int T, int k, const int64_t* pos, int ratio, int64_t* out,
                             cudaStream_t st);

// ---- decode glue (decode_glue.cu) -----------------------------------------------------------------
// Positions: int64 [N] device tensors. freqs: fp32 [R/2] RoPE frequencies of the layer. Weights of the
// norms are bf16 or fp32 (w_f32). All activations bf16.
// out[n] = bf16(x[n] * rsqrt(mean(x[n]^2) + eps) * weight), x / out [N, D] contiguous.
cudaError_t launch_rms_norm(const void* x, const void* weight, bool w_f32, int N, int D, float eps, void* out,
                            cudaStream_t st);
// x [N, H, D] -> out: (norm) per-head bf16(x * bf16(rsqrt(mean(x^2) + eps))), then RoPE of the last R dims at pos[n].
cudaError_t launch_head_rope(const void* x, const int64_t* pos, const float* freqs, int N, int H, int D, int R,
                             bool norm, float eps, void* out, cudaStream_t st);
// The row widths numerics=qat's Hadamard + FP4 simulation takes on the device (a warp per row: d / 32 values per lane).
__host__ __device__ constexpr bool hadamard_fp4_ok(int d) { return d >= 32 && d <= 256 && (d & (d - 1)) == 0; }
// numerics=qat's Hadamard + FP4 simulation of N contiguous bf16 rows of d values (ds4.quant: fp4_act_quant_sim(
// hadamard(x), 32), the same bits; hadamard_fp4_ok(d)).
cudaError_t launch_hadamard_fp4(const void* x, void* out, long N, int d, cudaStream_t st);
// win[n, pos[n] % W, :] = entry(kv[n]): rms_norm(weight), RoPE at pos[n], (fp8_nope) FP8 simulation of dims [0, D-R).
cudaError_t launch_kv_store(const void* kv, const void* weight, bool w_f32, const int64_t* pos, const float* freqs,
                            int N, int D, int R, float eps, bool fp8_nope, void* win, long win_b, int W,
                            cudaStream_t st);
struct CompressArgs {
  const float* kvz = nullptr;     // [N, 2*cw]: kv (cw) then gate z (cw), cw = (overlap ? 2 : 1) * w
  const float* ape = nullptr;     // [m, cw]
  const void* norm = nullptr;     // [w]
  bool norm_f32 = false;
  const int64_t* pos = nullptr;   // [N]
  const float* freqs = nullptr;   // [R/2]
  float* skv = nullptr;           // state rows at skv + n*state_b: [slots, cw] fp32 (slots = cw/w * m)
  float* ssc = nullptr;
  long state_b = 0;
  void* cache = nullptr;          // bf16 entry e of row n at cache + n*cache_b + e*w (elements)
  long cache_b = 0;
  int m = 0, w = 0, R = 0;
  // kvz holds `tokens` rows per row n (n * tokens + i: position pos[n] - tokens + 1 + i), present only where
  // (pos[n] + 1) % tokens == 0 (the deferred projection, ds4_launch.h launch_gemv_deferred); the step does nothing
  // elsewhere. tokens divides m.
  int tokens = 1;
  // the entry's qat simulation: fp8_nope (FP8 of dims [0, w - R) in blocks of 64) or fp4 (Hadamard + FP4 of all w,
  // hadamard_fp4_ok(w): the indexer compressor's), not both
  bool overlap = false, fp8_nope = false, fp4 = false;
  float eps = 0.f;
};
cudaError_t launch_compress_step(const CompressArgs& a, int N, cudaStream_t st);

}  // namespace ds4_attn
