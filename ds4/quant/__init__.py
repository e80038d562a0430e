"""Quantisation formats (FP8 E4M3 / FP4 E2M1 / E8M0) and reference QAT numerics simulations."""

from .formats import (
    E2M1_MAX,
    E4M3_MAX,
    dequant_fp4,
    dequant_fp8,
    e8m0_to_float,
    float_to_e8m0,
    fp4_e2m1_decode,
    fp4_e2m1_encode,
    fp8_e4m3_decode,
    fp8_e4m3_encode,
    pack_fp4,
    quant_fp4,
    quant_fp8,
    random_fp4,
    random_fp8,
    unpack_fp4,
)
from .qat import act_quant, act_quant_sim, fp4_act_quant_sim, hadamard

__all__ = [
    "E2M1_MAX",
    "E4M3_MAX",
    "dequant_fp4",
    "dequant_fp8",
    "e8m0_to_float",
    "float_to_e8m0",
    "fp4_e2m1_decode",
    "fp4_e2m1_encode",
    "fp8_e4m3_decode",
    "fp8_e4m3_encode",
    "pack_fp4",
    "quant_fp4",
    "quant_fp8",
    "random_fp4",
    "random_fp8",
    "unpack_fp4",
    "act_quant",
    "act_quant_sim",
    "fp4_act_quant_sim",
    "hadamard",
]
