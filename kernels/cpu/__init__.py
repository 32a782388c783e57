"""Our C++ CPU kernels, as llama.cpp's ggml-cpu: one set of sources (quant.cpp: packed linears;
layers.cpp: the small fused layers and the sampler; decode.cpp: a whole decode step in one call;
pool.h: the thread pool), built once per ISA variant (isa.py chooses it from the CPU's flags) by
build.py, loaded and called through ops.py."""
