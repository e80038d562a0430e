"""CPU-side checks of the CUDA options: clear failure of an explicit CUDA choice without CUDA,
`auto` falling back (and saying so), and an nvcc compile of csrc/*.cu for sm_80 (skipped
without nvcc) so an sm_80 break is caught without a GPU."""
from __future__ import annotations

import dataclasses
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from ds4 import kernels, registry
from ds4.registry import ImplUnavailable

CSRC = Path(__file__).resolve().parents[1] / "csrc"
NO_CUDA = not torch.cuda.is_available()


def test_cuda_options_registered():
    assert "gemv_cuda" in registry.names("linear")
    assert {"fp4_topk", "bf16_cache"} <= set(registry.names("moe"))
    assert registry.entry("moe", "fp4_topk").priority > registry.entry("moe", "bf16_cache").priority
    assert registry.entry("linear", "gemv_cuda").priority > registry.entry("linear", "dequant").priority


@pytest.mark.parametrize("component,name", [("linear", "gemv_cuda"), ("moe", "fp4_topk"), ("moe", "bf16_cache")])
def test_explicit_cuda_choice_on_cpu_fails_clearly(component, name):
    with pytest.raises(ImplUnavailable, match=rf"{component}={name} cannot run here: needs a CUDA device"):
        registry.resolve(component, name, torch.device("cpu"))


@pytest.mark.skipif(not NO_CUDA, reason="this machine has CUDA")
@pytest.mark.parametrize("component,name", [("linear", "gemv_cuda"), ("moe", "fp4_topk")])
def test_explicit_cuda_choice_without_cuda_fails_clearly(component, name):
    with pytest.raises(ImplUnavailable, match="CUDA is not available"):
        registry.resolve(component, name, torch.device("cuda"))


def test_explicit_choice_fails_in_build_ops():
    with pytest.raises(ImplUnavailable, match="moe=fp4_topk cannot run here"):
        registry.build_ops(registry.Impls(moe="fp4_topk"), "cpu")


@pytest.mark.parametrize("component,fallback,skipped", [("linear", "dequant", "gemv_cuda"), ("moe", "dequant", "fp4_topk")])
def test_auto_falls_back_and_says_so(component, fallback, skipped):
    e, note = registry.resolve(component, "auto", torch.device("cpu"))
    assert e.name == fallback
    assert note.startswith(f"auto -> {fallback}")
    assert f"{skipped}: needs a CUDA device" in note


@pytest.mark.skipif(not NO_CUDA, reason="this machine has CUDA")
def test_unavailable_reason_without_cuda():
    why = kernels.unavailable_reason()
    assert why is not None and ("CPU-only" in why or "CUDA is not available" in why)


@pytest.mark.parametrize("call", ["gemv", "moe_gate_up", "moe_down"])
def test_unknown_kernel_choice_fails_before_any_launch(call):
    # the kernel name is checked before the extension is loaded (no CUDA needed to see the message)
    x = torch.zeros(1, 64, dtype=torch.bfloat16)
    w = torch.zeros(16, 64, dtype=torch.uint8)
    fn = {"gemv": lambda: kernels.gemv(x, w, None, "fp8", kernel="tensor"),
          "moe_gate_up": lambda: kernels.moe_gate_up(x, None, None, w, None, w, None, "fp8", kernel="tensor"),
          "moe_down": lambda: kernels.moe_down(x, None, 1, w, None, "fp8", kernel="tensor")}[call]
    with pytest.raises(ValueError, match="kernel must be one of"):
        fn()


@pytest.mark.parametrize("call,fmt,why", [("gemv", "fp4p", "MoE kernels only"), ("gemv_rmsnorm", "fp4p", "MoE kernels only"),
                                          ("gemv", "fp4t", "MoE kernels only"),
                                          ("moe_gate_up", "fp6", "must be one of"), ("moe_down", "int4", "must be one of")])
def test_unknown_or_misplaced_format_fails_before_any_launch(call, fmt, why):
    # dense GEMVs take the stored formats; fp4p (the routed experts' permuted words) only the MoE kernels
    x = torch.zeros(1, 64, dtype=torch.bfloat16)
    w = torch.zeros(16, 32, dtype=torch.int8)
    fn = {"gemv": lambda: kernels.gemv(x, w, None, fmt),
          "gemv_rmsnorm": lambda: kernels.gemv_rmsnorm(x, w, None, fmt, torch.ones(64), 1e-6),
          "moe_gate_up": lambda: kernels.moe_gate_up(x, None, None, w, None, w, None, fmt),
          "moe_down": lambda: kernels.moe_down(x, None, 1, w, None, fmt)}[call]
    with pytest.raises(ValueError, match=why):
        fn()


def test_cuda_impls_construct_without_extension():
    # building the objects never compiles or loads anything
    from ds4.ops.linear_cuda import GemvCudaLinear
    from ds4.ops.moe_cuda import Bf16CacheMoE, Fp4TopkMoE
    assert GemvCudaLinear().name == "gemv_cuda"
    assert Fp4TopkMoE().name == "fp4_topk"
    assert Bf16CacheMoE().name == "bf16_cache"


def test_splitk_refusals_name_their_reason():
    """DS4_MOE_SPLITK=1 on a one-token call the split-K pair cannot take: the reason the separate launches run, said
    (ds4.ops.moe_cuda.splitk_refusal; each case returns before the shape check, which needs the extension)."""
    from types import SimpleNamespace

    from ds4.ops.moe_cuda import splitk_refusal
    q = lambda fmt: SimpleNamespace(fmt=fmt, weight=torch.zeros(2, 32, 64, dtype=torch.uint8))  # noqa: E731
    mw = SimpleNamespace(w1=q("fp4t"), w2=q("fp4t"))
    assert "qat" in splitk_refusal(True, None, mw, "auto", 6, 4096)
    assert "DS4_ROUTE_IN_MOE" in splitk_refusal(False, object(), mw, "auto", 6, 4096)
    assert "fp4p / fp4p" in splitk_refusal(False, None, SimpleNamespace(w1=q("fp4p"), w2=q("fp4p")), "auto", 6, 4096)
    assert "dp4a" in splitk_refusal(False, None, mw, "dp4a", 6, 4096)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
@pytest.mark.parametrize("folder,archs,expected", [
    ("", ("80",), {"gemv.cu", "moe.cu", "moe_mma.cu", "moe_dp4a.cu", "moe_splitk.cu", "moe_ffn.cu", "router.cu",
                   "argmax.cu", "prefetch.cu", "allreduce.cu", "capture.cu", "dequant.cu"}),  # GEMV / MoE ext.
    ("attn", ("80", "90"), {"hc.cu", "sparse_attn.cu", "indexer.cu", "decode_glue.cu", "topk.cu"}),  # ds4_attn
])
def test_csrc_compiles(folder, archs, expected, tmp_path):
    """Every kernel source compiles for sm_80 (and sm_90) with plain nvcc (no torch headers needed)."""
    sources = sorted((CSRC / folder).glob("*.cu"))
    assert {s.name for s in sources} >= expected

    def build(src: Path):
        gencode = [f for a in archs for f in ("-gencode", f"arch=compute_{a},code=sm_{a}")]
        cmd = ["nvcc", "-std=c++17", "-O3", *gencode, "-c", str(src), "-o", str(tmp_path / (src.stem + ".o"))]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        return src.name, r.returncode, r.stderr[-3000:]

    with ThreadPoolExecutor(max_workers=3) as ex:
        results = list(ex.map(build, sources))
    failed = [(n, err) for n, rc, err in results if rc != 0]
    assert not failed, failed


@pytest.mark.parametrize("fmt", ["fp4t", "fp8t"])
@pytest.mark.parametrize("shape", [(4, 16, 64), (4, 8, 128), (4, 24, 256)])
def test_tiled_bad_shapes_refused_before_any_launch(shape, fmt):
    """fp4t / fp8t matrices are whole 16-row tiles and rounds of 128 bytes; any other shape is refused in Python,
    before the op (these tensors are on the CPU: reaching the op would fail differently)."""
    n, k = 2, shape[-1] * (2 if fmt == "fp4t" else 1)
    x = torch.zeros(n, k, dtype=torch.bfloat16)
    w = torch.zeros(*shape, dtype=torch.int8)
    ids = torch.zeros(n, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="whole 16-row tiles"):
        kernels.moe_gate_up(x, ids, None, w, None, w, None, fmt)
    with pytest.raises(ValueError, match="whole 16-row tiles"):
        kernels.moe_down(torch.zeros(2 * n, k, dtype=torch.bfloat16), ids, 2, w, None, fmt)


def test_moe_ffn_gating_without_cuda(monkeypatch):
    """The one-launch FFN is opt-in (DS4_MOE_FFN=1), never taken off the GPU or by moe=bf16_cache, and a format it
    does not take is refused in Python, before the op (these tensors are on the CPU: the op would fail otherwise)."""
    from ds4.ops.base import MoEWeights, QWeight
    from ds4.ops.moe_cuda import Bf16CacheMoE, Fp4TopkMoE
    w = QWeight("fp4t", torch.zeros(2, 256, 128, dtype=torch.int8), torch.zeros(2, 256, 8, dtype=torch.uint8))
    s = QWeight("fp8", torch.zeros(256, 256, dtype=torch.uint8), torch.zeros(2, 2, dtype=torch.uint8))
    mw = MoEWeights(gate=torch.zeros(2, 256), bias=None, tid2eid=None, w1=w, w2=w, w3=w, shared_w1=s, shared_w2=s,
                    shared_w3=s, n_experts=2, expert_offset=0, topk=1, route_scale=1.0, swiglu_limit=10.0)
    x = torch.zeros(1, 256, dtype=torch.bfloat16)
    monkeypatch.delenv("DS4_MOE_FFN", raising=False)
    assert not Fp4TopkMoE().ffn_ok(x, mw)
    monkeypatch.setenv("DS4_MOE_FFN", "1")
    assert not Fp4TopkMoE().ffn_ok(x, mw)  # x on the CPU: decided before any extension call
    assert not Bf16CacheMoE().ffn_capable
    fp4p = QWeight("fp4p", w.weight, w.scale)
    with pytest.raises(ValueError, match="no one-launch FFN"):
        kernels.moe_ffn(x, torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, 1), fp4p, fp4p, fp4p, s, s, s, 0, 10.0)


def test_moe_prefill_chunk_limit_reads_its_variable(monkeypatch):
    """moe=fp4_topk's prompt MoE: decode-kernel chunks up to CHUNKED_TOKENS prompt tokens, DS4_MOE_CHUNKED_TOKENS
    moves the limit, and a value that is not a count fails clearly."""
    from ds4.ops.moe_cuda import CHUNKED_TOKENS, chunked_tokens
    monkeypatch.delenv("DS4_MOE_CHUNKED_TOKENS", raising=False)
    assert chunked_tokens() == CHUNKED_TOKENS == 128
    monkeypatch.setenv("DS4_MOE_CHUNKED_TOKENS", "64")
    assert chunked_tokens() == 64
    monkeypatch.setenv("DS4_MOE_CHUNKED_TOKENS", "many")
    with pytest.raises(ValueError, match="DS4_MOE_CHUNKED_TOKENS"):
        chunked_tokens()


@pytest.mark.parametrize("fmt,rows,cols,ok", [
    ("fp8", 100, 272, True), ("fp8", 64, 100, False), ("fp8t", 1024, 4096, True), ("fp8t", 8, 128, False),
    ("fp8t", 16, 64, False), ("fp4", 48, 96, True), ("fp4", 48, 80, False), ("fp4t", 2048, 4096, True),
    ("fp4t", 16, 128, False), ("bf16", 16, 128, False)])
def test_dequant_shape_rule(fmt, rows, cols, ok):
    """ds4.kernels.dequant_ok (csrc/dequant.cu's rule): rows of whole 16-byte chunks; fp8t / fp4t whole tiles."""
    assert kernels.dequant_ok(fmt, rows, cols) is ok


def test_prefill_dense_weights_off_cuda_are_qweight_dequant():
    """Off CUDA (and for what the kernel does not take) prefill's dense weight is QWeight.dequant's, never an error."""
    from ds4.ops.base import QWeight
    from ds4.ops.dequant_cuda import dense, takes
    g = torch.Generator().manual_seed(0)
    w = torch.randint(0, 256, (32, 256), generator=g, dtype=torch.uint8)
    w = torch.where((w & 0x7F) == 0x7F, w - 1, w).view(torch.float8_e4m3fn)
    q = QWeight("fp8", w, torch.randint(110, 130, (1, 2), generator=g, dtype=torch.uint8).view(torch.float8_e8m0fnu))
    assert not takes(q, torch.bfloat16)
    assert torch.equal(dense(q, torch.bfloat16), q.dequant(torch.bfloat16))
    out = torch.empty(32, 256)
    assert dense(q, torch.float32, out=out) is out and torch.equal(out, q.dequant(torch.float32))


@pytest.mark.parametrize("group_experts", [None, 3])
def test_grouped_prefill_loop_on_cpu_is_the_reference_loop(group_experts, monkeypatch):
    """moe=fp4_topk's long-prompt loop (grouped_routed) on CPU weights (QWeight.dequant forms them): moe=dequant's
    routed sum, with experts held on another rank (ids outside this rank's slice) adding nothing; all 4 local experts'
    weights formed at once, or 3 at a time (DS4_PREFILL_GROUP_BYTES: a second group whose rows start where the
    first's end; with one group, a loop that never advanced its row offset passed)."""
    from ds4.ops.base import MoEWeights, QWeight
    from ds4.ops.moe_cuda import grouped_routed
    from ds4.ops.moe_torch import DequantMoE
    g = torch.Generator().manual_seed(1)
    e_local, dim, inter, n, k = 4, 64, 32, 40, 3
    if group_experts:  # bytes of group_experts experts' dense bf16 w1, w3, w2
        monkeypatch.setenv("DS4_PREFILL_GROUP_BYTES", str(group_experts * 3 * inter * dim * 2))
    else:
        monkeypatch.delenv("DS4_PREFILL_GROUP_BYTES", raising=False)

    def fp4(o, i):
        return QWeight("fp4", torch.randint(-128, 128, (e_local, o, i // 2), generator=g, dtype=torch.int8),
                       torch.randint(120, 130, (e_local, o, i // 32), generator=g, dtype=torch.uint8))

    mw = MoEWeights(gate=None, bias=None, tid2eid=None, w1=fp4(inter, dim), w2=fp4(dim, inter), w3=fp4(inter, dim),
                    shared_w1=None, shared_w2=None, shared_w3=None, n_experts=12, expert_offset=4, topk=k,
                    route_scale=1.5, swiglu_limit=10.0)
    x = torch.randn(n, dim, generator=g).to(torch.bfloat16)
    ids = torch.randint(0, 12, (n, k), generator=g)
    w = torch.rand(n, k, generator=g)
    ref = DequantMoE().routed(x, w, ids, mw)
    got = grouped_routed(x, w, ids, mw)
    assert got.dtype == torch.float32 and got.shape == (n, dim)
    assert torch.allclose(got, ref, rtol=2e-2, atol=1e-2 * ref.abs().max().item())
    off = (ids < 4) | (ids >= 8)
    assert torch.equal(grouped_routed(x, w, torch.where(off, ids, 0), mw), torch.zeros(n, dim))


def test_dequant_wrapper_refuses_bad_shapes_before_the_op():
    """ds4.kernels.dequant names what it cannot take (a row of partial chunks, a scale of another shape) before it
    reaches the extension (these tensors are on the CPU: the op would fail otherwise)."""
    u8 = torch.uint8
    with pytest.raises(ValueError, match="not a shape it takes"):
        kernels.dequant(torch.zeros(64, 100, dtype=u8), torch.zeros(1, 1, dtype=u8), "fp8")
    with pytest.raises(ValueError, match=r"scale shape \(8, 8\), expected \(16, 8\)"):
        kernels.dequant(torch.zeros(16, 128, dtype=torch.int8), torch.zeros(8, 8, dtype=u8), "fp4t")
    with pytest.raises(ValueError, match=r"expected \(2, 2, 2\)"):
        kernels.dequant(torch.zeros(2, 130, 256, dtype=u8), torch.zeros(2, 1, 2, dtype=u8), "fp8")


@pytest.fixture
def fake_build(monkeypatch, tmp_path):
    """(csrc, build): a source folder with a.cu and b.cuh and an empty build folder, for ds4.kernels.build_and_load
    with torch taken for a CUDA build (each test replaces torch's load)."""
    src = tmp_path / "csrc"
    src.mkdir()
    (src / "a.cu").write_text("")
    (src / "b.cuh").write_text("")
    build = tmp_path / "build"
    build.mkdir()
    monkeypatch.setattr(torch.version, "cuda", "12.0")
    return src, build


def test_build_lock_clears_an_interrupted_builds_leftover_and_serialises(monkeypatch, fake_build, capsys):
    """torch's JIT build leaves its `lock` file when killed midway, and every later build of that directory waited
    on it forever; ds4's builds hold an OS lock (released when a process dies) and remove such a leftover. A second
    build waits for the first and says so."""
    import fcntl
    import threading

    import torch.utils.cpp_extension as cpp

    from ds4 import kernels
    src, build = fake_build
    (build / "lock").write_text("")  # a killed build's leftover
    seen = []
    monkeypatch.setattr(cpp, "load", lambda **kw: seen.append((build / "lock").exists()))
    kernels.build_and_load("x", src, ("a.cu",), build, False)
    assert seen == [False] and "removing" in capsys.readouterr().err
    with open(build / "ds4_build.lock", "w") as held:  # another process's build in progress
        fcntl.flock(held, fcntl.LOCK_EX)
        t = threading.Thread(target=kernels.build_and_load, args=("x", src, ("a.cu",), build, False))
        t.start()
        t.join(0.5)
        assert t.is_alive() and seen == [False]  # waiting, not building
        fcntl.flock(held, fcntl.LOCK_UN)
    t.join(10)
    assert not t.is_alive() and seen == [False, False]
    assert "waiting for another process's build" in capsys.readouterr().err


def test_attention_extension_takes_its_own_nvcc_flags_where_set(monkeypatch):
    """DS4_ATTN_NVCC_FLAGS overrides DS4_NVCC_FLAGS for the attention extension alone (set and empty means none), so
    one process can load each extension from a build of its own ablation flags without rebuilding either."""
    monkeypatch.setenv("DS4_NVCC_FLAGS", "-DMAIN_ONLY=1")
    monkeypatch.delenv("DS4_ATTN_NVCC_FLAGS", raising=False)
    main = kernels._cuda_flags_for("9.0")
    assert "-DMAIN_ONLY=1" in main and main[-1] == "-gencode=arch=compute_90,code=sm_90"
    assert "-DMAIN_ONLY=1" in kernels._cuda_flags_for("9.0", "DS4_ATTN_NVCC_FLAGS")  # unset: the shared flags
    monkeypatch.setenv("DS4_ATTN_NVCC_FLAGS", "")
    assert "-DMAIN_ONLY=1" not in kernels._cuda_flags_for("9.0", "DS4_ATTN_NVCC_FLAGS")
    monkeypatch.setenv("DS4_ATTN_NVCC_FLAGS", "-DATTN_ONLY=1")
    attn = kernels._cuda_flags_for("9.0", "DS4_ATTN_NVCC_FLAGS")
    assert "-DATTN_ONLY=1" in attn and "-DMAIN_ONLY=1" not in attn
    assert "-DATTN_ONLY=1" not in kernels._cuda_flags_for("9.0")


def test_build_says_it_compiles_when_the_library_is_missing_or_older_than_its_sources(monkeypatch, fake_build,
                                                                                      capsys):
    """torch's JIT build is silent for minutes: ds4 says before a build that will compile (no library, or a source
    newer than it) and nothing when the library is current."""
    import os

    import torch.utils.cpp_extension as cpp

    from ds4 import kernels
    src, build = fake_build
    monkeypatch.setattr(cpp, "load", lambda **kw: (build / "x.so").write_text(""))
    kernels.build_and_load("x", src, ("a.cu",), build, False)
    assert "compiling the x CUDA extension" in capsys.readouterr().err  # no library yet
    kernels.build_and_load("x", src, ("a.cu",), build, False)
    assert "compiling" not in capsys.readouterr().err  # current
    t = (build / "x.so").stat().st_mtime
    os.utime(src / "b.cuh", (t + 5, t + 5))  # a header changed after the build
    monkeypatch.setattr(cpp, "load", lambda **kw: None)
    kernels.build_and_load("x", src, ("a.cu",), build, False)
    assert "compiling the x CUDA extension" in capsys.readouterr().err


# ninja's log as torch's "Error building extension" holds it: the source compiled beside the failed one finished last
NINJA_LOG = """Error building extension 'x': [1/3] /usr/local/cuda/bin/nvcc -c /src/a.cu -o a.cuda.o
FAILED: b.cuda.o
/usr/local/cuda/bin/nvcc -MD -MF b.cuda.o.d -gencode=arch=compute_80,code=sm_80 -c /src/b.cu -o b.cuda.o
/src/b.cu(2): error: identifier "undefined_symbol" is undefined
      x[threadIdx.x] += undefined_symbol;
                        ^

1 error detected in the compilation of "/src/b.cu".
[2/3] /usr/local/cuda/bin/nvcc -MD -MF c.cuda.o.d """ + "-isystem /long/include " * 40 + """-c /src/c.cu -o c.cuda.o
ninja: build stopped: subcommand failed.
"""


def test_failed_build_says_the_compiler_error_in_one_line_every_time(monkeypatch, fake_build):
    """The reason of a failed build holds the compiler's error (not the tail of ninja's log, another source's command
    line), on one line; a second ask in the same process (torch would load the missing library, not build) says the
    same, without trying again."""
    import torch.utils.cpp_extension as cpp
    src, build = fake_build
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    tries = []

    def fail(**kw):
        tries.append(1)
        raise RuntimeError(NINJA_LOG)
    monkeypatch.setattr(cpp, "load", fail)
    load = lambda: kernels.build_and_load("x", src, ("a.cu",), build, False)  # noqa: E731
    why = [kernels.extension_reason("x", build / "x.so", load) for _ in range(2)]
    assert why[0] == why[1] and len(tries) == 1 and "\n" not in why[0]
    assert 'b.cu(2): error: identifier "undefined_symbol" is undefined' in why[0] and "c.cu" not in why[0]


@pytest.mark.parametrize("cc,archs,runs", [((9, 0), None, True), ((8, 6), None, True), ((12, 0), None, False),
                                           ((8, 6), "9.0", False), ((10, 0), "8.0 9.0+PTX", True),
                                           ((9, 0), "9.0a", True), ((10, 0), "9.0a+PTX", False)])
def test_a_gpu_the_build_has_no_code_for_is_refused_before_any_launch(monkeypatch, cc, archs, runs):
    monkeypatch.setattr(torch.version, "cuda", "12.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: cc)
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    if archs:
        monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", archs)
    why = kernels.extension_reason("x", Path("x.so"), lambda: None)
    assert (why is None) == runs and (runs or "TORCH_CUDA_ARCH_LIST" in why)


def test_arch_list_keeps_ptx():
    assert [f for f in kernels._cuda_flags_for("8.0 9.0+PTX") if "gencode" in f] == [
        "-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90,code=sm_90",
        "-gencode=arch=compute_90,code=compute_90"]


def test_shared_headers_count_only_where_included(tmp_path):
    """A header of csrc's root the extension's sources never include (e.g. a GEMV header, for csrc/attn) does not make
    its build look stale, which printed "compiling ... a few minutes" on every load though ninja had nothing to do."""
    import os
    (tmp_path / "attn").mkdir()
    (tmp_path / "used.cuh").write_text("")
    (tmp_path / "unused.cuh").write_text("")
    (tmp_path / "attn" / "a.cu").write_text('#include "../used.cuh"\n')
    so = tmp_path / "x.so"
    so.write_text("")
    t = so.stat().st_mtime
    for p in (tmp_path / "used.cuh", tmp_path / "unused.cuh", tmp_path / "attn" / "a.cu"):
        os.utime(p, (t - 10, t - 10))
    os.utime(tmp_path / "unused.cuh", (t + 5, t + 5))
    assert not kernels._stale(so, tmp_path / "attn", ("a.cu",))
    os.utime(tmp_path / "used.cuh", (t + 5, t + 5))
    assert kernels._stale(so, tmp_path / "attn", ("a.cu",))


def test_other_flags_say_they_compile_and_no_jit_never_compiles(monkeypatch, fake_build, capsys):
    import os

    import torch.utils.cpp_extension as cpp
    src, build = fake_build
    monkeypatch.delenv("DS4_NVCC_FLAGS", raising=False)
    monkeypatch.delenv("DS4_NO_JIT", raising=False)
    monkeypatch.setattr(cpp, "load", lambda **kw: (build / "x.so").write_text(""))
    kernels.build_and_load("x", src, ("a.cu",), build, False)
    capsys.readouterr()
    monkeypatch.setenv("DS4_NVCC_FLAGS", "-DX=1")  # the folder's build has other flags: torch recompiles it
    kernels.build_and_load("x", src, ("a.cu",), build, False)
    assert "nvcc flags or torch differ" in capsys.readouterr().err
    monkeypatch.setenv("DS4_NO_JIT", "1")
    monkeypatch.setattr(cpp, "load", lambda **kw: pytest.fail("DS4_NO_JIT=1 compiled"))
    loaded = []
    monkeypatch.setattr(torch.ops, "load_library", loaded.append)
    kernels.build_and_load("x", src, ("a.cu",), build, False)  # current: loaded as it is
    assert loaded == [str(build / "x.so")]
    t = (build / "x.so").stat().st_mtime
    os.utime(src / "a.cu", (t + 5, t + 5))
    with pytest.raises(RuntimeError, match="older than its sources"):
        kernels.build_and_load("x", src, ("a.cu",), build, False)
    monkeypatch.delenv("DS4_NVCC_FLAGS")
    os.utime(src / "a.cu", (t - 5, t - 5))
    with pytest.raises(RuntimeError, match="other nvcc flags"):
        kernels.build_and_load("x", src, ("a.cu",), build, False)


def test_attention_build_folder_follows_the_extension_folder(monkeypatch, tmp_path):
    from ds4 import kernels_attn
    monkeypatch.delenv("DS4_ATTN_EXT_BUILD_DIR", raising=False)
    monkeypatch.setenv("DS4_EXT_BUILD_DIR", str(tmp_path))
    assert kernels_attn.build_dir() == tmp_path / "attn"
    monkeypatch.setenv("DS4_ATTN_EXT_BUILD_DIR", str(tmp_path / "elsewhere"))
    assert kernels_attn.build_dir() == tmp_path / "elsewhere"


@pytest.mark.skipif(not Path("/proc/self/cwd").exists() or shutil.which("sleep") is None, reason="needs Linux /proc")
def test_build_lock_waits_for_an_orphaned_ninja_before_clearing_its_lock(monkeypatch, fake_build, capsys, tmp_path):
    """A process killed alone (kill -9 of its pid) leaves its ninja building on in the folder: torch's `lock` is then
    no leftover, and a second ninja beside it would rewrite the same objects; the next build waits for it."""
    import time

    import torch.utils.cpp_extension as cpp
    src, build = fake_build
    ninja = tmp_path / "ninja"  # a process named ninja working in the build folder
    shutil.copy(shutil.which("sleep"), ninja)
    orphan = subprocess.Popen([str(ninja), "1.5"], cwd=build)
    (build / "lock").write_text("")
    seen = []
    monkeypatch.setattr(cpp, "load", lambda **kw: seen.append(orphan.poll()))
    t0 = time.monotonic()
    kernels.build_and_load("x", src, ("a.cu",), build, False)
    assert seen == [0] and time.monotonic() - t0 >= 1  # built once the orphan had ended
    assert "waiting for an orphaned build" in capsys.readouterr().err


# ------------------------------------------------------------------ moe=fp4_dp4a (the integer-pipe gate+up)

def test_dp4a_kernel_choice_is_checked_before_any_launch():
    """kernel "dp4a" is moe_gate_up's alone, for one token of stored-fp4 routed experts up to DP4A_MAX_DIM wide; any
    other call fails in Python, before the op (these tensors are on the CPU: the op would fail otherwise)."""
    w, s = torch.zeros(4, 64, 256, dtype=torch.int8), torch.zeros(4, 64, 16, dtype=torch.uint8)
    x1, x2 = torch.zeros(1, 512, dtype=torch.bfloat16), torch.zeros(2, 512, dtype=torch.bfloat16)
    ids1, ids2, rw = torch.zeros(1, 2, dtype=torch.int64), torch.zeros(2, 2, dtype=torch.int64), torch.ones(2, 2)
    bad = {"two tokens": lambda: kernels.moe_gate_up(x2, ids2, rw, w, s, w, s, "fp4", kernel="dp4a"),
           "fp4p": lambda: kernels.moe_gate_up(x1, ids1, rw[:1], w, s, w, s, "fp4p", kernel="dp4a"),
           "no ids": lambda: kernels.moe_gate_up(x1, None, None, w[0], s[0], w[0], s[0], "fp4", kernel="dp4a"),
           "act_quant": lambda: kernels.moe_gate_up(x1, ids1, rw[:1], w, s, w, s, "fp4", kernel="dp4a",
                                                    act_quant=True)}
    for fn in bad.values():  # (the keys name the cases)
        with pytest.raises(ValueError, match="kernel 'dp4a' takes one token"):
            fn()
    wide = torch.zeros(4, 64, 4112, dtype=torch.int8)  # dim 8224 > DP4A_MAX_DIM
    with pytest.raises(ValueError, match="kernel 'dp4a' takes one token"):
        kernels.moe_gate_up(torch.zeros(1, 8224, dtype=torch.bfloat16), ids1, rw[:1], wide, None, wide, None, "fp4",
                            kernel="dp4a")
    for call in (lambda: kernels.moe_down(x1, ids1, 2, w, s, "fp4", kernel="dp4a"),
                 lambda: kernels.gemv(x1, w[0], s[0], "fp4", kernel="dp4a")):
        with pytest.raises(ValueError, match="moe_gate_up only"):
            call()
    assert kernels.dp4a_ok("fp4", 1, 4096) and kernels.dp4a_ok("fp4", 1, 32)
    assert not (kernels.dp4a_ok("fp4t", 1, 4096) or kernels.dp4a_ok("fp4", 2, 4096) or kernels.dp4a_ok("fp4", 1, 4112)
                or kernels.dp4a_ok("fp4", 1, 4128))


@pytest.mark.parametrize("src,dst", [("fp4", "fp4t"), ("fp4t", "fp4"), ("fp4p", "fp4"), ("fp4", "fp4p"),
                                     ("fp4t", "fp4p"), ("fp4p", "fp4t"), ("fp4", "fp4")])
def test_lay_fp4_converts_every_layout_in_place(src, dst):
    """ds4.ops.moe_cuda.lay_fp4 (moe=fp4_dp4a's w1 / w3 stored beside an fp4t w2): the same storage, the same values."""
    from ds4.ops.base import QWeight
    from ds4.ops.moe_cuda import lay_fp4
    from ds4.quant import dequant_fp4
    g = torch.Generator().manual_seed(5)
    stored = torch.randint(-128, 128, (2, 32, 128), dtype=torch.int8, generator=g)
    scale = torch.randint(110, 130, (2, 32, 8), dtype=torch.uint8, generator=g).view(torch.float8_e8m0fnu)
    want = dequant_fp4(stored, scale)
    q = lay_fp4(QWeight("fp4", stored.clone(), scale), src)
    ptr = q.weight.data_ptr()
    out = lay_fp4(q, dst)
    assert out.fmt == dst and out.weight.data_ptr() == ptr and out.scale is scale
    assert torch.equal(out.dequant(), want)
    if dst == "fp4":
        assert torch.equal(out.weight, stored)
    with pytest.raises(ValueError, match="must be fp4, fp4p or fp4t"):
        lay_fp4(q, "fp8")


def test_fp4_dp4a_takes_its_kernel_for_one_token_only(monkeypatch):
    """Fp4Dp4aMoE asks for kernel "dp4a" for a one-token gate+up it takes; prompts, qat's staged x and other layouts
    keep fp4_topk's choice; it never routes inside the kernels nor takes the one-launch FFN."""
    from ds4.ops.moe_cuda import Fp4Dp4aMoE, Fp4TopkMoE
    impl = Fp4Dp4aMoE()
    one, two = torch.zeros(1, 4096), torch.zeros(2, 4096)
    assert impl._gate_up_kernel(one, "fp4", False, None) == "dp4a"
    assert impl._gate_up_kernel(two, "fp4", False, None) == "auto"
    assert impl._gate_up_kernel(one, "fp4", True, None) == "auto"
    assert impl._gate_up_kernel(one, "fp4t", False, None) == "auto"
    assert impl._gate_up_kernel(torch.zeros(1, 7168), "fp4", False, None) == "auto"
    assert Fp4TopkMoE()._gate_up_kernel(one, "fp4", False, None) == "auto"
    assert not impl.route_in_kernels and not impl.ffn_capable and impl.gate_up_layout == "fp4"


def test_fp4_dp4a_registry_refuses_a_dim_its_kernel_cannot_take(monkeypatch):
    """An explicit moe=fp4_dp4a for a model wider than its gate+up kernel fails before the weights load."""
    e = registry.entry("moe", "fp4_dp4a")
    monkeypatch.setitem(registry._ENTRIES["moe"], "fp4_dp4a", dataclasses.replace(e, check=lambda _d: None))
    cuda = torch.device("cuda")
    assert registry.resolve("moe", "fp4_dp4a", cuda, registry.Setup(dim=4096))[1] == "fp4_dp4a"
    with pytest.raises(registry.ImplUnavailable, match="dim a multiple of 32 up to 4096"):
        registry.resolve("moe", "fp4_dp4a", cuda, registry.Setup(dim=7168))
    # FP8 / BF16 experts (model.overrides.expert_dtype, or a checkpoint's): its kernel reads E2M1 bytes, and the run
    # decoded on fp4_topk's kernels under its name (session 66's review)
    for dt in ("fp8", "bf16"):
        with pytest.raises(registry.ImplUnavailable, match=f"reads FP4 experts \\(expert_dtype={dt}\\)"):
            registry.resolve("moe", "fp4_dp4a", cuda, registry.Setup(dim=4096, expert_dtype=dt))
    # auto keeps fp4_topk (priority 10 against 8) until the step measures the integer pipe faster
    monkeypatch.setitem(registry._ENTRIES["moe"], "fp4_topk",
                        dataclasses.replace(registry.entry("moe", "fp4_topk"), check=lambda _d: None))
    assert registry.resolve("moe", "auto", cuda, registry.Setup(dim=4096))[0].name == "fp4_topk"
