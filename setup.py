"""Package layout: the three sides live in top-level folders but import as one namespace.

pyproject.toml holds the metadata; this file only maps folders to import names, since a static
`package-dir` table cannot list the sub-packages of each side without repeating them.
"""

import sys

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOTS = {
    "seedfed": "seedfed",
    "seedfed.shared": "shared",
    "seedfed.client": "client",
    "seedfed.server": "server",
}


def _packages() -> list[str]:
    found: list[str] = []
    for name, folder in ROOTS.items():
        found.append(name)
        found.extend(f"{name}.{sub}" for sub in find_packages(folder))
    return found


#: The perturbation stream's C kernel (Philox + fused multi-seed adds), loaded with ctypes by
#: shared/model/zkernel.py. No Python.h needed; -ffp-contract=off and no -ffast-math keep every
#: addition one IEEE float32 addition (the replay contract).
ZKERNEL = Extension(
    "seedfed.shared.model._zkernel",
    sources=["shared/model/_zkernel.c"],
    extra_compile_args=["-O3", "-ffp-contract=off", "-fno-fast-math", "-Wno-psabi"],
)


class OptionalBuildExt(build_ext):
    """The kernel is optional: without a working C compiler the package installs and
    stream.py runs its numpy path (same bits, slower)."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as e:  # noqa: BLE001 - any compiler failure means "no kernel"
            print(f"seedfed: C stream kernel not built ({e}); using the numpy path",
                  file=sys.stderr)

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as e:  # noqa: BLE001
            print(f"seedfed: C stream kernel not built ({e}); using the numpy path",
                  file=sys.stderr)


setup(packages=_packages(), package_dir=ROOTS, ext_modules=[ZKERNEL],
      cmdclass={"build_ext": OptionalBuildExt})
