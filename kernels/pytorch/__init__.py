"""The PyTorch path of the attention kernels (every device; the CPU's): paged decode with cascade
attention over shared prefixes (decode.py), sliced prefill (prefill.py), the KV cache write and
block copies (cache.py), memory budgets for their intermediates (budget.py). Where our C++ kernels
are built, decode attention and the cache write call them (kernels.cpu.ops)."""
