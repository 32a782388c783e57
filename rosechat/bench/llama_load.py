"""llama.cpp (llama-cpp-python) as every benchmark opens it, and what it ran, in words.

llama.cpp puts a model's weights in "extra" CPU buffer types where it has kernels for them: AMX tiles
on CPUs that have them, and repacked (interleaved) layouts. On an AMX CPU (Intel Sapphire Rapids and
later) llama-cpp-python 0.3.36's AMX matmul crashes the process (SIGSEGV in ggml_backend_amx_mul_mat)
on every batch of two or more tokens, so no comparison can run; there, by default, the extra buffer
types are off (llama.cpp's `--no-repack` / `use_extra_bufts = false`) and its AVX-512 kernels run, and
the report says so. ROSECHAT_LLAMA_EXTRA_BUFTS=on|off chooses either way (on: for a llama.cpp whose
AMX path works).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

ENV = "ROSECHAT_LLAMA_EXTRA_BUFTS"
CPUINFO = "/proc/cpuinfo"


def _has_amx() -> bool:
    try:
        return " amx_tile" in Path(CPUINFO).read_text()
    except OSError:
        return False


def extra_bufts() -> tuple[bool, str]:
    """(whether llama.cpp may use its extra CPU buffer types, why not when it may not)."""
    choice = os.environ.get(ENV, "auto").strip().lower()
    if choice not in ("auto", "on", "off"):
        raise ValueError(f"{ENV} must be auto, on or off, not {choice!r}")
    if choice == "on":
        return True, ""
    if choice == "off":
        return False, f"extra buffer types off ({ENV}=off)"
    if _has_amx():
        return False, f"extra buffer types off: its AMX matmul crashes on this CPU ({ENV}=on to try it)"
    return True, ""


def open_llama(model_path: str, **kwargs: Any) -> Any:
    """llama_cpp.Llama(model_path, **kwargs), its extra CPU buffer types on or off as `extra_bufts` says."""
    import llama_cpp
    from llama_cpp import llama as high_level

    use, _ = extra_bufts()
    if use:
        return llama_cpp.Llama(model_path=model_path, **kwargs)
    defaults = high_level.llama_cpp.llama_model_default_params  # what Llama() starts its model params from

    def without_extra_bufts() -> Any:
        params = defaults()
        params.use_extra_bufts = False
        return params

    high_level.llama_cpp.llama_model_default_params = without_extra_bufts
    try:
        return llama_cpp.Llama(model_path=model_path, **kwargs)
    finally:
        high_level.llama_cpp.llama_model_default_params = defaults


def llama_ran() -> str:
    """What llama.cpp ran: its CPU features, and its buffer types when they are not its default."""
    import llama_cpp

    features = llama_cpp.llama_print_system_info().decode().split("|")
    ran = "llama.cpp " + " ".join(f for f in features if f.strip().endswith("= 1") or "CPU :" in f).strip()
    _, why = extra_bufts()
    return f"{ran} ({why})" if why else ran
