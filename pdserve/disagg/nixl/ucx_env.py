"""The UCX environment a NIXL agent needs for a KV pool on the GPU, set before UCX loads.

UCX reads its variables once, when NIXL loads it, so these go into os.environ before the agent is
made, each only where the environment does not set it already (the user's own values win):
- `UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y`: UCX reads VRAM over cuda_ipc; without it, over tcp, which is
  orders of magnitude slower (docs/pd-gpu.md).
- `UCX_MODULE_DIR`: the UCX plugin folder of the installed NIXL wheel (`ucx_module_dir()`), so the
  UCX that NIXL loads uses the plugins built with it.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

UCX_GPU_DEFAULTS = {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y"}
NIXL_BACKEND_PACKAGES = ("nixl_cu13", "nixl_cu12", "nixl")  # wheels that ship <name>.libs/ucx


def _cuda_major() -> int | None:
    try:  # the nixl meta package's own choice of backend wheel (a plain module: loads no UCX)
        from nixl_meta_utils import detect_cuda_major
    except ImportError:
        return None
    return detect_cuda_major()


def ucx_module_dir(cuda_major: int | None = None) -> str | None:
    """The UCX plugin folder (`<package>.libs/ucx`) of the NIXL backend wheel that `import nixl`
    loads: nixl_cu<major> for the CUDA major of this process (torch's), else the first installed
    of NIXL_BACKEND_PACKAGES. Found on disk, without importing nixl. None when there is none."""
    major = _cuda_major() if cuda_major is None else cuda_major
    names = ((f"nixl_cu{major}",) if major else ()) + NIXL_BACKEND_PACKAGES
    for name in names:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            continue
        folder = Path(next(iter(spec.submodule_search_locations))).parent / f"{name}.libs" / "ucx"
        if folder.is_dir():
            return str(folder)
    return None


def apply_ucx_gpu_defaults(environ: dict | None = None) -> dict[str, str]:
    """Set UCX_GPU_DEFAULTS and UCX_MODULE_DIR in `environ` (os.environ) where unset, before UCX
    loads; returns what was set (the user's own values always win)."""
    env = os.environ if environ is None else environ
    wanted = dict(UCX_GPU_DEFAULTS)
    module_dir = ucx_module_dir()
    if module_dir is not None:
        wanted["UCX_MODULE_DIR"] = module_dir
    applied = {k: v for k, v in wanted.items() if k not in env}
    env.update(applied)
    return applied
