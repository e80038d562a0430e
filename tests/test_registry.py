"""Option files <-> registered implementations, one to one; resolution rules (no silent fallback)."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import yaml

from ds4 import registry
from ds4.registry import COMPONENTS, ImplUnavailable

CONF = Path(__file__).resolve().parents[1] / "ds4" / "conf"


def option_files(group: str) -> dict[str, dict]:
    return {p.stem: yaml.safe_load(p.read_text()) or {} for p in sorted((CONF / group).glob("*.yaml"))}


@pytest.mark.parametrize("component", COMPONENTS)
def test_option_files_match_registry(component):
    files = option_files(component)
    registered = set(registry.names(component))
    aliases = registry.aliases(component)
    assert "auto" in files, f"{component}/auto.yaml missing"
    for stem, body in files.items():
        assert body.get("name") == stem, f"{component}/{stem}.yaml must say name: {stem}"
    unknown = set(files) - registered - set(aliases) - {"auto"}
    assert not unknown, f"option files without a registered implementation: {component}/{sorted(unknown)}"
    missing = (registered | set(aliases)) - set(files)
    assert not missing, f"registered {component} implementations without an option file: {sorted(missing)}"


@pytest.mark.parametrize("component", COMPONENTS)
def test_every_option_resolves_or_says_why(component):
    cpu = torch.device("cpu")
    for name in option_files(component):
        try:
            entry, note = registry.resolve(component, name, cpu)
        except ImplUnavailable as e:      # an explicit choice that cannot run here names itself and why
            assert f"{component}={name}" in str(e) and "cannot run here" in str(e)
            continue
        assert entry.name in registry.names(component)
        assert note
        if name == "auto":
            assert note.startswith("auto -> ")


def test_reference_options_run_on_cpu():
    ops = registry.build_ops(registry.Impls(), "cpu")
    assert ops.chosen == {"attn": "torch", "indexer": "torch", "hc": "torch", "moe": "dequant", "linear": "dequant"}


def test_unknown_choice_names_component_and_options():
    with pytest.raises(ImplUnavailable, match=r"moe=nope: unknown implementation.*dequant"):
        registry.resolve("moe", "nope", torch.device("cpu"))


def test_alias_resolves_generically(monkeypatch):
    # An alias is a registry entry plus a one-line option file (e.g. attn/fused.yaml: `name: fused`).
    monkeypatch.setitem(registry._ALIASES["attn"], "reference", "torch")
    entry, note = registry.resolve("attn", "reference", torch.device("cpu"))
    assert entry.name == "torch" and "alias" in note
    for c in COMPONENTS:
        for alias, target in registry.aliases(c).items():
            assert registry.entry(c, alias).name == target


def test_auto_logs_skipped_options():
    # auto never fails silently: on CPU it lands on something runnable and the note says what it skipped.
    for c in COMPONENTS:
        entry, note = registry.resolve(c, "auto", torch.device("cpu"))
        assert entry.check(torch.device("cpu")) is None
        skipped = [e for e in registry.names(c) if registry.entry(c, e).check(torch.device("cpu")) is not None]
        for s in skipped:
            if registry.entry(c, s).priority > entry.priority:
                assert s in note


@pytest.mark.parametrize("group", ["numerics", "reduce", "runtime", "task", "tracking", "weights"])
def test_other_groups_match_what_the_app_runs(group):
    from ds4.app import CHOICES
    files = option_files(group)
    assert set(files) == set(CHOICES[group]), f"{group}: option files {sorted(files)} vs app {CHOICES[group]}"
    key = "kind" if group == "weights" else "name"
    for stem, body in files.items():
        assert body.get(key) == stem


def _runnable(monkeypatch, component: str, name: str):
    """The registered entry as if its extension could run here (its check passes): the setup rules alone."""
    e = registry.entry(component, name)
    runnable = dataclasses.replace(e, check=lambda _device: None)
    monkeypatch.setitem(registry._ENTRIES[component], e.name, runnable)
    return runnable


def test_explicit_choice_refuses_an_activation_dtype_its_kernels_do_not_take(monkeypatch):
    # dtype=float32 on CUDA: the fused attention's kernels take bf16 only; it would have run the torch twins
    _runnable(monkeypatch, "attn", "fused_cuda")
    cuda = torch.device("cuda")
    with pytest.raises(ImplUnavailable, match=r"attn=fused cannot run here: its kernels take bfloat16 activations "
                                              r"\(dtype=float32\)"):
        registry.resolve("attn", "fused", cuda, registry.Setup(dtype=torch.float32))
    entry, note = registry.resolve("attn", "auto", cuda, registry.Setup(dtype=torch.float32))
    assert entry.name == "torch" and "fused_cuda: its kernels take bfloat16" in note
    assert registry.resolve("attn", "fused", cuda, registry.Setup(dtype=torch.bfloat16))[0].name == "fused_cuda"
    _runnable(monkeypatch, "hc", "fused_cuda")  # the mHC kernels take fp32 too, not fp16
    assert registry.resolve("hc", "fused_cuda", cuda, registry.Setup(dtype=torch.float32))[0].name == "fused_cuda"
    with pytest.raises(ImplUnavailable, match="float16"):
        registry.resolve("hc", "fused_cuda", cuda, registry.Setup(dtype=torch.float16))


def test_notes_say_what_a_choice_leaves_to_other_code(monkeypatch):
    cuda = torch.device("cuda")
    for c, n in (("indexer", "fused_cuda"), ("attn", "fused_cuda"), ("linear", "gemv_cuda"), ("moe", "bf16_cache")):
        _runnable(monkeypatch, c, n)
    note = registry.resolve("indexer", "fused_cuda", cuda, registry.Setup(torch.bfloat16, max_batch=32))[1]
    assert "decode batch 32 > 16: the torch reference's scores" in note
    assert registry.resolve("indexer", "fused_cuda", cuda, registry.Setup(torch.bfloat16, max_batch=4))[1] == \
        "fused_cuda"
    assert "> 8: the compressors' projection" in registry.resolve("attn", "fused_cuda", cuda,
                                                                    registry.Setup(max_batch=9))[1]
    # BF16 dense weights take the GEMV's BF16 form with bf16 activations; float32 ones keep the reference's matmul
    assert registry.resolve("linear", "gemv_cuda", cuda, registry.Setup(torch.bfloat16, weight_dtype="bf16"))[1] == \
        "gemv_cuda"
    note = registry.resolve("linear", "gemv_cuda", cuda, registry.Setup(torch.float32, weight_dtype="bf16"))[1]
    assert "BF16 dense weights with float32 activations: torch matmuls" in note
    assert "the torch reference's experts" in registry.resolve("moe", "bf16_cache", cuda, registry.Setup())[1]


def test_decode_host_syncs_are_said(monkeypatch):
    # the torch reference's MoE groups its experts by counts read on the host past 64 (row, expert) pairs: a decode
    # step of batch 17 at tiny's 4 experts a token syncs every layer (runtime=cuda_graph refuses it, app.execute)
    cpu = torch.device("cpu")
    assert registry.entry("moe", "dequant").decode_sync(registry.Setup(max_batch=16, topk=4)) is None
    note = registry.resolve("moe", "dequant", cpu, registry.Setup(max_batch=17, topk=4))[1]
    assert "a decode step syncs with the host (batch 17 x 4 experts > 64 pairs" in note
    _runnable(monkeypatch, "moe", "fp4_topk")
    _runnable(monkeypatch, "moe", "bf16_cache")
    cuda = torch.device("cuda")
    assert registry.entry("moe", "fp4_topk").decode_sync(registry.Setup(max_batch=128)) is None
    assert "batch 129 > 128" in registry.resolve("moe", "fp4_topk", cuda, registry.Setup(max_batch=129))[1]
    monkeypatch.setenv("DS4_MOE_CHUNKED_TOKENS", "4")  # a prompt knob that moves the decode's limit to 8 rows
    assert "batch 9 > 8" in registry.entry("moe", "fp4_topk").decode_sync(registry.Setup(max_batch=9))
    assert "cache bookkeeping" in registry.resolve("moe", "bf16_cache", cuda, registry.Setup())[1]


def test_ds4_ext_flag_follows_the_entry_check(monkeypatch):
    """Entry.ds4_ext (the run's greedy argmax takes the ds4 extension's kernel where a choice has it) is set exactly
    where the entry's own check loads the ds4 (GEMV / MoE) extension: every check is run with that extension
    reporting a marker reason and everything else available."""
    from ds4 import kernels, kernels_attn
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(kernels, "unavailable_reason", lambda: "ds4 extension marker")
    monkeypatch.setattr(kernels_attn, "unavailable_reason", lambda: None)
    cuda = torch.device("cuda")
    flagged, checked = set(), set()
    for c in COMPONENTS:
        for n in registry.names(c):
            e = registry.entry(c, n)
            if e.ds4_ext:
                flagged.add((c, n))
            if e.check(cuda) == "ds4 extension marker":
                checked.add((c, n))
    assert flagged == checked and ("moe", "fp4_topk") in flagged and ("hc", "fused_cuda") not in flagged


def test_ops_ds4_ext_is_the_runs_own_choice(monkeypatch):
    """Ops.ds4_ext comes from the choices built, not from the process's state (a sweep's earlier job)."""
    assert registry.torch_reference_ops().ds4_ext is False
    _runnable(monkeypatch, "hc", "fused_cuda")  # a CUDA choice on the ds4_attn extension alone
    monkeypatch.setattr(registry.Entry, "build", lambda self: self.name)  # no extension module is imported
    cuda = torch.device("cuda")
    assert registry.build_ops(registry.Impls(hc="fused_cuda"), cuda).ds4_ext is False
    _runnable(monkeypatch, "linear", "gemv_cuda")
    assert registry.build_ops(registry.Impls(hc="fused_cuda", linear="gemv_cuda"), cuda).ds4_ext is True


def test_notes_say_the_decode_fallbacks_past_the_kernels_rows(monkeypatch):
    """moe=fp4_topk past its 8-row kernels (router logits by a torch fp32 GEMM, experts in 8-row launches), the fused
    indexer's top-k where the wide radix select does not fit (torch.topk), the fused attention's row skip past one row
    (torch ops): each said in the note of the setup that takes it."""
    from ds4 import kernels_attn
    from ds4.app import index_len
    from ds4.model.args import v4_flash
    cuda = torch.device("cuda")
    for c, n in (("moe", "fp4_topk"), ("indexer", "fused_cuda"), ("attn", "fused_cuda")):
        _runnable(monkeypatch, c, n)
    assert registry.resolve("moe", "fp4_topk", cuda, registry.Setup(torch.bfloat16, max_batch=8))[1] == "fp4_topk"
    note = registry.resolve("moe", "fp4_topk", cuda, registry.Setup(torch.bfloat16, max_batch=16))[1]
    assert "decode batch 16 > 8: the router's logits by a torch fp32 GEMM" in note
    a = v4_flash()
    assert index_len(a, 2048) == 0 and index_len(a, 2052) == 513 and index_len(a, 1 << 20) == 1 << 18
    fits = {}
    monkeypatch.setattr(kernels_attn, "topk_ok", lambda rows, T: fits[rows])
    fits.update({4: True, 5: False})
    s = dict(dtype=torch.bfloat16, index_len=index_len(a, 1 << 20))
    assert registry.resolve("indexer", "fused_cuda", cuda, registry.Setup(max_batch=4, **s))[1] == "fused_cuda"
    note = registry.resolve("indexer", "fused_cuda", cuda, registry.Setup(max_batch=5, **s))[1]
    assert "over 262144 indexer entries a row: the top-k by torch.topk" in note
    assert registry.resolve("attn", "fused_cuda", cuda, registry.Setup(max_batch=1, **s))[1] == "fused_cuda"
    assert "zeroed by torch ops" in registry.resolve("attn", "fused_cuda", cuda, registry.Setup(max_batch=2, **s))[1]
