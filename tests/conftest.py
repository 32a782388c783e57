import os
import tempfile

# GGUF config/tokenizer conversions are cached per file: keep the tests' out of the user's cache.
os.environ.setdefault("ROSECHAT_CACHE_DIR", tempfile.mkdtemp(prefix="rosechat-test-cache-"))

# Triton kernels run under the interpreter on CPU-only machines; compiled where CUDA is present.
# Must be set before triton.jit decorates anything, so it lives at the top of the root conftest.
try:
    import torch

    _cuda = torch.cuda.is_available()
except ImportError:  # pragma: no cover
    _cuda = False
if not _cuda:
    os.environ.setdefault("TRITON_INTERPRET", "1")
