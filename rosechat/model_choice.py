"""Which model the app runs, decided before the UI starts.

An explicitly named model (a flag, the user's file, ``--config``) that cannot load is an error the
command line reports and exits on. Only the shipped default falls back to the demo model, with a
notice saying how to install the real one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rosechat.config import Config

if TYPE_CHECKING:
    from engine import ModelSource


class ModelChoiceError(Exception):
    """The configured model cannot run here; the message says what, why and what to do."""


def choose_model(config: Config) -> tuple[ModelSource, str | None]:
    """(where the model is, a notice when the demo runs instead of the default). Checks the
    device and backend too, so nothing the engine would refuse reaches the UI."""
    from engine import EngineConfig, ModelNotFoundError, check_source_fits, resolve_model

    name = config.model.name
    try:
        EngineConfig(model=name, **config.engine_kwargs())
    except ValueError as e:
        raise ModelChoiceError(f"cannot run on this machine: {_one_line(e)}") from None
    try:
        source = resolve_model(name)
        source.quantization = config.model.quantization  # load_model's default for this source
        # too large for this machine: said now, not by the OOM killer halfway through the load
        check_source_fits(source, config.model.device, config.model.dtype, config.model.quantization)
        return source, None
    except ModelNotFoundError as e:
        if not config.is_default("model.name"):
            raise ModelChoiceError(
                f"{_one_line(e)}. Give --model a .gguf file, a Hugging Face model folder or hub id, or 'demo'"
            ) from None
        notice = f"{e}\nRunning the built-in demo model (random weights) instead."
        return resolve_model("demo"), notice
    except (ValueError, OSError) as e:  # unsupported architecture, broken folder or file
        raise ModelChoiceError(f"cannot load model {name!r}: {_one_line(e)}") from None


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split()).rstrip(".")


__all__ = ["ModelChoiceError", "choose_model"]
