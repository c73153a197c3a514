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

Module names come from the served architecture (`hstap.capture.arch`; Kimi-K2.5 keeps its text model at
`language_model.model`), checked against the live module tree at install time: a name that is not there fails
`install_taps` with one line, and an architecture missing from the table is found by its decoder-layer list
(the one `ModuleList` of `num_layers` entries named `...layers` beside a `norm`).

- a forward pre-hook on the model reads `input_ids` and `positions`, and the forward context's attention metadata
  (`max_query_len`, `num_actual_tokens`, `num_decode_tokens`: host ints); a pure-decode forward
  (`max_query_len <= 1`) is skipped without a copy. vLLM mixes decode and prefill rows in one forward (decodes
  first) and keeps per-request lengths on the device only, so the prefill rows are kept whole and the writer
  thread splits them by position runs; identity, chunk stitching and the prefix-cache refusal are the shared
  token-matching rules of `hstap.capture.engine_session`. Multimodal models (Kimi-K2.5, Gemma-3 VLM) are run from
  `inputs_embeds` with `input_ids=None` (v1 runners, `_preprocess`); their token ids are taken from a pre-hook on
  the text model's embedding (`<text>.embed_tokens`), which the runner calls on the scheduled tokens first;
- `<text>.layers.<k>` returns `(hidden_states, residual)` with the add deferred (every vLLM 0.33 layer in the
  table, DeepSeek and Kimi included): layer k's residual stream is `output[0] + output[1]`, added into a new tensor;
- `<text>.norm`'s `output[0]` is the teacher (`teacher.hidden`).

Only TP rank 0 of each data-parallel rank writes (`DIR/dp<R>` when DP > 1). Canonical layer k is vLLM's
`aux_hidden_state_layers` id k + 1; this adapter hooks module k directly, so no conversion happens here.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from hstap.capture.engine_session import (EngineCaptureConfig, EngineSession, close_sessions, is_residual_pair,
                                          session_for)
from hstap.capture.hooks import first_tensor, never_raise
from hstap.errors import HstapError
from hstap.store.names import hidden_name

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


def text_model(model: torch.nn.Module, cfg: EngineCaptureConfig) -> tuple[str, torch.nn.Module]:
    """(name, module) of the module holding the decoder layers and the final norm, by the layout's names; for an
    architecture missing from the table, the served module tree decides."""
    layout, names = cfg.layout, dict(model.named_modules())
    for path in layout.text:
        module = names.get(path)
        if isinstance(getattr(module, layout.layers, None), torch.nn.ModuleList):
            return path, module
    lists = sorted(n.rsplit(".", 1)[0] if "." in n else "" for n, m in names.items()
                   if n.split(".")[-1] == layout.layers and isinstance(m, torch.nn.ModuleList)
                   and len(m) == cfg.num_layers)
    fits = [p for p in lists if hasattr(names[p], layout.norm)]
    if not layout.known and len(fits) == 1:
        return fits[0], names[fits[0]]
    tried = ", ".join(f"{t}.{layout.layers}" for t in layout.text)
    raise HstapError(f"{type(model).__name__} ({layout.architecture}): no decoder-layer list at {tried}; ModuleLists "
                     f"of {cfg.num_layers} named {layout.layers!r}: {[f'{p}.{layout.layers}' for p in lists]} "
                     "(fix the row in hstap/capture/arch.py)")


class VllmTaps:
    """The hooks of one capture on one model; `install` registers them, `remove` takes them off."""

    def __init__(self, model: torch.nn.Module, session: EngineSession, cfg: EngineCaptureConfig) -> None:
        self.model, self.session, self.cfg = model, session, cfg
        self.handles: list = []
        self.text = ""  # where the decoder layers were found
        self._embedded_ids: torch.Tensor | None = None  # token ids the embedding saw last (inputs_embeds forwards)

    def install(self) -> None:
        self.text, inner = text_model(self.model, self.cfg)
        layers, layout = getattr(inner, self.cfg.layout.layers), self.cfg.layout
        guard = never_raise(self.session.error)  # no hook ever raises into the engine
        self.handles.append(self.model.register_forward_pre_hook(guard(self._pre_hook), with_kwargs=True))
        embed = getattr(inner, layout.embed, None)
        if isinstance(embed, torch.nn.Module):
            self.handles.append(embed.register_forward_pre_hook(guard(self._embed_hook)))
        for k in self.cfg.layers:
            self.handles.append(layers[k].register_forward_hook(guard(self._layer_hook(k))))
        self.handles.append(getattr(inner, layout.norm).register_forward_hook(guard(self._norm_hook)))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def _embed_hook(self, module, args) -> None:
        if args and isinstance(args[0], torch.Tensor) and not args[0].is_floating_point():
            self._embedded_ids = args[0]
        return None

    def _pre_hook(self, module, args, kwargs) -> None:
        session = self.session
        if session.active():
            session.tap.end()  # the previous forward never reached the norm: counted by the Tap
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        positions = kwargs.get("positions", args[1] if len(args) > 1 else None)
        if input_ids is None:  # a multimodal model runs from inputs_embeds: the embedding saw the ids
            input_ids = self._embedded_ids
        self._embedded_ids = None
        info = forward_info() or {}
        if input_ids is None or positions is None:
            session.skip("no_input_ids")  # prompt embeddings, or an unknown signature
            return
        if (info.get("max_query_len") or 0) <= 1:
            session.skip("decode")
            return
        total = int(info.get("num_actual_tokens") or input_ids.shape[0])
        session.begin_unsplit(int(info.get("num_decode_tokens") or 0), total)
        session.record("input_ids", input_ids)
        session.record("positions", positions)

    def _layer_hook(self, k: int):
        name = hidden_name(k)

        def hook(module, args, output) -> None:
            if not self.session.active():
                return
            if self.cfg.layout.output == "pairs" or is_residual_pair(output):
                self.session.record(name, output[0] + output[1])  # new tensor: the next norm is in place
            else:  # an unknown architecture whose layers return the residual stream itself
                self.session.record(name, first_tensor(output).clone())
        return hook

    def _norm_hook(self, module, args, output) -> None:
        if self.session.active():
            self.session.record("teacher", first_tensor(output).clone())


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
        text_model(self.model_runner.model, cfg)  # a wrong module name fails here, before a store is opened
        taps = VllmTaps(self.model_runner.model, session_for(cfg, out, extra=frozenset({"positions"})), cfg)
        taps.install()
        self._hstap_taps = taps
        return f"taps on {taps.text}.{cfg.layout.layers} {cfg.layers} writing to {taps.session.out}"

    def remove_taps(self) -> str:
        """Remove the hooks and commit the store; returns the capture counters as JSON."""
        self.hstap_remove_all()
        return json.dumps(close_sessions())

    def hstap_remove_all(self) -> None:
        taps = getattr(self, "_hstap_taps", None)
        if taps is not None:
            taps.remove()
            self._hstap_taps = None
