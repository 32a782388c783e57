"""Our CPU kernels: quantized linears (quant.cpp, quant_k.cpp: q4, q4k, q8, q8m, q6k blocks of 32, the
layouts described there), the fused small layers of a decode step (layers.cpp: RMSNorm, RoPE, SiLU * up,
the K/V write, one-query paged attention), sampling (sample.cpp), a whole Llama decode step (decode.cpp)
and a load's repack of GGUF blocks into these layouts (repack.cpp; kernels/cpu/repack.py).

Each ISA variant (kernels/cpu/isa.py) is built when the package is installed (setup.py: one extension
module per variant, beside this file) and loaded from there when its embedded source key matches these
sources, flags and torch; otherwise it is built at first use, once, into a directory keyed by that key.
`available()` says whether the chosen variant loaded, `unavailable_reason()` why not (torch's kernels run).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.machinery
import logging
import os
import shutil
import sys
import threading
from pathlib import Path

import torch
from torch import Tensor

from kernels.cpu import isa as cpu_isa
from kernels.cpu import tiles as cpu_tiles
from kernels.cpu.layouts import (  # noqa: F401 (the packers, here for the callers of cpu_ops)
    interleave_rows,
    pack_q4,
    pack_q6k,
    pack_q8,
    pack_scales,
    pack_sub_scales,
)

BLOCK = 32
_SOURCES = [Path(__file__).with_name(f)
            for f in ("quant.cpp", "quant_k.cpp", "layers.cpp", "sample.cpp", "decode.cpp", "repack.cpp")]
_HEADERS = [Path(__file__).with_name(f)
            for f in ("quant.h", "tile.h", "outer.h", "linear.h", "pool.h", "check.h", "vec.h")]
log = logging.getLogger(__name__)


_lock = threading.Lock()  # the engine thread and the UI may both ask first


def _build() -> str | None:
    """Compile (or load the build of) the ops once; None on success, else why they are unavailable."""
    with _lock:
        return _build_once()


def supported_cpu() -> bool:
    """Whether a variant of our kernels is meant to run here: a CPU with AVX2, and ROSECHAT_CPU_ISA not
    "generic" (elsewhere torch's kernels serve)."""
    try:
        return cpu_isa.choose().isa != "generic"
    except ValueError:  # a forced variant this CPU cannot run: _build_once reports it
        return False


def source_key(isa: str) -> str:
    """A hash of the `isa` variant's sources, flags, ISA, torch's and Python's versions: a build is loaded
    only by the sources, torch and CPU variant it was built from (setup.py embeds it in the module)."""
    key = hashlib.sha256()
    for f in _SOURCES + _HEADERS:
        key.update(f.read_bytes())
    key.update(" ".join([*_cflags(isa), isa, torch.__version__, sys.version]).encode())
    return key.hexdigest()


def build_dir(isa: str) -> Path:
    """Where the `isa` variant is built at run time (the install did not build it, or built other
    sources): keyed by source_key, so no checkout, torch or CPU ever loads another's build. In the
    environment where it is writable, else in the user cache."""
    root = Path(sys.prefix) / "share" / "rosechat-kernels"
    if not os.access(root if root.exists() else root.parent, os.W_OK) and not (root / isa).exists():
        import platformdirs

        root = Path(platformdirs.user_cache_dir("rosechat")) / "kernels"
    return root / f"{isa}-{source_key(isa)[:16]}"


KEY_MARK = b"rosechat-kernel-key:"  # + the source key, in the module's bytes (layers.cpp, ROSECHAT_KERNEL_KEY)


def installed_module(isa: str) -> Path | None:
    """The `isa` variant's extension module built at install (setup.py), beside this file, if any."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = Path(__file__).with_name(f"rosechat_cpu_{isa}{suffix}")
        if path.is_file():
            return path
    return None


def built_key(path: Path) -> str | None:
    """The source key a module was built from, read from its bytes, never by loading it: loading runs its
    static initialisers (SIGILL on a CPU without its ISA) and registers its operators (a second set aborts)."""
    data = path.read_bytes()
    at = data.find(KEY_MARK)
    return None if at < 0 else data[at + len(KEY_MARK) : at + len(KEY_MARK) + 64].decode("ascii", "replace")


def install_problem(isa: str) -> str | None:
    """None where the install built the `isa` variant from these sources, else what is wrong with it."""
    path = installed_module(isa)
    if path is None:
        return "were not built at install"
    if built_key(path) != source_key(isa):
        return "built at install are stale (sources, flags or torch changed since)"
    return None


def _cflags(isa: str) -> list[str]:
    # C++20 for std::atomic::wait (pool.h); no contraction: FMAs are written out where wanted, so
    # RoPE's products round as torch's do
    return ["-O3", "-std=c++20", *cpu_isa.CFLAGS[isa], "-ffp-contract=off"]


@functools.cache
def _build_once() -> str | None:
    global _running, _loaded_from
    if _running is not None:  # a process holds one variant's operators: a second would abort on load
        return None
    try:
        choice = cpu_isa.choose()
    except ValueError as e:
        return str(e)
    if choice.isa == "generic":
        return f"CPU kernels off: {choice.reason}"
    failed = []
    for candidate in [choice, *cpu_isa.fallbacks(choice)]:  # each one this CPU runs: never load another
        try:
            if install_problem(candidate.isa) is None:
                path = installed_module(candidate.isa)
            else:  # the runtime build, as a fallback
                where = build_dir(candidate.isa)
                done = where / "built"  # written after a build succeeded: a killed build leaves none
                if not done.exists():
                    _compile(candidate.isa, where, done)
                path = where / f"rosechat_cpu_{candidate.isa}.so"
            torch.ops.load_library(str(path))
        except Exception as exc:  # no compiler, no headers, flags it lacks: the next variant, then torch
            text = str(exc).strip()
            failed.append(f"{candidate.isa}: {text.splitlines()[-1] if text else type(exc).__name__}")
            log.warning("could not build the %s CPU kernels (%s)", candidate.isa, failed[-1])
            continue
        try:
            tiles = cpu_tiles.choose(candidate.isa)
        except ValueError as e:  # ROSECHAT_CPU_TILES set to what this variant cannot run
            return str(e)
        if tiles:
            candidate = dataclasses.replace(candidate, reason=f"{candidate.reason}, {tiles}")
        _running, _loaded_from = candidate, path
        log.info("CPU kernels: %s, from %s", candidate.reason, path)
        return None
    return f"could not build the CPU kernels ({'; '.join(failed)}): torch's own kernels run instead"


def _compile(isa: str, where: Path, done: Path) -> None:
    """Build the `isa` variant into `where`, one process at a time. The lock is an flock, released by
    the OS when its holder dies, so a killed build never blocks the next; torch's own lock file left
    by that build is removed under it."""
    import fcntl

    from torch.utils import cpp_extension

    where.mkdir(parents=True, exist_ok=True)
    with open(where.with_name(where.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if done.exists():  # another process built it while this one waited
            return
        log.warning("CPU kernels %s: building now (%s, once, in %s)", install_problem(isa), isa, where)
        (where / "lock").unlink(missing_ok=True)
        ninja_on_path()
        cpp_extension.load(name=f"rosechat_cpu_{isa}", sources=[str(f) for f in _SOURCES], is_python_module=False,
                           extra_cflags=_cflags(isa), build_directory=str(where), verbose=False)
        done.touch()


def ninja_on_path() -> None:
    """torch's builds run `ninja`: the one our dependencies install beside this Python, venv not activated."""
    bin_dir = str(Path(sys.executable).parent)
    if shutil.which("ninja") is None and bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join((bin_dir, os.environ.get("PATH", "")))


def needs_build() -> bool:
    """Whether the first use will compile the kernels (setup did not build them): a front end says so."""
    if _built or _build_once.cache_info().currsize:
        return False
    try:
        choice = cpu_isa.choose()
    except ValueError:
        return False
    return (choice.isa != "generic" and install_problem(choice.isa) is not None
            and not (build_dir(choice.isa) / "built").exists())


def build_status() -> str:
    """One line on which kernels run: "rosechat avx2 (…)" or "torch (why)", for titles and bench headers."""
    reason = _build()
    if reason is None and _running is not None:
        return f"rosechat {_running.reason}"
    return f"torch ({reason})"


_built = False  # once built, asked on every layer call: no lock
_running: cpu_isa.IsaChoice | None = None  # the variant loaded
_loaded_from: Path | None = None  # its library: the install's module or a runtime build


def loaded_from() -> Path | None:
    """The library the running variant was loaded from (None before it loaded, or where none did)."""
    return _loaded_from if available() else None


def available() -> bool:
    global _built
    if not _built:
        _built = _build() is None
    return _built


# ROSECHAT_CPU_LAYERS (to compare; tests flip the flags): "layers" (default) runs a decode step's
# Llama layers in one call where they qualify, "ops" the fused small layers from the Python
# modules, "torch" ATen's ops only
_LAYERS = os.environ.get("ROSECHAT_CPU_LAYERS", "layers")
fused_layers = _LAYERS != "torch"
whole_layers = _LAYERS == "layers"


def use_fused(t: Tensor) -> bool:
    """Whether float32 CPU tensor t goes through the fused layers (built at the first ask)."""
    return t.dtype == torch.float32 and t.is_cpu and fused_layers and (_built or available())


def unavailable_reason() -> str | None:
    return _build()


_EMPTY = torch.empty(0)  # "no offsets" for q6k


def q4_linear(x: Tensor, qs: Tensor, d: Tensor, m: Tensor) -> Tensor:
    """x [M, K] float32 @ (qs * d + m, per block of 32).T -> [M, N] float32; qs: pack_q4's layout
    [N, ceil(K/64) * 32] uint8, d and m: pack_scales' layout, both float32 or both float16."""
    return torch.ops.rosechat_quant.q4_linear(x, qs, d, m)


def q4k_linear(x: Tensor, qs: Tensor, dd: Tensor, sc: Tensor) -> Tensor:
    """x [M, K] float32 @ ((d * sc) * q - dmin * mn, per block of 32).T -> [M, N] float32 (GGUF's Q4_K as the
    file holds it); qs: pack_q4's layout, dd: each super-block's float16 (d, dmin) and sc: each block's uint8
    (sc, mn), both pack_sub_scales' layout of the pairs."""
    return torch.ops.rosechat_quant.q4k_linear(x, qs, dd, sc)


def q8_linear(x: Tensor, qs: Tensor, d: Tensor) -> Tensor:
    """x [M, K] float32 @ (qs [N, K] int8 in pack_q8's order * d, per block of 32).T -> [M, N] float32;
    d: pack_scales' layout, float32 or float16."""
    return torch.ops.rosechat_quant.q8_linear(x, qs, d)


def q8m_linear(x: Tensor, qs: Tensor, d: Tensor, m: Tensor) -> Tensor:
    """x [M, K] float32 @ (qs * d + m, per block of 32).T -> [M, N] float32; qs as q8_linear's, d and m
    pack_scales' layout (GGUF's Q5_1 and Q5_K, exactly)."""
    return torch.ops.rosechat_quant.q8m_linear(x, qs, d, m)


def q6k_linear(x: Tensor, qs: Tensor, d: Tensor, sc: Tensor, m: Tensor | None = None) -> Tensor:
    """x [M, K] float32 @ (q * d * sc (+ m)).T -> [M, N] float32; q the 6-bit values in pack_q6k's layout, d
    float16 (Q6_K's own) per 256 weights in pack_scales' layout, sc int8 per 16 in pack_sub_scales', m (or
    None) per 32 as pack_scales lays it out (GGUF's Q6_K, and Q4_K / Q5_K rows beside them)."""
    return torch.ops.rosechat_quant.q6k_linear(x, qs, d, sc, _EMPTY if m is None else m)


def q8m_rows(qs: Tensor, d: Tensor, m: Tensor, ids: Tensor) -> Tensor:
    """Rows ids (int64, any shape) of a q8m_linear weight as float32 [*ids.shape, K]."""
    return torch.ops.rosechat_quant.q8m_rows(qs, d, m, ids)


def q6k_rows(qs: Tensor, d: Tensor, sc: Tensor, m: Tensor | None, ids: Tensor) -> Tensor:
    """Rows ids (int64, any shape) of a q6k_linear weight as float32 [*ids.shape, K]."""
    return torch.ops.rosechat_quant.q6k_rows(qs, d, sc, _EMPTY if m is None else m, ids)


def q4_rows(qs: Tensor, d: Tensor, m: Tensor, ids: Tensor) -> Tensor:
    """Rows ids (int64, any shape) of a q4_linear weight as float32 [*ids.shape, K]."""
    return torch.ops.rosechat_quant.q4_rows(qs, d, m, ids)


def q4k_rows(qs: Tensor, dd: Tensor, sc: Tensor, ids: Tensor) -> Tensor:
    """Rows ids (int64, any shape) of a q4k_linear weight as float32 [*ids.shape, K]."""
    return torch.ops.rosechat_quant.q4k_rows(qs, dd, sc, ids)


def q8_rows(qs: Tensor, d: Tensor, ids: Tensor) -> Tensor:
    """Rows ids (int64, any shape) of a q8_linear weight as float32 [*ids.shape, K]."""
    return torch.ops.rosechat_quant.q8_rows(qs, d, ids)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dim of a contiguous float32 x [T, N]."""
    return torch.ops.rosechat_layers.rms_norm(x, weight, eps)


def add_rms_norm_(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> None:
    """In place: residual += x, then x = RMSNorm(residual)."""
    torch.ops.rosechat_layers.add_rms_norm_(x, residual, weight, eps)


def rotary_(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> None:
    """Neox RoPE in place on q [T, Hq, D] and k [T, Hk, D]; cos, sin: [T, 1, D/2]."""
    torch.ops.rosechat_layers.rotary_(q, k, cos, sin)


def silu_mul(x: Tensor) -> Tensor:
    """x [T, 2I] = gate | up -> silu(gate) * up [T, I]."""
    return torch.ops.rosechat_layers.silu_mul(x)


def write_kv(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor) -> None:
    """k, v [T, Hkv, D] into the caches' slots [T] int64 (-1: skipped)."""
    torch.ops.rosechat_layers.write_kv(k, v, k_cache, v_cache, slots)


def decode_attention(q: Tensor, k_rows: Tensor, v_rows: Tensor, slots: Tensor, counts: Tensor,
                     scale: float) -> tuple[Tensor, Tensor]:
    """q [n, Hq, D] against the first counts[i] of slots [n, L] in k_rows / v_rows [S, Hkv * D]:
    (out [n, Hq, D], log-sum-exp of the scaled scores [n, Hq])."""
    return torch.ops.rosechat_layers.decode_attention(q, k_rows, v_rows, slots, counts, scale)


def argmax_rows(x: Tensor) -> Tensor:
    """Each row's first index of its maximum (as torch.argmax: NaN counts as the maximum), x [B, V] float32."""
    return torch.ops.rosechat_layers.argmax_rows(x)


def sample_rows(logits: Tensor, seen: Tensor, seen_offsets: Tensor, penalties: Tensor, temperatures: Tensor,
                top_ks: Tensor, top_ps: Tensor, min_ps: Tensor, uniforms: Tensor) -> Tensor:
    """Next token of each row of logits [B, V] float32 (left as they were): row r's repetition penalty on
    ids seen[seen_offsets[r]:seen_offsets[r + 1]], then argmax where temperatures[r] == 0, else temperature,
    top-k (0 = off), top-p (1 = off), min-p (0 = off) and the draw at uniforms[r] (float64 in [0, 1))."""
    return torch.ops.rosechat_layers.sample_rows(logits, seen, seen_offsets, penalties, temperatures, top_ks,
                                                 top_ps, min_ps, uniforms)


def llama_decode_weights(weights: list[Tensor], eps: float, scale: float, num_heads: int,
                         num_kv_heads: int) -> torch.ScriptObject:
    """A Llama model's decode weights held in C++ for llama_decode: per layer the two norms, then
    (qs, d, m, sc) of qkv, o, gate_up and down (18 tensors: a BlockWeight's decode_operands()); then the
    final norm."""
    return torch.classes.rosechat_decode.LlamaDecodeWeights(weights, eps, scale, num_heads, num_kv_heads)


def llama_decode(model: torch.ScriptObject, x: Tensor, cos: Tensor, sin: Tensor, k_pool: Tensor, v_pool: Tensor,
                 slot_mapping: Tensor, att_slots: Tensor, att_counts: Tensor, prefix_seqs: list[Tensor],
                 prefix_blocks: list[Tensor], prefix_first: list[int]) -> Tensor:
    """Every Llama layer of a decode-only step, then the final norm, in one call (decode.cpp): x [T, H]
    embedded tokens -> normed hidden states; k_pool / v_pool the whole KV pool [layers, ...]. Attention:
    each sequence's own keys (att_slots [T, L], att_counts [T]), then each shared prefix (members,
    empty = all; its blocks; its first block if consecutive, else -1) for all its members."""
    return torch.ops.rosechat_decode.llama_decode(model, x, cos, sin, k_pool, v_pool, slot_mapping, att_slots,
                                                  att_counts, prefix_seqs, prefix_blocks, prefix_first)
