"""`rosechat bench`: the rosechat engine side by side with `transformers`, in one process."""

from rosechat.bench.cli import main

__all__ = ["main"]
