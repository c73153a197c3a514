"""A Llama checkpoint of a real shape with random bf16 weights, for capture and throughput runs at scale.

    python bench/make_checkpoint.py --shape 8b --out /tmp/llama8b --tokenizer-from DIR

The weights are random (seeded), so the checkpoint costs nothing to obtain and tests the pipeline's shapes,
memory and speed, not a model's quality. `--tokenizer-from` copies a tokenizer (e.g. SmolLM2's converted cache:
its ids are < 49,152, inside the 8B shape's 128,256-entry vocabulary) so `hstap capture --model DIR` can render
conversations for it.

It makes a benchmark's input, measures nothing, and so writes no harness record: `--out` is the checkpoint's
directory here. It takes the harness's device choice and check.
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

import torch

import harness

SHAPES = {
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0),
    "tiny": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=4, vocab_size=49152, max_position_embeddings=2048),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="8b", choices=list(SHAPES))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's)")
    ap.add_argument("--tokenizer-from", type=Path, default=None)
    ap.add_argument("--device", default=harness.default_device(), help="cpu, cuda or cuda:N (default: %(default)s)")
    args = ap.parse_args()
    harness.check_device(args.device)
    from transformers import LlamaConfig, LlamaForCausalLM

    start = time.perf_counter()
    shape = {**SHAPES[args.shape], **({"num_hidden_layers": args.layers} if args.layers else {})}
    cfg = LlamaConfig(**shape, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                      pad_token_id=2)
    torch.manual_seed(0)
    with torch.device(args.device):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(args.out)
    if args.tokenizer_from is not None:
        for name in TOKENIZER_FILES:
            if (args.tokenizer_from / name).exists():
                shutil.copy(args.tokenizer_from / name, args.out / name)
    size = sum(p.stat().st_size for p in args.out.iterdir())
    print(f"{args.shape}: {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters, "
          f"{size / 2**30:.1f} GiB in {args.out} ({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
