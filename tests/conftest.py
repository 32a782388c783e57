import os

# Triton kernels run under the interpreter on CPU-only machines; compiled where CUDA is present.
# Must be set before triton.jit decorates anything, so it lives at the top of the root conftest.
try:
    import torch

    _cuda = torch.cuda.is_available()
except ImportError:  # pragma: no cover
    _cuda = False
if not _cuda:
    os.environ.setdefault("TRITON_INTERPRET", "1")
