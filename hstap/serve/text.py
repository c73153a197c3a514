"""Token ids to answer text as it becomes final, ended at OpenAI `stop` strings: what the `hf` server sends.

    text = TextStream(tokenizer, stops=["\\n\\n", "END"])
    text.push([12, 345]) -> "Hello"      # only text that can no longer change or turn out to be a stop string
    text.stopped, text.used               # a stop string was completed; tokens consumed up to the one completing it
    text.flush() -> " wor"                # the end: what was held back (never the stop string or anything after)

A token can end inside a UTF-8 character (it decodes to U+FFFD until the next one arrives), and a SentencePiece
tokenizer drops a word's leading space when it is decoded alone: so each push decodes a short window of tokens
before the new ones and diffs (vLLM's incremental detokenization). Text that may be the start of a stop string is
held back until the next tokens decide it. Streamed or not, an answer is this class's output, so both are the
same text.
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"  # what a token ending inside a UTF-8 character decodes to


class TextStream:
    """One answer's text, pushed token ids at a time; ends at the first stop string, which is not returned."""

    def __init__(self, tokenizer, stops: list[str] = ()):
        self.tokenizer, self.stops = tokenizer, [s for s in stops if s]
        self.tokens: list[int] = []
        self.prefix_at = self.read_at = 0  # tokens[prefix_at:read_at] decoded already: the window's context
        self.pending = ""  # decoded, not yet returned: may be the start of a stop string
        self.stopped = False
        self.used = 0  # tokens consumed: all pushed, or up to the one that completed a stop string

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def push(self, tokens: list[int]) -> str:
        """Take new token ids; → the text that is now final (may be empty). Nothing after a stop string."""
        out = []
        for tok in tokens:
            if self.stopped:
                break
            self.tokens.append(tok)
            self.used += 1
            self.pending += self._delta(final=False)
            out.append(self._release())
        return "".join(out)

    def flush(self) -> str:
        """The answer ended: → the text still held back (a partial character or a stop string's start)."""
        if self.stopped:
            return ""
        self.pending += self._delta(final=True)
        text = self._release()
        text, self.pending = text + self.pending, ""
        return text

    def _delta(self, final: bool) -> str:
        """Text the tokens since `read_at` add, once it does not end inside a character (or `final`)."""
        context = self._decode(self.tokens[self.prefix_at:self.read_at])
        text = self._decode(self.tokens[self.prefix_at:])
        if len(text) <= len(context) or (text.endswith(REPLACEMENT) and not final):
            return ""
        self.prefix_at, self.read_at = self.read_at, len(self.tokens)
        return text[len(context):]

    def _release(self) -> str:
        """Cut `pending` at a completed stop string, or keep back its longest tail that starts one; → the rest."""
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            text, self.pending = self.pending[:min(hits)], ""
            return text
        keep = max((k for s in self.stops for k in range(1, len(s)) if self.pending.endswith(s[:k])), default=0)
        text, self.pending = self.pending[:len(self.pending) - keep], self.pending[len(self.pending) - keep:]
        return text
