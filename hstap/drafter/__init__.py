"""The EAGLE-3 drafter: config, model, draft vocabulary; shipped drafters (shipped.py) and loading one for a
target (load.py)."""

from hstap.drafter.config import DrafterConfig
from hstap.drafter.model import Eagle3Drafter
from hstap.drafter.vocab import (build_draft_vocab, count_tokens, draft_to_target_ids, grow_draft_vocab,
                                 target_to_draft_ids)

__all__ = ["DrafterConfig", "Eagle3Drafter", "build_draft_vocab", "count_tokens", "draft_to_target_ids",
           "grow_draft_vocab", "target_to_draft_ids"]
