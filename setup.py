"""Build hooks: a wheel carries the compiled custom-op library.

``pip wheel .`` (and ``pip install .``) compile onnxfuse's C++ library with onnxfuse/build.py
and put it, with a stamp naming the sources it was built from (``libonnxfuse_ops.json``), in
the wheel's ``onnxfuse/lib/``. The wheel is then tagged ``py3-none-<platform>``: the library
depends on the platform, not on the Python version. Editable installs (``pip install -e .``)
build nothing: the library is built on first use, as from any source checkout.

``ONNXFUSE_WHEEL_LIBRARY``: ``all`` (default: CPU and CUDA kernels; a cuda.h must be found,
which build_backend/ installs for wheel builds), ``cpu`` (CPU kernels only) or ``none`` (a pure
wheel without the library, which is then built on first use).
"""

from __future__ import annotations

import importlib
import os
import sys
import types
from pathlib import Path

from setuptools import Distribution as _Distribution
from setuptools import setup
from setuptools.command.build_py import build_py

try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # setuptools < 70.1
    from wheel.bdist_wheel import bdist_wheel

ROOT = Path(__file__).resolve().parent
MODES = ("all", "cpu", "none")


def library_mode() -> str:
    mode = os.environ.get("ONNXFUSE_WHEEL_LIBRARY", "all").strip().lower() or "all"
    if mode not in MODES:
        raise SystemExit(f"ONNXFUSE_WHEEL_LIBRARY={mode!r}: expected one of {', '.join(MODES)}")
    return mode


def load_build_module() -> types.ModuleType:
    """This checkout's onnxfuse/build.py, without running onnxfuse/__init__ (whose
    dependencies the build environment lacks) and whatever onnxfuse is installed."""
    names = ("onnxfuse", "onnxfuse.errors", "onnxfuse.build")
    saved = {n: sys.modules.pop(n) for n in names if n in sys.modules}
    pkg = types.ModuleType("onnxfuse")
    pkg.__path__ = [str(ROOT / "onnxfuse")]
    sys.modules["onnxfuse"] = pkg
    try:
        return importlib.import_module("onnxfuse.build")
    finally:
        for n in names:
            sys.modules.pop(n, None)
        sys.modules.update(saved)


class BuildPyWithLibrary(build_py):
    """build_py, then the library into <build_lib>/onnxfuse/lib (not for editable installs)."""

    def run(self) -> None:
        super().run()
        mode = library_mode()
        if self.editable_mode or mode == "none":
            return
        build = load_build_module()
        dest = Path(self.build_lib) / "onnxfuse" / "lib"
        try:
            lib = build.write_prebuilt(dest, require_cuda=mode == "all", verbose=True)
        except build.OnnxfuseError as e:
            raise SystemExit(f"onnxfuse: building the custom-op library for the wheel failed: {e} "
                             "(ONNXFUSE_WHEEL_LIBRARY=none builds a wheel without it)") from None
        print(f"onnxfuse: wheel library {lib} ({(dest / build.STAMP_NAME).read_text().strip()})")


class Distribution(_Distribution):
    library_in_wheel = False

    def has_ext_modules(self) -> bool:
        # a compiled file in the package: not pure (the wheel's files go to platlib, its root)
        return self.library_in_wheel or super().has_ext_modules()


class PlatformWheel(bdist_wheel):
    """A wheel holding the library is platform-specific, whatever Python runs it."""

    def finalize_options(self) -> None:
        editable = "editable_wheel" in self.distribution.command_obj
        if not editable and library_mode() != "none":
            self.distribution.library_in_wheel = True
        super().finalize_options()

    def get_tag(self) -> tuple[str, str, str]:
        impl, abi, plat = super().get_tag()
        return ("py3", "none", plat) if not self.root_is_pure else (impl, abi, plat)


setup(distclass=Distribution, cmdclass={"build_py": BuildPyWithLibrary, "bdist_wheel": PlatformWheel})
