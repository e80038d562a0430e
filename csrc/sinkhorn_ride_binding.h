// The bindings' side of a Sinkhorn ride (sinkhorn_ride.h): checks the optional comb tensor an op takes along,
// shared by the binding files of both extensions.
#pragma once
#include <ATen/ATen.h>

#include <optional>

#include "sinkhorn_ride.h"

namespace ds4 {

// comb: fp32 contiguous CUDA [ntok, n, n] (n = 1, 2, 4) as an hc finish with iters = 0 left it, on `device`;
// none: no ride.
inline SinkhornRide sinkhorn_ride_arg(const std::optional<at::Tensor>& comb, int64_t iters, double hc_eps,
                                      int64_t ntok, const at::Device& device, const char* op) {
  if (!comb.has_value()) return SinkhornRide{};
  const at::Tensor& c = *comb;
  // (no number in this message: with the token count in it, a failing check crashed both extensions with a
  // segfault instead of raising, on the lent H200's torch, session 30; cause not investigated)
  TORCH_CHECK(c.is_cuda() && c.device() == device && c.scalar_type() == at::kFloat && c.is_contiguous() &&
                  c.dim() == 3 && c.size(0) == ntok && c.size(1) == c.size(2) &&
                  (c.size(1) == 1 || c.size(1) == 2 || c.size(1) == 4),
              op, ": comb must be contiguous fp32 [tokens, n, n] with n = 1, 2 or 4 on the op's device");
  TORCH_CHECK(iters >= 1, op, ": the Sinkhorn's iters must be >= 1");
  return SinkhornRide{c.data_ptr<float>(), (int)c.size(1), (int)iters, (float)hc_eps};
}

}  // namespace ds4
