"""Sharded safetensors store of captured hidden states: atomic shard commits, a JSON manifest, resume, verify.

    from hstap.store import open_store, StoreWriter, store_info, verify_store

The names below are imported on first use (PEP 562), so `hstap --help` reads store/config.py without torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "bytes_per_token": "estimate", "capture_specs": "estimate", "check_free_space": "estimate",
    "conventional_specs": "estimate", "human_bytes": "estimate",
    "Manifest": "manifest", "StoreMeta": "manifest", "TensorSpec": "manifest", "load_manifest": "manifest",
    "Store": "reader", "open_store": "reader", "store_info": "reader", "verify_store": "reader",
    "StoreWriter": "writer",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"hstap.store.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'hstap.store' has no attribute {name!r}")
