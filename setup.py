"""Package layout: the three sides live in top-level folders but import as one namespace.

pyproject.toml holds the metadata; this file only maps folders to import names, since a static
`package-dir` table cannot list the sub-packages of each side without repeating them.
"""

from setuptools import find_packages, setup

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


setup(packages=_packages(), package_dir=ROOTS)
