"""Freed heap memory handed back to the OS: glibc keeps freed pages in each thread's malloc arena, and they
count as resident (a load's peak). Imports nothing of the engine, so any module may call it."""

from __future__ import annotations


def release_freed_memory() -> None:
    """Hand memory freed during a load back to the OS: packing's and dequantizing's temporaries, a tokenizer
    conversion's (in its thread's own arena)."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        ctypes.CDLL(name).malloc_trim(0)
    except (OSError, AttributeError, TypeError):  # not glibc
        pass


__all__ = ["release_freed_memory"]
