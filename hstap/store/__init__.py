"""Sharded safetensors store of captured hidden states: atomic shard commits, a JSON manifest, resume, verify."""

from hstap.store.estimate import bytes_per_token, check_free_space, conventional_specs, human_bytes
from hstap.store.manifest import Manifest, StoreMeta, TensorSpec, load_manifest
from hstap.store.reader import Store, open_store, store_info, verify_store
from hstap.store.writer import StoreWriter

__all__ = [
    "Manifest",
    "Store",
    "StoreMeta",
    "StoreWriter",
    "TensorSpec",
    "bytes_per_token",
    "check_free_space",
    "conventional_specs",
    "human_bytes",
    "load_manifest",
    "open_store",
    "store_info",
    "verify_store",
]
