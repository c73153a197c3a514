"""Where each engine keeps a served model's text decoder, and what its decoder layers return.

    from hstap.capture.arch import resolve_layout
    layout = resolve_layout(json.loads(Path("/ckpt/config.json").read_text()), "sglang")
    layout.layer(3)        # ['language_model.model.layers.3'] for Kimi-K2.5 (KimiK25ForConditionalGeneration)

Module names are not the same across models: Kimi-K2.5 wraps DeepSeek-V3 as `language_model`, so its layers are
`language_model.model.layers.<k>`, not `model.layers.<k>`; SGLang's `--forward-hooks` fnmatches whole names and
only logs a warning when nothing matches. Nor is a layer's return value: SGLang 0.5.23's Llama/Qwen layers return
one tensor (the residual lives in the batch's residual stream), DeepSeek's return `(hidden, topk_indices)`,
Gemma-2/3's and every vLLM 0.33 layer `(hidden, residual)`. So both come from this table, keyed by config.json's
`architectures`, per engine. `tests/capture/test_arch.py` checks every row against the engines' own model sources
(SGLang 0.5.23 always; vLLM 0.33 where its sources are present). An architecture missing here gets the generic
rule — try `model` and `language_model.model`, detect the contract per forward — and says so.

Layer-output contracts (`Layout.output`):
- `pairs`: the layer returns `(hidden, residual)` with the residual add deferred: layer k = `out[0] + out[1]`.
- `stream`: the layer returns one tensor (or an opaque handle) and the residual lives in SGLang's
  `forward_batch.residual_stream`: layer k is completed in layer k+1's `input_layernorm(hidden, residual)`
  (its second output) or, for the last layer, in the final norm.
- `stream_topk`: as `stream`, but the layer returns `(hidden, topk_indices)`; the indices (a tensor on the sparse-
  attention models, None otherwise) must never be added to anything.
- `auto`: unknown; decided per forward (a same-shape floating pair is `(hidden, residual)`, anything else `stream`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

OUTPUTS = ("pairs", "stream", "stream_topk", "auto")
ENGINES = ("sglang", "vllm")


@dataclass(frozen=True)
class Layout:
    """One engine's module names for one architecture. `text`: candidate paths of the module owning `layers` and
    `norm` (one when the architecture is known). `batch_positional`: SGLang calls the decoder layers with the
    ForwardBatch as a positional argument, so a forward hook (which sees positional arguments only) can read it."""

    __pydantic_config__ = {"extra": "forbid"}

    architecture: str = "unknown"
    text: tuple[str, ...] = ("model",)
    output: str = "auto"
    layers: str = "layers"
    input_norm: str = "input_layernorm"
    norm: str = "norm"
    embed: str = "embed_tokens"
    batch_positional: bool = True
    known: bool = field(default=True, compare=False)

    def layer(self, k: int) -> list[str]:
        """Candidate names of decoder layer k (exactly one for a known architecture)."""
        return [f"{t}.{self.layers}.{k}" for t in self.text]

    def layer_input_norm(self, k: int) -> list[str]:
        return [f"{t}.{self.layers}.{k}.{self.input_norm}" for t in self.text]

    def final_norm(self) -> list[str]:
        return [f"{t}.{self.norm}" for t in self.text]


def _row(text: str, output: str, **kw) -> Layout:
    return Layout(text=(text,), output=output, **kw)


# Read in SGLang 0.5.23's srt/models/*.py. Kimi-K2 checkpoints say DeepseekV3ForCausalLM; GLM-4.5/4.6/4.7 say
# Glm4MoeForCausalLM; Qwen2.5 says Qwen2ForCausalLM.
SGLANG: dict[str, Layout] = {
    "LlamaForCausalLM": _row("model", "stream"),
    "MistralForCausalLM": _row("model", "stream"),
    "MixtralForCausalLM": _row("model", "stream"),
    "Qwen2ForCausalLM": _row("model", "stream"),
    "Qwen2MoeForCausalLM": _row("model", "stream"),
    "Qwen3ForCausalLM": _row("model", "stream"),
    "Qwen3MoeForCausalLM": _row("model", "stream"),
    "DeepseekV2ForCausalLM": _row("model", "stream_topk"),
    "DeepseekV3ForCausalLM": _row("model", "stream_topk"),
    "DeepseekV32ForCausalLM": _row("model", "stream_topk"),
    "KimiK25ForConditionalGeneration": _row("language_model.model", "stream_topk"),
    "Glm4ForCausalLM": _row("model", "stream"),
    "Glm4MoeForCausalLM": _row("model", "stream"),
    "GptOssForCausalLM": _row("model", "stream"),
    "Gemma2ForCausalLM": _row("model", "pairs"),
    # Gemma-3 layers are called with keyword arguments only: a forward hook cannot see the ForwardBatch.
    "Gemma3ForCausalLM": _row("model", "pairs", batch_positional=False),
    "Gemma3ForConditionalGeneration": _row("language_model.model", "pairs", batch_positional=False),
}

# Read in vLLM 0.33.0's model_executor/models/*.py: every layer there returns (hidden, residual).
VLLM: dict[str, Layout] = {
    "LlamaForCausalLM": _row("model", "pairs"),
    "MistralForCausalLM": _row("model", "pairs"),
    "MixtralForCausalLM": _row("model", "pairs"),
    "Qwen2ForCausalLM": _row("model", "pairs"),
    "Qwen2MoeForCausalLM": _row("model", "pairs"),
    "Qwen3ForCausalLM": _row("model", "pairs"),
    "Qwen3MoeForCausalLM": _row("model", "pairs"),
    "DeepseekV2ForCausalLM": _row("model", "pairs"),
    "DeepseekV3ForCausalLM": _row("model", "pairs"),
    "DeepseekV32ForCausalLM": _row("model", "pairs"),
    "KimiK25ForConditionalGeneration": _row("language_model.model", "pairs"),
    "Glm4ForCausalLM": _row("model", "pairs"),
    "Glm4MoeForCausalLM": _row("model", "pairs"),
    "GptOssForCausalLM": _row("model", "pairs", embed="embedding"),
    "Gemma2ForCausalLM": _row("model", "pairs"),
    "Gemma3ForCausalLM": _row("model", "pairs"),
    "Gemma3ForConditionalGeneration": _row("language_model.model", "pairs"),
}

TABLES = {"sglang": SGLANG, "vllm": VLLM}

# SGLang releases whose layer contracts were read in their own sources (tests/capture/test_sglang_versions.py derives
# them again): SGLANG above is 0.5.23's and, row for row, 0.5.22's. 0.5.20 predates the layer-boundary rewrite:
# every row's layer returns `(hidden, residual)` with the add deferred to the next input norm (0.5.20
# models/llama.py:340-368), DeepSeek's `(hidden, residual, topk_indices)` (models/deepseek_v2.py:2424-2516), so
# all are `pairs`. 0.5.21 is half-way (Llama, Mistral, Mixtral, Qwen2, GLM-4 still pairs, the rest rewritten). Any
# other release keeps the row's module names (the same in all of these) and tells the contract apart per forward.
SGLANG_DEFAULT_VERSION = "0.5.23"
SGLANG_VERSIONS: dict[str, str | None] = {"0.5.20": "pairs", "0.5.22": None, "0.5.23": None}  # None: the table's

GENERIC = Layout(text=("model", "language_model.model"), output="auto", known=False)


# config.json without `architectures` (SmolLM2's cached GGUF conversion): the class its `model_type` loads
MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "mixtral": "MixtralForCausalLM",
               "qwen2": "Qwen2ForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3": "Qwen3ForCausalLM",
               "qwen3_moe": "Qwen3MoeForCausalLM", "deepseek_v2": "DeepseekV2ForCausalLM",
               "deepseek_v3": "DeepseekV3ForCausalLM", "kimi_k2": "DeepseekV3ForCausalLM",
               "kimi_k25": "KimiK25ForConditionalGeneration", "glm4": "Glm4ForCausalLM",
               "glm4_moe": "Glm4MoeForCausalLM", "gpt_oss": "GptOssForCausalLM", "gemma2": "Gemma2ForCausalLM",
               "gemma3_text": "Gemma3ForCausalLM",
               "gemma3": "Gemma3ForConditionalGeneration"}


def architecture(config: dict) -> str:
    """The served class config.json names (`architectures[0]`; else what its `model_type` loads), or 'unknown'."""
    archs = config.get("architectures") or []
    if archs:
        return str(archs[0])
    return MODEL_TYPES.get(str(config.get("model_type")), "unknown")


def resolve_layout(config: dict, engine: str, version: str | None = None) -> Layout:
    """The engine's layout for this checkpoint's architecture; the generic rule (`known=False`) when the table has
    no row for it, or for an engine without a table (`hf`, which finds the decoder itself). `version`: the SGLang
    release that will serve it (None: SGLANG_DEFAULT_VERSION); its layer contract can differ from the table's."""
    arch = architecture(config)
    row = TABLES.get(engine, {}).get(arch)
    if row is None:
        return replace(GENERIC, architecture=arch)
    if engine == "sglang":
        row = sglang_row(row, version)
    return replace(row, architecture=arch)


def sglang_row(row: Layout, version: str | None) -> Layout:
    """A row of SGLANG (read in 0.5.23) as SGLang `version` builds the model: the same module names, that release's
    layer contract (`auto`, told apart per forward, for a release not in SGLANG_VERSIONS)."""
    if version is None:
        return row
    if version not in SGLANG_VERSIONS:
        return replace(row, output="auto")
    return replace(row, output=SGLANG_VERSIONS[version] or row.output)


def version_note(engine: str, version: str | None) -> str | None:
    """The line a command prints when the engine's release is not one the table was checked against."""
    if engine != "sglang" or version is None or version in SGLANG_VERSIONS:
        return None
    return (f"hstap: SGLang {version} is not a release hstap/capture/arch.py was checked against "
            f"({', '.join(SGLANG_VERSIONS)}): keeping the module names, telling the layer outputs apart per forward")


def fallback_note(layout: Layout, engine: str) -> str | None:
    """The line a command prints when the generic rule is in use (None for a known architecture)."""
    if layout.known:
        return None
    names = " or ".join(f"{t}.{layout.layers}.<k>" for t in layout.text)
    return (f"hstap: architecture {layout.architecture!r} has no {engine} row in hstap/capture/arch.py: using the "
            f"generic rule (layers named {names}; layer outputs told apart per forward); a name that matches no "
            "module stops `hstap serve`")
