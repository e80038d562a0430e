"""CPU checks of csrc/moe_dp4a.cu's index and quantisation arithmetic (moe=fp4_dp4a), without a GPU: a host program
built with nvcc (skipped without it) includes the kernel's source and runs its host-callable helpers
(scale_word_lane: which lanes load a row's E8M0 scale word; q16_of / q16: the 16-bit activation code of a block).

- No lane reads a scale word outside its row of dim / 32 bytes: at dim 1024 / 2048 / 3072 (the `small` preset's 1024
  among them) every lane used to load one, up to 96 bytes past the scale tensor's end at its last row.
- Every bf16 block, down to the subnormals, quantises to within half a step of its values: 32767 / amax overflowed to
  inf under amax ~ 9.6e-35, and every value of such a block became +-amax (its zeros -amax). Blocks of amax >= 2^-64
  keep the bits they had (the same q and scale)."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

CSRC = Path(__file__).resolve().parents[1] / "csrc"

HARNESS = r"""
#include "moe_dp4a.cu"

#include <cmath>
#include <cstdio>
#include <cstring>

namespace ds4 {
int sm_count() { return 1; }  // gemv.cu's (resident_wave), not linked here
}  // namespace ds4

using namespace ds4;

static int fails = 0, shown_words = 0, shown_q = 0;  // (at most 20 lines of each check)
#define FAIL_AT(shown, ...) (++fails, ++shown <= 20 ? std::printf("FAIL " __VA_ARGS__) : 0)

template <int KB, bool FULL>
static void words(int nb) {
  for (int lane = 0; lane < 32; ++lane)
    if (scale_word_lane<KB, FULL>(lane, nb) && 4 * lane + 3 >= nb)
      FAIL_AT(shown_words, "scale word: KB %d FULL %d dim %d: lane %d reads bytes %d..%d of a %d-byte row\n", KB,
              FULL, nb * 32, lane, 4 * lane, 4 * lane + 3, nb);
  for (int b = 0; b < nb; ++b)  // finish_item shuffles block b's byte from lane b / 4
    if (!scale_word_lane<KB, FULL>(b >> 2, nb))
      FAIL_AT(shown_words, "scale word: KB %d FULL %d dim %d: lane %d's word (block %d) not loaded\n", KB, FULL,
              nb * 32, b >> 2, b);
}

template <int KB>
static void words_kb() {
  words<KB, true>(32 * KB);
  for (int dim = 1024 * (KB - 1) + 128; dim < 1024 * KB; dim += 128) words<KB, false>(dim / 32);  // SHFL: dim % 128
}

static float f32(unsigned u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

int main() {
  words_kb<1>();
  words_kb<2>();
  words_kb<3>();
  words_kb<4>();
  long checked = 0;
  for (unsigned a = 0x7F7Fu; a >= 1; --a) {  // every positive finite bf16 as a block's largest magnitude
    const float amax = f32(a << 16);
    const Q16 s = q16_of(amax);
    const double step = (double)amax / 32767.0;
    for (int k = -7; k <= 7; ++k) {
      // bf16 values of the block (truncated to bf16), and its smallest subnormal
      unsigned vb;
      const float vk = k == 7 ? amax : k == -7 ? -amax : amax / 7.f * (float)k;
      std::memcpy(&vb, &vk, 4);
      const float v = k == 0 && (a & 1) ? f32(0x00010000u) : f32(vb & 0xFFFF0000u);
      const int q = q16(v, s);
      const double err = std::fabs((double)q * (double)s.xs - (double)v);
      ++checked;
      if (!(err <= 0.5 * step * (1 + 1e-3) + 32767.0 * std::ldexp(1.0, -150)) || (v == 0.f && q != 0))
        FAIL_AT(shown_q, "q16: amax %a v %a: q %d xs %a (q xs - v = %g, half a step %g)\n", amax, v, q, s.xs, err,
                0.5 * step);
      if (amax >= 0x1p-64f) {  // the bits of every block an RMS-normed x holds: unchanged
        const int q0 = (int)fminf(fmaxf(rintf(v * (32767.f / amax)), -32767.f), 32767.f);
        if (q != q0 || s.xs != amax / 32767.f)
          FAIL_AT(shown_q, "q16: amax %a v %a: q %d xs %a, was %d %a\n", amax, v, q, s.xs, q0, amax / 32767.f);
      }
    }
  }
  std::printf("checked %ld values; %d failures\n", checked, fails);
  return fails ? 1 : 0;
}
"""


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not on PATH")
    d = tmp_path_factory.mktemp("dp4a")
    (d / "h.cu").write_text(HARNESS)
    cmd = ["nvcc", "-std=c++17", "-O2", "-arch=sm_80", f"-I{CSRC}", str(d / "h.cu"), "-o", str(d / "h")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    r = subprocess.run([str(d / "h")], capture_output=True, text=True, timeout=120)
    return r.returncode, r.stdout


def test_scale_words_stay_inside_their_row(harness):
    rc, out = harness
    bad = [line for line in out.splitlines() if line.startswith("FAIL scale word")]
    assert not bad, "\n".join(bad)


def test_every_bf16_block_quantises_within_half_a_step(harness):
    rc, out = harness
    bad = [line for line in out.splitlines() if line.startswith("FAIL q16")]
    assert not bad, "\n".join(bad)
    assert rc == 0 and "0 failures" in out, out[-2000:]
