"""Builds the `kvconnector._kvcopy` extension from this package's csrc/ (so the sdist is self-contained).

setuptools wants source paths relative to this file.
"""

from pathlib import Path

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

_HERE = Path(__file__).resolve().parent
_SOURCES = sorted(p.relative_to(_HERE).as_posix() for p in (_HERE / "csrc").glob("*.cpp"))

setup(
    ext_modules=[
        Pybind11Extension(
            "kvconnector._kvcopy",
            _SOURCES,
            cxx_std=17,
            extra_compile_args=["-O3", "-pthread"],
            extra_link_args=["-pthread"],
        )
    ],
    cmdclass={"build_ext": build_ext},
)
