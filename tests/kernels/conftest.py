import sys
from pathlib import Path

# Plain `pytest` (unlike `python -m pytest`) leaves the repo root off sys.path, and then this
# directory (no __init__.py) shadows the real `kernels` package as a namespace package.
_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
