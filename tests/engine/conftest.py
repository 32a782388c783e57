"""Engine test fixtures: tiny random model folders, built once per session and shared."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import make_tiny_model


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """`factory(arch, **overrides) -> folder`: saves each distinct tiny model once per session.
    Treat the folders as read-only; copy one before modifying it."""
    cache: dict[str, Path] = {}

    def factory(arch: str, **overrides: Any) -> Path:
        key = f"{arch}:{sorted(overrides.items())!r}"
        if key not in cache:
            cache[key] = make_tiny_model(tmp_path_factory.mktemp(arch), arch, **overrides)
        return cache[key]

    return factory


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_factory: Callable[..., Path]) -> Path:
    """A plain tiny Llama folder (GQA 2, tied embeddings) for tests that just need a model."""
    return tiny_model_factory("llama", tie_word_embeddings=True)
