"""Synthetic weights, checkpoint writing/loading (both namings), validation errors, HF naming."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ds4.model.args import ModelArgs, tiny
from ds4.weights.checkpoint import INDEX_FILE, CheckpointError, checkpoint_args, load_checkpoint
from ds4.weights.hf_naming import dense_args, dequant_weight, hf_to_official, official_to_hf
from ds4.weights.schema import E8M0, FP4_PACKED, FP8, expected_tensors, local_tensors
from ds4.weights.synthetic import random_weights
from ds4.weights.writer import write_checkpoint

ARGS = tiny()


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A dtype-agnostic view for bit-exact comparison."""
    t = t.contiguous()
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(-1).view(torch.uint8)


def assert_bit_equal(a: dict, b: dict):
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(_bytes(a[k]), _bytes(b[k])), f"{k} differs"


@pytest.fixture(scope="module")
def weights():
    return random_weights(ARGS, seed=0)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, weights):
    root = tmp_path_factory.mktemp("ckpt") / "tiny"
    write_checkpoint(root, ARGS, weights, max_shard_bytes=1 << 20)
    return root


# ---- synthetic ---------------------------------------------------------------------------

def test_synthetic_matches_schema(weights):
    local = local_tensors(ARGS)
    assert list(weights) == list(local)
    for name, (spec, _) in local.items():
        assert weights[name].dtype == spec.dtype and tuple(weights[name].shape) == spec.shape, name


def test_synthetic_deterministic(weights):
    assert_bit_equal(weights, random_weights(ARGS, seed=0))
    other = random_weights(ARGS, seed=1)
    assert not torch.equal(_bytes(other["embed.weight"]), _bytes(weights["embed.weight"]))


def test_synthetic_weights_show_their_progress(weights, capsys):
    """On a CPU V4-Flash's synthetic weights take minutes per layer (one layer ~200 s): the app's load shows a bar of
    the bytes made, as the checkpoint loader does, and the same tensors come out with or without it."""
    assert_bit_equal(weights, random_weights(ARGS, seed=0, progress=True))
    err = capsys.readouterr().err
    assert "creating synthetic weights" in err and "100%" in err, err[-500:]
    random_weights(ARGS, seed=0)
    assert "creating synthetic weights" not in capsys.readouterr().err  # off by default (tests, scripts)


def test_synthetic_weights_trim_the_heap_as_they_go(weights, monkeypatch):
    """On a CPU the C heap is trimmed every few tensors (the freed fp32 temporaries' pages otherwise stay resident:
    one V4-Flash layer's weights alone peaked at 1.51x their size, 1.10x with the trims); the tensors are the same."""
    from ds4.weights import synthetic
    calls = []
    monkeypatch.setattr(synthetic, "trim_heap", lambda: calls.append(1))
    assert_bit_equal(weights, random_weights(ARGS, seed=0))
    assert len(calls) == len(weights) // synthetic._TRIM_EVERY > 0
    monkeypatch.undo()
    from ds4.weights import heap
    heap._malloc_trim.cache_clear()
    heap.trim_heap()  # glibc here: malloc_trim; elsewhere a no-op, never an error


def test_stacking_the_experts_trims_the_heap_on_cpu(weights, monkeypatch):
    """Each stacked expert matrix gives its per-expert originals' pages back (ds4.weights.heap): on a CPU they otherwise
    stay resident in the C heap beside the stacked (mmapped) matrices."""
    from ds4.model import weights_module
    from ds4.model.transformer import Transformer
    from ds4.registry import torch_reference_ops
    calls = []
    monkeypatch.setattr(weights_module, "trim_heap", lambda: calls.append(1))
    model = Transformer(ARGS, torch_reference_ops(), device="cpu")
    model.load_weights(dict(weights), consume=True)
    stacked = sum(1 for m in model.modules() for a in ("w1", "w2", "w3")
                  if isinstance(getattr(m, f"{a}_weight", None), torch.Tensor) and getattr(m, f"{a}_weight").dim() == 3)
    scales = sum(1 for m in model.modules() for a in ("w1", "w2", "w3")
                 if isinstance(getattr(m, f"{a}_scale", None), torch.Tensor) and getattr(m, f"{a}_scale").dim() == 3)
    assert stacked > 0 and ARGS.n_routed_experts <= 32 and len(calls) == stacked + scales  # one per stack at its end


def test_stacking_drops_each_original_once_copied():
    """take_stacked's _stack copies the experts one by one and, from a dict, drops each original as soon as it is
    copied: the stacked matrix and the originals never coexist in full (stacking V4's 256 experts' w1 at once held
    1.1 GiB more at a CPU run's peak, session 68). The result is torch.stack's; a read-only mapping keeps its
    tensors; mismatched shapes or dtypes fail as torch.stack would, not by a silent cast or broadcast."""
    import types
    import weakref
    from ds4.model.weights_module import _stack
    g = torch.Generator().manual_seed(0)
    names = [f"e{i}" for i in range(70)]
    want = torch.randint(0, 256, (70, 8, 16), generator=g, dtype=torch.uint8)
    refs, alive_at_read = [], []

    class Spy(dict):
        def __getitem__(self, k):
            alive_at_read.append(sum(r() is not None for r in refs[:names.index(k)]))
            return super().__getitem__(k)

    originals = Spy()
    for n, t in zip(names, want.unbind(0)):
        t = t.clone()
        refs.append(weakref.ref(t))
        originals[n] = t
        del t
    got = _stack(originals, names)
    assert torch.equal(got, torch.stack(list(want.unbind(0)))) and len(originals) == 0
    assert max(alive_at_read[1:]) == 0  # before reading expert i, experts 0..i-1 are gone
    kept = types.MappingProxyType({n: t for n, t in zip(names, want.unbind(0))})
    assert torch.equal(_stack(kept, names), want) and len(kept) == 70
    with pytest.raises(ValueError, match="cannot stack e1"):
        _stack({"e0": torch.zeros(2, 3), "e1": torch.zeros(3, 2)}, ["e0", "e1"])
    with pytest.raises(ValueError, match="cannot stack e1"):
        _stack({"e0": torch.zeros(2, 3), "e1": torch.zeros(2, 3, dtype=torch.float64)}, ["e0", "e1"])


def test_synthetic_rank_slices_equal_full_slices(weights):
    n_seen = 0
    for rank in range(2):
        part = random_weights(ARGS, seed=0, rank=rank, world=2)
        local = local_tensors(ARGS, rank, 2)
        assert list(part) == list(local)
        for name, (spec, idx) in local.items():
            assert torch.equal(_bytes(part[name]), _bytes(weights[name][idx].contiguous())), name
            if ".experts." in name and "shared" not in name:
                e = int(name.split(".experts.")[1].split(".")[0])
                assert e // (ARGS.n_routed_experts // 2) == rank
                n_seen += 1
    assert n_seen == sum(1 for n, s in expected_tensors(ARGS).items() if s.expert is not None)


def test_tid2eid_distinct_per_row(weights):
    names = [n for n in weights if n.endswith("tid2eid")]
    assert len(names) == ARGS.n_hash_layers
    for n in names:
        t = weights[n]
        assert t.dtype == torch.int64 and t.min() >= 0 and t.max() < ARGS.n_routed_experts
        s = t.sort(dim=1).values
        assert (s[:, 1:] != s[:, :-1]).all(), f"{n} has repeated experts in a row"
        assert len(set(t[:, 0].tolist())) > ARGS.n_routed_experts // 2  # not a constant pattern


def test_synthetic_formats_and_magnitudes(weights):
    assert weights["layers.0.attn.wq_a.weight"].dtype == FP8
    assert weights["layers.0.attn.wq_a.scale"].dtype == E8M0
    assert weights["layers.0.ffn.experts.0.w1.weight"].dtype == FP4_PACKED
    for name in ("layers.0.attn.wq_a.weight", "layers.3.ffn.experts.5.w2.weight", "layers.2.attn.compressor.wkv.weight"):
        w = dequant_weight(weights, name, torch.float32)
        std = w.std().item() * w.shape[1] ** 0.5
        assert 0.7 < std < 1.3, (name, std)
    assert abs(weights["norm.weight"].float().mean().item() - 1) < 0.05
    assert 0.9 < weights["embed.weight"].float().std().item() < 1.1


# ---- write / load, official naming ------------------------------------------------------

def test_write_layout(ckpt, weights):
    index = json.loads((ckpt / INDEX_FILE).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert set(index["weight_map"]) == set(weights)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in weights.values())
    for s in shards:
        names = [k for k, v in index["weight_map"].items() if v == s]
        nbytes = sum(weights[k].numel() * weights[k].element_size() for k in names)
        assert nbytes <= 1 << 20 or len(names) == 1, (s, nbytes)  # only a lone big tensor may exceed
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "fp8"


def test_roundtrip_bit_identical(ckpt, weights):
    args, loaded = load_checkpoint(ckpt, progress=False)
    assert args == ARGS
    assert_bit_equal(weights, loaded)


def test_load_world2_slices(ckpt, weights):
    for rank in range(2):
        args, part = load_checkpoint(ckpt, rank=rank, world=2, progress=False)
        assert_bit_equal(random_weights(ARGS, seed=0, rank=rank, world=2), part)
        experts = {int(n.split(".experts.")[1].split(".")[0]) for n in part if ".experts." in n and "shared" not in n}
        assert experts == set(range(rank * 8, rank * 8 + 8))


def test_load_without_mtp(ckpt):
    _, loaded = load_checkpoint(ckpt, include_mtp=False, progress=False)
    assert loaded and not any(n.startswith("mtp.") for n in loaded)
    assert set(loaded) == set(expected_tensors(ARGS, include_mtp=False))


def test_load_fewer_layers(ckpt, weights, tmp_path):
    # model.n_layers=N: the layers past N are neither read nor reported as unexpected
    args2 = ARGS.with_layers(2)
    args, part = load_checkpoint(ckpt, args=args2, include_mtp=False, progress=False)
    assert args == args2 and list(part) == list(expected_tensors(args2, include_mtp=False))
    assert not any(n.startswith("layers.2.") for n in part)
    for n in part:
        assert torch.equal(_bytes(part[n]), _bytes(weights[n])), n
    # a layer beyond the checkpoint's own count is still unexpected
    bad = _copy(ckpt, tmp_path)
    _edit_shard(bad, "layers.1.attn_norm.weight", lambda t: t.update({"layers.9.attn_norm.weight": torch.ones(8)}))
    with pytest.raises(CheckpointError, match="unexpected tensor layers.9.attn_norm.weight"):
        load_checkpoint(bad, args=args2, include_mtp=False, progress=False)


def test_extra_mtp_stages_ignored_without_mtp(ckpt, tmp_path):
    # a checkpoint with another MTP head (V4-Flash-0731's three DSpark stages, spec §1.5) loads its backbone
    root = _copy(ckpt, tmp_path)
    _edit_shard(root, "mtp.0.norm.weight", lambda t: t.update({"mtp.2.markov_head.weight": torch.ones(4, 8)}))
    _, part = load_checkpoint(root, include_mtp=False, progress=False)
    assert set(part) == set(expected_tensors(ARGS, include_mtp=False))
    _expect_error(root, "unexpected tensor mtp.2.markov_head.weight")  # with MTP asked for, it is one


def test_expert_format_from_the_shards_when_config_is_silent(ckpt, tmp_path):
    # the first HF revision's config.json has no expert_dtype, its experts are FP4 (spec §14.1)
    root = _copy(ckpt, tmp_path)
    cfg = json.loads((root / "config.json").read_text())
    assert cfg.pop("expert_dtype") == "fp4"
    (root / "config.json").write_text(json.dumps(cfg))
    assert checkpoint_args(root) == ARGS
    args, _ = load_checkpoint(root, progress=False)
    assert args == ARGS
    # a config that names a format keeps it; shards that disagree are reported
    (root / "config.json").write_text(json.dumps({**cfg, "expert_dtype": "fp8"}))
    assert checkpoint_args(root).expert_dtype == "fp8"
    _expect_error(root, "tensor layers.0.ffn.experts.0.w1.weight: expected dtype F8_E4M3, found I8")


@pytest.mark.parametrize("experts", ["fp4", "fp8"])
def test_bf16_projections_with_quantised_experts_round_trip(tmp_path, experts):
    args = ARGS.replace(weight_dtype="bf16", expert_dtype=experts)
    w = random_weights(args, seed=1, include_mtp=False)
    write_checkpoint(tmp_path / "c", args, w, tokenizer=False)
    got_args, got = load_checkpoint(tmp_path / "c", include_mtp=False, progress=False)
    assert got_args == args
    assert_bit_equal(w, got)


def test_official_naming_fp32_checkpoint_loads(tmp_path):
    # a dequantised checkpoint saved in FP32 (official naming): its BF16 tensors stored as F32
    args = ARGS.replace(weight_dtype="bf16", expert_dtype="bf16")
    w = random_weights(args, seed=2, include_mtp=False)
    f32 = {k: (v.float() if v.dtype == torch.bfloat16 else v) for k, v in w.items()}
    write_checkpoint(tmp_path / "c", args, f32, tokenizer=False)
    _, got = load_checkpoint(tmp_path / "c", include_mtp=False, progress=False)
    assert got["layers.0.attn.wq_a.weight"].dtype == torch.float32
    _, got = load_checkpoint(tmp_path / "c", include_mtp=False, progress=False, dtype_policy="schema")
    assert_bit_equal(w, got)


def test_config_errors_name_the_file(ckpt, tmp_path):
    root = _copy(ckpt, tmp_path)
    cfg = json.loads((root / "config.json").read_text())
    del cfg["hidden_size"]
    (root / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"config.json: missing field 'hidden_size'"):
        checkpoint_args(root)


def test_default_rope_type_is_plain_rope():
    cfg = ARGS.to_hf_config()
    cfg["rope_scaling"] = {"rope_type": "default", "rope_theta": 50000.0}
    args = ModelArgs.from_hf_config(cfg)
    assert args.rope_factor == 1.0 and args.compress_rope_theta == 50000.0
    cfg["rope_scaling"] = {"rope_type": "linear", "factor": 2.0}
    with pytest.raises(ValueError, match="unsupported rope scaling"):
        ModelArgs.from_hf_config(cfg)


# ---- bad checkpoints ---------------------------------------------------------------------

def _copy(ckpt: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "bad"
    shutil.copytree(ckpt, dst)
    return dst


def _shard_of(root: Path, name: str) -> str:
    return json.loads((root / INDEX_FILE).read_text())["weight_map"][name]


def _edit_shard(root: Path, name: str, fn):
    """Rewrite the shard holding `name` with fn(tensors dict) applied; keep the index in sync."""
    shard = _shard_of(root, name)
    t = dict(load_file(root / shard))
    fn(t)
    save_file(t, root / shard, metadata={"format": "pt"})
    index = json.loads((root / INDEX_FILE).read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != shard or k in t}
    index["weight_map"].update({k: shard for k in t})
    (root / INDEX_FILE).write_text(json.dumps(index))
    return shard


def _expect_error(root: Path, *fragments: str):
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(root, progress=False)
    msg = str(e.value)
    for f in fragments:
        assert f in msg, f"{f!r} not in:\n{msg}"
    return e.value


def test_bad_missing_tensor(ckpt, tmp_path):
    root = _copy(ckpt, tmp_path)
    name = "layers.1.attn.wq_b.scale"
    _edit_shard(root, name, lambda t: t.pop(name))
    _expect_error(root, "missing tensor layers.1.attn.wq_b.scale", "F8_E8M0", "[4, 1]")


def test_bad_unexpected_tensor(ckpt, tmp_path):
    root = _copy(ckpt, tmp_path)
    shard = _edit_shard(root, "norm.weight", lambda t: t.__setitem__("layers.0.attn.bogus", torch.zeros(3)))
    _expect_error(root, shard, "unexpected tensor layers.0.attn.bogus")


def test_bad_dtype(ckpt, tmp_path):
    root = _copy(ckpt, tmp_path)
    name = "layers.2.attn.wkv.weight"
    shard = _edit_shard(root, name, lambda t: t.__setitem__(name, t[name].to(torch.bfloat16)))
    _expect_error(root, shard, name, "expected dtype F8_E4M3, found BF16")


def test_bad_shape(ckpt, tmp_path):
    root = _copy(ckpt, tmp_path)
    name = "layers.0.ffn.gate.tid2eid"
    shard = _edit_shard(root, name, lambda t: t.__setitem__(name, t[name][:, :3].contiguous()))
    _expect_error(root, shard, name, "expected shape [512, 4], found [512, 3]")


def test_bad_index_points_to_missing_shard(ckpt, tmp_path):
    root = _copy(ckpt, tmp_path)
    shard = _shard_of(root, "head.weight")
    (root / shard).unlink()
    err = _expect_error(root, INDEX_FILE, f"missing shard {shard}")
    assert not any("missing tensor" in p for p in err.problems)  # not re-reported per tensor


def test_bad_truncated_shard(ckpt, tmp_path, monkeypatch):
    root = _copy(ckpt, tmp_path)
    shard = _shard_of(root, "embed.weight")
    data = (root / shard).read_bytes()
    (root / shard).write_bytes(data[: len(data) - 1000])
    import safetensors
    monkeypatch.setattr(safetensors, "safe_open", None)  # must fail before any tensor data is read
    _expect_error(root, shard, "beyond file end", "truncated")


def test_bad_corrupt_header(ckpt, tmp_path):
    root = _copy(ckpt, tmp_path)
    shard = _shard_of(root, "norm.weight")
    data = bytearray((root / shard).read_bytes())
    data[8:20] = b"#not json!!#"
    (root / shard).write_bytes(bytes(data))
    _expect_error(root, shard, "corrupt header")
    data[0:8] = (1 << 40).to_bytes(8, "little")
    (root / shard).write_bytes(bytes(data))
    _expect_error(root, shard, "header length", "beyond file size")


def test_bad_reports_all_problems(ckpt, tmp_path):
    root = _copy(ckpt, tmp_path)
    a, b = "layers.1.attn.wq_b.scale", "layers.4.attn.attn_sink"
    _edit_shard(root, a, lambda t: t.pop(a))
    _edit_shard(root, b, lambda t: t.__setitem__(b, t[b].double()))
    err = _expect_error(root, f"missing tensor {a}", f"tensor {b}: expected dtype F32, found F64")
    assert len(err.problems) == 2


# ---- transformers naming -----------------------------------------------------------------

@pytest.fixture(scope="module")
def hf_model(weights):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.DeepseekV4Config(**ARGS.to_hf_config(quantized=False))
    model = transformers.DeepseekV4ForCausalLM(cfg).eval()
    model.load_state_dict(official_to_hf(ARGS, weights), strict=True)
    return model


def _dequantised(weights: dict, args=ARGS) -> dict:
    return {n: dequant_weight(weights, n, torch.float32) for n in expected_tensors(dense_args(args), include_mtp=False)}


def test_official_to_hf_roundtrip(hf_model, weights):
    ref = _dequantised(weights)
    back = hf_to_official(ARGS, hf_model.state_dict())
    assert list(back) == list(ref)
    for n in ref:
        assert torch.equal(back[n].to(ref[n].dtype), ref[n]), n


def test_hf_save_pretrained_loads(hf_model, weights, tmp_path):
    hf_model.save_pretrained(tmp_path)
    args, loaded = load_checkpoint(tmp_path, progress=False)
    assert args == dense_args(ARGS)
    ref = _dequantised(weights)
    assert list(loaded) == list(ref)
    for n in ref:
        assert loaded[n].dtype == ref[n].dtype and torch.equal(loaded[n], ref[n]), n
    _, bf = load_checkpoint(tmp_path, progress=False, dtype_policy="schema")
    assert bf["layers.0.attn.wq_a.weight"].dtype == torch.bfloat16 and bf["hc_head_fn"].dtype == torch.float32


def test_hf_module_naming_stacked_experts_world2(hf_model, weights, tmp_path, monkeypatch):
    # state_dict naming written directly (stacked experts), as some converters produce
    save_file({k: v.contiguous() for k, v in hf_model.state_dict().items()}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(ARGS.to_hf_config(quantized=False)))
    ref = _dequantised(weights)
    import safetensors
    real_open, read = safetensors.safe_open, {}

    class Recording:  # safe_open counting the elements read from each stacked tensor
        def __init__(self, *a, **kw):
            self.f = real_open(*a, **kw)

        def __enter__(self):
            self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def get_slice(self, key):
            sl = self.f.get_slice(key)

            class Cut:
                def __getitem__(_, idx):
                    t = sl[idx]
                    if ".mlp.experts." in key:
                        read[key] = read.get(key, 0) + t.numel()
                    return t
            return Cut()
    stacked = {k: v.numel() for k, v in hf_model.state_dict().items() if ".mlp.experts." in k}
    monkeypatch.setattr(safetensors, "safe_open", Recording)
    for experts in ("ep", "tp"):  # whole experts by id, or every expert's slice of its intermediate dim
        for rank in range(2):
            read.clear()
            args, part = load_checkpoint(tmp_path, rank=rank, world=2, progress=False, experts=experts)
            assert read == {k: n // 2 for k, n in stacked.items()}  # a rank reads its share of each, once
            local = local_tensors(args, rank, 2, include_mtp=False, experts=experts)
            assert list(part) == list(local)
            for n, (_, idx) in local.items():
                assert torch.equal(part[n], ref[n][idx]), n
            w2 = "layers.3.ffn.experts.0.w2.weight"
            assert (w2 in part) == (experts == "tp" or rank == 0)
            if experts == "tp":
                assert part[w2].shape[1] * 2 == ref[w2].shape[1] and part[w2].is_contiguous()
    # a bad stacked tensor is reported with its file and name
    sd = load_file(tmp_path / "model.safetensors")
    sd["model.layers.3.mlp.experts.down_proj"] = sd["model.layers.3.mlp.experts.down_proj"][:, :, :64].contiguous()
    save_file(sd, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model.safetensors: tensor model.layers.3.mlp.experts.down_proj: expected shape \[16, 128, 128\]"):
        load_checkpoint(tmp_path, progress=False)


def test_synthetic_model_is_confident(hf_model):
    ids = torch.randint(0, ARGS.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = hf_model(ids).logits[0].float()
    assert torch.isfinite(logits).all()
    assert 1.5 < logits.std(dim=-1).mean().item() < 10
    top2 = logits.topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).mean().item() > 0.3
