// The one binding file of the ds4_attn extension: checks tensors, takes the current CUDA stream,
// allocates outputs / workspaces through the caching allocator (no host sync), calls the launchers
// of the .cu files beside it and registers torch.ops.ds4_attn.*. Fake (meta) implementations are
// registered in Python (ds4/kernels_attn/_fake.py).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <optional>
#include <tuple>

#include "../sinkhorn_ride_binding.h"
#include "../check_text.h"
#include "attn_launch.h"

namespace {

using ds4_text::num;  // numbers in messages as text (check_text.h)

void check_cuda(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), "ds4_attn: ", name, " must be a CUDA tensor");
  TORCH_CHECK(t.is_contiguous(), "ds4_attn: ", name, " must be contiguous");
}

void check_launch(cudaError_t e, const char* what) {
  TORCH_CHECK(e == cudaSuccess, "ds4_attn: ", what, " launch failed: ", cudaGetErrorString(e),
              (e == cudaErrorInvalidValue ? " (shape not supported by this kernel)" : ""));
}

bool is_f32_act(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kFloat, "ds4_attn: ", name,
              " must be bfloat16 or float32");
  return t.scalar_type() == at::kFloat;
}

void check_f32(const at::Tensor& t, const char* name) {
  check_cuda(t, name);
  TORCH_CHECK(t.scalar_type() == at::kFloat, "ds4_attn: ", name, " must be float32");
}

// ---- mHC -------------------------------------------------------------------------------------------
// Prompts (more than HC_GEMM_ROWS tokens): the partials as fp32 cuBLAS products in one split (nsplit = 1), over
// slices of HC_GEMM_SLICE tokens (their fp32 copy of h is the temporary). The split kernel's ~128 blocks per token
// each re-read their slice of fn: 1.5 MB a token at V4's 24 x 16384 (with the cuBLAS partials hc.pre took 0.55 ms a
// call at 2048 tokens on an H200, experiments/decode_session48_h200.md). The finish reduces either form the same way.
constexpr int64_t HC_GEMM_ROWS = 64, HC_GEMM_SLICE = 4096;
at::Tensor hc_gemm_partials(const at::Tensor& h, const at::Tensor& fn) {
  const int64_t N = h.size(0), K = h.size(1) * h.size(2), mix = fn.size(0);
  auto part = at::empty({N, mix + 1, 1}, h.options().dtype(at::kFloat));
  auto p2 = part.view({N, mix + 1});
  for (int64_t r0 = 0; r0 < N; r0 += HC_GEMM_SLICE) {
    const int64_t rows = std::min(N - r0, HC_GEMM_SLICE);
    const auto v = h.narrow(0, r0, rows).reshape({rows, K}).to(at::kFloat);
    auto dst = p2.narrow(0, r0, rows);
    dst.narrow(1, 0, mix).copy_(at::matmul(v, fn.t()));
    dst.select(1, mix).copy_(v.square().sum(-1));
  }
  return part;
}

at::Tensor hc_mixes_partials(const at::Tensor& h, const at::Tensor& fn, int64_t& nsplit) {
  const bool f32 = is_f32_act(h, "h");
  const int64_t N = h.size(0), K = h.size(1) * h.size(2), mix = fn.size(0);
  TORCH_CHECK(fn.dim() == 2 && fn.size(1) == K, "ds4_attn.hc: fn must be [mix, hc*D]");
  if (N > HC_GEMM_ROWS) {
    nsplit = 1;
    return hc_gemm_partials(h, fn);
  }
  nsplit = ds4_attn::hc_nsplit((int)K);
  auto part = at::empty({N, mix + 1, nsplit}, h.options().dtype(at::kFloat));
  check_launch(ds4_attn::launch_hc_partials(h.data_ptr(), f32, fn.data_ptr<float>(), (int)N, (int)K, (int)mix,
                                            (int)nsplit, part.data_ptr<float>(), c10::cuda::getCurrentCUDAStream().stream()),
               "hc_partials");
  return part;
}

bool norm_weight_f32(const at::Tensor& w, int64_t n, const char* op);

// h [N, hc, D] (bf16 / fp32) and the fp32 mixing weights of hc_pre / hc_head.
void check_hc_inputs(const at::Tensor& h, const at::Tensor& fn, const at::Tensor& scale, const at::Tensor& base,
                     const char* op) {
  check_cuda(h, "h");
  check_f32(fn, "fn");
  check_f32(scale, "scale");
  check_f32(base, "base");
  TORCH_CHECK(h.dim() == 3, "ds4_attn.", op, ": h must be [N, hc, D]");
}

// The finishing launch of hc_pre / hc_post_pre: x, post, comb of h from its partials.
std::tuple<at::Tensor, at::Tensor, at::Tensor> hc_pre_finish(const at::Tensor& h, const at::Tensor& part, int64_t nsplit,
                                                             int64_t mix, const at::Tensor& scale,
                                                             const at::Tensor& base, int64_t iters, double hc_eps,
                                                             double norm_eps, const std::optional<at::Tensor>& norm,
                                                             bool nf) {
  const int64_t N = h.size(0), n = h.size(1), D = h.size(2);
  auto x = at::empty({N, D}, h.options());
  auto post = at::empty({N, n}, h.options().dtype(at::kFloat));
  auto comb = at::empty({N, n, n}, h.options().dtype(at::kFloat));
  check_launch(ds4_attn::launch_hc_finish(h.data_ptr(), h.scalar_type() == at::kFloat, part.data_ptr<float>(), (int)N,
                                          (int)n, (int)D, (int)mix, (int)nsplit, scale.data_ptr<float>(),
                                          base.data_ptr<float>(), (int)iters, (float)hc_eps, (float)norm_eps, false,
                                          x.data_ptr(), post.data_ptr<float>(), comb.data_ptr<float>(),
                                          norm.has_value() ? norm->data_ptr() : nullptr, nf,
                                          c10::cuda::getCurrentCUDAStream().stream()),
               "hc_finish");
  return {x, post, comb};
}

// The Sinkhorn's iterations: >= 1, or 0 (n = 1, 2, 4): comb then holds the Sinkhorn's input logits, which a later
// launch of the step finishes (ds4.ops.base.SinkhornRide: the sparse combine, the router top-k, or hc_sinkhorn).
void check_iters(int64_t iters, int64_t n, const char* op) {
  TORCH_CHECK(iters >= 1 || (iters == 0 && (n == 1 || n == 2 || n == 4)), "ds4_attn.", op,
              ": iters must be >= 1 (or 0 with 1, 2 or 4 streams: the Sinkhorn left to a later launch)");
}

void check_pre_weights(const at::Tensor& fn, const at::Tensor& scale, const at::Tensor& base, int64_t n,
                       int64_t iters, const char* op) {
  check_f32(fn, "fn");
  check_f32(scale, "scale");
  check_f32(base, "base");
  TORCH_CHECK(fn.dim() == 2 && fn.size(0) == (2 + n) * n && base.numel() == (2 + n) * n && scale.numel() >= 3,
              "ds4_attn.", op, ": fn/base/scale shapes");
  check_iters(iters, n, op);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> hc_pre(const at::Tensor& h, const at::Tensor& fn,
                                                      const at::Tensor& scale, const at::Tensor& base, int64_t iters,
                                                      double hc_eps, double norm_eps,
                                                      const std::optional<at::Tensor>& norm) {
  check_cuda(h, "h");
  TORCH_CHECK(h.dim() == 3, "ds4_attn.hc_pre: h must be [N, hc, D]");
  const int64_t N = h.size(0), n = h.size(1), D = h.size(2);
  check_pre_weights(fn, scale, base, n, iters, "hc_pre");
  const bool nf = norm.has_value() ? norm_weight_f32(*norm, D, "hc_pre") : false;
  c10::cuda::CUDAGuard guard(h.device());
  if (N == 0)
    return {at::empty({N, D}, h.options()), at::empty({N, n}, h.options().dtype(at::kFloat)),
            at::empty({N, n, n}, h.options().dtype(at::kFloat))};
  int64_t nsplit = 0;
  auto part = hc_mixes_partials(h, fn, nsplit);
  return hc_pre_finish(h, part, nsplit, fn.size(0), scale, base, iters, hc_eps, norm_eps, norm, nf);
}

// comb [N, n, n] fp32 (n = 1, 2, 4) as a finish with iters = 0 left it -> its Sinkhorn in place, as a launch of
// its own: where no launch of the step takes it along (ds4.ops.base.SinkhornRide.run).
void hc_sinkhorn(const at::Tensor& comb, int64_t iters, double hc_eps) {
  TORCH_CHECK(comb.dim() == 3, "ds4_attn.hc_sinkhorn: comb must be [N, n, n]");
  const int64_t N = comb.size(0);
  const ds4::SinkhornRide ride = ds4::sinkhorn_ride_arg(comb, iters, hc_eps, N, comb.device(), "ds4_attn.hc_sinkhorn");
  if (N == 0) return;
  c10::cuda::CUDAGuard guard(comb.device());
  check_launch(ds4_attn::launch_hc_sinkhorn(ride, (int)N, c10::cuda::getCurrentCUDAStream().stream()), "hc_sinkhorn");
}

// The inputs of hc_post / hc_post_pre: x [N, D] and res [N, hc, D] (bf16 / fp32), post [N, hc] and
// comb [N, hc, hc] fp32 -> (N, hc, D, x is fp32, res is fp32).
std::tuple<int64_t, int64_t, int64_t, bool, bool> check_post_inputs(const at::Tensor& x, const at::Tensor& res,
                                                                    const at::Tensor& post, const at::Tensor& comb,
                                                                    const char* op) {
  check_cuda(x, "x");
  check_cuda(res, "res");
  check_f32(post, "post");
  check_f32(comb, "comb");
  const bool xf = is_f32_act(x, "x"), rf = is_f32_act(res, "res");
  TORCH_CHECK(res.dim() == 3 && x.dim() == 2, "ds4_attn.", op, ": x [N, D], res [N, hc, D]");
  const int64_t N = res.size(0), n = res.size(1), D = res.size(2);
  TORCH_CHECK(x.size(0) == N && x.size(1) == D, "ds4_attn.", op, ": x shape");
  TORCH_CHECK(post.numel() == N * n && comb.numel() == N * n * n, "ds4_attn.", op, ": post/comb shapes");
  return {N, n, D, xf, rf};
}

// hc_post's new streams into h [N, n, D] and the next site's partials [N, mix + 1, nsplit] fp32
// (launch_hc_post_partials; for a prompt hc_post's launch, then hc_gemm_partials), for N >= 1 rows whose shapes the
// caller has checked; sets nsplit.
at::Tensor hc_post_partials(const at::Tensor& x, bool xf, const at::Tensor& res, bool rf, const at::Tensor& post,
                            const at::Tensor& comb, const at::Tensor& fn, const at::Tensor& h, int64_t& nsplit) {
  const int64_t N = res.size(0), n = res.size(1), D = res.size(2), mix = fn.size(0);
  if (N > HC_GEMM_ROWS) {
    check_launch(ds4_attn::launch_hc_post(x.data_ptr(), xf, res.data_ptr(), rf, post.data_ptr<float>(),
                                          comb.data_ptr<float>(), (int)N, (int)n, (int)D, h.data_ptr(),
                                          c10::cuda::getCurrentCUDAStream().stream()),
                 "hc_post");
    nsplit = 1;
    return hc_gemm_partials(h, fn);
  }
  nsplit = ds4_attn::hc_nsplit((int)(n * D));
  auto part = at::empty({N, mix + 1, nsplit}, res.options().dtype(at::kFloat));
  check_launch(ds4_attn::launch_hc_post_partials(x.data_ptr(), xf, res.data_ptr(), rf, post.data_ptr<float>(),
                                                 comb.data_ptr<float>(), (int)N, (int)n, (int)D, h.data_ptr(),
                                                 fn.data_ptr<float>(), (int)mix, (int)nsplit, part.data_ptr<float>(),
                                                 c10::cuda::getCurrentCUDAStream().stream()),
               "hc_post_partials");
  return part;
}

// hc_post(x, res, post, comb) followed by hc_pre of the result with the next site's weights, in 2 launches:
// -> (h, x_next, post_next, comb_next).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> hc_post_pre(
    const at::Tensor& x, const at::Tensor& res, const at::Tensor& post, const at::Tensor& comb, const at::Tensor& fn,
    const at::Tensor& scale, const at::Tensor& base, int64_t iters, double hc_eps, double norm_eps,
    const std::optional<at::Tensor>& norm) {
  const auto [N, n, D, xf, rf] = check_post_inputs(x, res, post, comb, "hc_post_pre");
  check_pre_weights(fn, scale, base, n, iters, "hc_post_pre");
  TORCH_CHECK(fn.size(1) == n * D, "ds4_attn.hc_post_pre: fn must be [mix, hc*D]");
  const bool nf = norm.has_value() ? norm_weight_f32(*norm, D, "hc_post_pre") : false;
  c10::cuda::CUDAGuard guard(res.device());
  auto h = at::empty_like(res);
  if (N == 0)
    return {h, at::empty({N, D}, res.options()), at::empty({N, n}, res.options().dtype(at::kFloat)),
            at::empty({N, n, n}, res.options().dtype(at::kFloat))};
  const int64_t mix = fn.size(0);
  int64_t nsplit = 0;
  const auto part = hc_post_partials(x, xf, res, rf, post, comb, fn, h, nsplit);
  auto [xn, pn, cn] = hc_pre_finish(h, part, nsplit, mix, scale, base, iters, hc_eps, norm_eps, norm, nf);
  return {h, xn, pn, cn};
}

// The router fold's finishing launch (launch_hc_finish_router) on h [N, n, D] bf16 and its partials: -> (x, post,
// comb, logits [N, E] fp32 = x . gate^T); the caller has checked the shapes (N >= 1).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> hc_router_finish(
    const at::Tensor& h, const at::Tensor& part, int64_t nsplit, int64_t mix, const at::Tensor& scale,
    const at::Tensor& base, int64_t iters, double hc_eps, double norm_eps, const at::Tensor& norm, bool nf,
    const at::Tensor& gate) {
  const int64_t N = h.size(0), n = h.size(1), D = h.size(2), E = gate.size(0);
  auto x = at::empty({N, D}, h.options());
  auto post = at::empty({N, n}, h.options().dtype(at::kFloat));
  auto comb = at::empty({N, n, n}, h.options().dtype(at::kFloat));
  auto logits = at::empty({N, E}, h.options().dtype(at::kFloat));
  check_launch(ds4_attn::launch_hc_finish_router(h.data_ptr(), part.data_ptr<float>(), (int)N, (int)n, (int)D, (int)mix,
                                                 (int)nsplit, scale.data_ptr<float>(), base.data_ptr<float>(),
                                                 (int)iters, (float)hc_eps, (float)norm_eps, x.data_ptr(),
                                                 post.data_ptr<float>(), comb.data_ptr<float>(), norm.data_ptr(), nf,
                                                 gate.data_ptr(), (int)E, logits.data_ptr<float>(),
                                                 c10::cuda::getCurrentCUDAStream().stream()),
               "hc_finish_router");
  return {x, post, comb, logits};
}

// hc_post_pre with the block norm whose finishing launch also computes the router's logits (the router fold,
// opt-in; launch_hc_finish_router): -> (h, x_next, post_next, comb_next, logits [N, E] fp32 = x_next . gate^T).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> hc_post_pre_router(
    const at::Tensor& x, const at::Tensor& res, const at::Tensor& post, const at::Tensor& comb, const at::Tensor& fn,
    const at::Tensor& scale, const at::Tensor& base, int64_t iters, double hc_eps, double norm_eps,
    const at::Tensor& norm, const at::Tensor& gate) {
  const auto [N, n, D, xf, rf] = check_post_inputs(x, res, post, comb, "hc_post_pre_router");
  check_pre_weights(fn, scale, base, n, iters, "hc_post_pre_router");
  TORCH_CHECK(fn.size(1) == n * D, "ds4_attn.hc_post_pre_router: fn must be [mix, hc*D]");
  TORCH_CHECK(!rf && ds4_attn::hc_router_fold_ok((int)n, (int)D),
              "ds4_attn.hc_post_pre_router: bf16 res with 1, 2 or 4 streams and D % 8 == 0 (at most 8192)");
  check_cuda(gate, "gate");
  TORCH_CHECK(gate.scalar_type() == at::kBFloat16 && gate.dim() == 2 && gate.size(1) == D && gate.size(0) >= 1,
              "ds4_attn.hc_post_pre_router: gate must be bf16 [E, D]");
  const bool nf = norm_weight_f32(norm, D, "hc_post_pre_router");
  c10::cuda::CUDAGuard guard(res.device());
  const int64_t E = gate.size(0), mix = fn.size(0);
  int64_t nsplit = 0;
  auto h = at::empty_like(res);
  if (N == 0)
    return {h, at::empty({N, D}, res.options()), at::empty({N, n}, res.options().dtype(at::kFloat)),
            at::empty({N, n, n}, res.options().dtype(at::kFloat)), at::empty({N, E}, res.options().dtype(at::kFloat))};
  const auto part = hc_post_partials(x, xf, res, rf, post, comb, fn, h, nsplit);
  auto [xn, pn, cn, logits] = hc_router_finish(h, part, nsplit, mix, scale, base, iters, hc_eps, norm_eps, norm, nf, gate);
  return {h, xn, pn, cn, logits};
}

// The finishing launch of an mHC site whose partials the hc fold formed (torch.ops.ds4.gemv_fold / moe_down's
// fold: one split per 16-row tile): h [N, n, D] the new streams, part [N, mix + 1, nsplit] fp32 ->
// (x, post, comb, logits). With gate (bf16 [E, D]; norm required) the router fold's finish (logits
// [N, E] = x . gate^T), else logits is [N, 0].
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> hc_fold_finish(
    const at::Tensor& h, const at::Tensor& part, const at::Tensor& scale, const at::Tensor& base, int64_t iters,
    double hc_eps, double norm_eps, const std::optional<at::Tensor>& norm, const std::optional<at::Tensor>& gate) {
  check_cuda(h, "h");
  check_f32(part, "part");
  check_f32(scale, "scale");
  check_f32(base, "base");
  TORCH_CHECK(h.dim() == 3 && h.scalar_type() == at::kBFloat16, "ds4_attn.hc_fold_finish: h must be bf16 [N, hc, D]");
  const int64_t N = h.size(0), n = h.size(1), D = h.size(2), mix = (2 + n) * n;
  TORCH_CHECK(part.dim() == 3 && part.size(0) == N && part.size(1) == mix + 1 && part.size(2) >= 1,
              "ds4_attn.hc_fold_finish: part must be [N, (2+hc)*hc + 1, nsplit]");
  TORCH_CHECK(base.numel() == mix && scale.numel() >= 3, "ds4_attn.hc_fold_finish: base/scale");
  check_iters(iters, n, "hc_fold_finish");
  const int64_t nsplit = part.size(2);
  c10::cuda::CUDAGuard guard(h.device());
  if (!gate.has_value()) {
    const bool nf = norm.has_value() ? norm_weight_f32(*norm, D, "hc_fold_finish") : false;
    if (N == 0)
      return {at::empty({N, D}, h.options()), at::empty({N, n}, h.options().dtype(at::kFloat)),
              at::empty({N, n, n}, h.options().dtype(at::kFloat)), at::empty({N, 0}, h.options().dtype(at::kFloat))};
    auto [x, post, comb] = hc_pre_finish(h, part, nsplit, mix, scale, base, iters, hc_eps, norm_eps, norm, nf);
    return {x, post, comb, at::empty({N, 0}, h.options().dtype(at::kFloat))};
  }
  TORCH_CHECK(norm.has_value() && ds4_attn::hc_router_fold_ok((int)n, (int)D),
              "ds4_attn.hc_fold_finish: the router's finish needs the block norm, 1, 2 or 4 streams, D % 8 == 0");
  check_cuda(*gate, "gate");
  TORCH_CHECK(gate->scalar_type() == at::kBFloat16 && gate->dim() == 2 && gate->size(1) == D && gate->size(0) >= 1,
              "ds4_attn.hc_fold_finish: gate must be bf16 [E, D]");
  const bool nf = norm_weight_f32(*norm, D, "hc_fold_finish");
  if (N == 0)
    return {at::empty({N, D}, h.options()), at::empty({N, n}, h.options().dtype(at::kFloat)),
            at::empty({N, n, n}, h.options().dtype(at::kFloat)),
            at::empty({N, gate->size(0)}, h.options().dtype(at::kFloat))};
  return hc_router_finish(h, part, nsplit, mix, scale, base, iters, hc_eps, norm_eps, *norm, nf, *gate);
}

// hc_fold_finish with the projection fold (launch_hc_finish_proj): the finishing launch also forms y [N, O] bf16 =
// x . W^T for the FP8 weight w (E4M3 [O, D], float8_e4m3fn or uint8) with E8M0 scales ws ([ceil(O/128), D/128],
// float8_e8m0fnu or uint8): -> (x, post, comb, y).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> hc_fold_finish_proj(
    const at::Tensor& h, const at::Tensor& part, const at::Tensor& scale, const at::Tensor& base, int64_t iters,
    double hc_eps, double norm_eps, const at::Tensor& norm, const at::Tensor& w, const at::Tensor& ws) {
  check_cuda(h, "h");
  check_f32(part, "part");
  check_f32(scale, "scale");
  check_f32(base, "base");
  TORCH_CHECK(h.dim() == 3 && h.scalar_type() == at::kBFloat16,
              "ds4_attn.hc_fold_finish_proj: h must be bf16 [N, hc, D]");
  const int64_t N = h.size(0), n = h.size(1), D = h.size(2), mix = (2 + n) * n;
  TORCH_CHECK(part.dim() == 3 && part.size(0) == N && part.size(1) == mix + 1 && part.size(2) >= 1,
              "ds4_attn.hc_fold_finish_proj: part must be [N, (2+hc)*hc + 1, nsplit]");
  TORCH_CHECK(base.numel() == mix && scale.numel() >= 3, "ds4_attn.hc_fold_finish_proj: base/scale");
  check_iters(iters, n, "hc_fold_finish_proj");
  TORCH_CHECK(ds4_attn::hc_proj_fold_ok((int)n, (int)D),
              "ds4_attn.hc_fold_finish_proj: 1, 2 or 4 streams and D a multiple of 128 (at most 4096)");
  check_cuda(w, "w");
  check_cuda(ws, "ws");
  TORCH_CHECK(w.element_size() == 1 && w.dim() == 2 && w.size(1) == D && w.size(0) >= 1,
              "ds4_attn.hc_fold_finish_proj: w must be FP8 E4M3 bytes [O, D]");
  const int64_t O = w.size(0);
  TORCH_CHECK(ws.element_size() == 1 && ws.dim() == 2 && ws.size(0) == (O + 127) / 128 && ws.size(1) == D / 128,
              "ds4_attn.hc_fold_finish_proj: ws must be E8M0 bytes [ceil(O/128), D/128]");
  const bool nf = norm_weight_f32(norm, D, "hc_fold_finish_proj");
  c10::cuda::CUDAGuard guard(h.device());
  auto x = at::empty({N, D}, h.options());
  auto post = at::empty({N, n}, h.options().dtype(at::kFloat));
  auto comb = at::empty({N, n, n}, h.options().dtype(at::kFloat));
  auto y = at::empty({N, O}, h.options());
  if (N == 0) return {x, post, comb, y};
  check_launch(ds4_attn::launch_hc_finish_proj(h.data_ptr(), part.data_ptr<float>(), (int)N, (int)n, (int)D, (int)mix,
                                               (int)part.size(2), scale.data_ptr<float>(), base.data_ptr<float>(),
                                               (int)iters, (float)hc_eps, (float)norm_eps, x.data_ptr(),
                                               post.data_ptr<float>(), comb.data_ptr<float>(), norm.data_ptr(), nf,
                                               w.data_ptr(), ws.data_ptr(), (int)ws.size(1), (int)O, y.data_ptr(),
                                               c10::cuda::getCurrentCUDAStream().stream()),
               "hc_finish_proj");
  return {x, post, comb, y};
}

// hc_head, and with norm (the final RMSNorm's weight) the normalised collapse in the same finishing launch.
at::Tensor hc_head(const at::Tensor& h, const at::Tensor& fn, const at::Tensor& scale, const at::Tensor& base,
                   double hc_eps, double norm_eps, const std::optional<at::Tensor>& norm) {
  check_hc_inputs(h, fn, scale, base, "hc_head");
  const int64_t N = h.size(0), n = h.size(1), D = h.size(2);
  TORCH_CHECK(fn.size(0) == n && base.numel() == n && scale.numel() >= 1, "ds4_attn.hc_head: fn/base/scale shapes");
  const bool nf = norm.has_value() ? norm_weight_f32(*norm, D, "hc_head") : false;
  c10::cuda::CUDAGuard guard(h.device());
  auto x = at::empty({N, D}, h.options());
  if (N == 0) return x;
  int64_t nsplit = 0;
  auto part = hc_mixes_partials(h, fn, nsplit);
  check_launch(ds4_attn::launch_hc_finish(h.data_ptr(), h.scalar_type() == at::kFloat, part.data_ptr<float>(), (int)N,
                                          (int)n, (int)D, (int)n, (int)nsplit, scale.data_ptr<float>(),
                                          base.data_ptr<float>(), 1, (float)hc_eps, (float)norm_eps, true,
                                          x.data_ptr(), nullptr, nullptr, norm.has_value() ? norm->data_ptr() : nullptr,
                                          nf, c10::cuda::getCurrentCUDAStream().stream()),
               "hc_finish(head)");
  return x;
}

at::Tensor hc_post(const at::Tensor& x, const at::Tensor& res, const at::Tensor& post, const at::Tensor& comb) {
  const auto [N, n, D, xf, rf] = check_post_inputs(x, res, post, comb, "hc_post");
  c10::cuda::CUDAGuard guard(res.device());
  auto out = at::empty_like(res);
  if (N == 0) return out;
  check_launch(ds4_attn::launch_hc_post(x.data_ptr(), xf, res.data_ptr(), rf, post.data_ptr<float>(),
                                        comb.data_ptr<float>(), (int)N, (int)n, (int)D, out.data_ptr(),
                                        c10::cuda::getCurrentCUDAStream().stream()),
               "hc_post");
  return out;
}

// ---- sparse attention --------------------------------------------------------------------------------
void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), "ds4_attn: ", name, " must be a CUDA tensor");
  TORCH_CHECK(t.scalar_type() == at::kBFloat16, "ds4_attn.sparse: ", name, " must be bfloat16");
  TORCH_CHECK(t.stride(-1) == 1, "ds4_attn.sparse: ", name, " must have a contiguous last dim");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, "ds4_attn.sparse: ", name,
              " must be 16-byte aligned");
  for (int i = 0; i < t.dim() - 1; ++i)
    TORCH_CHECK(t.stride(i) % 8 == 0 || t.size(i) == 1, "ds4_attn.sparse: ", name, " row strides must be multiples of 8");
}

at::Tensor sparse_attn(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& valid,
                       const std::optional<at::Tensor>& sel_kv, const std::optional<at::Tensor>& sel_valid,
                       const at::Tensor& sink, double scale) {
  check_cuda(q, "q");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && q.dim() == 4, "ds4_attn.sparse: q must be bf16 [B, S, H, D]");
  check_rows(kv, "kv");
  TORCH_CHECK(kv.dim() == 3, "ds4_attn.sparse: kv must be [B, K, D]");
  check_f32(sink, "sink");
  const int64_t B = q.size(0), S = q.size(1), H = q.size(2), D = q.size(3), K = kv.size(1);
  TORCH_CHECK(kv.size(0) == B && kv.size(2) == D, "ds4_attn.sparse: kv shape");
  TORCH_CHECK(sink.numel() == H, "ds4_attn.sparse: sink must be [H]");
  TORCH_CHECK(valid.is_cuda() && valid.scalar_type() == at::kBool && valid.dim() == 3 && valid.size(0) == B &&
                  valid.size(1) == S && valid.size(2) == K && valid.stride(2) == 1,
              "ds4_attn.sparse: valid must be bool [B, S, K] with a contiguous last dim");
  ds4_attn::SparseArgs a;
  a.q = q.data_ptr();
  a.kv = kv.data_ptr();
  a.kv_b = kv.stride(0);
  a.kv_r = kv.stride(1);
  a.valid = reinterpret_cast<const uint8_t*>(valid.data_ptr());
  a.valid_b = valid.stride(0);
  a.valid_s = valid.stride(1);
  a.sink = sink.data_ptr<float>();
  a.B = (int)B; a.S = (int)S; a.H = (int)H; a.D = (int)D; a.K = (int)K;
  a.scale = (float)scale;
  if (sel_kv.has_value()) {
    TORCH_CHECK(sel_valid.has_value(), "ds4_attn.sparse: sel_valid is required with sel_kv");
    const at::Tensor& s = *sel_kv;
    const at::Tensor& sv = *sel_valid;
    check_rows(s, "sel_kv");
    TORCH_CHECK(s.dim() == 4 && s.size(0) == B && s.size(1) == S && s.size(3) == D, "ds4_attn.sparse: sel_kv shape");
    TORCH_CHECK(sv.is_cuda() && sv.scalar_type() == at::kBool && sv.dim() == 3 && sv.size(0) == B &&
                    sv.size(1) == S && sv.size(2) == s.size(2) && sv.stride(2) == 1,
                "ds4_attn.sparse: sel_valid must be bool [B, S, P] with a contiguous last dim");
    a.sel = s.data_ptr();
    a.sel_b = s.stride(0); a.sel_s = s.stride(1); a.sel_r = s.stride(2);
    a.sel_valid = reinterpret_cast<const uint8_t*>(sv.data_ptr());
    a.sv_b = sv.stride(0); a.sv_s = sv.stride(1);
    a.P = (int)s.size(2);
  }
  c10::cuda::CUDAGuard guard(q.device());
  auto out = at::empty({B, S, H, D}, q.options());
  if (B * S == 0) return out;
  int64_t nsplit = ds4_attn::sparse_nsplit((int)(K + a.P));
  // A prompt's rows (S > 1): at most SP_PROMPT_SLOTS (row, split) pairs, so the fp32 partial outputs stay small (256
  // rows at 28 splits and 64 heads of 512 would be 940 MB, written and read back by the combine); the blocks then take
  // several 32-key chunks each (their running max), as past sparse_nsplit's cap. Decode rows (S = 1) keep the rule.
  constexpr int64_t SP_PROMPT_SLOTS = 1024;
  if (S > 1) nsplit = std::max<int64_t>(1, std::min<int64_t>(nsplit, SP_PROMPT_SLOTS / (B * S)));
  auto opart = at::empty({B * S, nsplit, H, D}, q.options().dtype(at::kFloat));
  auto ml = at::empty({B * S, nsplit, H, 2}, q.options().dtype(at::kFloat));
  check_launch(ds4_attn::launch_sparse_attn(a, (int)nsplit, opart.data_ptr<float>(), ml.data_ptr<float>(),
                                            out.data_ptr(), c10::cuda::getCurrentCUDAStream().stream()),
               "sparse_attn");
  return out;
}

// ---- indexer -----------------------------------------------------------------------------------------
void check_pos(const at::Tensor& pos, int64_t n, const char* op) {
  TORCH_CHECK(pos.is_cuda() && pos.scalar_type() == at::kLong && pos.dim() == 1 && pos.size(0) == n &&
                  pos.is_contiguous(),
              "ds4_attn.", op, ": pos must be a contiguous int64 CUDA tensor [", num(n), "]");
}

void check_freqs(const at::Tensor& freqs, const char* op) {
  TORCH_CHECK(freqs.is_cuda() && freqs.scalar_type() == at::kFloat && freqs.dim() == 1 && freqs.is_contiguous(),
              "ds4_attn.", op, ": freqs must be a contiguous float32 CUDA tensor [R/2]");
}

// skip_k: see launch_indexer_scores (indexer_select's scores, read by its top-k alone); out_f32: bf16 scores written
// as fp32 (launch_indexer_scores; indexer_select's, for its top-k)
static at::Tensor indexer_scores_impl(const at::Tensor& q, const at::Tensor& w, const at::Tensor& keys, bool bf16,
                                      const std::optional<at::Tensor>& pos, int64_t ratio, double w_scale,
                                      const std::optional<at::Tensor>& rope_freqs, int64_t skip_k, bool q_fp4,
                                      bool out_f32 = false) {
  check_cuda(q, "q");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && q.dim() == 4, "ds4_attn.indexer: q must be bf16 [B, S, H, d]");
  check_cuda(w, "w");
  TORCH_CHECK((w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16) && w.is_contiguous(),
              "ds4_attn.indexer: w must be a contiguous float32 or bfloat16 tensor");
  TORCH_CHECK(keys.is_cuda() && keys.scalar_type() == at::kBFloat16 && keys.dim() == 3 && keys.stride(2) == 1,
              "ds4_attn.indexer: keys must be bf16 [B, T, d] with a contiguous last dim");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(keys.data_ptr()) % 16 == 0 && keys.stride(1) % 8 == 0 &&
                  (keys.stride(0) % 8 == 0 || keys.size(0) == 1),
              "ds4_attn.indexer: keys must be 16-byte aligned with row strides multiple of 8");
  const int64_t B = q.size(0), S = q.size(1), H = q.size(2), d = q.size(3), T = keys.size(1);
  TORCH_CHECK(w.dim() == 3 && w.size(0) == B && w.size(1) == S && w.size(2) == H, "ds4_attn.indexer: w shape");
  TORCH_CHECK(keys.size(0) == B && keys.size(2) == d, "ds4_attn.indexer: keys shape");
  if (pos.has_value()) {
    TORCH_CHECK(S == 1 && ratio >= 1, "ds4_attn.indexer: positions need one query per row and ratio >= 1");
    check_pos(*pos, B, "indexer");
  }
  int64_t R = 0;
  if (rope_freqs.has_value()) {
    TORCH_CHECK(pos.has_value(), "ds4_attn.indexer: rope_freqs needs decode positions");
    check_freqs(*rope_freqs, "indexer");
    R = 2 * rope_freqs->numel();
    TORCH_CHECK(R >= 2 && R <= d && R <= 256, "ds4_attn.indexer: 2 len(rope_freqs) must be in [2, min(d, 256)]");
    TORCH_CHECK(q.is_contiguous() && reinterpret_cast<uintptr_t>(q.data_ptr()) % 16 == 0,
                "ds4_attn.indexer: with rope_freqs q must be contiguous and 16-byte aligned");
  }
  TORCH_CHECK(!q_fp4 || (rope_freqs.has_value() && ds4_attn::hadamard_fp4_ok((int)d)),
              "ds4_attn.indexer: q_fp4 needs rope_freqs and an index head dim that is a power of two in [32, 256]");
  c10::cuda::CUDAGuard guard(q.device());
  auto out = at::empty({B, S, T}, q.options().dtype(bf16 && !out_f32 ? at::kBFloat16 : at::kFloat));
  if (B * S == 0 || T == 0) return out;
  check_launch(ds4_attn::launch_indexer_scores(q.data_ptr(), w.data_ptr(), w.scalar_type() == at::kBFloat16,
                                               (float)w_scale, keys.data_ptr(), keys.stride(0),
                                               keys.stride(1), (int)B, (int)S, (int)H, (int)d, (int)T, bf16,
                                               pos.has_value() ? pos->data_ptr<int64_t>() : nullptr, (int)ratio,
                                               rope_freqs.has_value() ? rope_freqs->data_ptr<float>() : nullptr,
                                               (int)R, out.data_ptr(), c10::cuda::getCurrentCUDAStream().stream(),
                                               (int)skip_k, q_fp4, bf16 && out_f32),
               "indexer_scores");
  return out;
}

at::Tensor indexer_scores(const at::Tensor& q, const at::Tensor& w, const at::Tensor& keys, bool bf16,
                          const std::optional<at::Tensor>& pos, int64_t ratio, double w_scale,
                          const std::optional<at::Tensor>& rope_freqs, bool q_fp4) {
  return indexer_scores_impl(q, w, keys, bf16, pos, ratio, w_scale, rope_freqs, 0, q_fp4);
}

at::Tensor topk_indices(const at::Tensor& scores, int64_t k, const std::optional<at::Tensor>& pos, int64_t ratio);

// The decode selection: top-k (k) of the indexer scores of one query per row (S == 1) at decode positions, the
// scores kernel then the top-k kernel. While a row has at most k visible entries the top-k selects all of them
// without reading a score, so the scores kernel leaves that row alone (contexts below k * ratio tokens: 2048 for
// V4's CSA). DS4_INDEXER_SKIP=0 (read per call, the ablation) computes every row's scores anyway; the indices are
// the same either way.
at::Tensor indexer_select(const at::Tensor& q, const at::Tensor& w, const at::Tensor& keys, int64_t k, bool bf16,
                          const at::Tensor& pos, int64_t ratio, double w_scale,
                          const std::optional<at::Tensor>& rope_freqs, bool q_fp4) {
  TORCH_CHECK(q.dim() == 4 && q.size(1) == 1, "ds4_attn.indexer_select: q must be [B, 1, H, d]");
  TORCH_CHECK(k >= 1 && k <= keys.size(1), "ds4_attn.indexer_select: need 1 <= k <= T (keys' rows)");
  const char* env = std::getenv("DS4_INDEXER_SKIP");
  const bool skip = !(env && env[0] == '0');
  // bf16 scores (qat) are written as fp32 values, which the top-k reads: before session 72 they were written as bf16
  // and cast by a launch of its own on the CSA layer's critical path (2.8 us per layer on an H100)
  at::Tensor sc = indexer_scores_impl(q, w, keys, bf16, pos, ratio, w_scale, rope_freqs, skip ? k : 0,
                                      q_fp4, true);
  return topk_indices(sc.select(1, 0), k, pos, ratio);
}

// ---- decode attention (positions instead of masks, gather by index, output de-rotation) ---------------
at::Tensor sparse_decode(const at::Tensor& q, const at::Tensor& win, const at::Tensor& pos,
                         const std::optional<at::Tensor>& ext, const std::optional<at::Tensor>& ext_idx, int64_t ratio,
                         const at::Tensor& sink, double scale, const std::optional<at::Tensor>& freqs,
                         std::optional<double> q_norm_eps, const std::optional<at::Tensor>& comb, int64_t iters,
                         double hc_eps) {
  check_cuda(q, "q");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && q.dim() == 3, "ds4_attn.sparse_decode: q must be bf16 [B, H, D]");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  // comb: a row's mHC Sinkhorn that the combine launch finishes along the way (ds4.ops.base.SinkhornRide)
  const ds4::SinkhornRide ride = ds4::sinkhorn_ride_arg(comb, iters, hc_eps, B, q.device(), "ds4_attn.sparse_decode");
  check_rows(win, "win");
  TORCH_CHECK(win.dim() == 3 && win.size(0) == B && win.size(2) == D, "ds4_attn.sparse_decode: win must be [B, W, D]");
  check_pos(pos, B, "sparse_decode");
  check_f32(sink, "sink");
  TORCH_CHECK(sink.numel() == H, "ds4_attn.sparse_decode: sink must be [H]");
  TORCH_CHECK(ratio >= 1, "ds4_attn.sparse_decode: ratio must be >= 1");
  ds4_attn::SparseArgs a;
  a.q = q.data_ptr();
  a.kv = win.data_ptr();
  a.kv_b = win.stride(0);
  a.kv_r = win.stride(1);
  a.sink = sink.data_ptr<float>();
  a.B = (int)B; a.S = 1; a.H = (int)H; a.D = (int)D; a.K = (int)win.size(1);
  a.scale = (float)scale;
  a.pos = pos.data_ptr<int64_t>();
  a.ratio = (int)ratio;
  if (ext.has_value()) {
    const at::Tensor& e = *ext;
    check_rows(e, "ext");
    TORCH_CHECK(e.dim() == 3 && e.size(0) == B && e.size(2) == D, "ds4_attn.sparse_decode: ext must be [B, T, D]");
    a.sel = e.data_ptr();
    a.sel_b = e.stride(0);
    a.sel_r = e.stride(1);
    a.P = (int)e.size(1);
    if (ext_idx.has_value()) {
      const at::Tensor& ix = *ext_idx;
      TORCH_CHECK(ix.is_cuda() && ix.scalar_type() == at::kLong && ix.dim() == 2 && ix.size(0) == B &&
                      ix.stride(1) == 1,
                  "ds4_attn.sparse_decode: ext_idx must be int64 [B, k] with a contiguous last dim");
      a.sel_idx = ix.data_ptr<int64_t>();
      a.si_b = ix.stride(0);
      a.P = (int)ix.size(1);
    }
  } else {
    TORCH_CHECK(!ext_idx.has_value(), "ds4_attn.sparse_decode: ext_idx needs ext");
  }
  if (freqs.has_value()) {
    check_freqs(*freqs, "sparse_decode");
    a.freqs = freqs->data_ptr<float>();
    a.R = (int)(2 * freqs->numel());
  }
  if (q_norm_eps.has_value()) {  // q before head_rope: the kernel applies it (same freqs as the de-rotation)
    a.q_prep = true;
    a.qnorm_eps = (float)*q_norm_eps;
  }
  c10::cuda::CUDAGuard guard(q.device());
  auto out = at::empty({B, H, D}, q.options());
  if (B == 0) return out;
  const int64_t nsplit = ds4_attn::sparse_nsplit(a.K + a.P);
  auto opart = at::empty({B, nsplit, H, D}, q.options().dtype(at::kFloat));
  auto ml = at::empty({B, nsplit, H, 2}, q.options().dtype(at::kFloat));
  check_launch(ds4_attn::launch_sparse_attn(a, (int)nsplit, opart.data_ptr<float>(), ml.data_ptr<float>(),
                                            out.data_ptr(), c10::cuda::getCurrentCUDAStream().stream(), ride),
               "sparse_decode");
  return out;
}

// ---- top-k -------------------------------------------------------------------------------------------
at::Tensor topk_indices(const at::Tensor& scores, int64_t k, const std::optional<at::Tensor>& pos, int64_t ratio) {
  check_f32(scores, "scores");
  TORCH_CHECK(scores.dim() == 2, "ds4_attn.topk: scores must be [B, T]");
  const int64_t B = scores.size(0), T = scores.size(1);
  // String-only messages: a TORCH_CHECK that formats integers crashed the process instead of raising (sessions 24
  // and 37; session 44's first form of the check below). ds4.kernels_attn.topk raises ValueError with the numbers.
  TORCH_CHECK(k >= 1 && k <= T && T <= ds4_attn::topk_max_len(), "ds4_attn.topk: need 1 <= k <= T <= topk_max_len");
  TORCH_CHECK(ratio >= 1, "ds4_attn.topk: ratio must be >= 1");
  c10::cuda::CUDAGuard guard(scores.device());
  TORCH_CHECK(B == 0 || ds4_attn::topk_ok((int)B, (int)T),
              "ds4_attn.topk: the rows' blocks do not fit on this GPU at once (topk_ok)");
  const int64_t* p = nullptr;
  if (pos.has_value()) {
    TORCH_CHECK(pos->is_cuda() && pos->scalar_type() == at::kLong && pos->numel() == B && pos->is_contiguous(),
                "ds4_attn.topk: pos must be a contiguous int64 CUDA tensor [B]");
    p = pos->data_ptr<int64_t>();
  }
  auto out = at::empty({B, k}, scores.options().dtype(at::kLong));
  if (B == 0) return out;
  check_launch(ds4_attn::launch_topk(scores.data_ptr<float>(), (int)B, (int)T, (int)k, p, (int)ratio,
                                     out.data_ptr<int64_t>(),
                                     c10::cuda::getCurrentCUDAStream().stream()),
               "topk");
  return out;
}

// Whether topk takes B rows of T entries on the current device (topk_ok).
bool topk_ok_host(int64_t B, int64_t T) {
  return B >= 1 && T >= 1 && T <= ds4_attn::topk_max_len() && ds4_attn::topk_ok((int)B, (int)T);
}

// ---- decode glue -------------------------------------------------------------------------------------
bool norm_weight_f32(const at::Tensor& w, int64_t n, const char* op) {
  TORCH_CHECK(w.is_cuda() && w.is_contiguous() && w.numel() == n &&
                  (w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16),
              "ds4_attn.", op, ": norm weight must be a contiguous bf16/float32 CUDA tensor of ", num(n), " values");
  return w.scalar_type() == at::kFloat;
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_cuda(x, "x");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() >= 1, "ds4_attn.rms_norm: x must be bf16 [..., D]");
  const int64_t D = x.size(-1), N = D ? x.numel() / D : 0;
  const bool wf = norm_weight_f32(weight, D, "rms_norm");
  c10::cuda::CUDAGuard guard(x.device());
  auto out = at::empty_like(x);
  if (N == 0) return out;
  check_launch(ds4_attn::launch_rms_norm(x.data_ptr(), weight.data_ptr(), wf, (int)N, (int)D, (float)eps, out.data_ptr(),
                                         c10::cuda::getCurrentCUDAStream().stream()),
               "rms_norm");
  return out;
}

at::Tensor head_rope(const at::Tensor& x, const at::Tensor& pos, const at::Tensor& freqs, bool norm, double eps) {
  check_cuda(x, "x");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 3, "ds4_attn.head_rope: x must be bf16 [N, H, D]");
  const int64_t N = x.size(0), H = x.size(1), D = x.size(2);
  check_pos(pos, N, "head_rope");
  check_freqs(freqs, "head_rope");
  c10::cuda::CUDAGuard guard(x.device());
  auto out = at::empty_like(x);
  if (N == 0) return out;
  check_launch(ds4_attn::launch_head_rope(x.data_ptr(), pos.data_ptr<int64_t>(), freqs.data_ptr<float>(), (int)N,
                                          (int)H, (int)D, (int)(2 * freqs.numel()), norm, (float)eps, out.data_ptr(),
                                          c10::cuda::getCurrentCUDAStream().stream()),
               "head_rope");
  return out;
}

// numerics=qat's Hadamard + FP4 simulation of bf16 rows (the indexer's prompt query): x [..., d] -> the same shape
at::Tensor hadamard_fp4(const at::Tensor& x) {
  check_cuda(x, "x");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() >= 1 && x.is_contiguous(),
              "ds4_attn.hadamard_fp4: x must be a contiguous bf16 tensor");
  const int64_t d = x.size(-1);
  TORCH_CHECK(ds4_attn::hadamard_fp4_ok((int)d),
              "ds4_attn.hadamard_fp4: the last dim must be a power of two in [32, 256], got ", num(d));
  c10::cuda::CUDAGuard guard(x.device());
  auto out = at::empty_like(x);
  check_launch(ds4_attn::launch_hadamard_fp4(x.data_ptr(), out.data_ptr(), x.numel() / d, (int)d,
                                             c10::cuda::getCurrentCUDAStream().stream()),
               "hadamard_fp4");
  return out;
}

void kv_store(at::Tensor& win, const at::Tensor& kv, const at::Tensor& weight, const at::Tensor& pos,
              const at::Tensor& freqs, double eps, bool fp8_nope) {
  check_cuda(kv, "kv");
  TORCH_CHECK(kv.scalar_type() == at::kBFloat16 && kv.dim() == 2, "ds4_attn.kv_store: kv must be bf16 [N, D]");
  const int64_t N = kv.size(0), D = kv.size(1);
  TORCH_CHECK(win.is_cuda() && win.scalar_type() == at::kBFloat16 && win.dim() == 3 && win.size(0) == N &&
                  win.size(2) == D && win.stride(2) == 1 && win.stride(1) == D,
              "ds4_attn.kv_store: win must be bf16 [N, W, D] with contiguous rows");
  const bool wf = norm_weight_f32(weight, D, "kv_store");
  check_pos(pos, N, "kv_store");
  check_freqs(freqs, "kv_store");
  if (N == 0) return;
  c10::cuda::CUDAGuard guard(kv.device());
  check_launch(ds4_attn::launch_kv_store(kv.data_ptr(), weight.data_ptr(), wf, pos.data_ptr<int64_t>(),
                                         freqs.data_ptr<float>(), (int)N, (int)D, (int)(2 * freqs.numel()), (float)eps,
                                         fp8_nope, win.data_ptr(), win.stride(0), (int)win.size(1),
                                         c10::cuda::getCurrentCUDAStream().stream()),
               "kv_store");
}

void compress_step(const at::Tensor& kvz, const at::Tensor& ape, const at::Tensor& norm, const at::Tensor& pos,
                   const at::Tensor& freqs, at::Tensor& skv, at::Tensor& ssc, at::Tensor& cache, int64_t m,
                   bool overlap, double eps, bool fp8_nope, int64_t tokens, bool fp4) {
  check_f32(kvz, "kvz");
  check_f32(ape, "ape");
  TORCH_CHECK(cache.is_cuda() && cache.scalar_type() == at::kBFloat16 && cache.dim() == 3 && cache.stride(2) == 1 &&
                  cache.stride(1) == cache.size(2),
              "ds4_attn.compress_step: cache must be bf16 [N, T, w] with contiguous rows");
  // (tokens is checked in Python too: ds4.kernels_attn.compress_step)
  TORCH_CHECK(m >= 1 && tokens >= 1 && m % tokens == 0, "ds4_attn.compress_step: tokens must divide m");
  const int64_t N = cache.size(0), w = cache.size(2), cw = (overlap ? 2 : 1) * w;
  TORCH_CHECK(kvz.dim() == 2 && kvz.size(1) == 2 * cw && kvz.size(0) == N * tokens,
              "ds4_attn.compress_step: kvz must be [N * tokens, 2*cw] (cw = ", num(cw), ")");
  TORCH_CHECK(ape.dim() == 2 && ape.size(0) == m && ape.size(1) == cw, "ds4_attn.compress_step: ape must be [m, cw]");
  for (const at::Tensor* t : {&skv, &ssc})
    TORCH_CHECK(t->is_cuda() && t->scalar_type() == at::kFloat && t->dim() == 3 && t->size(0) == N &&
                    t->size(1) == (overlap ? 2 : 1) * m && t->size(2) == cw && t->stride(2) == 1 &&
                    t->stride(1) == cw && t->stride(0) == skv.stride(0),
                "ds4_attn.compress_step: state must be float32 [N, slots, cw] with contiguous rows (same strides)");
  const bool wf = norm_weight_f32(norm, w, "compress_step");
  check_pos(pos, N, "compress_step");
  TORCH_CHECK(!fp4 || (!fp8_nope && ds4_attn::hadamard_fp4_ok((int)w)),
              "ds4_attn.compress_step: fp4 (the Hadamard + FP4 entry) excludes fp8_nope and needs an entry width that "
              "is a power of two in [32, 256]");
  check_freqs(freqs, "compress_step");
  if (N == 0) return;
  ds4_attn::CompressArgs a;
  a.kvz = kvz.data_ptr<float>();
  a.ape = ape.data_ptr<float>();
  a.norm = norm.data_ptr();
  a.norm_f32 = wf;
  a.pos = pos.data_ptr<int64_t>();
  a.freqs = freqs.data_ptr<float>();
  a.skv = skv.data_ptr<float>();
  a.ssc = ssc.data_ptr<float>();
  a.state_b = skv.stride(0);
  a.cache = cache.data_ptr();
  a.cache_b = cache.stride(0);
  a.m = (int)m; a.w = (int)w; a.R = (int)(2 * freqs.numel());
  a.overlap = overlap; a.fp8_nope = fp8_nope; a.fp4 = fp4; a.eps = (float)eps; a.tokens = (int)tokens;
  c10::cuda::CUDAGuard guard(kvz.device());
  check_launch(ds4_attn::launch_compress_step(a, (int)N, c10::cuda::getCurrentCUDAStream().stream()), "compress_step");
}

}  // namespace

TORCH_LIBRARY(ds4_attn, m) {
  m.def("hc_pre(Tensor h, Tensor fn, Tensor scale, Tensor base, int iters, float hc_eps, float norm_eps, "
        "Tensor? norm=None) -> (Tensor, Tensor, Tensor)");
  m.def("hc_head(Tensor h, Tensor fn, Tensor scale, Tensor base, float hc_eps, float norm_eps, Tensor? norm=None) "
        "-> Tensor");
  m.def("hc_post(Tensor x, Tensor res, Tensor post, Tensor comb) -> Tensor");
  m.def("hc_sinkhorn(Tensor(a!) comb, int iters, float hc_eps) -> ()");
  m.def("hc_post_pre(Tensor x, Tensor res, Tensor post, Tensor comb, Tensor fn, Tensor scale, Tensor base, int iters, "
        "float hc_eps, float norm_eps, Tensor? norm=None) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("hc_post_pre_router(Tensor x, Tensor res, Tensor post, Tensor comb, Tensor fn, Tensor scale, Tensor base, "
        "int iters, float hc_eps, float norm_eps, Tensor norm, Tensor gate) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("hc_fold_finish(Tensor h, Tensor part, Tensor scale, Tensor base, int iters, float hc_eps, float norm_eps, "
        "Tensor? norm=None, Tensor? gate=None) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("hc_fold_finish_proj(Tensor h, Tensor part, Tensor scale, Tensor base, int iters, float hc_eps, "
        "float norm_eps, Tensor norm, Tensor w, Tensor ws) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("sparse_attn(Tensor q, Tensor kv, Tensor valid, Tensor? sel_kv, Tensor? sel_valid, Tensor sink, "
        "float scale) -> Tensor");
  m.def("indexer_scores(Tensor q, Tensor w, Tensor keys, bool bf16, Tensor? pos=None, int ratio=1, "
        "float w_scale=1.0, Tensor? rope_freqs=None, bool q_fp4=False) -> Tensor");
  m.def("indexer_select(Tensor q, Tensor w, Tensor keys, int k, bool bf16, Tensor pos, int ratio=1, "
        "float w_scale=1.0, Tensor? rope_freqs=None, bool q_fp4=False) -> Tensor");
  m.def("sparse_decode(Tensor q, Tensor win, Tensor pos, Tensor? ext, Tensor? ext_idx, int ratio, Tensor sink, "
        "float scale, Tensor? freqs, float? q_norm_eps=None, Tensor(a!)? comb=None, int iters=0, float hc_eps=0.0) "
        "-> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("topk(Tensor scores, int k, Tensor? pos=None, int ratio=1) -> Tensor");
  m.def("topk_ok(int B, int T) -> bool", &topk_ok_host);
  m.def("head_rope(Tensor x, Tensor pos, Tensor freqs, bool norm, float eps) -> Tensor");
  m.def("kv_store(Tensor(a!) win, Tensor kv, Tensor weight, Tensor pos, Tensor freqs, float eps, bool fp8_nope) -> ()");
  m.def("compress_step(Tensor kvz, Tensor ape, Tensor norm, Tensor pos, Tensor freqs, Tensor(a!) skv, "
        "Tensor(b!) ssc, Tensor(c!) cache, int m, bool overlap, float eps, bool fp8_nope, int tokens=1, "
        "bool fp4=False) -> ()");
  m.def("hadamard_fp4(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(ds4_attn, CUDA, m) {
  m.impl("hc_pre", &hc_pre);
  m.impl("hc_head", &hc_head);
  m.impl("hc_post", &hc_post);
  m.impl("hc_sinkhorn", &hc_sinkhorn);
  m.impl("hc_post_pre", &hc_post_pre);
  m.impl("hc_post_pre_router", &hc_post_pre_router);
  m.impl("hc_fold_finish", &hc_fold_finish);
  m.impl("hc_fold_finish_proj", &hc_fold_finish_proj);
  m.impl("sparse_attn", &sparse_attn);
  m.impl("indexer_scores", &indexer_scores);
  m.impl("indexer_select", &indexer_select);
  m.impl("sparse_decode", &sparse_decode);
  m.impl("rms_norm", &rms_norm);
  m.impl("topk", &topk_indices);
  m.impl("head_rope", &head_rope);
  m.impl("hadamard_fp4", &hadamard_fp4);
  m.impl("kv_store", &kv_store);
  m.impl("compress_step", &compress_step);
}
