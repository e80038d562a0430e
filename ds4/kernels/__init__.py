"""The ds4 CUDA extension: build / JIT load and thin typed wrappers.

Sources live in ``csrc/`` (one .cu per kernel family over raw pointers, one binding .cpp that
registers ``torch.ops.ds4.*`` with TORCH_LIBRARY). The extension is built with ninja through
``torch.utils.cpp_extension.load`` into ``<repo>/.ext_build`` (override with
``DS4_EXT_BUILD_DIR``), for the architectures in ``TORCH_CUDA_ARCH_LIST`` (default "8.0;9.0").
Build it explicitly once with ``python scripts/build_ext.py`` so parallel jobs never compile at the
same time; a later ``load()`` then only loads the built library.

Nothing here is needed on a CPU machine: ``unavailable_reason()`` says why the kernels cannot run
and the package's CPU paths never import the extension.
"""
from __future__ import annotations

import contextlib
import functools
import os
import re
import sys
import time
from pathlib import Path

import torch

from ds4.kernels.ops import (AR_CHUNK, AR_FOLD_ROWS, AR_MAX_WORLD, ARGMAX_MAX_ROWS, DEQUANT_FMTS,  # noqa: F401
                             DP4A_MAX_DIM, ROUTER_MAX_EXPERTS, ROUTER_MAX_K, InKernelRoute, act_quant_sim,
                             act_quant_staged_ok, all_reduce_ll, all_reduce_ll_fold, argmax, bulk_stage_site,
                             dequant, dequant_ok, dp4a_ok, fork_programmatic, gemv, gemv_deferred, gemv_deferred_ok,
                             gemv_fold, gemv_max_tokens, gemv_rmsnorm, gemv_rmsnorm_ok, hc_fold_ok, join_programmatic,
                             l2_prefetch, moe_act_quant_ok, moe_down, moe_ffn, moe_ffn_ok, moe_gate_up, moe_route_ok,
                             moe_splitk_down, moe_splitk_rows, moe_splitk_up, router)  # (typed wrappers)

REPO = Path(__file__).resolve().parents[2]
CSRC = REPO / "csrc"
SOURCES = ("ds4_bindings.cpp", "gemv.cu", "moe.cu", "moe_mma.cu", "moe_dp4a.cu", "moe_splitk.cu", "moe_ffn.cu",
           "router.cu", "argmax.cu", "prefetch.cu", "allreduce.cu", "capture.cu", "dequant.cu", "act_quant.cu")
EXT_NAME = "ds4_ext"
DEFAULT_ARCHS = "8.0;9.0"


def build_dir() -> Path:
    return Path(os.environ.get("DS4_EXT_BUILD_DIR", REPO / ".ext_build"))


class BuildError(RuntimeError):
    """A ds4 extension failed to build or load; the message is one line (the compiler's errors where it has any)."""


def build_and_load(name: str, csrc: Path, sources: tuple[str, ...], directory: Path, verbose: bool,
                   flags_env: str = "DS4_NVCC_FLAGS") -> None:
    """JIT-build (ninja, only what changed) and load one ds4 extension for TORCH_CUDA_ARCH_LIST
    (default "8.0;9.0"); shared by every ds4 extension. Extra nvcc flags come from the variable `flags_env`
    (see _cuda_flags_for). DS4_NO_JIT=1: load the built library as it is, or fail where it is missing or out of date.
    Raises RuntimeError with the reason."""
    if torch.version.cuda is None:
        raise RuntimeError("torch is a CPU-only build (torch.version.cuda is None)")
    from torch.utils.cpp_extension import load as _load

    missing = [s for s in sources if not (csrc / s).exists()]
    if missing:
        raise RuntimeError(f"CUDA sources missing under {csrc}: {missing}")
    key = (name, directory.resolve())
    if key in _FAILED:  # torch would not build again in this process (it loads the missing library): the first why
        raise BuildError(_FAILED[key])
    # TORCH_CUDA_ARCH_LIST would make torch add its own -gencode flags too; ours are explicit.
    archs = os.environ.get("TORCH_CUDA_ARCH_LIST")
    so, flags = directory / f"{name}.so", _cuda_flags_for(archs, flags_env)
    stamp, built_with = directory / f"{name}.flags", " ".join(flags) + f" (torch {torch.__version__})"
    if os.environ.get("DS4_NO_JIT") == "1":  # never compile: a library out of date is refused, not rebuilt
        why = "not built" if not so.exists() else "older than its sources" if _stale(so, csrc, sources) else \
            "built with other nvcc flags or torch" if _other_build(stamp, built_with) else None
        if why is not None:
            raise RuntimeError(f"{so} is {why} (DS4_NO_JIT=1; run python scripts/build_ext.py with this process's "
                               "TORCH_CUDA_ARCH_LIST and nvcc flags)")
        torch.ops.load_library(str(so))
        return
    directory.mkdir(parents=True, exist_ok=True)
    os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
    try:
        with _build_lock(directory):
            # torch compiles in silence (minutes for ds4_ext): say so before a build that will surely compile, and
            # after any load that took long (a change of torch's headers also recompiles, unseen from here)
            other_flags = so.exists() and _other_build(stamp, built_with)
            if other_flags or _stale(so, csrc, sources):
                why = "its nvcc flags or torch differ from the build's" if other_flags else \
                    "first use, or its sources changed"
                print(f"ds4: compiling the {name} CUDA extension into {directory} ({why}); this takes a few minutes",
                      file=sys.stderr, flush=True)
            t0 = time.perf_counter()
            try:
                _load(name=name, sources=[str(csrc / s) for s in sources], extra_cflags=["-O3"],
                      extra_cuda_cflags=flags, extra_include_paths=[str(csrc)],
                      build_directory=str(directory), is_python_module=False, verbose=verbose)
            except Exception as e:
                _FAILED[key] = _failure_text(e)
                raise BuildError(_FAILED[key]) from e
            stamp.write_text(built_with)
            if (dt := time.perf_counter() - t0) > 10:
                print(f"ds4: {name} CUDA extension ready after {dt:.0f} s", file=sys.stderr, flush=True)
    finally:
        if archs is not None:
            os.environ["TORCH_CUDA_ARCH_LIST"] = archs


def _other_build(stamp: Path, built_with: str) -> bool:
    """The folder's library was built with other nvcc flags or another torch (its stamp says; none: not known)."""
    return stamp.is_file() and stamp.read_text() != built_with


_FAILED: dict[tuple[str, Path], str] = {}  # (extension, build folder) -> why its build/load failed in this process


def _failure_text(e: BaseException) -> str:
    """One line saying why a build/load failed. torch's "Error building extension" holds ninja's whole log, whose
    tail is often the command line of another source that finished after the failure: from it, each FAILED edge's
    target and the compiler's error lines (all its output where none says error); else the message."""
    lines, said = str(e).strip().splitlines(), []
    for i, ln in enumerate(lines):
        if ln.startswith("FAILED:"):  # FAILED: <target> / <command> / <output> ... up to ninja's next line
            out = []
            for o in lines[i + 2:]:
                if o.startswith(("[", "FAILED:", "ninja: ")):
                    break
                out.append(o.strip())
            errs = [o for o in out if re.search(r"\berror\b|undefined reference|cannot find|fatal", o, re.IGNORECASE)]
            said += [ln.strip(), *(errs or [o for o in out if o])]
    text = " | ".join(said) if said else " ".join(str(e).split())
    return f"{type(e).__name__}: " + (text if len(text) <= 1000 else text[:1000] + " ...")


def _stale(so: Path, csrc: Path, sources: tuple[str, ...] = ()) -> bool:
    """The built library is missing or older than a source or header in csrc or a header the sources include
    (the attention extension's csrc/attn includes some of CSRC's root): ninja will compile."""
    if not so.exists():
        return True
    files = [*csrc.glob("*"), *_included(csrc, sources)]
    newest = max((p.stat().st_mtime for p in files if p.suffix in {".cu", ".cuh", ".cpp", ".h"}), default=0)
    return so.stat().st_mtime < newest


def _included(csrc: Path, sources: tuple[str, ...]) -> set[Path]:
    """The files `sources` reach by #include "..." (beside the including file, else in csrc, as nvcc -I csrc)."""
    seen, todo = set(), [(csrc / s).resolve() for s in sources]
    while todo:
        p = todo.pop()
        if p in seen or not p.is_file():
            continue
        seen.add(p)
        for inc in re.findall(r'^\s*#\s*include\s*"([^"]+)"', p.read_text(errors="replace"), re.MULTILINE):
            todo.append(next((c for c in (p.parent / inc, csrc / inc) if c.is_file()), p.parent / inc).resolve())
    return seen


@contextlib.contextmanager
def _build_lock(directory: Path):
    """Serialise ds4's builds into `directory` with an OS file lock, which dies with its process. torch's own
    `lock` file there does not: a build killed midway (Ctrl-C, a timeout) leaves it, and every later build of the
    directory then waits on it forever, in silence (session 56 lost a device run so). Holding this lock, no ds4
    build runs, so a `lock` file is such a leftover, and is removed with a note, once no ninja of a process killed
    alone (kill -9 of its pid: its ninja runs on, orphaned) still builds there. Other processes wait here, then
    find the library built (ninja has nothing to do)."""
    import fcntl
    with open(directory / "ds4_build.lock", "w") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"ds4: waiting for another process's build in {directory}", file=sys.stderr, flush=True)
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            stale = directory / "lock"
            if stale.exists():
                if pids := _ninjas_in(directory):
                    print(f"ds4: waiting for an orphaned build in {directory} (ninja pid {pids})", file=sys.stderr,
                          flush=True)
                    while _ninjas_in(directory):
                        time.sleep(1)
                print(f"ds4: removing {stale}, left by a build that was interrupted", file=sys.stderr, flush=True)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _ninjas_in(directory: Path) -> list[int]:
    """The ninja processes working in `directory` (torch runs its ninja there), from Linux's /proc; [] elsewhere."""
    d, pids = os.path.realpath(directory), []
    for p in Path("/proc").glob("[0-9]*"):
        try:
            if os.readlink(p / "cwd") == d and (p / "comm").read_text().strip() == "ninja":
                pids.append(int(p.name))
        except OSError:  # gone, or another user's
            pass
    return pids


@functools.lru_cache(maxsize=None)
def load(verbose: bool = False) -> None:
    """Build (if needed) and load the GEMV/MoE extension; registers the ops and their fake implementations."""
    build_and_load(EXT_NAME, CSRC, SOURCES, build_dir(), verbose)
    from ds4.kernels import _fake  # noqa: F401  registers fake impls once the ops exist


def _cuda_flags_for(archs: str | None, flags_env: str = "DS4_NVCC_FLAGS") -> list[str]:
    # DS4_NVCC_FLAGS: extra nvcc flags for an ablation build (e.g. a -D switch of the CUDA sources); give such
    # a build its own DS4_EXT_BUILD_DIR / DS4_ATTN_EXT_BUILD_DIR so it never overwrites the default one.
    # flags_env (DS4_ATTN_NVCC_FLAGS for the attention extension) overrides it for one extension where set, empty
    # included, so one process can load each extension from a build of its own flags. The flags are part of
    # torch's build hash: a process whose flags differ from the folder's build rebuilds it (about 2 minutes).
    extra = os.environ.get(flags_env, os.environ.get("DS4_NVCC_FLAGS", ""))
    flags = ["-O3", "-lineinfo", *extra.split()]
    for num, ptx in _arch_list(archs):
        flags.append(f"-gencode=arch=compute_{num},code=sm_{num}")
        if ptx:  # as torch: PTX too, which the driver compiles for a newer GPU
            flags.append(f"-gencode=arch=compute_{num},code=compute_{num}")
    return flags


def _arch_list(archs: str | None) -> list[tuple[str, bool]]:
    """TORCH_CUDA_ARCH_LIST ("8.0;9.0", "8.0 9.0+PTX", "9.0a") -> [("80", False), ("90", True), ("90a", False)]."""
    out = []
    for a in (archs or DEFAULT_ARCHS).replace(",", ";").replace(" ", ";").split(";"):
        if a := a.strip():
            out.append((a.removesuffix("+PTX").replace(".", ""), a.endswith("+PTX")))
    return out


def _runs_on(cc: tuple[int, int], archs: str | None) -> bool:
    """Whether a build for `archs` has code for compute capability cc: a cubin of the same major and a minor at
    most cc's (an arch-specific "a" one: cc's own), or PTX of an arch at most cc."""
    for num, ptx in _arch_list(archs):
        m = re.fullmatch(r"(\d+)(\d)([af]?)", num)
        if m is None:
            return True  # a form this does not read (e.g. an arch name): let the build and the launch say
        arch, suffix = (int(m[1]), int(m[2])), m[3]
        cubin = arch == cc if suffix == "a" else arch[0] == cc[0] and arch[1] <= cc[1]
        if cubin or (ptx and not suffix and arch <= cc):
            return True
    return False


def extension_reason(name: str, so_path: Path, load_fn) -> str | None:
    """Why the extension `name` cannot run here (CPU torch, no CUDA, compute capability < 8.0, not
    built under DS4_NO_JIT=1, build/load failure), or None. Shared by every ds4 extension."""
    if torch.version.cuda is None:
        return "torch is a CPU-only build"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    cc = torch.cuda.get_device_capability()
    if cc[0] < 8:
        return f"needs compute capability >= 8.0 (found {cc[0]}.x)"
    archs = os.environ.get("TORCH_CUDA_ARCH_LIST") or DEFAULT_ARCHS
    if not _runs_on(cc, archs):
        return (f"built for TORCH_CUDA_ARCH_LIST={archs!r}, which has no code for this GPU (compute capability "
                f"{cc[0]}.{cc[1]}): set TORCH_CUDA_ARCH_LIST={cc[0]}.{cc[1]} (or add +PTX to the newest)")
    if os.environ.get("DS4_NO_JIT") == "1" and not so_path.exists():
        return f"{name} extension not built (DS4_NO_JIT=1; run python scripts/build_ext.py)"
    try:
        load_fn()
    except BuildError as e:  # the compiler's errors; python scripts/build_ext.py shows its whole output
        return f"{name} CUDA extension failed to build/load: {e}"
    except Exception as e:  # noqa: BLE001  report any other failure as the reason
        return f"{name} CUDA extension failed to build/load: {_failure_text(e)}"
    return None


def unavailable_reason() -> str | None:
    """None when the GEMV/MoE kernels can run here, else why not."""
    return extension_reason("ds4", build_dir() / f"{EXT_NAME}.so", load)


def require(who: str) -> None:
    """For the GPU scripts: load the extension, or end the process with one line saying why it cannot run here."""
    reason = unavailable_reason()
    if reason is not None:
        raise SystemExit(f"{who}: needs a CUDA GPU and the ds4 extension: {reason}")


__all__ = ["load", "unavailable_reason", "require", "build_dir", "gemv", "gemv_deferred", "moe_gate_up", "moe_down",
           "moe_ffn", "router", "argmax", "act_quant_sim", "act_quant_staged_ok", "dequant", "dequant_ok", "l2_prefetch",
           "all_reduce_ll", "all_reduce_ll_fold"]
