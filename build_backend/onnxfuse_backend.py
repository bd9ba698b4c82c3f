"""The PEP 517 build backend: setuptools', plus a cuda.h for wheel builds.

The wheel's library has CUDA kernels, compiled against the CUDA driver API header (types
only: libcuda is opened at run time). A wheel build gets that header from the small
nvidia-cuda-runtime-cu12 wheel; editable installs and sdists need nothing beyond setuptools.
"""

from __future__ import annotations

import os

from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F403 (every hook, as setuptools defines it)

CUDA_HEADERS = ('nvidia-cuda-runtime-cu12; platform_system == "Linux" '
                'and (platform_machine == "x86_64" or platform_machine == "aarch64")')


def get_requires_for_build_wheel(config_settings=None):
    requires = list(_setuptools.get_requires_for_build_wheel(config_settings))
    if os.environ.get("ONNXFUSE_WHEEL_LIBRARY", "all").strip().lower() in ("all", ""):
        requires.append(CUDA_HEADERS)
    return requires
