"""The build backend's hook (setuptools, see pyproject.toml): builds our C++ CPU kernels at install, every
ISA variant as an extension module of its own (kernels/cpu/build.py). An install that cannot compile
them still succeeds, says why, and leaves the build to the first use."""

import sys
from pathlib import Path

from setuptools import setup

sys.path.insert(0, str(Path(__file__).resolve().parent))
try:
    from kernels.cpu import build
except ImportError as exc:  # no torch where the package is built
    print(f"rosechat: CPU kernels not built at install ({exc}): the first use builds them", file=sys.stderr)
    setup()
else:
    setup(**build.setup_args())
