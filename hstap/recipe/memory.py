"""Online or store: does the target fit on the device beside the drafter in training?

    choice = choose_training("auto", "cuda", need_bytes=online_bytes(...), free_bytes=free_memory("cuda"))
    print(choice.line())     # training: online (auto: the target and the drafter in training fit: ~57 GiB needed, ...)

Online training runs the target's prefill inside the trainer (no store on disk: for the GPU recipe a store would
be ~30 GB, written once and read every epoch, costing more than redoing the prefill); it needs the target's
weights, the drafter's training state and the step's activations on one device at once. Everything here reads
config.json and the safetensors headers only: no weights, no torch.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

GIB = 1 << 30
MARGIN = 0.2  # of the estimate: the allocator's caches and fragmentation
FIXED = 2 * GIB  # the CUDA context, the target's prefill activations, the teacher's lm_head chunk (1 GiB)
TARGET_BYTES = 2  # per parameter: the target computes in bf16 on CUDA
STATE_BYTES = 16  # per trainable parameter: fp32 weight, gradient and AdamW's two moments
FROZEN_BYTES = 4  # per frozen parameter (the embedding copied from the target)
# Activation bytes per position and TTT step: the draft-vocabulary logits in fp32 plus ~20 bytes per hidden unit.
# Fitted to the 8B drafter step's peak memory (docs/benchmarks.md, "8B trainer and teacher": 13.7 GiB at 2,048
# positions, 22.2 GiB at 8,192, i.e. 1.45 MB a position at TTT 7, draft vocabulary 32,000, hidden 4,096).
LOGIT_BYTES, HIDDEN_BYTES = 4, 20


@dataclass(frozen=True)
class TrainingChoice:
    mode: str  # "online" | "store"
    reason: str

    def line(self) -> str:
        return f"training: {self.mode} ({self.reason})"


def safetensors_parameters(directory: Path) -> int | None:
    """Parameters in the directory's *.safetensors files, from their headers (8-byte length + JSON): None when
    there are none."""
    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        return None
    total = 0
    for path in files:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        total += sum(math.prod(t["shape"]) for name, t in header.items() if name != "__metadata__")
    return total


def dense_parameters(config: dict) -> int:
    """A dense decoder's parameters from config.json (for checkpoints without safetensors): embeddings, attention,
    MLP and norms. Mixture-of-experts configs count one expert per MLP: an underestimate, said by the caller."""
    h, layers, vocab = config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]
    heads = config["num_attention_heads"]
    kv, head_dim = config.get("num_key_value_heads") or heads, config.get("head_dim") or h // heads
    attention = 2 * h * heads * head_dim + 2 * h * kv * head_dim
    mlp = 3 * h * config.get("intermediate_size", 4 * h)
    embeddings = vocab * h * (1 if config.get("tie_word_embeddings") else 2)
    return embeddings + layers * (attention + mlp + 2 * h) + h


def drafter_parameters(config: dict, draft_vocab: int) -> tuple[int, int]:
    """(trainable, frozen) parameters of the EAGLE-3 drafter of a target with this config.json: fc (3H → H), one
    decoder layer whose attention reads 2H, the final norm, the draft head; frozen: the embedding."""
    h, heads = config["hidden_size"], config["num_attention_heads"]
    kv, head_dim = config.get("num_key_value_heads") or heads, config.get("head_dim") or h // heads
    attention = 2 * h * heads * head_dim + 2 * 2 * h * kv * head_dim + heads * head_dim * h  # q, k, v from 2H; o
    mlp = 3 * h * config.get("intermediate_size", 4 * h)
    trainable = 3 * h * h + attention + mlp + 4 * h + draft_vocab * h
    return trainable, config["vocab_size"] * h


def online_bytes(config: dict, target_params: int, draft_vocab: int, ttt_steps: int, batch_tokens: int) -> int:
    """Device memory online training needs: the target's weights, the drafter's training state and one step's
    activations, plus MARGIN and FIXED."""
    trainable, frozen = drafter_parameters(config, draft_vocab)
    per_position = ttt_steps * (LOGIT_BYTES * draft_vocab + HIDDEN_BYTES * config["hidden_size"])
    need = TARGET_BYTES * target_params + STATE_BYTES * trainable + FROZEN_BYTES * frozen + batch_tokens * per_position
    return int(need * (1 + MARGIN) + FIXED)


def free_memory(device: str) -> int:
    """Free bytes on a CUDA device now (what another process, e.g. a served engine, holds is not free)."""
    import torch

    free, _ = torch.cuda.mem_get_info(torch.device(device))
    return int(free)


def choose_training(requested: str, device: str, need_bytes: int | None = None,
                    free_bytes: int | None = None) -> TrainingChoice:
    """The training mode and why, in words: what the recipe asked for, else store on a CPU (there the target's
    prefill is the costly part: captured once, it is read back every epoch instead of run again), else online
    where `need_bytes` fits `free_bytes`."""
    if requested != "auto":
        return TrainingChoice(requested, "set in the recipe")
    if not device.startswith("cuda"):
        return TrainingChoice("store", "auto: on the CPU the target's prefill is the costly part, so it is captured "
                                       "once and the store read every epoch")
    assert need_bytes is not None and free_bytes is not None, "auto on CUDA needs the estimate and the free memory"
    sizes = f"~{need_bytes / GIB:.1f} GiB needed, {free_bytes / GIB:.1f} GiB free on {device}"
    if need_bytes <= free_bytes:
        return TrainingChoice("online", f"auto: the target and the drafter in training fit: {sizes}")
    return TrainingChoice("store", f"auto: the target and the drafter in training do not fit: {sizes}; the target is "
                                   "captured to a store first and the drafter trained from it")
