// The launch arguments of a Sinkhorn that rides along in another kernel of the decode step (sinkhorn_dev.cuh
// runs it): host-safe, shared by the launchers of both extensions.
#pragma once

namespace ds4 {

// A Sinkhorn that rides along in another launch of the step: comb [N, n, n] fp32 as a finish called with
// iters = 0 left it (the logits), n = 1, 2 or 4; comb == nullptr: none. Why: in the finish the ~40 dependent
// steps (about 1 us) outlast its other work and the next kernel's PDL wait waits for all of it, while comb is
// read only at the end of the site (hc.post or the hc fold's epilogue).
struct SinkhornRide {
  float* comb = nullptr;
  int n = 0;
  int iters = 0;
  float eps = 0.f;
};

// Host: whether a ride's shape is one the device code takes.
inline bool sinkhorn_ride_ok(const SinkhornRide& r, int ntok) {
  return r.comb == nullptr || ((r.n == 1 || r.n == 2 || r.n == 4) && r.iters >= 1 && ntok >= 1);
}

}  // namespace ds4
