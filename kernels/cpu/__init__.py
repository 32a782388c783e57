"""Our C++ CPU kernels, as llama.cpp's ggml-cpu: one set of sources (quant.cpp, quant_k.cpp: packed
linears; layers.cpp: the small fused layers; sample.cpp: argmax and sampling; decode.cpp: a whole decode
step in one call; repack.cpp: GGUF blocks into the kernels' layouts; pool.h: the thread pool), built
once per ISA variant (isa.py chooses it from the CPU's flags) by build.py, loaded and called through
ops.py."""
