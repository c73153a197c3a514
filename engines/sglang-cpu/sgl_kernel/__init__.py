"""Stand-in for SGLang's CUDA kernel package (`sgl-kernel` / `sglang-kernel`), for SGLang's CPU engine only.

No CPU build of the kernel package exists on PyPI, yet SGLang 0.5.20 imports names from `sgl_kernel` at module level
on paths its CPU engine loads (e.g. `sglang/kernels/ops/kvcache/cache_move.py:10`, `from sgl_kernel import
copy_all_layer_kv_cache_cpu`) without calling them when it serves with `SGLANG_USE_CPU_ENGINE=1 --device cpu
--attention-backend torch_native --sampling-backend pytorch`. So every name imports, and calling any of them raises:
a kernel the CPU engine did need would fail loudly at its first call, never compute something else.

Installed by engines/sglang.sh into `.venv-sglang` only; never into hstap's own environment.
"""

from __future__ import annotations

from typing import NoReturn


class MissingKernel:
    """A kernel name that imports but cannot run: calling it (or anything under it) raises."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __call__(self, *args: object, **kwargs: object) -> NoReturn:
        raise RuntimeError(f"sgl_kernel.{self._name} was called, but this is hstap's CPU stand-in for the CUDA "
                           "kernel package (engines/sglang-cpu): only SGLang's CPU engine runs in this environment")

    def __getattr__(self, name: str) -> "MissingKernel":
        if name.startswith("__"):
            raise AttributeError(name)
        return MissingKernel(f"{self._name}.{name}")

    def __repr__(self) -> str:
        return f"<sgl_kernel stand-in {self._name}>"


def __getattr__(name: str) -> MissingKernel:
    if name.startswith("__"):  # dunders (__path__, __file__, ...): what a real module lacks, this one lacks too
        raise AttributeError(name)
    return MissingKernel(name)
