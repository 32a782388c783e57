"""rosechat: terminal chat for local language models on a paged KV-cache engine."""

__version__ = "0.1.0"
