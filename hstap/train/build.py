"""What a training run is built from: the sample source, checked against the target, and the drafter.

    source, layer_ids, teacher = open_source(cfg, target, device)   # a store (offline) or the target (--online)
    drafter = build_drafter(cfg, target, source, train_idx, layer_ids)   # fresh, or --init-from (grown if asked)

Every mismatch between a store, a run being resumed or an init drafter and the target (another model, other
layers, another hidden size, a missing tensor) fails here in one line, before a step is taken.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from tqdm import tqdm

from hstap.config import TeacherSpec
from hstap.drafter import (
    DrafterConfig,
    Eagle3Drafter,
    build_draft_vocab,
    count_tokens,
    grow_draft_vocab,
)
from hstap.drafter.shipped import resolve_drafter
from hstap.errors import HstapError
from hstap.progress import progress_bar
from hstap.store.names import hidden_name, scale_name
from hstap.train import rundir
from hstap.train.config import TrainConfig
from hstap.train.data import BatchSource, SampleSource, StoreSource
from hstap.train.online import DeviceOnlineSource


def open_source(cfg: TrainConfig, target, device: torch.device) -> tuple[SampleSource | BatchSource, list[int],
                                                                        TeacherSpec]:
    """The sample source, its canonical layer ids and the teacher spec, checked against the target."""
    from hstap.capture.layers import parse_layers

    if cfg.online:
        from hstap.data import SkipReport, render_all

        layer_ids = parse_layers(cfg.layers, target.num_layers)
        report = SkipReport()
        samples = render_all(cfg.data, target.tokenizer, report, max_tokens=cfg.max_tokens, limit=cfg.limit,
                             loops=cfg.loops)
        if not samples:
            raise HstapError(f"--data {cfg.data}: no usable conversations ({report.summary()})")
        tqdm.write(f"hstap train: {len(samples)} samples from {cfg.data}; {report.summary()}")
        teacher = TeacherSpec()
        source = DeviceOnlineSource(target, samples, layer_ids, teacher=teacher, device=str(device),
                                    as_fp8=cfg.online_dtype == "fp8")
        return source, layer_ids, teacher
    from hstap.store import open_store

    store = open_store(cfg.store, skip_bad_shards=cfg.skip_bad_shards)
    if store.skipped:
        s = store.skipped
        tqdm.write(f"hstap train: skipped {len(s)} damaged shards of {len(s) + len(store.manifest.shards)} "
                   f"({sum(x.samples for x in s)} samples, {sum(x.tokens for x in s)} tokens left out): "
                   + "; ".join(x.problem for x in s))
    meta = store.manifest.meta
    if len(store) == 0:
        raise HstapError(f"store {cfg.store} is empty: run `hstap capture --out {cfg.store}` first")
    if meta.model_fingerprint != target.fingerprint:
        raise HstapError(f"store {cfg.store} was captured from {meta.model_id} (fingerprint "
                         f"{meta.model_fingerprint}), --model {cfg.model} has fingerprint {target.fingerprint}")
    if meta.hidden_size != target.hidden_size:
        raise HstapError(f"store {cfg.store}: hidden_size={meta.hidden_size}, the target's is {target.hidden_size}")
    _check_store_tensors(cfg.store, store.manifest, meta.layer_ids)
    rundir.check_loss_on(cfg.loss_on, meta.extra.get("loops", "keep"),
                         f"the capture of store {cfg.store} (--loops cut)")
    if cfg.limit is not None and cfg.limit < len(store):
        raise HstapError(f"--limit {cfg.limit} is for --online; train on a store of that size instead")
    head = target.model.get_output_embeddings()
    if meta.teacher.kind == "hidden":  # its top-k is made per batch where the head lives: there, not on a CPU
        head = teacher_head(head, device)
    return StoreSource(store, lm_head=head, pin=device.type == "cuda"), list(meta.layer_ids), meta.teacher


def teacher_head(head: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """The target's lm_head on the training device, for a store whose teacher is the final hidden state: the target
    itself stays on the CPU unless it prefills or calibrates, and an 8B head's 2,048 × 4,096 × 128,256 logits a
    sample (2.1 TFLOP) are milliseconds of a GPU's time but ~9 s of a 2-core VM's. A copy (1 GB in bf16 for 8B)
    where it is elsewhere."""
    if head.weight.device == device:
        return head
    dtype = torch.bfloat16 if device.type == "cuda" else head.weight.dtype
    return copy.deepcopy(head).to(device, dtype).requires_grad_(False)


def _check_store_tensors(path, manifest, layer_ids: list[int]) -> None:
    names = set(manifest.tensors)
    needed = {"input_ids", "loss_mask", *(hidden_name(k) for k in layer_ids)}
    if manifest.meta.hidden_dtype == "fp8":
        needed |= {scale_name(k) for k in layer_ids}
    teacher = {"teacher.topk_ids", "teacher.topk_logprobs"} if manifest.meta.teacher.kind == "topk" \
        else {"teacher.hidden"}
    missing = sorted((needed | teacher) - names)
    if missing:
        raise HstapError(f"store {path}: missing tensor(s) {missing} (has {sorted(names)}); re-capture it")


def check_resume_compatible(out: Path, layer_ids: list[int], hidden_size: int, fingerprint: str,
                            flag: str = "--resume", draft_vocab: int | None = None,
                            intermediate: int | None = None) -> None:
    """A resumed (or initialised) run must read the same layers of the same target as the drafter it continues; a
    resumed one (`draft_vocab`, `intermediate` given) must also build its head size and MLP width, or the checkpoint
    would fail inside load_state_dict with a size-mismatch traceback (a grown run resumed without its flags, say)."""
    prior = DrafterConfig.load(out / "config.json")
    for field, mine, now in [("aux_layer_ids", prior.aux_layer_ids, layer_ids),
                             ("target_hidden_size", prior.target_hidden_size, hidden_size),
                             ("target_fingerprint", prior.target_fingerprint, fingerprint)]:
        if mine != now:
            raise HstapError(f"{flag}: drafter in {out} has {field}={mine}, the training data give {now}")
    if draft_vocab is not None and prior.draft_vocab_size != draft_vocab:
        raise HstapError(f"{flag}: the run in {out} trains a {prior.draft_vocab_size:,}-token draft vocabulary, this "
                         f"command builds {draft_vocab:,}: pass --draft-vocab {prior.draft_vocab_size}, as the run's "
                         "command did")
    if intermediate is not None and prior.intermediate_size != intermediate:
        raise HstapError(f"{flag}: the run in {out} trains an MLP of {prior.intermediate_size:,} units, this command "
                         f"builds {intermediate:,}: pass --draft-intermediate {prior.intermediate_size}, as the run's "
                         "command did")


def build_drafter(cfg: TrainConfig, target, source: SampleSource, train_idx: list[int],
                  layer_ids: list[int]) -> Eagle3Drafter:
    """The drafter to train: `--init-from`'s (grown if asked), else a fresh one over the draft vocabulary of the
    training split's most frequent answer tokens, initialised from the target (embedding copied and frozen)."""
    vocab = target.model.config.vocab_size
    size = min(cfg.draft_vocab, vocab)
    if cfg.init_from is not None:
        return _init_drafter(cfg, target, source, train_idx, layer_ids, size)
    d2t, t2d = build_draft_vocab(_count_tokens(source, train_idx, vocab), size)
    dcfg = DrafterConfig.from_target(target.model.config, layer_ids, size, target.model_id, target.fingerprint,
                                     intermediate_size=cfg.draft_intermediate)
    torch.manual_seed(cfg.seed)
    drafter = Eagle3Drafter(dcfg)
    drafter.init_from_target(target.model, d2t, t2d)
    return drafter


def _init_drafter(cfg: TrainConfig, target, source: SampleSource, train_idx: list[int], layer_ids: list[int],
                  size: int) -> Eagle3Drafter:
    """A drafter trained earlier (another session, a smaller set) keeps learning, over its own draft vocabulary or,
    when `size` (TrainConfig.init_size: never smaller) is larger, over it plus the most frequent tokens it misses
    (each is a certain rejection whenever the target emits it); and with its own MLP or, when
    --draft-intermediate is larger, a wider one that starts out computing what the init drafter computes."""
    init = resolve_drafter(cfg.init_from, flag="--init-from")  # a run directory or a shipped drafter's name
    check_resume_compatible(init, layer_ids, target.hidden_size, target.fingerprint, flag="--init-from")
    drafter = Eagle3Drafter.from_pretrained(init, target.model).float()
    have, width = drafter.config.draft_vocab_size, drafter.config.intermediate_size
    assert size >= have, f"draft vocabulary {size} < the init drafter's {have}: TrainConfig.init_size refuses it"
    if size > have:
        d2t, t2d = grow_draft_vocab(_count_tokens(source, train_idx, drafter.config.vocab_size), drafter.t2d, size)
        torch.manual_seed(cfg.seed)  # the new rows start where a fresh drafter's would
        tqdm.write(f"hstap train: draft vocabulary grown from {have:,} to {size:,} tokens: {size - have:,} new rows "
                   "start from a fresh head's initialisation")
        drafter = drafter.with_draft_vocab(d2t, t2d)
    if cfg.draft_intermediate is not None and cfg.draft_intermediate > width:
        torch.manual_seed(cfg.seed + 1)  # the new units' gate and up rows
        tqdm.write(f"hstap train: MLP grown from {width:,} to {cfg.draft_intermediate:,} units; the new ones start "
                   "with a zero output (the drafter computes what it did)")
        drafter = drafter.with_mlp_width(cfg.draft_intermediate)
    return drafter


def _count_tokens(source: SampleSource, train_idx: list[int], vocab: int) -> torch.Tensor:
    """Target-token counts over the training split's loss-masked positions: what the draft vocabulary is made of."""
    counted = progress_bar(train_idx, desc="draft vocab", unit="sample", leave=False, disable=len(train_idx) < 2000)
    masks = (dict(zip(("input_ids", "loss_mask"), source.token_masks(i))) for i in counted)
    return count_tokens(masks, vocab)

