"""Weights: how a checkpoint's tensor becomes the operand a kernel multiplies.

    source.py      where a model comes from (demo, packaged, GGUF file, HF folder or hub id), checked
                   without reading weights
    gguf.py        a GGUF file through the `gguf` package: config, tokenizer, tensors (dense, or raw
                   blocks for a packed load)
    gguf_header.py the file's header and metadata arrays, read quickly
    gguf_meta.py   the config and tokenizer transformers makes of a GGUF file, without its slow passes
    gguf_config.py the converted config and tokenizer, kept in a cache folder per file
    blocks.py      GGUFBlocks: a quantized matrix as its raw GGUF blocks (BlockShards: of mixed types);
                   GGML's byte layout
    formats.py     each GGUF type's packed form under "auto", whether it has a kernel, its memory
    q4.py          the 4-bit format: Q4_0 / Q4_1 -> Q4HalfWeight, Q4_K -> Q4KWeight (ours), Int4Weight (torch's)
    q5.py          the 5-bit formats: Q5_0 -> Q8Weight, Q5_1 / Q5_K -> Q8MWeight (our CPU kernels)
    q6.py          the 6-bit format: Q6_K (and mixed K-quant shards) -> Q6Weight (our CPU kernels)
    q8.py          the 8-bit format: Q8_0 -> Q8Weight (our CPU kernels), Int8Weight (torch's)
    packed.py      PackedWeight, what a packed operand offers; BlockWeight; GPUBlockWeight (Triton)
    routes.py      which kernels multiply packed weights on a device, and pack(): one matrix for them
    packing.py     PackedLinear / PackedEmbedding, and which modules a load packs in which format
    checkpoint.py  load_weights: checkpoint tensors into a built model's parameters and packed modules
    memory.py      whether a GGUF model and the smallest KV cache fit the available memory (before loading)
    cache.py       the weight cache: a packed load's tensors saved once, mapped by the next load
    cache_entries.py  the cache's folder: each entry's header, the pruning of stale entries, clearing
    loader.py      load_model: a name to a LoadedModel, through all of the above

Callers import from the modules themselves; this package imports nothing, since engine.models imports
packed.py (BlockWeight) while loader.py imports engine.models.
"""
