// Launchers over raw pointers + a cudaStream_t (no torch types): implemented in the .cu files,
// called by the one binding file ds4_bindings.cpp. Each returns the launch's cudaError_t.
#pragma once
#include <cuda_runtime.h>
#include <stdint.h>

#include "sinkhorn_ride.h"

namespace ds4 {

// Largest token count one launch handles (activations of all tokens sit in shared memory).
int gemv_max_tokens(int fmt, int K);
int moe_max_tokens(int fmt, int topk, int dim, int inter);

// Kernel choice of the GEMV / MoE launchers: FMA kernels (any format, 1..8 tokens) or tensor-core
// kernels (mma_dot.cuh: FP8 / FP4, one token, K a multiple of 64 / 128). AUTO takes the tensor cores
// for one-token FP4 products, for one-token FP8 products with K >= 2048, and for FP8 at K = 1024 with
// O >= 16384 rows (wq_b: 10.19 us at depth 2 against 11.26 on the FMA kernel, H200,
// experiments/decode_session9_h200.md, run 2); the indexer's wq_b (8192 x 1024) stays on the FMA kernel, which
// measured faster there (experiments/decode_session5_h200.md), except with q_norm fused (gemv_rmsnorm).
// DS4_MMA=0 in the environment makes AUTO always FMA, DS4_MMA=all always tensor cores where they apply,
// DS4_MMA=k2048 the FP8 rule before wq_b moved (read at every launch, for the ablation). An explicit MMA
// request that does not apply returns cudaErrorInvalidValue. DP4A (launch_moe_gate_up only: moe_dp4a.cu, the routed
// experts' one-token gate+up on the integer pipe, FMT_FP4's stored layout) likewise, where moe_dp4a_ok says no.
// SPLITK (launch_moe_gate_up / launch_moe_down, the routed experts' one-token pair in fp4t: moe_splitk.cu) likewise,
// where moe_splitk_rows says no; its gate+up writes partial sums of the output, not h (below). SPLITK_K: the same with
// w2 and its scales in the chunk-major fp4k layout (ds4.quant.chunk_fp4_splitk; an experiment).
enum Kernel : int { KERNEL_AUTO = 0, KERNEL_FMA = 1, KERNEL_MMA = 2, KERNEL_DP4A = 3, KERNEL_SPLITK = 4,
                    KERNEL_SPLITK_K = 5 };
inline bool kernel_splitk(int k) { return k == KERNEL_SPLITK || k == KERNEL_SPLITK_K; }
bool mma_auto(int fmt, int K, int O);
// Widest run of 16-B chunks per lane and row the tensor-core kernels read (DS4_MMA_W: 1, 2, 4).
int mma_max_width();
// Chunks per lane and row the tensor-core kernels keep in flight for rows of K (grouped: wo_a's
// per-group rows): DS4_MMA_DEPTH = 8, 4, 2 for all, else the per-shape default (gemv.cu), whose 8
// DS4_LONG_ROW_DEPTH replaces; 0 with DS4_MMA_LOAD=smem (mma_dot.cuh).
int mma_depth(int K, bool grouped);
// The same with long_rows (8, 4, 2; 0: none) in place of the rule's 8 (the routed gate+up's own rule, moe_mma.cu).
int mma_depth_for(int K, bool grouped, int long_rows);
int env_depth(const char* name);  // a depth variable: 8, 4, 2, or 0 where unset or empty
// Weight rounds per warp the tensor-core GEMVs (down = false) / the MoE down kernels (down = true) load before
// their PDL wait: DS4_PREFETCH / DS4_PREFETCH_DOWN = N (0: none, the loads all after the wait), else -1 = all
// of the stream's depth (the default). Read at every launch (an ablation knob).
int mma_prefetch_rounds(bool down);
// Diagnostic (timing only; the outputs are unchanged): DS4_SPACER holding the letter g / d / u puts an empty PDL
// launch in front of every tensor-core GEMV / MoE down / MoE gate+up launch, so that kernel launches only once
// the kernel before it has ended: what PDL's early launch is worth per kernel class (H200: 1-3 us per kernel,
// experiments/decode_session32_h200.md). launch_spacer_before returns cudaSuccess when it launches nothing.
cudaError_t launch_spacer_before(char kind, cudaStream_t st);
// Opt-in (an ablation; the outputs are the same bits): DS4_BULK_STAGE holding the letter g / d / u (or "all") has every
// one-row tensor-core GEMV (not its RMSNorm or qat forms) / MoE down / MoE gate+up launch stage its activations by
// bulk copies on the TMA unit (csrc/bulk_stage.cuh) instead of its threads' loads; sm_90+ only (elsewhere false).
// Read at every launch. Not faster (H200, experiments/session79.md). bulk_piece_ok: a piece such a copy takes
// (16-byte aligned address, size a multiple of 16).
bool bulk_stage_site(char site);
bool bulk_piece_ok(const void* p, long bytes);

// out[t, o] = sum_k x[t, xoff(o) + k] * W[o, k]   (t < n_tok <= 8)
// fmt 0 bf16 / 1 fp8 (E4M3 + E8M0 128x128) / 2 fp4 (E2M1 pairs + E8M0 per 32); not 3 (fp4p: MoE only).
// group_rows > 0: row o reads x columns [(o / group_rows) * K, +K) (grouped wo_a); else xoff = 0.
// aq (numerics=qat): x's values are act_quant_sim(x, 128)'s, simulated in the tensor-core kernel's activation staging
// (act_quant.cuh); only where gemv_act_quant_ok says the launch takes such a kernel (one token, FP8 / FP4, K % 128 ==
// 0, ungrouped, the shapes gemv.cu's aq_shape_ok names), else cudaErrorInvalidValue. With (kernel AUTO, one token,
// ungrouped) it also says whether launch_gemv_rmsnorm / launch_gemv_fold take aq.
bool gemv_act_quant_ok(int fmt, int kernel, int n_tok, int O, int K, int group_rows);
cudaError_t launch_gemv(int fmt, int kernel, const void* x, long x_ld, int n_tok,
                        const void* W, const void* S, int s_ld, void* out, bool out_f32, long out_ld,
                        int O, int K, int group_rows, cudaStream_t st, bool aq = false);

// Deferred one-row projection (the compressors' BF16 [wkv; wgate] rows at decode; gemv.cu): a token's x is needed by
// its compressor only once its window completes, and windows are multiples of `every` tokens, so the product of
// every `every` tokens is formed at once, reading the weights once instead of `every` times. Per launch, p = pos[0]:
// where (p + 1) % every != 0, x [K] is copied to ring[p % every] and nothing else is done (out is not written; no
// weight is read); else out[t, o] = sum_k r_t[k] * W[o, k] (fp32 [every, O]) with r_t = ring[t] for t < every - 1
// and r_{every-1} = x (the due step's own token). W bf16 [O, K]; ring bf16 [every, K]; 2 <= every <= 8.
// pos: int64 [1], a device position written before the step's branches fork (read before the PDL wait).
cudaError_t launch_gemv_deferred(const void* x, void* ring, int every, const int64_t* pos, const void* W, void* out,
                                 int O, int K, cudaStream_t st);

// One token: out[0, o] = sum_k rms_norm(x)[k] * W[o, k] with rms_norm(x) = bf16(x * rsqrt(mean(x^2) + eps)
// * nw) (nw fp32 or bf16 [K]), rounded as ds4_attn's rms_norm computes it; the tensor-core kernel with
// the norm in its activation staging (q_norm + wq_b in one launch). gemv_rmsnorm_ok: whether it
// applies (FP8 / FP4, K <= 8192, the row lengths launch_gemv's AUTO sends to the tensor cores at any row
// count: the indexer's 8192-row wq_b too).
bool gemv_rmsnorm_ok(int fmt, int O, int K);

// The hc fold (hc_fold.cuh): the next mHC site's partials formed by the epilogue of the one-token
// tensor-core kernel that produces a block's output y [D] (wo_b's GEMV, the MoE down kernel). Token 0 only.
struct HcFold {
  const void* res = nullptr;   // bf16 [n, D]: the streams the block's output updates
  const float* post = nullptr; // [n]
  const float* comb = nullptr; // [n, n]
  const float* fn = nullptr;   // [mix, n * D]: the next site's weights
  void* out = nullptr;         // bf16 [n, D]: the new streams
  float* part = nullptr;       // [mix + 1, D / 16]: the next site's partials, one split per 16-row tile
  int n = 0, mix = 0;
};
// Whether a launch can fold (kind 0: launch_gemv_fold with O x K; kind 1: launch_moe_down at dim x inter,
// topk): one token on the tensor cores (mma_auto's rule, DS4_MMA honoured), D = O (dim) a multiple of 16,
// n = 1, 2 or 4 streams, the buffers within the shared-memory cap.
bool hc_fold_ok(int kind, int fmt, int rows, int cols, int topk, int n);
// One token: out[0, :] = x @ W^T (bf16) on the tensor cores, and the fold's streams and partials.
// aq: as launch_gemv's (gemv_act_quant_ok).
cudaError_t launch_gemv_fold(int fmt, const void* x, const void* W, const void* S, int s_ld, void* out, int O, int K,
                             const HcFold& fold, cudaStream_t st, bool aq = false);
// skip (pos != nullptr): where the token's (pos[0] + 1) / ratio <= k, rows [rows, O) are not computed but written
// as zeros, and the grid's blocks share the tiles of rows [0, rows) instead (rows % 16 == 0; decided on the device
// each launch). The merged wq_b + indexer wq_b at contexts where the indexer's top-k of k selects every visible
// entry: zero index queries then score every entry 0, and the selection does not read a score.
struct RowSkip {
  const int64_t* pos = nullptr;  // int64 [1], a device position
  int ratio = 1, k = 0, rows = 0;
};
// aq: the normed values act_quant_sim(., 128)'s (numerics=qat: q_norm, the FP8 simulation and wq_b in one launch;
// gemv_act_quant_ok).
cudaError_t launch_gemv_rmsnorm(int fmt, const void* x, const void* W, const void* S, int s_ld, void* out, bool out_f32,
                                int O, int K, const void* nw, bool nw_f32, float eps, cudaStream_t st,
                                const RowSkip& skip = RowSkip{}, bool aq = false);

// Routed / shared expert gate+up: for every distinct local expert of ids [n_tok, topk] and every
// token that selected it: h[t*topk + j, :] = bf16(silu(min(g, lim)) * clamp(u, +-lim) * rw[t, j]).
// ids == nullptr: one expert (the shared one), topk must be 1, rw may be nullptr (weight 1).
// ptrs != nullptr (bf16 only): weights of local expert e at ptrs[3e+0] (w1), ptrs[3e+1] (w3).
// fmt: 0 bf16 / 1 fp8 / 2 fp4 / 3 fp4p (fp4 with the permuted words of ds4_common.cuh's fp4p_regs).
struct MoEArgs {
  int fmt = 2;
  int n_tok = 1, topk = 1;
  const int64_t* ids = nullptr;     // [n_tok, topk] global ids
  const float* rw = nullptr;        // [n_tok, topk] route weights
  int expert_offset = 0, n_local = 1;
  const uint64_t* ptrs = nullptr;   // [n_local, 3]
  const void *W1 = nullptr, *S1 = nullptr, *W3 = nullptr, *S3 = nullptr, *W2 = nullptr, *S2 = nullptr;
  long w13_estride = 0, s13_estride = 0, w2_estride = 0, s2_estride = 0;  // bytes per expert
  int s13_ld = 0, s2_ld = 0;       // scale row length (bytes)
  int dim = 0, inter = 0;
  float limit = 10.f;
  int kernel = KERNEL_AUTO;
  bool add_bf16 = false;           // moe_down's add is bf16 (see down_store), else fp32
  // Routing inside the one-token tensor-core kernels (route_logits != nullptr; moe_route_ok): every
  // block runs the router's tail (route_dev.cuh) on the router GEMV's logits [1, n_experts] instead of
  // reading ids / rw, and the gate+up launch's block 0 writes the ids and weights to ids_out / rw_out.
  // The down kernel routes before its PDL wait: route_logits must not be written by the launch right
  // before it (in the decode step: the router GEMV, then gate+up, then down).
  const float* route_logits = nullptr;
  const float* route_bias = nullptr;   // learned layers: [n_experts]
  const void* tid2eid = nullptr;       // hash layers: [vocab, topk] int32 / int64 (tid64)
  int tid64 = 0;
  const int64_t* token_ids = nullptr;  // [1]
  int n_experts = 0;
  float route_scale = 1.f;
  int64_t* ids_out = nullptr;          // [1, topk]
  float* rw_out = nullptr;             // [1, topk]
};
// aq (launch_moe_gate_up / launch_moe_down; numerics=qat, DS4_ACT_QUANT=staged, the default since session 71): x
// (gate+up) or h (down) FP8-simulated per 128 values in the one-token tensor-core kernel's staging (act_quant_sim's
// bits) instead of a launch before; only where moe_act_quant_ok (gate_up: x of dim values, else h of inter) says so:
// the tensor-core kernels, the tiled layouts (fp4t routed, fp8t shared), rows of a multiple of 128. (A launch argument,
// not a MoEArgs field: the kernels take MoEArgs by value, and a larger struct changed the plain kernels' register
// allocation.)
bool moe_act_quant_ok(const MoEArgs& a, bool gate_up);
// Whether the one-token kernels route for themselves at this shape (tensor-core kernels, n_experts and
// topk within the shared-memory scratch and ROUTER_MAX_K).
bool moe_route_ok(const MoEArgs& a);
// Whether kernel DP4A takes this gate+up (moe_dp4a.cu): one token, routed FMT_FP4 experts with E8M0 scales, ids
// given (no routing in the kernel, no bf16 pointers), dim a multiple of 32 up to 4096, topk <= 32.
bool moe_dp4a_ok(const MoEArgs& a);
cudaError_t launch_moe_gate_up(const MoEArgs& a, const void* x /*bf16 [n_tok, dim]*/,
                               void* h /*bf16 [n_tok*topk, inter]*/, cudaStream_t st, bool aq = false);
// out[t, :] = (add ? add[t, :] : 0) + sum over the local (token, slot) pairs of h[t*topk+j] @ w2[e]^T
// (add fp32, or bf16 with a.add_bf16; the rounding order is down_store's in moe_dev.cuh). The one-token
// tensor-core kernel reads ids (or routes from route_logits) before its PDL wait: they must not be
// written by the launch right before (in the decode step they come from the router, before the
// gate+up launch). fold (hc_fold_ok(1, ...); bf16 out): the epilogue also forms the hc fold's streams and partials.
cudaError_t launch_moe_down(const MoEArgs& a, const void* h, const void* add, void* out, bool out_f32,
                            cudaStream_t st, const HcFold* fold = nullptr, bool aq = false);
// Kernel SPLITK (moe_splitk.cu): the routed experts' one-token gate+up and down as a split-K pair. With
// kernel_splitk(a.kernel), launch_moe_gate_up's h is parts, fp32 [moe_splitk_rows(a), dim]: each row one block's
// partial sums of the routed output (its pairs' h times the matching columns of w2; a's W2 / S2 / w2_estride /
// s2_estride / s2_ld set as a down's), and launch_moe_down's h is those rows: it sums them in a fixed order and runs
// the down's epilogue (add, out_f32, fold), the outputs the separate kernels' to fp32 rounding. moe_splitk_rows: the
// partial rows for these shapes (the launch's grid: the gate+up's resident wave), or -1 where the pair does not apply
// (fmt FMT_FP4T, one token, ids given: no routing in the kernel, no bf16 pointers, dim % 64 == 0, inter % 32 == 0,
// topk <= 32; no numerics=qat staging).
int moe_splitk_rows(const MoEArgs& a);
cudaError_t launch_moe_splitk(const MoEArgs& a, const void* x, float* parts, cudaStream_t st);
cudaError_t launch_moe_splitk_reduce(const MoEArgs& a, const float* parts, const void* add, void* out, bool out_f32,
                                     cudaStream_t st, const HcFold* fold);

// The whole one-token MoE FFN in one launch (moe_ffn.cu): r the routed experts (FMT_FP4T, ids and rw given,
// one token), s the shared expert (FP8, one expert, its w1 / w3 / w2 set like launch_moe_gate_up's and
// launch_moe_down's), x bf16 [1, dim]. out bf16 [1, dim] = bf16(bf16(shared(x)) + routed sum) — the separate
// launches' block output — and, with fold, the hc fold's streams and partials. hbuf: a bf16 workspace of
// topk * r.inter + s.inter values (the h rows). sh_h (bf16 [s.inter], or nullptr): the shared expert's h row
// formed by an earlier launch (its gate+up), so the launch runs only the shared expert's down. moe_ffn_ok: whether
// it takes these shapes (FMT_FP4T / FP8 run widths, topk <= 32, shared memory); one launch at a time per device
// (its grid barrier's state is global).
bool moe_ffn_ok(const MoEArgs& r, const MoEArgs& s, const HcFold* fold);
cudaError_t launch_moe_ffn(const MoEArgs& r, const MoEArgs& s, const void* x, void* hbuf, const void* sh_h, void* out,
                           const HcFold* fold, cudaStream_t st);
// The phase probe of the last moe_ffn launches run with DS4_FFN_PROBE=1: per block (< 1024) 4 %globaltimer stamps
// (PDL wait's end, phase 1's end, barrier exit, end; 0 where a block stopped earlier), copied to host[blocks][4].
cudaError_t moe_ffn_probe_read(unsigned long long* host, int blocks);
// The step probe of the routed experts' one-token tensor-core kernels (moe_mma.cu; an alt build with -DDS4_MOE_PROBE,
// else cudaErrorNotSupported): host[2][MOE_PROBE_SLOTS][MOE_PROBE_BLOCKS][MOE_PROBE_MARKS] = per kind (gate+up, down),
// launch slot (launch % MOE_PROBE_SLOTS) and block, %globaltimer at its marks 0-5, 8, 9 (0 where a block did not reach
// one) and clock64 at its first and last ([6], [7]); tickets[2] = the blocks each kind saw exit (launches x grid);
// clear zeroes both after the copy.
constexpr int MOE_PROBE_BLOCKS = 1024, MOE_PROBE_SLOTS = 16, MOE_PROBE_MARKS = 10;
cudaError_t moe_probe_read(unsigned long long* host, unsigned* tickets, bool clear);

// Prefill's weight dequantisation (dequant.cu): E stacked matrices [O, K] in layout fmt (fp8 / fp8t / any fp4; experts
// w_es bytes and their scales s_es bytes apart, scale rows s_ld bytes) -> out bf16 / fp32 [E, O, K] (the experts o_es
// values apart), the values of QWeight.dequant (ds4.quant). dequant_ok: the shapes it takes (K whole 16-B chunks; the
// tiled layouts' tiles).
bool dequant_ok(int fmt, int O, int K);
cudaError_t launch_dequant(int fmt, const void* W, const void* S, int E, long w_es, long s_es, int O, int K, int s_ld,
                           void* out, long o_es, bool out_f32, cudaStream_t st);

// Greedy argmax: out[r] = first index of the maximum of fp32 x[r, 0..V) (NaN largest), as torch.argmax(-1);
// one launch, B <= ARGMAX_MAX_ROWS rows (argmax.cu).
constexpr int ARGMAX_MAX_ROWS = 64;
cudaError_t launch_argmax(const float* x, int B, long V, int64_t* out, cudaStream_t st);

// numerics=qat's FP8 activation simulation (act_quant.cu): bf16 x [rows, K] -> bf16 out, per row and block of `block`
// (64 or 128; K % block == 0) the values e4m3(x / s) s of ds4.quant.act_quant_sim, bit for bit.
cudaError_t launch_act_quant_sim(const void* x, void* out, long rows, int K, int block, cudaStream_t st);

// Router tail: logits f32 [n_tok, E] -> scores sqrt(softplus); ids (top-k of score + bias, or
// tid2eid[token_ids]); weights = renormalised scores * route_scale. ride (comb [n_tok, n, n]): the launch also
// finishes each token's mHC Sinkhorn in place (both router launchers).
cudaError_t launch_router_topk(const float* logits, int n_tok, int E, const float* bias,
                               const void* tid2eid, bool tid64, const int64_t* token_ids, int topk,
                               float route_scale, float* w_out, int64_t* ids_out, cudaStream_t st,
                               const SinkhornRide& ride = SinkhornRide{});

// The whole router in one launch for decode-sized inputs (opt-in, DS4_ROUTER_FUSED=1; router_fused_ok:
// n_tok <= ROUTER_FUSED_TOKENS, n_tok * E <= ROUTER_FUSED_SLOTS, dim % 8 == 0): x bf16 [n_tok, dim], gate
// bf16 [E, dim]; logits is an fp32 [n_tok, E] workspace. Same outputs as the BF16 GEMV + launch_router_topk.
constexpr int ROUTER_FUSED_TOKENS = 8;
constexpr int ROUTER_FUSED_SLOTS = 4096;
bool router_fused_ok(int n_tok, int E, int dim);
cudaError_t launch_router_fused(const void* x, int n_tok, const void* gate, int E, int dim, const float* bias,
                                const void* tid2eid, bool tid64, const int64_t* token_ids, int topk,
                                float route_scale, float* logits, float* w_out, int64_t* ids_out, cudaStream_t st,
                                const SinkhornRide& ride = SinkhornRide{});

// L2 prefetch of weight ranges on the current stream (prefetch.cu): direct ranges [ptr[r], ptr[r] + bytes[r]),
// or, with ids (int64 [n_ids] on the device), range r of slot k at ptr[r] + (ids[k] - id_offset) * stride[r]
// for local experts (0 <= ids[k] - id_offset < n_local). Writes nothing; chunk_end is the launcher's.
constexpr int PF_MAX_RANGES = 4;
struct L2PrefetchArgs {
  const char* ptr[PF_MAX_RANGES];
  long bytes[PF_MAX_RANGES];
  long stride[PF_MAX_RANGES];
  int chunk_end[PF_MAX_RANGES];
  int n_ranges;
  const int64_t* ids;
  int n_ids;
  long id_offset, n_local;
};
cudaError_t launch_l2_prefetch(const L2PrefetchArgs& a, cudaStream_t st);

// While both streams are captured into one graph: add the side stream's last captured nodes (kernels only) to the
// main stream's dependency set with programmatic edges (capture.cu); false (nothing changed) where it cannot.
bool capture_join_programmatic(cudaStream_t side, cudaStream_t main);
// While both are captured into one graph: the side stream (forked from main: waiting on it) depends on main's last
// captured kernels by programmatic edges instead (capture.cu); false (nothing changed) where it cannot.
bool capture_fork_programmatic(cudaStream_t main, cudaStream_t side);

// One-shot all-reduce over peer memory (allreduce.cu, parallel.comm=ll): out[i] = (sum over ranks r in rank
// order of the partials x_r[i], each rounded to bf16 first and the sum too when round_bf16). peers[r]:
// rank r's buffer as mapped in this process ([2][world][cap] uint2, zeroed before the first call); counters:
// one int per block (n <= cap, ceil(cap / AR_CHUNK) of them, zeroed), this rank's memory. Every rank must
// make the same calls in the same order.
constexpr int AR_THREADS = 256;
constexpr int AR_CHUNK = 512;  // elements per block
constexpr int AR_MAX_WORLD = 8;
struct AllReduceArgs {
  const void* x;               // fp32, or bf16 with x_bf16
  void* out;                   // fp32, or bf16 with out_bf16
  uint2* peers[AR_MAX_WORLD];
  int* counters;
  long n, cap;
  int rank, world;
  bool x_bf16, out_bf16, round_bf16;
};
cudaError_t launch_all_reduce_ll(const AllReduceArgs& a, cudaStream_t st);
// The same all-reduce of a block output y [n = D] (bf16 out) with the hc fold (HcFold, D % 16 == 0, n = 1, 2, 4
// streams) in the same launch: out = y, and the fold's new streams and partials (one per 16-row tile) as the
// one-GPU fold forms them from y. a.peers: a buffer region of its own, a.counters: one int per block of
// AR_FOLD_TILES tiles (ceil(cap / (16 AR_FOLD_TILES)), zeroed), both used by these calls only.
constexpr int AR_FOLD_TILES = 2;    // 16-row tiles per block
constexpr int AR_FOLD_THREADS = 128;  // >= 16 AR_FOLD_TILES (exchange) and a pass of the 4-stream fold
cudaError_t launch_all_reduce_ll_fold(const AllReduceArgs& a, const HcFold& f, cudaStream_t st);

}  // namespace ds4
