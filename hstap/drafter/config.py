"""The drafter's config: its own shape plus the target identity it was trained against.

Saved as the run directory's `config.json`; export turns it into SGLang's / vLLM's EAGLE-3 configs.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from hstap.errors import HstapError


class DrafterConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192
    vocab_size: int  # the target's vocabulary (embedding rows)
    draft_vocab_size: int
    aux_layer_ids: list[int]  # canonical hstap layer ids the fc layer reads, in order
    target_model_id: str
    target_fingerprint: str
    target_num_layers: int
    target_hidden_size: int
    hstap_format: int = 1

    @classmethod
    def from_target(cls, target_config, aux_layer_ids: list[int], draft_vocab_size: int, model_id: str,
                    fingerprint: str, intermediate_size: int | None = None) -> "DrafterConfig":
        """Mirror the target's attention/MLP shape (EAGLE-3's choice) from a transformers config; `intermediate_size`
        widens (or narrows) the MLP: SGLang and vLLM read it from the draft model's own config."""
        rope = getattr(target_config, "rope_parameters", None) or {}
        rope_type = rope.get("rope_type", "default")
        if rope_type != "default":
            raise HstapError(f"target rope_parameters.rope_type={rope_type!r}: only 'default' RoPE is supported")
        theta = rope.get("rope_theta", getattr(target_config, "rope_theta", 10000.0))
        heads = target_config.num_attention_heads
        return cls(
            hidden_size=target_config.hidden_size,
            intermediate_size=intermediate_size or target_config.intermediate_size,
            num_attention_heads=heads,
            num_key_value_heads=getattr(target_config, "num_key_value_heads", heads),
            head_dim=getattr(target_config, "head_dim", None) or target_config.hidden_size // heads,
            rms_norm_eps=target_config.rms_norm_eps,
            rope_theta=float(theta),
            max_position_embeddings=target_config.max_position_embeddings,
            vocab_size=target_config.vocab_size,
            draft_vocab_size=draft_vocab_size,
            aux_layer_ids=list(aux_layer_ids),
            target_model_id=model_id,
            target_fingerprint=fingerprint,
            target_num_layers=target_config.num_hidden_layers,
            target_hidden_size=target_config.hidden_size,
        )

    def save(self, path: Path) -> None:
        Path(path).write_text(self.model_dump_json(indent=2) + "\n")

    @classmethod
    def load(cls, path: Path) -> "DrafterConfig":
        path = Path(path)
        try:
            return cls.model_validate(json.loads(path.read_text()))
        except FileNotFoundError:
            raise HstapError(f"{path}: no drafter config (expected a run directory written by `hstap train`)") from None
        except (json.JSONDecodeError, ValueError) as exc:
            raise HstapError(f"{path}: not a valid drafter config: {str(exc).splitlines()[0]}") from None
