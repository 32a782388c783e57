"""Build every ISA variant of our CPU kernels ahead, into the environment: `python -m kernels.build`
(`make setup` runs it, so no first launch waits on a compiler)."""

from __future__ import annotations

import logging
import shutil
import sys

from kernels import cpu_isa, cpu_ops


def main() -> int:
    """Build every ISA variant ahead (setup): `python -m kernels.cpu_ops`."""
    import time

    from torch.utils import cpp_extension

    logging.basicConfig(level=logging.ERROR)
    if shutil.which(cpp_extension.get_cxx_compiler()) is None:
        print(f"no C++ compiler ({cpp_extension.get_cxx_compiler()}): torch's own CPU kernels will run")
        return 0
    failed = 0
    for isa in cpu_isa.BUILT:
        where, t0 = cpu_ops.build_dir(isa), time.perf_counter()
        if (where / "built").exists():
            print(f"CPU kernels ({isa}): built, in {where}")
            continue
        print(f"building CPU kernels ({isa})… ", end="", flush=True)
        try:
            cpu_ops._compile(isa, where, where / "built")
        except Exception as exc:  # the runtime falls back to torch's kernels and says so
            failed += 1
            print(f"failed: {str(exc).strip().splitlines()[-1] if str(exc).strip() else exc}")
            continue
        print(f"{time.perf_counter() - t0:.1f} s, in {where}")
    print(f"this CPU runs: {cpu_isa.choose(forced='').reason}" + (" (torch's kernels where a build failed)"
                                                                   if failed else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
