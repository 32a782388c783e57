"""Triton kernels (CUDA; on a CPU only under TRITON_INTERPRET=1, as the tests run them): paged decode
and prefill attention over a shared tile loop (tiles.py), the KV cache write and block copies
(cache.py), packed GGML blocks (quant.py); compile_check.py compiles them for a GPU without one."""
