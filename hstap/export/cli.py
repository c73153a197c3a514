"""`hstap export --drafter DIR --format sglang|vllm --out DIR`: flags → ExportConfig → export_drafter;
`hstap export --drafter DIR --out DIR --check [--store DIR]`: check_export."""

from __future__ import annotations

import json

from hstap.config import add_config_flags
from hstap.export.config import ExportConfig

_SERVE_HINTS = {
    "sglang": "python -m sglang.launch_server --model-path TARGET --speculative-algorithm EAGLE3 "
              "--speculative-draft-model-path {out} --speculative-num-steps 3 --speculative-eagle-topk 1 "
              "--speculative-num-draft-tokens 4",
    "vllm": "vllm serve TARGET --speculative-config "
            "'{{\"method\": \"eagle3\", \"model\": \"{out}\", \"num_speculative_tokens\": 3}}'",
}


def add_arguments(parser) -> None:
    add_config_flags(parser, ExportConfig, "export")


def run(cfg: ExportConfig) -> int:
    if cfg.check:
        from hstap.export.check import check_export

        done = check_export(cfg.out, cfg.drafter, cfg.store)
        against = f" and store {cfg.store}" if cfg.store else ""
        print(f"export {cfg.out} matches drafter {cfg.drafter}{against}: layer ids {done['layer_ids']} as SGLang "
              f"and vLLM read them, config, {done['tensors']} tensors, d2t/t2d")
        return 0
    from hstap.export.write import export_drafter

    out = export_drafter(cfg.drafter, cfg.format, cfg.out, dtype=cfg.dtype, include_embedding=cfg.with_embedding,
                         force=cfg.force)
    ids = json.loads((out / "hstap.json").read_text())
    print(f"exported {cfg.drafter} as {cfg.format} ({cfg.dtype}) to {out}, checked against the drafter")
    print(f"  layer ids: canonical {ids['aux_layer_ids']} = SGLang {ids['engine_layer_ids']['sglang']} "
          f"= vLLM {ids['engine_layer_ids']['vllm']}")
    print(f"  serve: {_SERVE_HINTS[cfg.format].format(out=out)}")
    print(f"  check again any time: hstap export --drafter {cfg.drafter} --out {out} --check")
    return 0
