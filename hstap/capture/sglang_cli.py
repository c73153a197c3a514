"""`hstap sglang-flags --model M --layers auto --out DIR`: print the SGLang launch flags a capture needs."""

from __future__ import annotations

import json

from hstap.capture.config import SglangFlagsConfig
from hstap.config import add_config_flags


def add_arguments(parser) -> None:
    add_config_flags(parser, SglangFlagsConfig, "sglang-flags")


def run(cfg: SglangFlagsConfig) -> int:
    import sys

    from hstap.capture.arch import fallback_note, version_note
    from hstap.capture.engine_session import EngineCaptureConfig
    from hstap.capture.sglang import format_flags, hook_specs, sglang_flags

    engine = EngineCaptureConfig.for_checkpoint(cfg.model, cfg.layers, cfg.out, "sglang", cfg.sglang_version,
                                                dtype=cfg.dtype, shard_mb=cfg.shard_mb, flush_s=cfg.flush_s)
    for note in (fallback_note(engine.layout, "sglang"), version_note("sglang", cfg.sglang_version)):
        if note:
            print(note, file=sys.stderr)
    print(json.dumps(hook_specs(engine)) if cfg.as_json else format_flags(sglang_flags(engine)))
    return 0
