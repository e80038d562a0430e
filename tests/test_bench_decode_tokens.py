"""scripts/bench_decode.py's variant tokens that are plain functions (no GPU needed)."""
from __future__ import annotations

import pytest
import torch
from script_loader import load_script


def _bench_decode():
    return load_script("bench_decode")


@pytest.mark.parametrize("tokens,expected", [
    ({"kernels", "graph"}, "0"), ({"kernels", "pf"}, "1"), ({"pfqd"}, "d,q"), ({"pfo", "pfb"}, "b,o"),
    ({"pfx"}, "0"),  # not a site: not a prefetch token
])
def test_bench_tokens_choose_the_sites(tokens, expected):
    assert _bench_decode()._prefetch_sites(tokens) == expected


@pytest.mark.parametrize("tokens,expected", [
    ({"kernels", "graph"}, (None, None, None, None)), ({"pre0"}, ("0", None, None, None)),
    ({"pre1", "dpre0"}, ("1", "0", None, None)), ({"spg", "spd"}, (None, None, "dg", None)),
    ({"spgdu"}, (None, None, "gdu", None)), ({"bsd", "spu"}, (None, None, "u", "d")),
    ({"bsdgu"}, (None, None, None, "dgu")),
    ({"sprio", "pre", "dprex", "bsx", "bs"}, (None, None, None, None)),  # other tokens, no number / letters: not these
])
def test_launch_order_tokens_set_their_variables(tokens, expected):
    env = _bench_decode().launch_order_env(tokens)
    assert (env["DS4_PREFETCH"], env["DS4_PREFETCH_DOWN"], env["DS4_SPACER"], env["DS4_BULK_STAGE"]) == expected


def test_bulk_stage_tokens_are_known():
    bd = _bench_decode()
    assert bd.unknown_tokens({"bsd", "bsgdu", "bsx", "bs"}) == ["bs", "bsx"]


@pytest.mark.parametrize("tokens,expected", [
    ({"kernels", "graph", "d4"}, (None, None, None, None)), ({"rd8"}, ("8", None, None, None)),
    ({"lrd4"}, (None, "4", None, None)),  # lrd4 is not rd4
    ({"dn8", "rd2"}, ("2", None, "8", None)), ({"shd4", "shw50"}, (None, None, None, "4")),
    ({"dn", "lrdx", "d2", "shd"}, (None, None, None, None)),  # no number: not these knobs
])
def test_depth_tokens_set_their_variables(tokens, expected):
    env = _bench_decode().depth_env(tokens)
    got = (env["DS4_ROUTED_DEPTH"], env["DS4_LONG_ROW_DEPTH"], env["DS4_DOWN_DEPTH"], env["DS4_SHARED_DEPTH"])
    assert got == expected


def test_qat_token_chooses_the_numerics():
    bd = _bench_decode()
    assert bd.numerics_of({"kernels", "fused", "graph", "qat"}) == "qat"
    assert bd.numerics_of({"kernels", "fused", "graph"}) == "plain"
    assert bd.numerics_of({"qatx"}) == "plain"


def test_repeated_variants_get_rows_of_their_own():
    names = _bench_decode().repeat_names(["k+graph", "k+graph+spg", "k+graph", "k+graph+rd4", "k+graph"])
    assert names == ["k+graph", "k+graph+spg", "k+graph#2", "k+graph+rd4", "k+graph#3"]


def test_warm_pass_runs_the_first_variant_unrecorded():
    """--warm-pass (the default): after each model load an untimed pass of the first variant (row name None), then
    the listed passes with their row names; --no-warm-pass: the listed ones alone."""
    bd = _bench_decode()
    assert bd.planned_passes(["a", "b", "a"], True) == [("a", None), ("a", "a"), ("b", "b"), ("a", "a#2")]
    assert bd.planned_passes(["a", "b"], False) == [("a", "a"), ("b", "b")]


def test_xshared_diagnostic_launches_no_shared_expert():
    """bench_decode's xshared (timing only): the MoE implementation's shared_up returns zeros in line."""
    from ds4.ops.moe_cuda import Fp4TopkMoE
    moe = Fp4TopkMoE()
    _bench_decode().skip_shared_expert(moe)
    x = torch.randn(1, 8)
    up = moe.shared_up(x, None)
    assert up.branch.side is None and torch.equal(up.out, torch.zeros_like(x))
    assert moe.shared_up(torch.randn(32, 8), None) is None  # a prompt: the shared expert runs as usual
    # (session 13's run 4 returned zeros for the prompt too, and routed() rejected them)
    assert Fp4TopkMoE().shared_up(x, None) is None  # the untouched implementation: a CPU input stays in line


def test_removal_diagnostics_replace_only_decode_sized_calls():
    """xrouter / xrouted / xattn: decode-sized calls return fixed device-side results without the
    implementation's kernels; prompt-sized calls go to the implementation as before."""
    from types import SimpleNamespace

    from ds4.ops.moe_cuda import PREFILL_TOKENS, SharedUp
    from ds4.ops.side_stream import Branch
    bd = _bench_decode()
    calls = []

    class FakeMoE:
        def route(self, x, token_ids, mw, logits=None):
            calls.append("route")
            return "routed by the implementation"

        def routed(self, x, weights, ids, mw, act_quant=False, shared=None, fold=None, partial=False):
            calls.append("routed")
            return "experts by the implementation"

    class FakeAttn:
        def decode(self, q, *args, **kw):
            calls.append("decode")

    ops = SimpleNamespace(moe=FakeMoE(), attn=FakeAttn())
    bd._apply_removals(ops, {"xrouter", "xrouted", "xattn", "kernels"})
    mw = SimpleNamespace(topk=6, expert_offset=32)
    x = torch.randn(1, 16)
    w, ids = ops.moe.route(x, None, mw)
    assert torch.equal(ids, torch.arange(32, 38).unsqueeze(0)) and torch.allclose(w, torch.full((1, 6), 1 / 6))
    assert torch.equal(ops.moe.routed(x, w, ids, mw), torch.zeros(1, 16))
    up = SharedUp(torch.ones(1, 16, dtype=torch.bfloat16), Branch(None, x.device))
    assert torch.equal(ops.moe.routed(x, w, ids, mw, shared=up), up.out)
    part = ops.moe.routed(x, w, ids, mw, shared=up, partial=True)  # a sliced shared expert: fp32 partial sum
    assert part.dtype == torch.float32 and torch.equal(part, up.out.float())
    q = torch.randn(1, 4, 8)
    assert torch.equal(ops.attn.decode(q, None, None), torch.zeros_like(q))
    assert calls == []
    big = torch.randn(PREFILL_TOKENS + 1, 16)
    assert ops.moe.route(big, None, mw) == "routed by the implementation"
    assert ops.moe.routed(big, None, None, mw) == "experts by the implementation"
    assert calls == ["route", "routed"]


@pytest.mark.parametrize("tokens,csa,hca", [({"deferh8"}, 0, 8), ({"defer4"}, 4, 4), ({"defer4", "deferh8"}, 4, 8),
                                            ({"kernels"}, 0, 0)])
def test_defer_tokens_pick_their_layers(tokens, csa, hca):
    """deferN defers every compressor's projection; deferhN the HCA layers' alone (the CSA layers keep deferN's or
    their per-token step); SWA layers have no compressor."""
    from ds4.model.args import tiny
    from ds4.model.attention import Attention
    from ds4.model.transformer import Transformer
    from ds4.registry import torch_reference_ops
    model = Transformer(tiny(), torch_reference_ops(), device="meta")
    _bench_decode().attention_options(model, tokens)
    got = {(a.compressor is not None, a.indexer is not None): a.defer_compress
           for a in model.modules() if isinstance(a, Attention)}
    assert got == {(False, False): 0 if not {"defer4"} & tokens else 4, (True, True): csa, (True, False): hca}


def test_unknown_and_misplaced_variants_are_refused(capsys):
    bd = _bench_decode()
    assert bd.unknown_tokens({"kernels", "fused", "graph", "cap8192", "rd4", "lrd2", "spgd", "pfqo", "deferh8"}) == []
    assert bd.unknown_tokens({"kernels", "kernal", "rdx", "spx", "co60"}) == ["co60", "kernal", "rdx", "spx"]
    assert bd.check_variants(["ref", "kernels+graph", "kernels+graph+noride"], 1) == []
    errs = bd.check_variants(["kernels", "ref", "kernels+typo"], 1)
    assert "variant ref: without kernels after a variant with them" in errs[0] and "typo" in errs[1]
    bd.check_variants(["kernels+bf16+ll"], 1)
    assert "bf16, ll change nothing at one rank" in capsys.readouterr().out


@pytest.mark.parametrize("token", ["rd0", "lrd0", "dn0", "shd0", "cap0", "defer0", "deferh0", "rw0", "rw100", "shw0",
                                   "shw150"])
def test_numbered_tokens_that_change_nothing_are_refused(token):
    """A numbered token at a number that leaves the library's default (session 66's review: `+rd0` timed the
    default under its own name)."""
    bd = _bench_decode()
    errs = bd.check_variants([f"kernels+graph+{token}"], 1)
    assert len(errs) == 1 and f"{token} change(s) nothing" in errs[0], errs
    assert bd.check_variants(["kernels+graph+rd4+lrd2+dn8+shd4+cap8192+defer4+deferh8+rw50+shw25+pre0+dpre0"], 1) == []


def test_act_quant_tokens_name_one_mode():
    """aqtorch / aqstaged / aqlaunch each set DS4_ACT_QUANT (torch / staged / kernel): one per variant, else refused
    before anything loads (the later token would win in silence)."""
    bd = _bench_decode()
    assert bd.ACT_QUANT_TOKENS == {"aqtorch": "torch", "aqstaged": "staged", "aqlaunch": "kernel"}
    assert bd.check_variants(["kernels+graph+qat+aqlaunch", "kernels+graph+qat+aqstaged"], 1) == []
    errs = bd.check_variants(["kernels+graph+qat+aqstaged+aqlaunch"], 1)
    assert len(errs) == 1 and "aqlaunch, aqstaged each set DS4_ACT_QUANT" in errs[0], errs


def test_profile_step_applies_only_bench_decode_tokens(monkeypatch):
    """scripts/profile_step.py's tokens are bench_decode.py's (but shtp, which bench_decode.py takes as a load suffix,
    VARIANT@shtp), and its dp4a selects moe=fp4_dp4a as there."""
    import sys
    from pathlib import Path
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "scripts"))  # its `from bench_decode import`
    prof = load_script("profile_step")
    bench = sys.modules["bench_decode"]
    assert prof.APPLIED_TOKENS - {"shtp"} <= bench.PLAIN_TOKENS
    assert bench.impls_of({"kernels", "fused", "dp4a"}).moe == "fp4_dp4a"
