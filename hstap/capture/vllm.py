"""vLLM adapter: a worker extension whose `install_taps` / `remove_taps` run in every worker via `collective_rpc`.

    VLLM_SERVER_DEV_MODE=1 vllm serve /ckpt --enforce-eager --no-enable-prefix-caching \\
        --worker-extension-cls hstap.capture.vllm.HstapWorkerExtension --port 8000
    curl -s localhost:8000/collective_rpc -H 'content-type: application/json' \\
        -d "{\\"method\\": \\"install_taps\\", \\"args\\": [$(hstap sglang-flags ... )]}"   # see docs/engines.md
    hstap capture-remote --url http://127.0.0.1:8000 --data jsonl:synth.jsonl --capture-dir runs/vl

or offline: `LLM(model, enforce_eager=True, enable_prefix_caching=False, worker_extension_cls=EXTENSION)`,
`llm.collective_rpc("install_taps", args=(config_json,))`, `llm.generate(...)`, `llm.collective_rpc("remove_taps")`.

vLLM (0.33) has no forward-hook flag; its worker class gains this class's methods (`v1/worker/worker_base.py`).
`--enforce-eager` is required: torch.compile traces the model before the taps exist and never runs Python hooks.
Hooks (registered on `self.model_runner.model`, removed by `remove_taps`):

- a forward pre-hook on the model reads `input_ids` and `positions`, and the forward context's attention metadata
  (`max_query_len`, `num_actual_tokens`, `num_decode_tokens`: host ints); a pure-decode forward
  (`max_query_len <= 1`) is skipped without a copy. vLLM mixes decode and prefill rows in one forward (decodes
  first) and keeps per-request lengths on the device only, so the prefill rows are kept whole and the writer
  thread splits them by position runs; identity, chunk stitching and the prefix-cache refusal are the shared
  token-matching rules of `hstap.capture.engine`;
- `model.layers.<k>` returns `(hidden_states, residual)` with the add deferred (vLLM's Llama/Qwen contract):
  layer k's residual stream is `output[0] + output[1]`, added into a new tensor;
- `model.norm`'s `output[0]` is the teacher (`teacher.hidden`).

Only TP rank 0 of each data-parallel rank writes (`DIR/dp<R>` when DP > 1). Canonical layer k is vLLM's
`aux_hidden_state_layers` id k + 1; this adapter hooks module k directly, so no conversion happens here.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from hstap.capture.engine import EngineCaptureConfig, EngineSession, close_sessions, session_for

EXTENSION = "hstap.capture.vllm.HstapWorkerExtension"
LAUNCH_FLAGS = ["--enforce-eager", "--no-enable-prefix-caching",
                "--worker-extension-cls", EXTENSION]


def forward_info() -> dict | None:
    """Host-side facts of the current vLLM forward: `max_query_len`, `num_actual_tokens`, `num_decode_tokens`;
    None outside a forward context. Reads the first attention layer's metadata, which every layer shares."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return None
    meta = get_forward_context().attn_metadata
    if isinstance(meta, list):  # micro-batched (DBO): one dict per ubatch
        return None
    first = next(iter(meta.values()), None) if isinstance(meta, dict) else meta
    if first is None:
        return None
    return {name: getattr(first, name, None) for name in ("max_query_len", "num_actual_tokens", "num_decode_tokens")}


def writer_rank() -> tuple[bool, int | None]:
    """(TP rank 0 here, DP rank when DP > 1)."""
    try:
        from vllm.distributed.parallel_state import get_dp_group, get_tp_group

        tp_rank = get_tp_group().rank_in_group
    except Exception:  # noqa: BLE001 — not initialised: one process
        return True, None
    try:
        dp = get_dp_group()
        dp_rank = dp.rank_in_group if dp.world_size > 1 else None
    except Exception:  # noqa: BLE001
        dp_rank = None
    return tp_rank == 0, dp_rank


class VllmTaps:
    """The hooks of one capture on one model; `install` registers them, `remove` takes them off."""

    def __init__(self, model: torch.nn.Module, session: EngineSession, cfg: EngineCaptureConfig) -> None:
        self.model, self.session, self.cfg = model, session, cfg
        self.handles: list = []

    def install(self) -> None:
        inner = getattr(self.model, "model", self.model)
        self.handles.append(self.model.register_forward_pre_hook(self._pre_hook, with_kwargs=True))
        for k in self.cfg.layers:
            self.handles.append(inner.layers[k].register_forward_hook(self._layer_hook(k)))
        self.handles.append(inner.norm.register_forward_hook(self._norm_hook))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def _pre_hook(self, module, args, kwargs) -> None:
        try:
            session = self.session
            if session.active():
                session.tap.end()  # the previous forward never reached the norm: counted by the Tap
            input_ids = kwargs.get("input_ids", args[0] if args else None)
            positions = kwargs.get("positions", args[1] if len(args) > 1 else None)
            info = forward_info() or {}
            if input_ids is None or positions is None:
                session.skip("no_input_ids")  # prompt embeddings, or an unknown signature
                return None
            if (info.get("max_query_len") or 0) <= 1:
                session.skip("decode")
                return None
            total = int(info.get("num_actual_tokens") or input_ids.shape[0])
            session.begin_unsplit(int(info.get("num_decode_tokens") or 0), total)
            session.record("input_ids", input_ids)
            session.record("positions", positions)
        except Exception as exc:  # noqa: BLE001 — never raise into the engine
            self.session.error(exc)
        return None

    def _layer_hook(self, k: int):
        def hook(module, args, output) -> None:
            try:
                if self.session.active():
                    self.session.record(f"hidden.{k}", output[0] + output[1])  # new tensor: the next norm is in place
            except Exception as exc:  # noqa: BLE001
                self.session.error(exc)
            return None
        return hook

    def _norm_hook(self, module, args, output) -> None:
        try:
            if self.session.active():
                normed = output[0] if isinstance(output, (tuple, list)) else output
                self.session.record("teacher", normed.clone())
        except Exception as exc:  # noqa: BLE001
            self.session.error(exc)
        return None


class HstapWorkerExtension:
    """Mixed into vLLM's worker class by `--worker-extension-cls`; call through `collective_rpc`."""

    def install_taps(self, config: str | dict) -> str:
        """Start capturing into `config["out"]` (JSON as `hstap vllm-config` prints it). Returns what this
        worker did, for the caller to log."""
        cfg = EngineCaptureConfig.model_validate(json.loads(config) if isinstance(config, str) else config)
        writes, dp_rank = writer_rank()
        if not writes:
            return "not a writer rank: no taps"
        self.hstap_remove_all()
        out = Path(cfg.out) / f"dp{dp_rank}" if dp_rank is not None else None
        session = session_for(cfg, out, extra=frozenset({"positions"}))
        taps = VllmTaps(self.model_runner.model, session, cfg)
        taps.install()
        self._hstap_taps = taps
        return f"taps on layers {cfg.layers} writing to {session.out}"

    def remove_taps(self) -> str:
        """Remove the hooks and commit the store; returns the capture counters as JSON."""
        self.hstap_remove_all()
        return json.dumps(close_sessions())

    def hstap_remove_all(self) -> None:
        taps = getattr(self, "_hstap_taps", None)
        if taps is not None:
            taps.remove()
            self._hstap_taps = None
