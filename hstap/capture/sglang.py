"""SGLang adapter: a hook factory that SGLang's own `--forward-hooks` loads; no SGLang source is touched.

    hstap sglang-flags --model /ckpt --layers auto --out runs/sg      # prints the flags below, ready to paste
    python -m sglang.launch_server --model-path /ckpt \\
        --forward-hooks '[{"name": "hstap-layer-1", "target_modules": ["model.layers.1"],
                           "hook_factory": "hstap.capture.sglang:make_hook", "config": {...}}, ...]' \\
        --disable-radix-cache --cuda-graph-backend-prefill disabled --enforce-disable-flashinfer-allreduce-fusion
    hstap capture-remote --url http://127.0.0.1:30000 --data jsonl:synth.jsonl --capture-dir runs/sg

SGLang (0.5.23, `model_executor/hook_manager.py`) calls `make_hook(config)` once per spec in every TP worker and
registers the returned hook with `module.register_forward_hook` on the modules whose whole `named_modules()` name
fnmatches one of the spec's patterns, after CUDA-graph capture: hooks run on the eager path only. Module names and
the layer-output contract come from the served architecture (`hstap.capture.arch`: Kimi-K2.5's layers are
`language_model.model.layers.<k>`); `<text>` below is that prefix. Sites, per canonical layer k:

- `<text>.layers.<k>` of the lowest captured layer reads the ForwardBatch from `args[2]` and decides whether this
  forward is captured at all (pure `ForwardMode.EXTEND`, host-side lengths present, not only health probes), then
  announces the packed layout. Where layers return `(hidden_states, residual)` with the add deferred (`pairs`:
  Gemma-2 in 0.5.23; Gemma-3 too, but its layers get the batch as a keyword argument, so it is refused), every
  captured layer is hooked and gives `output[0] + output[1]`, added into a new tensor: the next fused add-RMSNorm
  overwrites both in place.
- `<text>.layers.<k+1>.input_layernorm` (`<text>.norm` for the last layer) where layers return one tensor (or an
  opaque owed handle whose tensor-parallel all-reduce is still pending) and keep the residual in
  `forward_batch.residual_stream` (`stream`: Llama, Qwen, GLM-4, gpt-oss, Mixtral; `stream_topk`: DeepSeek-V2/V3/
  V3.2 and Kimi, whose layers return `(hidden_states, topk_indices)` — the indices are never added to anything).
  The first place the completed residual exists without a collective is the next norm, called as
  `norm(hidden, residual)` → `(normed, hidden + residual)`; its `output[1]`, cloned, is layer k's residual stream.
  (FlashInfer/aiter all-reduce fusion bypasses that module: the flags turn FlashInfer's off, `hstap serve` refuses
  the flags that turn either on and stops when SGLang's log says it enabled one; a forward whose tensor never came
  is counted, never stored.)
- `<text>.norm` — `output[0]` is the final normed hidden state: the teacher (`teacher.hidden`; the trainer applies
  the target's lm_head). SGLang's logits processor only computes logits for sampled positions, so top-k teachers
  cannot come from the engine.

Releases differ (hstap.capture.arch.SGLANG_VERSIONS): 0.5.20's layers all return `(hidden, residual)` — the
rewrite above came in 0.5.21-0.5.22 — so the same architecture gets other sites there. `hstap serve` asks the
engine's Python which release it has; `hstap sglang-flags --sglang-version V` targets one. A hook made for one
release that finds itself in another whose contract differs prints one `hstap capture: error:` line (which stops
`hstap serve`) and stays off. The launch flags below are accepted by both releases' parsers.

An architecture missing from the table gets both kinds of site and tells the contracts apart per forward (a pair
of same-shape floating tensors is `(hidden, residual)`). A spec that matches nothing is only a warning in SGLang's
log; `hstap serve` watches for it and stops.

Only the writer rank holds a session: attention-TP rank 0 (= TP rank 0 without DP attention); with DP attention
each DP group's rank 0 writes its own store under `DIR/dp<R>`. Other ranks get a no-op hook. No hook syncs, runs a
collective or raises: errors are counted into `DIR/engine-report.json`.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import shlex
import sys
from pathlib import Path
from typing import Any, Callable

import torch

from hstap.capture.arch import SGLANG, SGLANG_DEFAULT_VERSION, sglang_row
from hstap.capture.engine_session import EngineCaptureConfig, EngineSession, Span, is_residual_pair, session_for
from hstap.capture.hooks import first_tensor, never_raise
from hstap.errors import HstapError
from hstap.store.names import hidden_name

FACTORY = "hstap.capture.sglang:make_hook"
SPEC_PREFIX = "hstap-"  # every spec's name starts with it: `hstap serve` reads SGLang's log lines about them
HEALTH_CHECK_PREFIX = "HEALTH_CHECK"  # sglang/srt/constants.py: /health_generate's rid is HEALTH_CHECK_<hex>
# What capture needs from SGLang 0.5.23: radix-cache hits skip the cached prefix's tokens (samples with holes);
# prefill CUDA graphs replay without running Python hooks (0.5.23 has no --disable-piecewise-cuda-graph); the
# FlashInfer all-reduce fusion, which 0.5.23 (and 0.5.20) turn on by themselves for Kimi-K2.5, DeepSeek-V3, Qwen3-MoE,
# GLM-4-MoE, gpt-oss, ... at tp > 1 on sm90/sm100 (srt/arg_groups/overrides.py:955-1001), calls the next layer's
# input norm as `plan.norm.forward_with_allreduce_fusion(...)` (layer_boundary/fusions/allreduce.py:109), so the
# hook on that norm never runs. The enforce-disable pass runs right after the auto-enable (model_hook.py:747-748).
CAPTURE_FLAGS = ["--disable-radix-cache", "--cuda-graph-backend-prefill", "disabled",
                 "--enforce-disable-flashinfer-allreduce-fusion"]


def hook_specs(cfg: EngineCaptureConfig) -> list[dict[str, Any]]:
    """The `--forward-hooks` JSON list: one spec per site, each carrying the whole capture config. Which sites
    depends on the architecture's layer-output contract (`cfg.layout.output`, see hstap.capture.arch): the
    lowest captured layer always (it announces the forward), every captured layer for `pairs`, the next layer's
    input norm (the final norm for the last layer) for `stream`/`stream_topk`, both for `auto`."""
    layout = cfg.layout
    if not layout.batch_positional:
        raise HstapError(f"SGLang 0.5.23 calls {layout.architecture}'s decoder layers with forward_batch as a keyword "
                         "argument, which a --forward-hooks hook cannot see: capture this model with --engine vllm "
                         "or --engine hf")
    base = json.loads(cfg.model_dump_json())
    specs = []
    last = cfg.num_layers - 1
    for k in cfg.layers:
        if k == min(cfg.layers) or layout.output in ("pairs", "auto"):
            specs.append(_spec(f"layer-{k}", layout.layer(k), {**base, "site": f"layer:{k}"}))
        if k < last and layout.output != "pairs":
            specs.append(_spec(f"residual-{k}", layout.layer_input_norm(k + 1), {**base, "site": f"norm:{k}"}))
    specs.append(_spec("final-norm", layout.final_norm(), {**base, "site": "final"}))
    return specs


def _spec(name: str, modules: list[str], config: dict) -> dict[str, Any]:
    return {"name": f"{SPEC_PREFIX}{name}", "target_modules": modules, "hook_factory": FACTORY, "config": config}


def sglang_flags(cfg: EngineCaptureConfig) -> list[str]:
    """The argv SGLang's launcher needs for this capture (without `--model-path`)."""
    return ["--forward-hooks", json.dumps(hook_specs(cfg), separators=(",", ":")), *CAPTURE_FLAGS]


def format_flags(argv: list[str]) -> str:
    return " ".join(shlex.quote(a) for a in argv)


def writer_rank() -> tuple[bool, int | None]:
    """(this process writes, its attention-DP group or None), from SGLang's parallel context; (True, None) alone.

    0.5.23 keeps ranks in `sglang.srt.runtime_context.get_parallel()`: `attn_tp_rank` (= the TP rank without DP
    attention), `attn_dp_size`, `attn_dp_rank`.
    """
    try:
        from sglang.srt.runtime_context import get_parallel

        parallel = get_parallel()
        attn_tp_rank = int(parallel.attn_tp_rank)
    except Exception:  # noqa: BLE001 — no parallel context (one process, tests): fall back to torch.distributed
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return torch.distributed.get_rank() == 0, None
        return True, None
    try:
        dp_size = int(parallel.attn_dp_size)
    except Exception:  # noqa: BLE001 — not published: no DP attention
        dp_size = 1
    return attn_tp_rank == 0, (int(parallel.attn_dp_rank) if dp_size > 1 else None)


@functools.lru_cache(maxsize=1)
def running_sglang() -> str | None:
    """The SGLang release this process runs (its distribution metadata; None outside an SGLang install)."""
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


def version_mismatch(cfg: EngineCaptureConfig, running: str | None) -> str:
    """'' when the flags' layer contract is the one SGLang `running` builds, else the one-line reason: hooks made
    for one release would add the wrong outputs in another (Llama's layers return `(hidden, residual)` in 0.5.20,
    one tensor from 0.5.22 on; hstap.capture.arch.SGLANG_VERSIONS)."""
    row = SGLANG.get(cfg.layout.architecture)
    if running is None or running == cfg.engine_version or row is None or not cfg.layout.known:
        return ""
    expected = sglang_row(row, running).output
    if expected == cfg.layout.output:
        return ""
    made_for = cfg.engine_version or f"{SGLANG_DEFAULT_VERSION} (the default)"
    return (f"the --forward-hooks were made for SGLang {made_for}, whose {cfg.layout.architecture} layers are "
            f"'{cfg.layout.output}', but this engine is SGLang {running} ('{expected}'): regenerate them with "
            f"`hstap sglang-flags --sglang-version {running}` (hstap serve asks the engine itself); capture is off")


_WARNED: set[str] = set()


def make_hook(config: dict) -> Callable:
    """SGLang's hook factory: `config` is one spec's `config` as `hstap sglang-flags` printed it."""
    site = str(config.get("site", ""))
    cfg = EngineCaptureConfig.model_validate({k: v for k, v in config.items() if k != "site"})
    problem = version_mismatch(cfg, running_sglang())
    if problem:  # `hstap serve` stops the engine on this line; by hand, the log says why the store stays empty
        if problem not in _WARNED:
            _WARNED.add(problem)
            print(f"hstap capture: error: {problem}", file=sys.stderr, flush=True)
        return _noop
    writes, dp_group = writer_rank()
    if not writes:
        return _noop
    out = Path(cfg.out) / f"dp{dp_group}" if dp_group is not None else None
    state = _state_for(session_for(cfg, out), cfg)
    kind, _, arg = site.partition(":")
    if kind == "layer":
        return state.layer_hook(int(arg))
    if kind == "norm":
        return state.norm_hook(int(arg))
    if kind == "final":
        return state.final_hook()
    raise ValueError(f"hstap hook config has site={site!r}: expected layer:K, norm:K or final "
                     "(regenerate the flags with `hstap sglang-flags`)")


def _noop(module, args, output) -> None:
    return None


def _state_for(session: EngineSession, cfg: EngineCaptureConfig) -> "_ForwardState":
    if not isinstance(session.adapter_state, _ForwardState):
        session.adapter_state = _ForwardState(session, cfg)
    return session.adapter_state


def _forward_batch(args: tuple):
    if len(args) > 2 and hasattr(args[2], "forward_mode"):
        return args[2]
    return next((a for a in args if hasattr(a, "forward_mode")), None)


class _ForwardState:
    """Per-process hook state shared by every site of one session: what the current forward is doing."""

    def __init__(self, session: EngineSession, cfg: EngineCaptureConfig) -> None:
        self.session = session
        self.first = min(cfg.layers)
        self.last_layer = cfg.num_layers - 1
        self.capture_last = self.last_layer in cfg.layers
        self.output = cfg.layout.output  # the architecture's layer-output contract (hstap.capture.arch)
        self.pairs = self.output == "pairs"  # this forward's layer sites record (decided per forward for `auto`)

    def layer_hook(self, k: int) -> Callable:
        name = hidden_name(k)

        @never_raise(self.session.error)
        def hook(module, args, output) -> None:
            if k == self.first:
                self._start(_forward_batch(args))
            if not self.session.active():
                return
            if self.output == "auto" and is_residual_pair(output):
                self.pairs = True
            if self.pairs:
                if not is_residual_pair(output):  # a wrong row or release: indexing one tensor would "work"
                    raise TypeError(f"decoder layer {k} returned {_kind(output)}, not (hidden, residual): the flags' "
                                    "layer contract is not this SGLang's (hstap sglang-flags --sglang-version)")
                self.session.record(name, output[0] + output[1])  # new tensor: inputs get overwritten
        return hook

    def norm_hook(self, k: int) -> Callable:
        name = hidden_name(k)

        @never_raise(self.session.error)
        def hook(module, args, output) -> None:
            if self.session.active() and not self.pairs:
                self.session.record(name, _updated_residual(args, output).clone())
        return hook

    def final_hook(self) -> Callable:
        @never_raise(self.session.error)
        def hook(module, args, output) -> None:
            if not self.session.active():
                return
            if self.capture_last and not self.pairs:
                self.session.record(hidden_name(self.last_layer), _updated_residual(args, output).clone())
            self.session.record("teacher", first_tensor(output).clone())
        return hook

    def _start(self, fb) -> None:
        """Decide on the lowest captured layer whether this forward is captured, and announce its layout."""
        self.pairs = self.output == "pairs"
        session = self.session
        if session.active():
            session.tap.end()  # the previous forward died before its last site: counted by the Tap
        mode = getattr(getattr(fb, "forward_mode", None), "name", None)
        if mode != "EXTEND":  # DECODE, IDLE, MIXED (prefill + decode rows), TARGET_VERIFY, …: not a whole prefill
            session.skip((mode or "no_forward_batch").lower())
            return
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return
        lens, prefix = fb.extend_seq_lens_cpu, fb.extend_prefix_lens_cpu
        if lens is None or prefix is None:  # device-only lengths: reading them would sync
            session.skip("no_host_lengths")
            return
        rids = getattr(fb, "rids", None) or [None] * len(lens)
        spans, offset = [], 0
        for n, p, rid in zip(lens, prefix, rids):
            if isinstance(rid, str) and rid.startswith(HEALTH_CHECK_PREFIX):
                session.skip("health_check")
            elif n > 0:
                spans.append(Span(start=offset, length=int(n), prefix=int(p), rid=rid))
            offset += int(n)
        if not spans:
            return
        session.begin(spans, total=offset)
        session.record("input_ids", fb.input_ids)


def _kind(output) -> str:
    if isinstance(output, torch.Tensor):
        return f"one tensor {tuple(output.shape)}"
    return type(output).__name__ + (f" of {len(output)}" if isinstance(output, (tuple, list)) else "")


def _updated_residual(args: tuple, output) -> torch.Tensor:
    """The residual stream a `norm(hidden, residual)` call produced: its second output, or — called without a
    residual — its input."""
    if is_residual_pair(output):
        return output[1]
    return args[0]
