"""The build backend's hook (setuptools, see pyproject.toml): builds our C++ CPU kernels at install, every
ISA variant as an extension module of its own (kernels/cpu/build.py). An install that cannot compile
them still succeeds, says why, and leaves the build to the first use. ROSECHAT_BUILD_KERNELS=0 builds
none (`make setup` installs the dependencies so, then builds the kernels as a step of its own)."""

import os
import sys
import warnings
from pathlib import Path

from setuptools import setup


def _kernels() -> dict:
    if os.environ.get("ROSECHAT_BUILD_KERNELS") == "0":
        print("rosechat: CPU kernels not built by this install (ROSECHAT_BUILD_KERNELS=0)", file=sys.stderr)
        return {}
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")  # torch's, before numpy is installed
    try:
        from kernels.cpu import build
    except ImportError as exc:  # no torch where the package is built
        print(f"rosechat: CPU kernels not built at install ({exc}): the first use builds them", file=sys.stderr)
        return {}
    return build.setup_args()


setup(**_kernels())
