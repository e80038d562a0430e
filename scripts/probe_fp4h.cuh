// The fp16 FP4 decode that scripts/fp4_decode_search.py finds (6 LOP3 per word, every shift a left shift), and the
// word layout it reads ("fp4h"): register i holds two values, each half s 000e1e0 m000000000 (the E2M1 value x 2^-14;
// e = 0 lands on fp16 subnormals). Shared by scripts/probe_fp16_decode.cu (its arithmetic alone, session 34) and
// scripts/probe_hfma.cu (the HFMA2 product on real fp4h words, session 51).
#pragma once
#include <stdint.h>

namespace fp4h {

__host__ __device__ __forceinline__ void regs(uint32_t q, uint32_t (&r)[4]) {
  r[0] = q & 0x8E008E00u;
  r[1] = (q << 3) & 0x8E008E00u;
  r[2] = ((q << 1) & 0x80008000u) | ((q << 6) & 0x0E000E00u);
  r[3] = ((q << 2) & 0x80008000u) | ((q << 9) & 0x0E000E00u);
}

// Where regs takes register i's low half from: its sign bit and the lowest of its e1 e0 m bits (the high half: +16).
__host__ __device__ constexpr int sign_bit(int i) { return i == 0 ? 15 : i == 1 ? 12 : i == 2 ? 14 : 13; }
__host__ __device__ constexpr int mag_lsb(int i) { return 9 - 3 * i; }

// The word whose regs are r (each half's bit 15 and bits 11..9; its other bits are not read).
__host__ __device__ __forceinline__ uint32_t pack(const uint32_t (&r)[4]) {
  uint32_t q = 0u;
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int hh = 0; hh < 32; hh += 16)
      q |= ((r[i] >> (15 + hh)) & 1u) << (sign_bit(i) + hh) | ((r[i] >> (9 + hh)) & 7u) << (mag_lsb(i) + hh);
  return q;
}

}  // namespace fp4h
