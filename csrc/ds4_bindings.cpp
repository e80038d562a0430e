// The one binding file: checks tensors, takes the current CUDA stream, calls the launchers of the
// .cu files (which include CUDA headers only) and registers the ops as torch.ops.ds4.*.
// Fake (meta) implementations are registered in Python (ds4/kernels/_ops.py).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "ds4_launch.h"
#include "check_text.h"
#include "sinkhorn_ride_binding.h"

namespace {

using ds4_text::dims;  // numbers in messages as text (check_text.h)
using ds4_text::num;

constexpr int64_t FMT_BF16 = 0, FMT_FP8 = 1, FMT_FP4 = 2, FMT_FP4P = 3, FMT_FP4T = 4, FMT_FP8T = 5;
// fp4p: MXFP4 with permuted words (ds4_common.cuh fp4p_regs; the routed experts' layout after
// ds4.quant.formats.pack_fp4_mma): the same shapes and scales as fp4.
// fp4t: fp4p words in the tensor-core kernels' fragment order (ds4.quant.tile_fp4_mma; one-token MoE kernels only).
// fp8t: fp8 bytes in the same fragment order (ds4.quant.tile_fp8_mma; the dense GEMVs and the MoE kernels).
bool is_fp4(int64_t fmt) { return fmt == FMT_FP4 || fmt == FMT_FP4P || fmt == FMT_FP4T; }
bool is_fp8(int64_t fmt) { return fmt == FMT_FP8 || fmt == FMT_FP8T; }

void check_cuda(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), "ds4: ", name, " must be a CUDA tensor");
  TORCH_CHECK(t.is_contiguous(), "ds4: ", name, " must be contiguous");
}

void check_launch(cudaError_t e, const char* what) {
  TORCH_CHECK(e == cudaSuccess, "ds4: ", what, " launch failed: ", cudaGetErrorString(e),
              (e == cudaErrorInvalidValue ? " (shape not supported by this kernel)" : ""));
}

void check_weight(const at::Tensor& w, int64_t fmt, const char* name) {
  if (fmt == FMT_BF16) {
    TORCH_CHECK(w.scalar_type() == at::kBFloat16, "ds4: ", name, " must be bfloat16 for fmt bf16");
  } else {
    TORCH_CHECK(w.element_size() == 1, "ds4: ", name, " must have 1-byte elements for fp8/fp4");
  }
}

int64_t logical_in(const at::Tensor& w, int64_t fmt) { return w.size(-1) * (is_fp4(fmt) ? 2 : 1); }

int64_t scale_ld(const std::optional<at::Tensor>& s, int64_t fmt, const char* name) {
  if (fmt == FMT_BF16) return 0;
  TORCH_CHECK(s.has_value(), "ds4: ", name, " scale is required for fp8/fp4");
  check_cuda(*s, name);
  TORCH_CHECK(s->element_size() == 1, "ds4: ", name, " scale must be E8M0 (1 byte)");
  return s->size(-1);
}

const void* opt_ptr(const std::optional<at::Tensor>& t) { return t.has_value() ? t->data_ptr() : nullptr; }

// A dense weight's scale row length, its shape checked against the [O, K] weight (fp8: 128x128 blocks; fp4:
// per row and 32 values; bf16: none).
int64_t dense_scale_ld(const std::optional<at::Tensor>& scale, int64_t fmt, int64_t O, int64_t K, const char* op) {
  const int64_t s_ld = scale_ld(scale, fmt, "w");
  if (is_fp8(fmt)) TORCH_CHECK(scale->size(0) == (O + 127) / 128 && s_ld == (K + 127) / 128, op, ": fp8 scale shape");
  if (fmt == FMT_FP4) TORCH_CHECK(scale->size(0) == O && s_ld == K / 32, op, ": fp4 scale shape");
  return s_ld;
}

void check_aligned16(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, op, ": ", name, " must be 16-byte aligned");
}

// The hc fold's tensors (ds4_launch.h HcFold) for an output row of D values: res / out bf16 [1, n, D],
// post fp32 [1, n], comb fp32 [1, n, n], fn fp32 [mix, n * D], part fp32 [1, mix + 1, D / 16].
ds4::HcFold make_fold(const at::Tensor& res, const at::Tensor& post, const at::Tensor& comb, const at::Tensor& fn,
                      const at::Tensor& out, const at::Tensor& part, int64_t D, const char* op) {
  for (const at::Tensor* t : {&res, &post, &comb, &fn, &out, &part}) check_cuda(*t, "fold tensor");
  TORCH_CHECK(res.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16 && res.dim() == 3 &&
                  res.size(0) == 1 && res.size(2) == D && out.sizes() == res.sizes(),
              op, ": fold res / out must be bf16 [1, n, ", num(D), "]");
  const int64_t n = res.size(1), mix = (2 + n) * n;
  TORCH_CHECK(n == 1 || n == 2 || n == 4, op, ": the fold takes 1, 2 or 4 streams");
  TORCH_CHECK(post.scalar_type() == at::kFloat && comb.scalar_type() == at::kFloat && fn.scalar_type() == at::kFloat &&
                  part.scalar_type() == at::kFloat,
              op, ": fold post / comb / fn / part must be float32");
  TORCH_CHECK(post.numel() == n && comb.numel() == n * n && fn.dim() == 2 && fn.size(0) == mix && fn.size(1) == n * D &&
                  D % 16 == 0 && part.numel() == (mix + 1) * (D / 16),
              op, ": fold shapes (post [1, n], comb [1, n, n], fn [(2+n)n, n D], part [1, mix + 1, D / 16])");
  for (const at::Tensor* t : {&res, &fn, &out}) check_aligned16(*t, op, "fold res / fn / out");
  ds4::HcFold f;
  f.res = res.data_ptr();
  f.post = post.data_ptr<float>();
  f.comb = comb.data_ptr<float>();
  f.fn = fn.data_ptr<float>();
  f.out = out.data_ptr();
  f.part = part.data_ptr<float>();
  f.n = (int)n;
  f.mix = (int)mix;
  return f;
}

// act_quant (numerics=qat): x's values act_quant_sim(x, 128)'s, simulated in the kernel's staging; only where
// gemv_act_quant_ok holds (one row, ungrouped; ds4.kernels.act_quant_staged_ok asks it first).
at::Tensor gemv(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& scale, int64_t fmt,
                int64_t groups, int64_t kernel, bool out_f32, bool act_quant) {
  check_cuda(x, "x");
  check_cuda(w, "w");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2, "ds4.gemv: x must be bf16 [N, K]");
  TORCH_CHECK(w.dim() == 2, "ds4.gemv: w must be 2-D");
  check_weight(w, fmt, "w");
  const int64_t O = w.size(0), K = logical_in(w, fmt), N = x.size(0);
  TORCH_CHECK(groups >= 1 && O % groups == 0, "ds4.gemv: rows must split into groups");
  TORCH_CHECK(x.size(1) == K * groups, "ds4.gemv: x has ", num(x.size(1)), " columns, expected ", num(K * groups));
  const int64_t vals = fmt == FMT_BF16 ? 8 : (is_fp8(fmt) ? 16 : 32);
  TORCH_CHECK(K % vals == 0, "ds4.gemv: in_features must be a multiple of ", num(vals));
  const int64_t s_ld = dense_scale_ld(scale, fmt, O, K, "ds4.gemv");
  TORCH_CHECK(!act_quant || (N == 1 && groups == 1 && ds4::gemv_act_quant_ok((int)fmt, (int)kernel, 1, (int)O, (int)K, 0)),
              "ds4.gemv: act_quant needs one row on a tensor-core kernel that stages it (gemv_act_quant_ok)");
  c10::cuda::CUDAGuard guard(x.device());
  auto out = at::empty({N, O}, x.options().dtype(out_f32 ? at::kFloat : at::kBFloat16));
  if (N == 0) return out;
  const int step = ds4::gemv_max_tokens((int)fmt, (int)K);
  TORCH_CHECK(step >= 1, "ds4.gemv: in_features ", num(K), " too large for the shared-memory activation tile");
  cudaStream_t st = at::cuda::getCurrentCUDAStream();
  const int64_t esz = out_f32 ? 4 : 2;
  for (int64_t t0 = 0; t0 < N; t0 += step) {
    const int nt = (int)std::min<int64_t>(step, N - t0);
    check_launch(ds4::launch_gemv((int)fmt, (int)kernel,
                                  static_cast<const at::BFloat16*>(x.data_ptr()) + t0 * x.size(1), x.size(1), nt,
                                  w.data_ptr(), opt_ptr(scale), (int)s_ld,
                                  static_cast<char*>(out.data_ptr()) + t0 * O * esz, out_f32, O, (int)O, (int)K,
                                  groups > 1 ? (int)(O / groups) : 0, st, act_quant),
                 "gemv");
  }
  return out;
}

// The compressors' deferred projection (ds4_launch.h launch_gemv_deferred): fp32 [every, O], written only on the step
// whose position completes the ring; the others copy x into ring[pos % every]. The shapes are checked in Python
// (ds4.kernels.gemv_deferred); these checks' messages hold strings only.
at::Tensor gemv_deferred(const at::Tensor& x, at::Tensor& ring, const at::Tensor& w, const at::Tensor& pos) {
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&x, &ring, &w, &pos})
    check_cuda(*t, "gemv_deferred tensor");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && ring.scalar_type() == at::kBFloat16 &&
                  w.scalar_type() == at::kBFloat16 && pos.scalar_type() == at::kLong,
              "ds4.gemv_deferred: x, ring, w must be bf16 and pos int64");
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 1 && ring.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1) &&
                  ring.size(1) == w.size(1) && pos.numel() == 1 && x.is_contiguous() && ring.is_contiguous() &&
                  w.is_contiguous(),
              "ds4.gemv_deferred: x [1, K], ring [every, K], w [O, K] contiguous, pos [1]");
  c10::cuda::CUDAGuard guard(x.device());
  auto out = at::empty({ring.size(0), w.size(0)}, x.options().dtype(at::kFloat));
  check_launch(ds4::launch_gemv_deferred(x.data_ptr(), ring.data_ptr(), (int)ring.size(0), pos.data_ptr<int64_t>(),
                                         w.data_ptr(), out.data_ptr(), (int)w.size(0), (int)w.size(1),
                                         at::cuda::getCurrentCUDAStream()),
               "gemv_deferred");
  return out;
}

// The hc fold (ds4_launch.h HcFold): bf16 [1, O] = x @ W^T on the tensor cores, and the next mHC
// site's streams (out) and partials (part) from its epilogue.
at::Tensor gemv_fold(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& scale, int64_t fmt,
                     const at::Tensor& res, const at::Tensor& post, const at::Tensor& comb, const at::Tensor& fn,
                     const at::Tensor& out, const at::Tensor& part, bool act_quant) {
  check_cuda(x, "x");
  check_cuda(w, "w");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.size(0) == 1, "ds4.gemv_fold: x must be bf16 [1, K]");
  TORCH_CHECK(w.dim() == 2, "ds4.gemv_fold: w must be 2-D");
  check_weight(w, fmt, "w");
  const int64_t O = w.size(0), K = logical_in(w, fmt);
  TORCH_CHECK(x.size(1) == K, "ds4.gemv_fold: x has ", num(x.size(1)), " columns, expected ", num(K));
  const int64_t s_ld = dense_scale_ld(scale, fmt, O, K, "ds4.gemv_fold");
  const ds4::HcFold f = make_fold(res, post, comb, fn, out, part, O, "ds4.gemv_fold");
  TORCH_CHECK(ds4::hc_fold_ok(0, (int)fmt, (int)O, (int)K, 1, f.n),
              "ds4.gemv_fold: no fold at this shape or format (hc_fold_ok; DS4_MMA=0 turns the tensor cores off)");
  TORCH_CHECK(!act_quant || ds4::gemv_act_quant_ok((int)fmt, ds4::KERNEL_AUTO, 1, (int)O, (int)K, 0),
              "ds4.gemv_fold: act_quant at a shape no staging kernel takes (gemv_act_quant_ok)");
  c10::cuda::CUDAGuard guard(x.device());
  auto y = at::empty({1, O}, x.options());
  check_launch(ds4::launch_gemv_fold((int)fmt, x.data_ptr(), w.data_ptr(), opt_ptr(scale), (int)s_ld, y.data_ptr(),
                                     (int)O, (int)K, f, at::cuda::getCurrentCUDAStream(), act_quant),
               "gemv_fold");
  return y;
}

bool hc_fold_ok_host(int64_t kind, int64_t fmt, int64_t rows, int64_t cols, int64_t topk, int64_t n) {
  return ds4::hc_fold_ok((int)kind, (int)fmt, (int)rows, (int)cols, (int)topk, (int)n);
}

// q_norm + wq_b in one launch (decode, one token): bf16 [1, O] = rms_norm(x, norm_weight, eps) @ W^T.
// skip_pos (int64 [1]): where (skip_pos + 1) / skip_ratio <= skip_k, rows [skip_rows, O) are zeros, not computed
// (ds4::RowSkip).
at::Tensor gemv_rmsnorm(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& scale, int64_t fmt,
                        const at::Tensor& norm_weight, double eps, const std::optional<at::Tensor>& skip_pos,
                        int64_t skip_ratio, int64_t skip_k, int64_t skip_rows, bool act_quant) {
  check_cuda(x, "x");
  check_cuda(w, "w");
  check_cuda(norm_weight, "norm_weight");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.size(0) == 1 && x.is_contiguous(),
              "ds4.gemv_rmsnorm: x must be one contiguous bf16 row [1, K]");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0, "ds4.gemv_rmsnorm: x must be 16-byte aligned");
  TORCH_CHECK(w.dim() == 2, "ds4.gemv_rmsnorm: w must be 2-D");
  check_weight(w, fmt, "w");
  const int64_t O = w.size(0), K = logical_in(w, fmt);
  TORCH_CHECK(x.size(1) == K, "ds4.gemv_rmsnorm: x has ", num(x.size(1)), " columns, expected ", num(K));
  TORCH_CHECK(ds4::gemv_rmsnorm_ok((int)fmt, (int)O, (int)K), "ds4.gemv_rmsnorm: no tensor-core kernel for fmt ",
              num(fmt), " at ", num(O), " x ", num(K), " (see gemv_rmsnorm_ok)");
  TORCH_CHECK(!act_quant || ds4::gemv_act_quant_ok((int)fmt, ds4::KERNEL_AUTO, 1, (int)O, (int)K, 0),
              "ds4.gemv_rmsnorm: act_quant at a shape no staging kernel takes (gemv_act_quant_ok)");
  const int64_t s_ld = dense_scale_ld(scale, fmt, O, K, "ds4.gemv_rmsnorm");
  const bool nw_f32 = norm_weight.scalar_type() == at::kFloat;
  TORCH_CHECK((nw_f32 || norm_weight.scalar_type() == at::kBFloat16) && norm_weight.dim() == 1 &&
                  norm_weight.size(0) == K && norm_weight.is_contiguous(),
              "ds4.gemv_rmsnorm: norm_weight must be a contiguous fp32 or bf16 [K]");
  ds4::RowSkip skip;
  if (skip_pos.has_value()) {
    TORCH_CHECK(skip_pos->is_cuda() && skip_pos->device() == x.device() && skip_pos->scalar_type() == at::kLong &&
                    skip_pos->numel() == 1,
                "ds4.gemv_rmsnorm: skip_pos must be one int64 position on x's device");
    // (a message of strings only: session 37's run 4 crashed where this check formatted its integers)
    TORCH_CHECK(skip_ratio >= 1 && skip_k >= 1 && skip_rows >= 16 && skip_rows % 16 == 0 && skip_rows < O,
                "ds4.gemv_rmsnorm: need skip_ratio >= 1, skip_k >= 1 and 16 <= skip_rows < O, a multiple of 16");
    skip = ds4::RowSkip{skip_pos->data_ptr<int64_t>(), (int)skip_ratio, (int)skip_k, (int)skip_rows};
  }
  c10::cuda::CUDAGuard guard(x.device());
  auto out = at::empty({1, O}, x.options());
  check_launch(ds4::launch_gemv_rmsnorm((int)fmt, x.data_ptr(), w.data_ptr(), opt_ptr(scale), (int)s_ld, out.data_ptr(),
                                        false, (int)O, (int)K, norm_weight.data_ptr(), nw_f32, (float)eps,
                                        at::cuda::getCurrentCUDAStream(), skip, act_quant),
               "gemv_rmsnorm");
  return out;
}

// The MoEArgs of one token's launch at a shape, for the host-only questions below.
static ds4::MoEArgs one_token_moe(int64_t fmt, int64_t topk, int64_t dim, int64_t inter) {
  ds4::MoEArgs a;
  a.fmt = (int)fmt;
  a.n_tok = 1;
  a.topk = (int)topk;
  a.dim = (int)dim;
  a.inter = (int)inter;
  return a;
}

bool moe_route_ok_host(int64_t fmt, int64_t topk, int64_t dim, int64_t inter, int64_t n_experts) {
  ds4::MoEArgs a = one_token_moe(fmt, topk, dim, inter);
  a.n_experts = (int)n_experts;
  return ds4::moe_route_ok(a);
}

// The split-K pair's partial rows at a shape on the current device (-1: kernel "splitk" does not take it).
int64_t moe_splitk_rows_host(int64_t fmt, int64_t topk, int64_t dim, int64_t inter) {
  return ds4::moe_splitk_rows(one_token_moe(fmt, topk, dim, inter));
}

bool moe_act_quant_ok_host(int64_t fmt, int64_t topk, int64_t dim, int64_t inter, bool gate_up) {
  return ds4::moe_act_quant_ok(one_token_moe(fmt, topk, dim, inter), gate_up);
}

// Whether the launches of a kind (one letter of DS4_BULK_STAGE: g, d, u) now stage their activations by bulk copies.
bool bulk_stage_site_host(std::string site) { return site.size() == 1 && ds4::bulk_stage_site(site[0]); }

bool gemv_act_quant_ok_host(int64_t fmt, int64_t rows, int64_t cols) {
  return ds4::gemv_act_quant_ok((int)fmt, ds4::KERNEL_AUTO, 1, (int)rows, (int)cols, 0);
}

bool gemv_rmsnorm_ok(int64_t fmt, int64_t rows, int64_t cols) {
  return ds4::gemv_rmsnorm_ok((int)fmt, (int)rows, (int)cols);
}

// Fills the weight part of MoEArgs from stacked [E, O, I] (or single [O, I]) tensors.
void fill_moe(ds4::MoEArgs& a, int64_t fmt, const at::Tensor& w1, const std::optional<at::Tensor>& s1,
              const at::Tensor& w3, const std::optional<at::Tensor>& s3, const at::Tensor& w2,
              const std::optional<at::Tensor>& s2, const std::optional<at::Tensor>& ptrs, int64_t expert_offset,
              int64_t n_local) {
  a.fmt = (int)fmt;
  a.expert_offset = (int)expert_offset;
  a.n_local = (int)n_local;
  if (ptrs.has_value()) {
    TORCH_CHECK(fmt == FMT_BF16, "ds4.moe: pointer tables are for bf16 (cached) experts only");
    check_cuda(*ptrs, "ptrs");
    TORCH_CHECK(ptrs->scalar_type() == at::kLong && ptrs->dim() == 2 && ptrs->size(1) == 3 &&
                    ptrs->size(0) == n_local, "ds4.moe: ptrs must be int64 [n_local, 3]");
    a.ptrs = reinterpret_cast<const uint64_t*>(ptrs->data_ptr());
  }
}

// The router's tables for N tokens over E experts, top-k: hash layers (tid2eid) need token_ids, learned
// layers the bias. Shared by ds4.router and the MoE kernels that route for themselves.
struct RouteTables {
  const float* bias = nullptr;
  const void* tid2eid = nullptr;
  bool tid64 = false;
  const int64_t* token_ids = nullptr;
};
RouteTables route_tables(const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& tid2eid,
                         const std::optional<at::Tensor>& token_ids, int64_t N, int64_t E, int64_t k,
                         const char* what) {
  RouteTables r;
  if (tid2eid.has_value()) {
    check_cuda(*tid2eid, "tid2eid");
    TORCH_CHECK(token_ids.has_value(), what, ": hash routing needs token_ids");
    check_cuda(*token_ids, "token_ids");
    TORCH_CHECK(token_ids->scalar_type() == at::kLong && token_ids->numel() == N, what, ": token_ids int64 [N]");
    TORCH_CHECK((tid2eid->scalar_type() == at::kInt || tid2eid->scalar_type() == at::kLong) && tid2eid->dim() == 2 &&
                    tid2eid->size(1) == k && tid2eid->is_contiguous(),
                what, ": tid2eid must be contiguous int32/int64 [vocab, topk]");
    r.tid2eid = tid2eid->data_ptr();
    r.tid64 = tid2eid->scalar_type() == at::kLong;
    r.token_ids = static_cast<const int64_t*>(token_ids->data_ptr());
  } else {
    TORCH_CHECK(bias.has_value(), what, ": learned routing needs the bias");
    check_cuda(*bias, "bias");
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == E && bias->is_contiguous(),
                what, ": bias must be contiguous f32 [E]");
    r.bias = static_cast<const float*>(bias->data_ptr());
  }
  return r;
}

// Routing inside the one-token MoE kernels (MoEArgs::route_logits): the router GEMV's logits f32 [1, E]
// and the router's tables (route_tables). No-op without route_logits.
void fill_route(ds4::MoEArgs& a, const std::optional<at::Tensor>& logits, const std::optional<at::Tensor>& bias,
                const std::optional<at::Tensor>& tid2eid, const std::optional<at::Tensor>& token_ids, double route_scale,
                int64_t N, int64_t k, const char* what) {
  if (!logits.has_value()) return;
  check_cuda(*logits, "route_logits");
  TORCH_CHECK(N == 1 && logits->scalar_type() == at::kFloat && logits->dim() == 2 && logits->size(0) == 1 &&
                  logits->is_contiguous(), what, ": route_logits must be contiguous f32 [1, E] (one token)");
  const int64_t E = logits->size(1);
  TORCH_CHECK(k >= 1 && k <= E, what, ": topk ", num(k), " out of range for ", num(E), " experts");
  const RouteTables r = route_tables(bias, tid2eid, token_ids, 1, E, k, what);
  a.route_bias = r.bias;
  a.tid2eid = r.tid2eid;
  a.tid64 = r.tid64 ? 1 : 0;
  a.token_ids = r.token_ids;
  a.route_logits = static_cast<const float*>(logits->data_ptr());
  a.n_experts = (int)E;
  a.route_scale = (float)route_scale;
}

at::Tensor moe_gate_up(const at::Tensor& x, const std::optional<at::Tensor>& ids,
                       const std::optional<at::Tensor>& route_w, const at::Tensor& w1,
                       const std::optional<at::Tensor>& s1, const at::Tensor& w3, const std::optional<at::Tensor>& s3,
                       const std::optional<at::Tensor>& ptrs, int64_t fmt, int64_t expert_offset, int64_t n_local,
                       double limit, int64_t kernel, const std::optional<at::Tensor>& route_logits,
                       const std::optional<at::Tensor>& route_bias, const std::optional<at::Tensor>& tid2eid,
                       const std::optional<at::Tensor>& token_ids, double route_scale, bool act_quant,
                       const std::optional<at::Tensor>& w2, const std::optional<at::Tensor>& s2) {
  check_cuda(x, "x");
  check_cuda(w1, "w1");
  check_cuda(w3, "w3");
  check_weight(w1, fmt, "w1");
  check_weight(w3, fmt, "w3");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2, "ds4.moe_gate_up: x must be bf16 [N, dim]");
  TORCH_CHECK(w1.sizes() == w3.sizes() && (w1.dim() == 2 || w1.dim() == 3), "ds4.moe_gate_up: w1/w3 shapes");
  const int64_t N = x.size(0), dim = x.size(1), inter = w1.size(-2);
  TORCH_CHECK(logical_in(w1, fmt) == dim, "ds4.moe_gate_up: w1 in_features != dim");
  ds4::MoEArgs a;
  int64_t k = 1;
  if (ids.has_value()) {
    check_cuda(*ids, "ids");
    TORCH_CHECK(ids->scalar_type() == at::kLong && ids->dim() == 2 && ids->size(0) == N,
                "ds4.moe_gate_up: ids must be int64 [N, k]");
    k = ids->size(1);
  } else {
    TORCH_CHECK(w1.dim() == 2 || ptrs.has_value() || w1.size(0) == 1, "ds4.moe_gate_up: ids=None needs one expert");
  }
  if (route_w.has_value()) {
    check_cuda(*route_w, "route_w");
    TORCH_CHECK(route_w->scalar_type() == at::kFloat && route_w->numel() == N * k,
                "ds4.moe_gate_up: route weights must be f32 [N, k]");
  }
  fill_moe(a, fmt, w1, s1, w3, s3, w1, std::nullopt, ptrs, expert_offset, n_local);
  if (!ptrs.has_value()) {
    const int64_t s_ld = scale_ld(s1, fmt, "w1");
    if (fmt != FMT_BF16) {
      TORCH_CHECK(s3.has_value() && s3->sizes() == s1->sizes(), "ds4.moe_gate_up: s1/s3 shapes");
      if (is_fp8(fmt)) TORCH_CHECK(s_ld == (dim + 127) / 128 && s1->size(-2) == (inter + 127) / 128, "fp8 scale shape");
      if (is_fp4(fmt)) TORCH_CHECK(s_ld == dim / 32 && s1->size(-2) == inter, "fp4 scale shape");
      check_cuda(*s3, "s3");
    }
    a.W1 = w1.data_ptr();
    a.W3 = w3.data_ptr();
    a.S1 = opt_ptr(s1);
    a.S3 = opt_ptr(s3);
    a.w13_estride = w1.dim() == 3 ? w1.stride(0) * w1.element_size() : 0;
    a.s13_estride = (fmt != FMT_BF16 && s1->dim() == 3) ? s1->stride(0) : 0;
    a.s13_ld = (int)s_ld;
    if (!ids.has_value()) a.n_local = 1;
  }
  a.topk = (int)k;
  a.dim = (int)dim;
  a.inter = (int)inter;
  a.limit = (float)limit;
  a.kernel = (int)kernel;
  fill_route(a, route_logits, route_bias, tid2eid, token_ids, route_scale, N, k, "ds4.moe_gate_up");
  if (a.route_logits) {  // ids and route_w are this launch's outputs (written by its block 0)
    TORCH_CHECK(ids.has_value() && route_w.has_value() && ids->is_contiguous() && route_w->is_contiguous(),
                "ds4.moe_gate_up: routing in the kernel writes ids and route_w: pass both, contiguous");
    a.n_tok = 1;
    TORCH_CHECK(ds4::moe_route_ok(a), "ds4.moe_gate_up: no routing inside the kernel at this shape (moe_route_ok)");
    a.ids_out = static_cast<int64_t*>(ids->data_ptr());
    a.rw_out = static_cast<float*>(route_w->data_ptr());
  }
  if (act_quant) {  // numerics=qat's simulation of x in the one-token tensor-core kernel's staging
    ds4::MoEArgs one = a;
    one.n_tok = 1;
    TORCH_CHECK(N == 1 && !ptrs.has_value() && ds4::moe_act_quant_ok(one, true),
                "ds4.moe_gate_up: act_quant needs one token on a tensor-core kernel that stages it (moe_act_quant_ok)");
  }
  c10::cuda::CUDAGuard guard(x.device());
  if (ds4::kernel_splitk((int)kernel)) {  // the split-K pair's first launch: partial rows of the output, not h
    const int64_t rows = ds4::moe_splitk_rows(a);
    TORCH_CHECK(N == 1 && ids.has_value() && route_w.has_value() && !a.route_logits && !act_quant && rows >= 1 &&
                    w2.has_value() && s2.has_value() && !ptrs.has_value(),
                "ds4.moe_gate_up: kernel splitk takes one token of routed fp4t experts with ids, route weights, w2 and "
                "s2, no routing in the kernel or act_quant, at the shapes moe_splitk_rows takes");
    check_cuda(*w2, "w2");
    check_cuda(*s2, "s2");
    check_weight(*w2, fmt, "w2");
    TORCH_CHECK(w2->dim() == w1.dim() && w2->size(0) == w1.size(0) && w2->size(-2) == dim &&
                    logical_in(*w2, fmt) == inter && scale_ld(s2, fmt, "w2") == inter / 32 && s2->size(-2) == dim,
                "ds4.moe_gate_up: kernel splitk's w2 [E, dim, inter] and s2 [E, dim, inter / 32] must match w1");
    a.W2 = w2->data_ptr();
    a.S2 = s2->data_ptr();
    a.w2_estride = w2->dim() == 3 ? w2->stride(0) * w2->element_size() : 0;
    a.s2_estride = s2->dim() == 3 ? s2->stride(0) : 0;
    a.s2_ld = inter / 32;
    auto parts = at::empty({rows, dim}, x.options().dtype(at::kFloat));
    ds4::MoEArgs c = a;
    c.ids = static_cast<const int64_t*>(ids->data_ptr());
    c.rw = static_cast<const float*>(route_w->data_ptr());
    check_launch(ds4::launch_moe_gate_up(c, x.data_ptr(), parts.data_ptr(), at::cuda::getCurrentCUDAStream()),
                 "moe_gate_up");
    return parts;
  }
  auto h = at::empty({N * k, inter}, x.options());
  if (N == 0) return h;
  const int step = ds4::moe_max_tokens((int)fmt, (int)k, (int)dim, (int)inter);
  TORCH_CHECK(step >= 1, "ds4.moe_gate_up: shape too large for the shared-memory tiles");
  cudaStream_t st = at::cuda::getCurrentCUDAStream();
  for (int64_t t0 = 0; t0 < N; t0 += step) {
    ds4::MoEArgs c = a;
    c.n_tok = (int)std::min<int64_t>(step, N - t0);
    c.ids = ids.has_value() ? static_cast<const int64_t*>(ids->data_ptr()) + t0 * k : nullptr;
    c.rw = route_w.has_value() ? static_cast<const float*>(route_w->data_ptr()) + t0 * k : nullptr;
    check_launch(ds4::launch_moe_gate_up(c, static_cast<const at::BFloat16*>(x.data_ptr()) + t0 * dim,
                                         static_cast<at::BFloat16*>(h.data_ptr()) + t0 * k * inter, st, act_quant),
                 "moe_gate_up");
  }
  return h;
}

at::Tensor moe_down(const at::Tensor& h, const std::optional<at::Tensor>& ids, int64_t topk, const at::Tensor& w2,
                    const std::optional<at::Tensor>& s2, const std::optional<at::Tensor>& ptrs, int64_t fmt,
                    int64_t expert_offset, int64_t n_local, const std::optional<at::Tensor>& add, bool out_f32,
                    int64_t kernel, const std::optional<at::Tensor>& route_logits,
                    const std::optional<at::Tensor>& route_bias, const std::optional<at::Tensor>& tid2eid,
                    const std::optional<at::Tensor>& token_ids, double route_scale,
                    const std::optional<at::Tensor>& fold_res, const std::optional<at::Tensor>& fold_post,
                    const std::optional<at::Tensor>& fold_comb, const std::optional<at::Tensor>& fold_fn,
                    const std::optional<at::Tensor>& fold_out, const std::optional<at::Tensor>& fold_part,
                    bool act_quant) {
  check_cuda(h, "h");
  check_cuda(w2, "w2");
  check_weight(w2, fmt, "w2");
  TORCH_CHECK(w2.dim() == 2 || w2.dim() == 3, "ds4.moe_down: w2 shape");
  const bool splitk = ds4::kernel_splitk((int)kernel);  // h: the split-K gate+up's partial rows, fp32 [rows, dim]
  if (splitk) {
    TORCH_CHECK(h.scalar_type() == at::kFloat && h.dim() == 2 && h.size(1) == w2.size(-2) && h.is_contiguous() &&
                    h.size(0) == ds4::moe_splitk_rows(one_token_moe(fmt, topk, w2.size(-2), logical_in(w2, fmt))) &&
                    !route_logits.has_value() && !act_quant,
                "ds4.moe_down: kernel splitk takes the partial rows of moe_gate_up's kernel splitk, fp32 "
                "[moe_splitk_rows, dim], without routing in the kernel or act_quant");
  } else {
    TORCH_CHECK(h.scalar_type() == at::kBFloat16 && h.dim() == 2 && topk >= 1 && h.size(0) % topk == 0,
                "ds4.moe_down: h must be bf16 [N*topk, inter]");
  }
  const int64_t N = splitk ? 1 : h.size(0) / topk, inter = splitk ? logical_in(w2, fmt) : h.size(1),
                dim = w2.size(-2);
  TORCH_CHECK(logical_in(w2, fmt) == inter, "ds4.moe_down: w2 in_features != inter");
  ds4::MoEArgs a;
  if (ids.has_value()) {
    check_cuda(*ids, "ids");
    TORCH_CHECK(ids->scalar_type() == at::kLong && ids->dim() == 2 && ids->size(0) == N && ids->size(1) == topk,
                "ds4.moe_down: ids must be int64 [N, topk]");
  } else {
    TORCH_CHECK(topk == 1, "ds4.moe_down: ids=None needs topk 1");
  }
  if (add.has_value()) {
    check_cuda(*add, "add");
    TORCH_CHECK((add->scalar_type() == at::kFloat || add->scalar_type() == at::kBFloat16) && add->numel() == N * dim &&
                    add->is_contiguous(),
                "ds4.moe_down: add must be contiguous f32 or bf16 [N, dim]");
  }
  fill_moe(a, fmt, w2, std::nullopt, w2, std::nullopt, w2, s2, ptrs, expert_offset, n_local);
  a.add_bf16 = add.has_value() && add->scalar_type() == at::kBFloat16;
  if (!ptrs.has_value()) {
    const int64_t s_ld = scale_ld(s2, fmt, "w2");
    if (is_fp8(fmt)) TORCH_CHECK(s_ld == (inter + 127) / 128 && s2->size(-2) == (dim + 127) / 128, "fp8 scale shape");
    if (is_fp4(fmt)) TORCH_CHECK(s_ld == inter / 32 && s2->size(-2) == dim, "fp4 scale shape");
    a.W2 = w2.data_ptr();
    a.S2 = opt_ptr(s2);
    a.w2_estride = w2.dim() == 3 ? w2.stride(0) * w2.element_size() : 0;
    a.s2_estride = (fmt != FMT_BF16 && s2->dim() == 3) ? s2->stride(0) : 0;
    a.s2_ld = (int)s_ld;
    if (!ids.has_value()) a.n_local = 1;
  }
  a.topk = (int)topk;
  a.dim = (int)dim;
  a.inter = (int)inter;
  a.kernel = (int)kernel;
  fill_route(a, route_logits, route_bias, tid2eid, token_ids, route_scale, N, topk, "ds4.moe_down");
  if (a.route_logits) {
    a.n_tok = 1;
    TORCH_CHECK(ids.has_value() && ds4::moe_route_ok(a),
                "ds4.moe_down: no routing inside the kernel at this shape (moe_route_ok), or no ids");
  }
  // the hc fold (all six tensors or none): one token, bf16 out
  const int nfold = fold_res.has_value() + fold_post.has_value() + fold_comb.has_value() + fold_fn.has_value() +
                    fold_out.has_value() + fold_part.has_value();
  TORCH_CHECK(nfold == 0 || nfold == 6, "ds4.moe_down: the fold takes all of fold_res, fold_post, fold_comb, fold_fn, "
              "fold_out, fold_part");
  ds4::HcFold fold;
  if (nfold == 6) {
    fold = make_fold(*fold_res, *fold_post, *fold_comb, *fold_fn, *fold_out, *fold_part, dim, "ds4.moe_down");
    TORCH_CHECK(N == 1 && !out_f32 && !ptrs.has_value() &&
                    ds4::hc_fold_ok(1, (int)fmt, (int)dim, (int)inter, (int)topk, fold.n),
                "ds4.moe_down: no fold at this shape (hc_fold_ok: one token, bf16 out, the tensor-core kernel)");
  }
  if (act_quant) {  // numerics=qat's simulation of h in the one-token tensor-core kernel's staging
    ds4::MoEArgs one = a;
    one.n_tok = 1;
    TORCH_CHECK(N == 1 && !ptrs.has_value() && ds4::moe_act_quant_ok(one, false),
                "ds4.moe_down: act_quant needs one token on a tensor-core kernel that stages it (moe_act_quant_ok)");
  }
  c10::cuda::CUDAGuard guard(h.device());
  auto out = at::empty({N, dim}, h.options().dtype(out_f32 ? at::kFloat : at::kBFloat16));
  if (N == 0) return out;
  if (splitk) {
    ds4::MoEArgs c = a;
    c.ids = ids.has_value() ? static_cast<const int64_t*>(ids->data_ptr()) : nullptr;
    check_launch(ds4::launch_moe_down(c, h.data_ptr(), add.has_value() ? add->data_ptr() : nullptr, out.data_ptr(),
                                      out_f32, at::cuda::getCurrentCUDAStream(), nfold == 6 ? &fold : nullptr),
                 "moe_down");
    return out;
  }
  const int step = ds4::moe_max_tokens((int)fmt, (int)topk, (int)dim, (int)inter);
  TORCH_CHECK(step >= 1, "ds4.moe_down: shape too large for the shared-memory tiles");
  cudaStream_t st = at::cuda::getCurrentCUDAStream();
  const int64_t esz = out_f32 ? 4 : 2;
  for (int64_t t0 = 0; t0 < N; t0 += step) {
    ds4::MoEArgs c = a;
    c.n_tok = (int)std::min<int64_t>(step, N - t0);
    c.ids = ids.has_value() ? static_cast<const int64_t*>(ids->data_ptr()) + t0 * topk : nullptr;
    check_launch(ds4::launch_moe_down(c, static_cast<const at::BFloat16*>(h.data_ptr()) + t0 * topk * inter,
                                      add.has_value() ? static_cast<const char*>(add->data_ptr()) +
                                                            t0 * dim * add->element_size() : nullptr,
                                      static_cast<char*>(out.data_ptr()) + t0 * dim * esz, out_f32, st,
                                      nfold == 6 ? &fold : nullptr, act_quant),
                 "moe_down");
  }
  return out;
}

// given_logits (fp32 [N, E], e.g. from the mHC router fold): the tail kernel alone, no GEMV. comb (fp32 [N, n, n] as
// an hc finish with iters = 0 left it): the router's last launch also finishes each token's mHC Sinkhorn in place
// (ds4.ops.base.SinkhornRide).
std::tuple<at::Tensor, at::Tensor> router(const at::Tensor& x, const at::Tensor& gate,
                                          const std::optional<at::Tensor>& bias,
                                          const std::optional<at::Tensor>& tid2eid,
                                          const std::optional<at::Tensor>& token_ids, int64_t topk,
                                          double route_scale, const std::optional<at::Tensor>& given_logits,
                                          const std::optional<at::Tensor>& comb, int64_t iters, double hc_eps) {
  check_cuda(gate, "gate");
  TORCH_CHECK(gate.scalar_type() == at::kBFloat16 && gate.dim() == 2, "ds4.router: gate must be bf16 [E, dim]");
  const int64_t N = x.size(0), E = gate.size(0), dim = gate.size(1);
  const ds4::SinkhornRide ride = ds4::sinkhorn_ride_arg(comb, iters, hc_eps, N, x.device(), "ds4.router");
  if (given_logits.has_value()) {
    check_cuda(*given_logits, "logits");
    TORCH_CHECK(given_logits->scalar_type() == at::kFloat && given_logits->dim() == 2 && given_logits->size(0) == N &&
                    given_logits->size(1) == E,
                "ds4.router: logits must be fp32 [N, E]");
  }
  // The BF16 GEMV, then the tail kernel; DS4_ROUTER_FUSED=1 (read at every call) takes one fused launch
  // for decode sizes instead — not the default: in the decode step it measured 1.8-4.8 us per layer
  // slower (H200, experiments/decode_session8_h200.md; its 64 blocks compete with the shared expert's
  // side-stream kernels, which start at the same time, before its last block can run the tail).
  const char* env = std::getenv("DS4_ROUTER_FUSED");
  const bool fused = !given_logits.has_value() && env && env[0] == '1' && ds4::router_fused_ok((int)N, (int)E, (int)dim);
  at::Tensor logits;
  if (given_logits.has_value()) {
    logits = *given_logits;
  } else if (fused) {
    check_cuda(x, "x");
    TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.size(1) == dim && x.is_contiguous(),
                "ds4.router: x must be contiguous bf16 [N, dim]");
    TORCH_CHECK(gate.is_contiguous(), "ds4.router: gate must be contiguous");
    logits = at::empty({N, E}, x.options().dtype(at::kFloat));
  } else {
    logits = gemv(x, gate, std::nullopt, FMT_BF16, 1, 0, true, false);
  }
  const RouteTables r = route_tables(bias, tid2eid, token_ids, N, E, topk, "ds4.router");
  const float* b = r.bias;
  const void* tid = r.tid2eid;
  const bool tid64 = r.tid64;
  const int64_t* tok = r.token_ids;
  c10::cuda::CUDAGuard guard(x.device());
  auto w = at::empty({N, topk}, x.options().dtype(at::kFloat));
  auto ids = at::empty({N, topk}, x.options().dtype(at::kLong));
  if (N == 0) return {w, ids};
  if (fused) {
    check_launch(ds4::launch_router_fused(x.data_ptr(), (int)N, gate.data_ptr(), (int)E, (int)dim, b, tid, tid64, tok,
                                          (int)topk, (float)route_scale, static_cast<float*>(logits.data_ptr()),
                                          static_cast<float*>(w.data_ptr()), static_cast<int64_t*>(ids.data_ptr()),
                                          at::cuda::getCurrentCUDAStream(), ride),
                 "router_fused");
    return {w, ids};
  }
  check_launch(ds4::launch_router_topk(static_cast<const float*>(logits.data_ptr()), (int)N, (int)E, b, tid, tid64,
                                       tok, (int)topk, (float)route_scale, static_cast<float*>(w.data_ptr()),
                                       static_cast<int64_t*>(ids.data_ptr()), at::cuda::getCurrentCUDAStream(), ride),
               "router_topk");
  return {w, ids};
}

at::Tensor argmax(const at::Tensor& x) {
  check_cuda(x, "x");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(0) >= 1 && x.size(1) >= 1,
              "ds4.argmax: x must be fp32 [B, V]");
  TORCH_CHECK(x.size(0) <= ds4::ARGMAX_MAX_ROWS, "ds4.argmax: at most ", num(ds4::ARGMAX_MAX_ROWS), " rows");
  c10::cuda::CUDAGuard guard(x.device());
  auto out = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  check_launch(ds4::launch_argmax(static_cast<const float*>(x.data_ptr()), (int)x.size(0), (long)x.size(1),
                                  static_cast<int64_t*>(out.data_ptr()), at::cuda::getCurrentCUDAStream()),
               "argmax");
  return out;
}

at::Tensor act_quant_sim(const at::Tensor& x, int64_t block) {
  check_cuda(x, "x");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() >= 1 && x.is_contiguous(),
              "ds4.act_quant_sim: x must be contiguous bf16");
  TORCH_CHECK((block == 64 || block == 128) && x.size(-1) % block == 0 && x.size(-1) > 0,
              "ds4.act_quant_sim: block must be 64 or 128 and divide the last dim, got block ", num(block), " for ",
              num(x.size(-1)));
  c10::cuda::CUDAGuard guard(x.device());
  auto out = at::empty_like(x);
  if (x.numel() == 0) return out;
  check_launch(ds4::launch_act_quant_sim(x.data_ptr(), out.data_ptr(), x.numel() / x.size(-1), (int)x.size(-1),
                                         (int)block, at::cuda::getCurrentCUDAStream()),
               "act_quant_sim");
  return out;
}

// Prefill's weight dequantisation (dequant.cu): w [..., O, Kb] in layout fmt (fp8 / fp8t / fp4 / fp4p / fp4t; the
// leading dims stack experts), its E8M0 scale [..., ceil(O/128), ceil(K/128)] (fp8) or [..., O, K/32] (fp4) -> out
// bf16 or fp32 [..., O, K] (written whole; its matrices contiguous, and where it is not contiguous as a whole a
// 3-dim [E, O, K] with any expert stride: e.g. the w1 half of a [E, 2 O, K] buffer), the values of QWeight.dequant.
void dequant(const at::Tensor& w, const at::Tensor& scale, int64_t fmt, const at::Tensor& out) {
  TORCH_CHECK(is_fp8(fmt) || is_fp4(fmt), "ds4.dequant: fmt must be fp8, fp8t or an fp4 layout");
  check_cuda(w, "w");
  check_cuda(scale, "scale");
  TORCH_CHECK(out.is_cuda(), "ds4: out must be a CUDA tensor");
  check_weight(w, fmt, "w");
  TORCH_CHECK(w.dim() >= 2 && scale.dim() == w.dim() && scale.element_size() == 1 && out.dim() == w.dim(),
              "ds4.dequant: w, scale and out must have the same number of dims (>= 2), the scale 1-byte E8M0");
  const int64_t O = w.size(-2), K = logical_in(w, fmt);
  TORCH_CHECK(O >= 1 && K >= 1 && ds4::dequant_ok((int)fmt, (int)O, (int)K), "ds4.dequant: shape [", num(O), ", ",
              num(K), "] not supported in this layout (rows of whole 16-byte chunks; fp8t / fp4t whole tiles)");
  const int64_t E = w.numel() / (O * w.size(-1));
  std::vector<int64_t> want_s(w.sizes().begin(), w.sizes().end() - 2), want_o(want_s);
  want_s.push_back(is_fp8(fmt) ? (O + 127) / 128 : O);
  want_s.push_back(is_fp8(fmt) ? (K + 127) / 128 : K / 32);
  want_o.push_back(O);
  want_o.push_back(K);
  TORCH_CHECK(scale.sizes() == at::IntArrayRef(want_s), "ds4.dequant: scale shape ", dims(scale.sizes()), ", expected ",
              dims(at::IntArrayRef(want_s)));
  TORCH_CHECK(out.sizes() == at::IntArrayRef(want_o) &&
                  (out.scalar_type() == at::kBFloat16 || out.scalar_type() == at::kFloat),
              "ds4.dequant: out must be bf16 or fp32 ", dims(at::IntArrayRef(want_o)));
  TORCH_CHECK(out.is_contiguous() || (out.dim() == 3 && out.stride(2) == 1 && out.stride(1) == K),
              "ds4.dequant: out must be contiguous, or [E, O, K] with contiguous matrices");
  const int64_t o_es = out.is_contiguous() ? O * K : out.stride(0);
  if (E == 0) return;
  c10::cuda::CUDAGuard guard(w.device());
  check_launch(ds4::launch_dequant((int)fmt, w.data_ptr(), scale.data_ptr(), (int)E, (long)(O * w.size(-1)),
                                   (long)(scale.numel() / E), (int)O, (int)K, (int)scale.size(-1), out.data_ptr(),
                                   (long)o_es, out.scalar_type() == at::kFloat, at::cuda::getCurrentCUDAStream()),
               "dequant");
}

// One-shot all-reduce over peer memory (parallel.comm=ll; allreduce.cu): x [n] fp32 or bf16, contiguous;
// peers: every rank's buffer ([2][W][cap] uint2, zeroed before the first call) as mapped here; counters
// int32 [>= ceil(cap / AR_CHUNK)] (zeroed; this kernel's own state). out_f32 picks the output dtype.
at::Tensor all_reduce_ll(const at::Tensor& x, at::IntArrayRef peers,
                         at::Tensor& counters, int64_t rank, int64_t cap, bool round_bf16, bool out_f32) {
  check_cuda(x, "x");
  TORCH_CHECK((x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) && x.is_contiguous() &&
                  x.numel() >= 1 && x.numel() <= cap,
              "ds4.all_reduce_ll: x must be contiguous fp32 or bf16 with 1..cap elements");
  const int64_t W = (int64_t)peers.size();
  TORCH_CHECK(W >= 2 && W <= ds4::AR_MAX_WORLD && rank >= 0 && rank < W, "ds4.all_reduce_ll: 2..",
              num(ds4::AR_MAX_WORLD), " ranks, rank in range");
  check_cuda(counters, "counters");
  TORCH_CHECK(counters.scalar_type() == at::kInt && counters.is_contiguous() && counters.device() == x.device() &&
                  counters.numel() >= (cap + ds4::AR_CHUNK - 1) / ds4::AR_CHUNK,
              "ds4.all_reduce_ll: counters must be int32 [ceil(cap / ", num(ds4::AR_CHUNK), ")] on x's device");
  ds4::AllReduceArgs a{};
  c10::cuda::CUDAGuard guard(x.device());
  auto out = at::empty(x.sizes(), x.options().dtype(out_f32 ? at::kFloat : at::kBFloat16));
  a.x = x.data_ptr();
  a.out = out.data_ptr();
  for (int64_t r = 0; r < W; ++r) a.peers[r] = reinterpret_cast<uint2*>(static_cast<uintptr_t>(peers[r]));
  a.counters = static_cast<int*>(counters.data_ptr());
  a.n = x.numel();
  a.cap = cap;
  a.rank = (int)rank;
  a.world = (int)W;
  a.x_bf16 = x.scalar_type() == at::kBFloat16;
  a.out_bf16 = !out_f32;
  a.round_bf16 = round_bf16;
  check_launch(ds4::launch_all_reduce_ll(a, at::cuda::getCurrentCUDAStream()), "all_reduce_ll");
  return out;
}

// all_reduce_ll with the hc fold (bf16 out; x one block output [1, D] or [D]): the fold's buffers as gemv_fold's,
// peers: the fold region of each rank's buffer, counters: the fold calls' own.
at::Tensor all_reduce_ll_fold(const at::Tensor& x, at::IntArrayRef peers, at::Tensor& counters, int64_t rank,
                              int64_t cap, bool round_bf16, const at::Tensor& res, const at::Tensor& post,
                              const at::Tensor& comb, const at::Tensor& fn, const at::Tensor& out,
                              const at::Tensor& part) {
  check_cuda(x, "x");
  const int64_t D = x.numel();
  TORCH_CHECK((x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) && x.is_contiguous() && D >= 16 &&
                  D % 16 == 0 && D <= cap,
              "ds4.all_reduce_ll_fold: x must be one contiguous fp32 or bf16 row of D elements, D % 16 == 0, D <= cap");
  const int64_t W = (int64_t)peers.size();
  TORCH_CHECK(W >= 2 && W <= ds4::AR_MAX_WORLD && rank >= 0 && rank < W, "ds4.all_reduce_ll_fold: 2..",
              num(ds4::AR_MAX_WORLD), " ranks, rank in range");
  check_cuda(counters, "counters");
  const int64_t per = 16 * ds4::AR_FOLD_TILES;
  TORCH_CHECK(counters.scalar_type() == at::kInt && counters.is_contiguous() && counters.device() == x.device() &&
                  counters.numel() >= (cap + per - 1) / per,
              "ds4.all_reduce_ll_fold: counters must be int32 [ceil(cap / ", num(per), ")] on x's device");
  const ds4::HcFold f = make_fold(res, post, comb, fn, out, part, D, "ds4.all_reduce_ll_fold");
  for (const at::Tensor* t : {&res, &post, &comb, &fn, &out, &part})
    TORCH_CHECK(t->device() == x.device(), "ds4.all_reduce_ll_fold: the fold's tensors on x's device");
  ds4::AllReduceArgs a{};
  c10::cuda::CUDAGuard guard(x.device());
  auto y = at::empty(x.sizes(), x.options().dtype(at::kBFloat16));
  a.x = x.data_ptr();
  a.out = y.data_ptr();
  for (int64_t r = 0; r < W; ++r) a.peers[r] = reinterpret_cast<uint2*>(static_cast<uintptr_t>(peers[r]));
  a.counters = static_cast<int*>(counters.data_ptr());
  a.n = D;
  a.cap = cap;
  a.rank = (int)rank;
  a.world = (int)W;
  a.x_bf16 = x.scalar_type() == at::kBFloat16;
  a.out_bf16 = true;
  a.round_bf16 = round_bf16;
  check_launch(ds4::launch_all_reduce_ll_fold(a, f, at::cuda::getCurrentCUDAStream()), "all_reduce_ll_fold");
  return y;
}

// The whole one-token MoE FFN in one launch (moe_ffn.cu): routed experts in fp4t (stacked [E_local, rows, cols]),
// ids / route_w [1, topk], and the fp8 shared expert; bf16 [1, dim] = the block output the separate launches
// form (routed sum + the shared expert's bf16 output), with the hc fold when its six tensors are given.
// One token's expert weights of moe_ffn (formats and shapes checked by the callers).
void ffn_weights(ds4::MoEArgs& a, int64_t fmt, int64_t topk, int64_t inter, int64_t dim, const at::Tensor& w1,
                 const at::Tensor& s1, const at::Tensor& w3, const at::Tensor& s3, const at::Tensor& w2,
                 const at::Tensor& s2) {
  a.fmt = (int)fmt;
  a.n_tok = 1;
  a.topk = (int)topk;
  a.W1 = w1.data_ptr();
  a.W3 = w3.data_ptr();
  a.S1 = s1.data_ptr();
  a.S3 = s3.data_ptr();
  a.W2 = w2.data_ptr();
  a.S2 = s2.data_ptr();
  a.dim = (int)dim;
  a.inter = (int)inter;
}

void ffn_routed_args(ds4::MoEArgs& r, const at::Tensor& w1, const at::Tensor& s1, const at::Tensor& w3,
                     const at::Tensor& s3, const at::Tensor& w2, const at::Tensor& s2, int64_t dim, int64_t k) {
  for (const at::Tensor* t : {&w1, &s1, &w3, &s3, &w2, &s2}) check_cuda(*t, "routed expert tensor");
  for (const at::Tensor* t : {&w1, &w3, &w2}) check_weight(*t, FMT_FP4T, "routed w");
  TORCH_CHECK(w1.dim() == 3 && w3.sizes() == w1.sizes() && w2.dim() == 3 && w2.size(0) == w1.size(0),
              "ds4.moe_ffn: routed w1 / w3 / w2 must be stacked [E_local, rows, cols]");
  const int64_t inter = w1.size(1);
  TORCH_CHECK(logical_in(w1, FMT_FP4T) == dim && w2.size(1) == dim && logical_in(w2, FMT_FP4T) == inter,
              "ds4.moe_ffn: routed shapes (w1 / w3 [E, inter, dim / 2], w2 [E, dim, inter / 2])");
  TORCH_CHECK(s1.sizes() == s3.sizes() && s1.dim() == 3 && s1.size(1) == inter && s1.size(2) == dim / 32 &&
                  s2.dim() == 3 && s2.size(1) == dim && s2.size(2) == inter / 32 && s1.element_size() == 1 &&
                  s2.element_size() == 1,
              "ds4.moe_ffn: routed scales (E8M0 [E, rows, cols / 32])");
  ffn_weights(r, FMT_FP4T, k, inter, dim, w1, s1, w3, s3, w2, s2);
  r.n_local = (int)w1.size(0);
  r.w13_estride = w1.stride(0);
  r.s13_estride = s1.stride(0);
  r.w2_estride = w2.stride(0);
  r.s2_estride = s2.stride(0);
  r.s13_ld = (int)s1.size(2);
  r.s2_ld = (int)s2.size(2);
}

void ffn_shared_args(ds4::MoEArgs& s, const at::Tensor& w1, const at::Tensor& s1, const at::Tensor& w3,
                     const at::Tensor& s3, const at::Tensor& w2, const at::Tensor& s2, int64_t dim) {
  for (const at::Tensor* t : {&w1, &s1, &w3, &s3, &w2, &s2}) check_cuda(*t, "shared expert tensor");
  for (const at::Tensor* t : {&w1, &w3, &w2}) check_weight(*t, FMT_FP8, "shared w");
  TORCH_CHECK(w1.dim() == 2 && w3.sizes() == w1.sizes() && w2.dim() == 2 && w1.size(1) == dim && w2.size(0) == dim &&
                  w2.size(1) == w1.size(0),
              "ds4.moe_ffn: shared shapes (w1 / w3 [inter, dim], w2 [dim, inter])");
  const int64_t inter = w1.size(0);
  dense_scale_ld(s1, FMT_FP8, inter, dim, "ds4.moe_ffn (shared w1)");
  dense_scale_ld(s3, FMT_FP8, inter, dim, "ds4.moe_ffn (shared w3)");
  dense_scale_ld(s2, FMT_FP8, dim, inter, "ds4.moe_ffn (shared w2)");
  ffn_weights(s, FMT_FP8, 1, inter, dim, w1, s1, w3, s3, w2, s2);
  s.s13_ld = (int)s1.size(1);
  s.s2_ld = (int)s2.size(1);
}

bool moe_ffn_ok_host(int64_t topk, int64_t dim, int64_t inter, int64_t shared_inter, int64_t fold_n) {
  ds4::MoEArgs r, s;
  r.fmt = (int)FMT_FP4T;
  r.topk = (int)topk;
  r.dim = s.dim = (int)dim;
  r.inter = (int)inter;
  s.fmt = (int)FMT_FP8;
  s.inter = (int)shared_inter;
  ds4::HcFold f;
  f.n = (int)fold_n;
  f.mix = (2 + f.n) * f.n;
  return ds4::moe_ffn_ok(r, s, fold_n > 0 ? &f : nullptr);
}

at::Tensor moe_ffn(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& route_w, const at::Tensor& w1,
                   const at::Tensor& s1, const at::Tensor& w3, const at::Tensor& s3, const at::Tensor& w2,
                   const at::Tensor& s2, int64_t expert_offset, double limit, const at::Tensor& sw1,
                   const at::Tensor& ss1, const at::Tensor& sw3, const at::Tensor& ss3, const at::Tensor& sw2,
                   const at::Tensor& ss2, const std::optional<at::Tensor>& fold_res,
                   const std::optional<at::Tensor>& fold_post, const std::optional<at::Tensor>& fold_comb,
                   const std::optional<at::Tensor>& fold_fn, const std::optional<at::Tensor>& fold_out,
                   const std::optional<at::Tensor>& fold_part, const std::optional<at::Tensor>& shared_h) {
  check_cuda(x, "x");
  check_cuda(ids, "ids");
  check_cuda(route_w, "route_w");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.size(0) == 1,
              "ds4.moe_ffn: x must be one contiguous bf16 row [1, dim]");
  check_aligned16(x, "ds4.moe_ffn", "x");
  const int64_t dim = x.size(1), k = ids.dim() == 2 ? ids.size(1) : 0;
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 2 && ids.size(0) == 1 && k >= 1,
              "ds4.moe_ffn: ids must be int64 [1, k]");
  TORCH_CHECK(route_w.scalar_type() == at::kFloat && route_w.numel() == k, "ds4.moe_ffn: route_w must be f32 [1, k]");
  ds4::MoEArgs r, s;
  ffn_routed_args(r, w1, s1, w3, s3, w2, s2, dim, k);
  ffn_shared_args(s, sw1, ss1, sw3, ss3, sw2, ss2, dim);
  r.ids = static_cast<const int64_t*>(ids.data_ptr());
  r.rw = static_cast<const float*>(route_w.data_ptr());
  r.expert_offset = (int)expert_offset;
  r.limit = s.limit = (float)limit;
  const int nfold = fold_res.has_value() + fold_post.has_value() + fold_comb.has_value() + fold_fn.has_value() +
                    fold_out.has_value() + fold_part.has_value();
  TORCH_CHECK(nfold == 0 || nfold == 6, "ds4.moe_ffn: the fold takes all of fold_res, fold_post, fold_comb, fold_fn, "
              "fold_out, fold_part");
  ds4::HcFold fold;
  if (nfold == 6)
    fold = make_fold(*fold_res, *fold_post, *fold_comb, *fold_fn, *fold_out, *fold_part, dim, "ds4.moe_ffn");
  TORCH_CHECK(ds4::moe_ffn_ok(r, s, nfold == 6 ? &fold : nullptr),
              "ds4.moe_ffn: no one-launch FFN at this shape (moe_ffn_ok: fp4t routed and fp8 shared experts, "
              "topk <= 32, the kernels' run widths)");
  if (shared_h.has_value()) {
    check_cuda(*shared_h, "shared_h");
    TORCH_CHECK(shared_h->scalar_type() == at::kBFloat16 && shared_h->numel() == s.inter &&
                    shared_h->device() == x.device(),
                "ds4.moe_ffn: shared_h must be the shared expert's bf16 h row [1, ", num(s.inter), "] on x's device");
    check_aligned16(*shared_h, "ds4.moe_ffn", "shared_h");
  }
  c10::cuda::CUDAGuard guard(x.device());
  auto out = at::empty({1, dim}, x.options());
  auto hbuf = at::empty({k * r.inter + s.inter}, x.options());
  check_launch(ds4::launch_moe_ffn(r, s, x.data_ptr(), hbuf.data_ptr(), shared_h ? shared_h->data_ptr() : nullptr,
                                   out.data_ptr(), nfold == 6 ? &fold : nullptr, at::cuda::getCurrentCUDAStream()),
               "moe_ffn");
  return out;
}

// The phase probe of the last moe_ffn launch under DS4_FFN_PROBE=1 (ds4_launch.h): int64 [blocks, 4] on the CPU.
at::Tensor moe_ffn_probe(int64_t blocks) {
  auto t = at::zeros({blocks, 4}, at::TensorOptions().dtype(at::kLong));
  check_launch(ds4::moe_ffn_probe_read(reinterpret_cast<unsigned long long*>(t.data_ptr()), (int)blocks),
               "moe_ffn_probe");
  return t;
}

// The step probe of the routed MoE kernels (ds4_launch.h; a build with -DDS4_MOE_PROBE), on the CPU: the records,
// int64 [2, 16, 1024, 10] (kind, launch slot, block, mark: ds4_launch.h's MOE_PROBE_*), and the tickets each kind's
// blocks took, int64 [2].
std::vector<at::Tensor> moe_step_probe(bool clear) {
  auto rec = at::zeros({2, ds4::MOE_PROBE_SLOTS, ds4::MOE_PROBE_BLOCKS, ds4::MOE_PROBE_MARKS},
                       at::TensorOptions().dtype(at::kLong));
  unsigned tickets[2] = {0, 0};
  const cudaError_t e = ds4::moe_probe_read(reinterpret_cast<unsigned long long*>(rec.data_ptr()), tickets, clear);
  TORCH_CHECK(e != cudaErrorNotSupported, "moe_step_probe: this build of the ds4 extension has no MoE step probe "
              "(build it with DS4_NVCC_FLAGS=-DDS4_MOE_PROBE into its own DS4_EXT_BUILD_DIR)");
  check_launch(e, "moe_step_probe");
  return {rec, at::tensor({(int64_t)tickets[0], (int64_t)tickets[1]}, at::TensorOptions().dtype(at::kLong))};
}

// Prefetch into L2 (no output): the given tensors (t0 and the present ones of t1..t3) whole, or with ids
// (int64 [n], on the device) the experts ids[k] - id_offset of tensors stacked by local expert ([E_local, ...],
// all with the same E_local).
void l2_prefetch(const at::Tensor& t0, const std::optional<at::Tensor>& t1, const std::optional<at::Tensor>& t2,
                 const std::optional<at::Tensor>& t3, const std::optional<at::Tensor>& ids, int64_t id_offset) {
  const at::Tensor* ts[ds4::PF_MAX_RANGES] = {&t0, t1 ? &*t1 : nullptr, t2 ? &*t2 : nullptr, t3 ? &*t3 : nullptr};
  ds4::L2PrefetchArgs a{};
  for (const at::Tensor* t : ts) {
    if (t == nullptr) continue;
    check_cuda(*t, "t");
    TORCH_CHECK(t->device() == t0.device(), "ds4.l2_prefetch: tensors on one device");
    const int r = a.n_ranges++;
    a.ptr[r] = static_cast<const char*>(t->data_ptr());
    const int64_t nb = t->numel() * t->element_size();
    if (ids.has_value()) {
      TORCH_CHECK(t->dim() >= 1 && t->size(0) == t0.size(0) && t0.size(0) >= 1,
                  "ds4.l2_prefetch: indexed tensors are stacked [E_local, ...] with one E_local");
      a.stride[r] = nb / t->size(0);
      a.bytes[r] = a.stride[r];
    } else {
      a.bytes[r] = nb;
    }
  }
  if (ids.has_value()) {
    check_cuda(*ids, "ids");
    TORCH_CHECK(ids->scalar_type() == at::kLong && ids->device() == t0.device(),
                "ds4.l2_prefetch: ids must be int64 on the tensors' device");
    if (ids->numel() == 0) return;
    a.ids = static_cast<const int64_t*>(ids->data_ptr());
    a.n_ids = (int)ids->numel();
    a.id_offset = id_offset;
    a.n_local = t0.size(0);
  }
  c10::cuda::CUDAGuard guard(t0.device());
  check_launch(ds4::launch_l2_prefetch(a, at::cuda::getCurrentCUDAStream()), "l2_prefetch");
}

}  // namespace

// Host-only: join the side stream's captured branch into the main stream by programmatic edges (capture.cu);
// false where it cannot (not capturing, no PDL, a non-kernel last node), and the caller joins by an event.
static bool join_programmatic(int64_t side, int64_t main) {
  return ds4::capture_join_programmatic(reinterpret_cast<cudaStream_t>(side), reinterpret_cast<cudaStream_t>(main));
}
// Host-only: a branch just forked from main (side waits on it) depends on main's last kernels by programmatic edges
// instead (capture.cu); false where it cannot, and the fork stays a full edge.
static bool fork_programmatic(int64_t main, int64_t side) {
  return ds4::capture_fork_programmatic(reinterpret_cast<cudaStream_t>(main), reinterpret_cast<cudaStream_t>(side));
}

TORCH_LIBRARY(ds4, m) {
  m.def("gemv(Tensor x, Tensor w, Tensor? scale, int fmt, int groups=1, int kernel=0, bool out_f32=False, "
        "bool act_quant=False) -> Tensor");
  m.def("moe_gate_up(Tensor x, Tensor(a!)? ids, Tensor(b!)? route_w, Tensor w1, Tensor? s1, Tensor w3, Tensor? s3, "
        "Tensor? ptrs, int fmt, int expert_offset, int n_local, float limit, int kernel=0, Tensor? route_logits=None, "
        "Tensor? route_bias=None, Tensor? tid2eid=None, Tensor? token_ids=None, float route_scale=1.0, "
        "bool act_quant=False, Tensor? w2=None, Tensor? s2=None) -> Tensor");
  m.def("moe_down(Tensor h, Tensor? ids, int topk, Tensor w2, Tensor? s2, Tensor? ptrs, int fmt, "
        "int expert_offset, int n_local, Tensor? add, bool out_f32, int kernel=0, Tensor? route_logits=None, "
        "Tensor? route_bias=None, Tensor? tid2eid=None, Tensor? token_ids=None, float route_scale=1.0, "
        "Tensor? fold_res=None, Tensor? fold_post=None, Tensor? fold_comb=None, Tensor? fold_fn=None, "
        "Tensor(c!)? fold_out=None, Tensor(d!)? fold_part=None, bool act_quant=False) -> Tensor");
  m.def("moe_route_ok(int fmt, int topk, int dim, int inter, int n_experts) -> bool", &moe_route_ok_host);
  m.def("moe_act_quant_ok(int fmt, int topk, int dim, int inter, bool gate_up) -> bool", &moe_act_quant_ok_host);
  m.def("moe_splitk_rows(int fmt, int topk, int dim, int inter) -> int", &moe_splitk_rows_host);
  m.def("bulk_stage_site(str site) -> bool", &bulk_stage_site_host);
  m.def("router(Tensor x, Tensor gate, Tensor? bias, Tensor? tid2eid, Tensor? token_ids, int topk, "
        "float route_scale, Tensor? logits=None, Tensor(a!)? comb=None, int iters=0, float hc_eps=0.0) "
        "-> (Tensor, Tensor)");
  m.def("gemv_rmsnorm(Tensor x, Tensor w, Tensor? scale, int fmt, Tensor norm_weight, float eps, Tensor? skip_pos=None, "
        "int skip_ratio=1, int skip_k=0, int skip_rows=0, bool act_quant=False) -> Tensor");
  m.def("gemv_deferred(Tensor x, Tensor(a!) ring, Tensor w, Tensor pos) -> Tensor");
  m.def("argmax(Tensor x) -> Tensor");
  m.def("act_quant_sim(Tensor x, int block) -> Tensor");
  m.def("dequant(Tensor w, Tensor scale, int fmt, Tensor(a!) out) -> ()");
  m.def("all_reduce_ll(Tensor x, int[] peers, Tensor(a!) counters, int rank, int cap, bool round_bf16, "
        "bool out_f32) -> Tensor");
  m.def("all_reduce_ll_fold(Tensor x, int[] peers, Tensor(a!) counters, int rank, int cap, bool round_bf16, "
        "Tensor res, Tensor post, Tensor comb, Tensor fn, Tensor(b!) out, Tensor(c!) part) -> Tensor");
  m.def("l2_prefetch(Tensor t0, Tensor? t1, Tensor? t2, Tensor? t3, Tensor? ids, int id_offset) -> ()");
  m.def("gemv_rmsnorm_ok(int fmt, int rows, int cols) -> bool", &gemv_rmsnorm_ok);  // host-only question
  m.def("gemv_act_quant_ok(int fmt, int rows, int cols) -> bool", &gemv_act_quant_ok_host);  // host-only question
  m.def("gemv_fold(Tensor x, Tensor w, Tensor? scale, int fmt, Tensor res, Tensor post, Tensor comb, Tensor fn, "
        "Tensor(a!) out, Tensor(b!) part, bool act_quant=False) -> Tensor");
  m.def("hc_fold_ok(int kind, int fmt, int rows, int cols, int topk, int n) -> bool", &hc_fold_ok_host);
  m.def("moe_ffn(Tensor x, Tensor ids, Tensor route_w, Tensor w1, Tensor s1, Tensor w3, Tensor s3, Tensor w2, "
        "Tensor s2, int expert_offset, float limit, Tensor sw1, Tensor ss1, Tensor sw3, Tensor ss3, Tensor sw2, "
        "Tensor ss2, Tensor? fold_res=None, Tensor? fold_post=None, Tensor? fold_comb=None, Tensor? fold_fn=None, "
        "Tensor(a!)? fold_out=None, Tensor(b!)? fold_part=None, Tensor? shared_h=None) -> Tensor");
  m.def("moe_ffn_ok(int topk, int dim, int inter, int shared_inter, int fold_n) -> bool", &moe_ffn_ok_host);
  m.def("moe_ffn_probe(int blocks) -> Tensor", &moe_ffn_probe);  // host-only diagnostic (DS4_FFN_PROBE=1)
  m.def("moe_step_probe(bool clear) -> Tensor[]", &moe_step_probe);  // host-only diagnostic (-DDS4_MOE_PROBE builds)
  m.def("join_programmatic(int side, int main) -> bool", &join_programmatic);  // host-only, during a capture
  m.def("fork_programmatic(int main, int side) -> bool", &fork_programmatic);  // host-only, during a capture
}

TORCH_LIBRARY_IMPL(ds4, CUDA, m) {
  m.impl("gemv", &gemv);
  m.impl("moe_gate_up", &moe_gate_up);
  m.impl("moe_down", &moe_down);
  m.impl("router", &router);
  m.impl("gemv_rmsnorm", &gemv_rmsnorm);
  m.impl("gemv_deferred", &gemv_deferred);
  m.impl("gemv_fold", &gemv_fold);
  m.impl("argmax", &argmax);
  m.impl("act_quant_sim", &act_quant_sim);
  m.impl("dequant", &dequant);
  m.impl("all_reduce_ll", &all_reduce_ll);
  m.impl("all_reduce_ll_fold", &all_reduce_ll_fold);
  m.impl("l2_prefetch", &l2_prefetch);
  m.impl("moe_ffn", &moe_ffn);
}
