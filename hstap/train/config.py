"""TrainConfig: everything a training run depends on; `hstap train --plan` prints it resolved.

Sizes left unset fit the device: a GPU gets the EAGLE-3 recipe (TTT 7, a 32k draft vocabulary, 2,048-token
samples), a CPU sizes it can finish in minutes rather than hours (TTT 3, 8k vocabulary, 512 tokens); an
`--init-from` run keeps its drafter's vocabulary unless told to grow it. `--plan` shows what was picked; any of them
can be set explicitly.
"""

from __future__ import annotations

from typing import Literal

from pathlib import Path

from pydantic import BaseModel, ConfigDict, field_validator

from hstap.capture.config import LAYERS_HELP, layers_text
from hstap.config import LOOPS_HELP, Device, Loops, option, parse_duration
from hstap.errors import HstapError

# (GPU, CPU) values of the sizes left unset
DEVICE_DEFAULTS = {"ttt_steps": (7, 3), "draft_vocab": (32000, 8192), "max_tokens": (2048, 512),
                   "calib_prompts": (8, 2)}

# TrainConfig field -> (the DrafterConfig field it sets, what it counts): the sizes an --init-from run may grow
INIT_SIZES = {"draft_vocab": ("draft_vocab_size", "-token draft vocabulary"),
              "draft_intermediate": ("intermediate_size", " units of the MLP")}


class TrainConfig(BaseModel):
    """Train an EAGLE-3 drafter offline from a store, or online with the target in this process.

    The flags that need more than their help line (docs/train.md and docs/distributed.md say more):
    - `ttt_attention`: flex fuses the TTT attention into one kernel on CUDA; flexdiag is one flex kernel over the
      step-0 and diagonal keys with no separate merge; cudnn runs the flash path on cuDNN's fused attention;
      flash is PyTorch's flash kernels (bf16/fp16 on CUDA); math materialises the scores (the exact reference).
      flexdiag and cudnn are opt-in until timed on a GPU; the timings are in docs/benchmarks.md.
    - `loss_on all`: prompt positions count too (the drafter computes them anyway, and the target's distribution
      is the teacher there as well); held-out figures stay on answers.
    - `init_from`: a run or export directory of the same target and layers, or a shipped drafter's name; a fresh
      optimizer and schedule. A larger `draft_vocab` adds the most frequent tokens the drafter misses (fresh head
      rows), a larger `draft_intermediate` adds MLP units that start with a zero output; smaller ones are refused.
    - `online_dtype fp8`: the tapped states go through e4m3 with one scale per token and layer, with the store's
      own quantiser and reader: an fp8-vs-bf16 A/B on the same data without writing two stores.
    - `cuda_graphs`: each length bucket's batches are padded to one shape (about a tenth more positions computed)
      so the step replays without its launch cost; it pays where the step is host-bound (small drafters, short
      sequences). Under torchrun it needs `grad_reduce after`.
    - `grad_reduce`: overlap is DDP (buckets all-reduced while the backward runs); after is one all-reduce of a
      flat gradient buffer once the backward is done (no hooks, so the backward may be a replayed graph).
      `grad_reduce_dtype bf16` halves the bytes on the link, each averaged gradient rounded to bf16 once.
    - `prefetch`: online on CUDA, the next batch's prefill on a side stream; from a store, its read on a host
      thread (always on with CUDA; on a CPU the read competes with the step's own threads).
    """

    model_config = ConfigDict(extra="forbid")

    store: Path | None = option(None, "capture store to train from (offline)")
    skip_bad_shards: bool = option(False, "check every shard's checksum first and leave damaged ones out (counted "
                                          "and reported)")
    online: bool = option(False, "run the target in-process; no store on disk")
    model: str = option("smollm2", "the target: 'smollm2' or a checkpoint dir")
    data: str = option("sharegpt", "(online) sharegpt | mt-bench | jsonl:PATH")
    limit: int | None = option(None, "(online) first N usable conversations", ge=1)
    layers: str = option("auto", f"(online) {LAYERS_HELP}")
    max_tokens: int | None = option(None, "(online) longest sample in tokens (default 2048 on a GPU, 512 on a CPU)",
                                    gt=0)
    loops: Loops = option("keep", f"(online) {LOOPS_HELP}")
    out: Path = option(help="run directory")
    epochs: int = option(1, "passes over the training samples", ge=1)
    lr: float = option(1e-3, "peak learning rate (AdamW, linear warmup, cosine decay)", gt=0)
    warmup_ratio: float = option(0.05, "fraction of the steps spent warming up", ge=0, lt=1)
    weight_decay: float = option(0.0, "AdamW weight decay", ge=0)
    grad_clip: float = option(0.5, "gradient-norm clip", gt=0)
    batch_tokens: int = option(4096, "padded tokens per batch (per rank)", gt=0)
    grad_accum: int = option(1, "batches per rank per optimizer step (global batch = ranks × this × "
                                "--batch-tokens)", ge=1)
    ttt_steps: int | None = option(None, "training-time-test unroll length (default 7 on a GPU, 3 on a CPU)", ge=1)
    decay: float = option(0.8, "weight of TTT step k is decay**k", gt=0, le=1)
    ttt_attention: Literal["auto", "cudnn", "flash", "flex", "flexdiag", "math"] = option(
        "auto", "TTT attention kernel: flex, flexdiag, cudnn (CUDA), flash (bf16/fp16 on CUDA), math (exact "
        "reference); auto = flex on CUDA")
    compile: bool = option(True, "(CUDA) fuse the drafter's norms, rotary and MLP gate with torch.compile; falls "
                                 "back to eager if it fails")
    draft_vocab: int | None = option(None, "draft vocabulary size (default 32000 on a GPU, 8192 on a CPU, at most "
                                           "the target's; with --init-from, the init drafter's: larger grows it)",
                                     ge=1)
    draft_intermediate: int | None = option(None, "units of the drafter's MLP (default the target's "
                                                  "intermediate_size; with --init-from, the init drafter's: larger "
                                                  "grows it)", ge=1)
    loss_on: Literal["answers", "all"] = option(
        "answers", "positions the loss counts: answers (those predicting an assistant token) or all (prompt "
        "tokens too)")
    heldout: float = option(0.05, "fraction of samples held out for evaluation", ge=0, lt=1)
    seed: int = option(0, "seed of the split, the batch order and the initial weights")
    device: Device = option("cpu", "cpu | cuda | cuda:N")
    checkpoint_every: int | None = option(None, "also checkpoint every N optimizer steps", ge=1)
    checkpoint_interval_s: float = option(300.0, "checkpoint at least this often (and always at the end): 90s, 5m",
                                          flag="--checkpoint-interval", metavar="DURATION", gt=0)
    max_steps: int | None = option(None, "stop after this many optimizer steps", ge=1)
    time_budget_s: float | None = option(None, "fit the run (schedule included) into this wall time: 90s, 8m, 1h",
                                         flag="--time-budget", metavar="DURATION", gt=0)
    resume: bool = option(False, "continue from OUT/checkpoint exactly")
    init_from: Path | None = option(None, "start from this drafter's weights and draft vocabulary: a run or export "
                                    "dir of the same target and layers, or a shipped name (smollm2-recipe)",
                                    metavar="DIR|NAME")
    overwrite: bool = option(False, "start afresh in an OUT that holds a run: its checkpoint, metrics and weights "
                                    "are deleted first")
    online_dtype: Literal["bf16", "fp8"] = option(
        "bf16", "(online) round the tapped states as a store of this dtype holds them (fp8: e4m3, a scale per token "
        "and layer)")
    cuda_graphs: bool = option(False, "(CUDA) replay the drafter's forward and backward from a CUDA graph per "
                                      "length bucket; under torchrun with --grad-reduce after")
    grad_reduce: Literal["auto", "overlap", "after"] = option(
        "auto", "(several ranks) overlap (DDP, during the backward) or after (one flat all-reduce after it); auto = "
        "after with --cuda-graphs, else overlap")
    grad_reduce_dtype: Literal["fp32", "bf16"] = option(
        "fp32", "(several ranks) the dtype gradients cross the link in: bf16 halves the bytes")
    prefetch: bool = option(False, "make the next batch while the drafter trains on this one (always on from a "
                                   "store with CUDA)")
    calib_prompts: int | None = option(None, "held-out prompts decoded with the drafter at every evaluation to "
                                             "measure τ (0 = off; default 8 on a GPU, 2 on a CPU)", ge=0)
    calib_tokens: int = option(64, "new tokens per calibration prompt (greedy)", ge=2)
    calib_chain: int = option(3, "chain length the calibration drafts (capped at --ttt-steps)", ge=1)

    _layers_text = field_validator("layers", mode="before")(layers_text)
    _duration = field_validator("time_budget_s", "checkpoint_interval_s", mode="before")(parse_duration)

    def sized_for_device(self) -> "TrainConfig":
        """A copy with every size left unset filled in for the device (GPU recipe or CPU-sized), except the draft
        vocabulary and MLP width of an `--init-from` run: `init_size` decides them."""
        on_gpu = self.device.startswith("cuda")
        fill = {name: pair[0 if on_gpu else 1] for name, pair in DEVICE_DEFAULTS.items()
                if getattr(self, name) is None}
        if self.init_from is not None:
            fill["draft_vocab"] = self.init_size("draft_vocab")
            fill["draft_intermediate"] = self.init_size("draft_intermediate")
        return self.model_copy(update=fill)

    @property
    def reduce_after(self) -> bool:
        """Whether several ranks average their gradients after the backward (`--grad-reduce`), not inside it."""
        return self.grad_reduce == "after" or (self.grad_reduce == "auto" and self.cuda_graphs)

    def init_size(self, name: Literal["draft_vocab", "draft_intermediate"]) -> int:
        """The draft vocabulary or MLP width an `--init-from` run trains: the init drafter's own when unset (a GPU's
        default 32,000-token vocabulary would grow the shipped 16,384 unasked), a larger one set explicitly
        (hstap.train.build grows the drafter), never a smaller one (shrinking would throw trained weights away)."""
        from hstap.drafter.config import DrafterConfig
        from hstap.drafter.shipped import drafter_config_path

        assert self.init_from is not None, "init_size is for --init-from runs"
        init = DrafterConfig.load(drafter_config_path(self.init_from, flag="--init-from"))
        have, want = getattr(init, INIT_SIZES[name][0]), getattr(self, name)
        flag, what = "--" + name.replace("_", "-"), INIT_SIZES[name][1]
        if want is not None and want < have:
            raise HstapError(f"{flag} {want} is smaller than the {have:,}{what} of --init-from {self.init_from}: "
                             f"shrinking would throw trained weights away; pass {flag} {have} or more (more grows "
                             "it), or leave it unset to keep it")
        return have if want is None else want

    def resolved(self) -> dict:
        out = self.sized_for_device().model_dump(mode="json")
        if self.online:
            from hstap.capture.layers import parse_layers
            from hstap.models.target import model_config

            out["layers"] = parse_layers(self.layers, int(model_config(self.model)["num_hidden_layers"]))
        return out
