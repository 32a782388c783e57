"""The sampling settings people chat with, named once for every bench: rosechat's `SamplingParams` fields
and llama-cpp-python's `generate()` arguments for the same computation."""

from __future__ import annotations

import argparse

SAMPLINGS: dict[str, dict[str, float | int]] = {
    "greedy": {},
    "app": {"repetition_penalty": 1.1, "repetition_window": 64},  # the app's default (config.toml [sampling])
    "t0.7-p0.9": {"temperature": 0.7, "top_p": 0.9},
}
# top_k 0 and min_p 0: off, as ours; repeat_penalty looks at the last 64 tokens (its default repeat_last_n)
SAMPLINGS_LLAMA: dict[str, dict[str, float | int]] = {
    "greedy": {"temp": 0.0, "top_k": 1},
    "app": {"temp": 0.0, "top_k": 1, "repeat_penalty": 1.1},
    "t0.7-p0.9": {"temp": 0.7, "top_p": 0.9, "top_k": 0, "min_p": 0.0},
}
GREEDY = "greedy"
# What each setting lets llama.cpp choose, for the output check: llama-cpp-python's sampler chain cuts
# top-p before it applies the temperature (ours and transformers' divide by the temperature first), so
# its nucleus is the one of the temperature-1 distribution, a wider one for temperatures below 1.
LLAMA_CPP_CHECK: dict[str, dict[str, float | int]] = {**SAMPLINGS, "t0.7-p0.9": {"temperature": 1.0, "top_p": 0.9}}


def sampling_list(text: str) -> tuple[str, ...]:
    """`--sampling a,b`: known names, in the order given."""
    names = tuple(dict.fromkeys(s.strip() for s in text.split(",") if s.strip()))
    unknown = sorted(set(names) - set(SAMPLINGS))
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown setting(s) {unknown}; choose from {', '.join(SAMPLINGS)}")
    return names


def describe() -> str:
    """For --help: each name with what it sets."""
    return ", ".join(f"{k} {v or {'temperature': 0}}" for k, v in SAMPLINGS.items())
