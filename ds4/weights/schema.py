"""The tensor inventory of a DeepSeek-V4 checkpoint in the official naming (spec §10.2).

`expected_tensors(args)` is the one contract between the loader, the synthetic-weight
generator, the checkpoint writer and the model: name -> (dtype, shape, tensor-parallel rule).
The model consumes a flat dict in exactly this naming, in checkpoint-native dtypes:

* FP8 linear:  `<name>.weight` float8_e4m3fn [out, in] + `<name>.scale` float8_e8m0fnu
  [ceil(out/128), ceil(in/128)]
* FP4 expert:  `<name>.weight` int8 [out, in/2] (two e2m1 per byte, low nibble first) +
  `<name>.scale` float8_e8m0fnu [out, in/32]
* BF16 linear (weight_dtype/expert_dtype "bf16"): `<name>.weight` bfloat16 [out, in], no scale.

Tensor parallelism (spec §10.4/§10.6): `split` is the dimension cut into W equal parts
(None = replicated); routed experts (`expert` = its id) are laid out as `local_tensors(experts=)` says:
distributed whole ("ep", the reference's layout) or cut along their intermediate dim ("tp").
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace

import torch

from ds4.model.args import CSA, HCA, ModelArgs

FP8 = torch.float8_e4m3fn
E8M0 = torch.float8_e8m0fnu
FP4_PACKED = torch.int8
BF16 = torch.bfloat16
F32 = torch.float32
I64 = torch.int64


@dataclass(frozen=True)
class TensorSpec:
    dtype: torch.dtype
    shape: tuple[int, ...]
    split: int | None = None  # tensor-parallel split dim, None = replicated
    expert: int | None = None  # routed expert id (expert-parallel: owned by one rank)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def linear_specs(name: str, out: int, inp: int, fmt: str, split: int | None = None,
                 expert: int | None = None) -> dict[str, TensorSpec]:
    """Tensors of one linear layer `name` ([out, in]) stored in format `fmt`."""
    if fmt == "fp8":
        return {f"{name}.weight": TensorSpec(FP8, (out, inp), split, expert),
                f"{name}.scale": TensorSpec(E8M0, (_cdiv(out, 128), _cdiv(inp, 128)), split, expert)}
    if fmt == "fp4":
        if inp % 32:
            raise ValueError(f"{name}: fp4 needs in_features divisible by 32, got {inp}")
        return {f"{name}.weight": TensorSpec(FP4_PACKED, (out, inp // 2), split, expert),
                f"{name}.scale": TensorSpec(E8M0, (out, inp // 32), split, expert)}
    if fmt == "bf16":
        return {f"{name}.weight": TensorSpec(BF16, (out, inp), split, expert)}
    raise ValueError(f"unknown weight format {fmt!r}")


def _compressor(prefix: str, a: ModelArgs, ratio: int, width: int, overlap: bool) -> dict[str, TensorSpec]:
    coff = 2 if overlap else 1
    return {
        f"{prefix}.wkv.weight": TensorSpec(BF16, (coff * width, a.dim)),
        f"{prefix}.wgate.weight": TensorSpec(BF16, (coff * width, a.dim)),
        f"{prefix}.ape": TensorSpec(F32, (ratio, coff * width)),
        f"{prefix}.norm.weight": TensorSpec(BF16, (width,)),
    }


def block_specs(prefix: str, a: ModelArgs, layer: int) -> dict[str, TensorSpec]:
    """One transformer block (main layer `layer`, or the MTP block with its own index)."""
    wf, ef = a.weight_dtype, a.expert_dtype
    d, hd = a.dim, a.head_dim
    s: dict[str, TensorSpec] = {}
    for site in ("attn", "ffn"):
        mix = (2 + a.hc_mult) * a.hc_mult
        s[f"{prefix}.hc_{site}_fn"] = TensorSpec(F32, (mix, a.hc_mult * d))
        s[f"{prefix}.hc_{site}_base"] = TensorSpec(F32, (mix,))
        s[f"{prefix}.hc_{site}_scale"] = TensorSpec(F32, (3,))
    s[f"{prefix}.attn_norm.weight"] = TensorSpec(BF16, (d,))
    s[f"{prefix}.ffn_norm.weight"] = TensorSpec(BF16, (d,))
    at = f"{prefix}.attn"
    s |= linear_specs(f"{at}.wq_a", a.q_lora_rank, d, wf)
    s[f"{at}.q_norm.weight"] = TensorSpec(BF16, (a.q_lora_rank,))
    s |= linear_specs(f"{at}.wq_b", a.n_heads * hd, a.q_lora_rank, wf, split=0)
    s |= linear_specs(f"{at}.wkv", hd, d, wf)
    s[f"{at}.kv_norm.weight"] = TensorSpec(BF16, (hd,))
    s |= linear_specs(f"{at}.wo_a", a.o_groups * a.o_lora_rank, a.n_heads * hd // a.o_groups, wf, split=0)
    s |= linear_specs(f"{at}.wo_b", d, a.o_groups * a.o_lora_rank, wf, split=1)
    s[f"{at}.attn_sink"] = TensorSpec(F32, (a.n_heads,), split=0)
    kind = a.layer_type(layer)
    if kind in (CSA, HCA):
        s |= _compressor(f"{at}.compressor", a, a.ratio(layer), hd, overlap=kind == CSA)
    if kind == CSA:
        ix = f"{at}.indexer"
        # replicated under tensor parallelism (no split): every rank scores all index heads and picks the
        # same top-k, so no all-reduce of the [B, T] scores per CSA layer; the extra bytes per rank are
        # half of the indexer's wq_b (4.2 MB of V4-Flash's FP8), about 1 us at H200 bandwidth
        s |= linear_specs(f"{ix}.wq_b", a.index_n_heads * a.index_head_dim, a.q_lora_rank, wf)
        s[f"{ix}.weights_proj.weight"] = TensorSpec(BF16, (a.index_n_heads, d))
        s |= _compressor(f"{ix}.compressor", a, a.ratio(layer), a.index_head_dim, overlap=True)
    ff = f"{prefix}.ffn"
    s[f"{ff}.gate.weight"] = TensorSpec(BF16, (a.n_routed_experts, d))
    if a.is_hash(layer):
        s[f"{ff}.gate.tid2eid"] = TensorSpec(I64, (a.vocab_size, a.n_activated_experts))
    else:
        s[f"{ff}.gate.bias"] = TensorSpec(F32, (a.n_routed_experts,))
    for e in range(a.n_routed_experts):
        s |= linear_specs(f"{ff}.experts.{e}.w1", a.moe_inter_dim, d, ef, expert=e)
        s |= linear_specs(f"{ff}.experts.{e}.w2", d, a.moe_inter_dim, ef, expert=e)
        s |= linear_specs(f"{ff}.experts.{e}.w3", a.moe_inter_dim, d, ef, expert=e)
    s |= linear_specs(f"{ff}.shared_experts.w1", a.moe_inter_dim, d, wf)
    s |= linear_specs(f"{ff}.shared_experts.w2", d, a.moe_inter_dim, wf)
    s |= linear_specs(f"{ff}.shared_experts.w3", a.moe_inter_dim, d, wf)
    return s


def expected_tensors(a: ModelArgs, include_mtp: bool = True) -> dict[str, TensorSpec]:
    """Every tensor of the checkpoint, official naming, in file order (globals, layers, mtp)."""
    s: dict[str, TensorSpec] = {
        "embed.weight": TensorSpec(BF16, (a.vocab_size, a.dim), split=0),
        "head.weight": TensorSpec(BF16, (a.vocab_size, a.dim), split=0),
        "norm.weight": TensorSpec(BF16, (a.dim,)),
        "hc_head_fn": TensorSpec(F32, (a.hc_mult, a.hc_mult * a.dim)),
        "hc_head_base": TensorSpec(F32, (a.hc_mult,)),
        "hc_head_scale": TensorSpec(F32, (1,)),
    }
    for i in range(a.n_layers):
        s |= block_specs(f"layers.{i}", a, i)
    if include_mtp:
        for j in range(a.n_mtp_layers):
            p = f"mtp.{j}"
            # The MTP block is never hash-routed; its ratio is compress_ratios[n_layers + j].
            s |= block_specs(p, a.replace(n_hash_layers=0), a.n_layers + j)
            s |= linear_specs(f"{p}.e_proj", a.dim, a.dim, a.weight_dtype)
            s |= linear_specs(f"{p}.h_proj", a.dim, a.dim, a.weight_dtype)
            for n in ("enorm", "hnorm", "norm"):
                s[f"{p}.{n}.weight"] = TensorSpec(BF16, (a.dim,))
            s[f"{p}.hc_head_fn"] = TensorSpec(F32, (a.hc_mult, a.hc_mult * a.dim))
            s[f"{p}.hc_head_base"] = TensorSpec(F32, (a.hc_mult,))
            s[f"{p}.hc_head_scale"] = TensorSpec(F32, (1,))
    return s


def rank_slice(name: str, spec: TensorSpec, rank: int, world: int) -> tuple[TensorSpec, tuple[slice, ...] | None]:
    """The part of tensor `name` that rank `rank` of `world` holds.

    Returns (local spec, index into the full tensor) or (spec, None) when this rank does not
    hold the tensor at all (a routed expert owned by another rank). Replicated tensors return
    the full index."""
    if spec.expert is not None:
        # Spec §10.4: rank i keeps experts [i*E/W, (i+1)*E/W); the caller passes n_experts via the name.
        raise ValueError("use expert_owner() for routed experts")
    if spec.split is None or world == 1:
        return spec, tuple(slice(None) for _ in spec.shape)
    n = spec.shape[spec.split]
    if n % world:
        raise ValueError(f"{name}: dim {spec.split} of size {n} does not divide by world size {world}")
    part = n // world
    shape = list(spec.shape)
    shape[spec.split] = part
    idx = [slice(None)] * len(shape)
    idx[spec.split] = slice(rank * part, (rank + 1) * part)
    return TensorSpec(spec.dtype, tuple(shape), spec.split, spec.expert), tuple(idx)


def expert_owner(expert: int, n_experts: int, world: int) -> int:
    if n_experts % world:
        raise ValueError(f"{n_experts} experts do not divide by world size {world}")
    return expert // (n_experts // world)


# How routed experts are laid out over the ranks (parallel.experts):
#   ep: rank i holds experts [i E/W, (i+1) E/W) whole (the reference's layout, spec §10.4). At batch 1 a
#       token's k experts fall unevenly on the ranks (k = 6, W = 2: the busier rank streams 3.94 experts on
#       average, not 3), and every rank waits for the busiest at the all-reduce.
#   tp: every rank holds a 1/W slice of every expert's intermediate dim (w1 / w3 rows, w2 columns, and
#       their scales), so each rank streams exactly k/W experts' bytes per token. The down projection's
#       output is a partial sum either way, reduced by the same all-reduce.
EXPERT_LAYOUTS = ("ep", "tp")
# How the shared expert is laid out (parallel.shared_expert):
#   replicate: every rank holds all of it and adds its output after the all-reduce (the reference, spec §10.6);
#   tp: every rank holds 1/W of its intermediate dim, as the routed experts under "tp": its output is then a
#       partial sum, added to the routed partial sum before the one all-reduce (each rank streams 1/W of it).
SHARED_LAYOUTS = ("replicate", "tp")
_SHARED_EXPERT = re.compile(r"\.shared_experts\.w[123]\.(weight|scale)$")


def expert_split_dim(name: str) -> int:
    """The dim of an expert tensor (weight or scale) that the "tp" layouts cut: the intermediate dim, rows of
    w1 / w3 ([inter, dim]) and columns of w2 ([dim, inter])."""
    part = name.rsplit(".", 2)[-2]
    if part not in ("w1", "w2", "w3"):
        raise ValueError(f"{name}: not an expert's w1 / w2 / w3")
    return 1 if part == "w2" else 0


def local_tensors(a: ModelArgs, rank: int = 0, world: int = 1, include_mtp: bool = True,
                  experts: str = "ep", shared: str = "replicate") -> dict[str, tuple[TensorSpec, tuple[slice, ...]]]:
    """name -> (local spec, index into the full tensor) for everything rank `rank` holds; `experts`: the
    routed experts' layout (EXPERT_LAYOUTS); `shared`: the shared expert's (SHARED_LAYOUTS)."""
    if experts not in EXPERT_LAYOUTS:
        raise ValueError(f"experts={experts!r}: choose one of {', '.join(EXPERT_LAYOUTS)}")
    if shared not in SHARED_LAYOUTS:
        raise ValueError(f"shared={shared!r}: choose one of {', '.join(SHARED_LAYOUTS)}")
    # the split of whole heads, o-groups and vocabulary rows (spec §10.4); the tensors' own cuts do not always show
    # it (an o-group's wo_a rows are whole 128-row scale blocks only at o_lora_rank 128)
    bad = [f"{what} {n}" for what, n in (("heads", a.n_heads), ("o_groups", a.o_groups), ("vocab_size", a.vocab_size))
           if n % world]
    if bad:
        raise ValueError(f"{world} ranks must divide the model's {', '.join(bad)}")
    out = {}
    for name, spec in expected_tensors(a, include_mtp).items():
        if shared == "tp" and _SHARED_EXPERT.search(name):  # (rank_slice refuses a cut inside a scale block)
            out[name] = rank_slice(name, replace(spec, split=expert_split_dim(name)), rank, world)
            continue
        if spec.expert is not None:
            if experts == "tp":
                # packed FP4 columns and block scales are cut too: rank_slice refuses any dim (weight or
                # scale) that does not divide, e.g. FP8 experts whose intermediate dim / W is not whole 128-blocks
                lspec, idx = rank_slice(name, replace(spec, expert=None, split=expert_split_dim(name)), rank, world)
                out[name] = (replace(lspec, expert=spec.expert), idx)
            elif expert_owner(spec.expert, a.n_routed_experts, world) == rank:
                out[name] = (spec, tuple(slice(None) for _ in spec.shape))
            continue
        out[name] = rank_slice(name, spec, rank, world)
    return out
