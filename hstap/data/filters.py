"""Rules a generated user prompt must pass: each failing rule is a named drop reason, counted by the caller.

    from hstap.data.filters import FilterSettings, prompt_problem
    prompt_problem("Write a haiku about autumn.", n_tokens=8, settings=FilterSettings())   # None: keep it
    prompt_problem("I'm sorry, but I can't help with that.", 11, FilterSettings())      # "refusal"

A small model writing "user" messages (Magpie) fails in recognisable ways: it leaks template tokens, rambles
until the token limit, drifts into another language, loops, or writes an assistant's reply instead of a request.
Rules are cheap text heuristics (no model, no downloaded language detector) applied in a fixed order, so each
dropped prompt is counted under the first rule it breaks:

    template_leftover  a special-token string (`<|im_start|>`, `<filename>`, any `<|...|>`) or a role label line
    too_short/too_long characters outside [min_chars, max_chars]
    too_few_tokens/too_many_tokens  generated tokens outside [min_tokens, max_tokens]
    not_english        under `min_ascii_letters` of the letters are ASCII, or under `min_function_words` of the
                       prose words are common English function words (fenced code is left out of the count)
    repetitive         over `max_repeated_ngrams` of the word 3-grams are repeats, or zlib shrinks a text of at
                       least 200 bytes below `min_compression_ratio` of its size
    refusal            "I'm sorry", "I cannot help", ...
    assistant_speak    "As an AI", "How can I assist you", "Sure! ...", or "Here is ..." with nothing asked: the
                       model answered as the assistant
    not_a_request      no question mark, no request word ("write", "explain", "can you", "rephrase", ...) and no
                       first person ("I", "my", "we"): a statement such as an answer or a story, not a user turn
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Iterable
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field, model_validator

REASONS = ("template_leftover", "too_short", "too_long", "too_few_tokens", "too_many_tokens", "not_english",
           "repetitive", "refusal", "assistant_speak", "not_a_request")

_FUNCTION_WORDS = frozenset("""
a an the and or but if then so because as of to in on at by for with from into about than this that these those
it its is are was were be been being am do does did have has had will would can could should may might must
i me my we our you your he she they them their his her what which who whom whose when where why how not no yes
please there here some any all each more most other such only also just very what's i'm don't can't it's
""".split())
_TEMPLATE = re.compile(r"<\|[^|<>\n]{1,40}\|>|^\s*(system|user|assistant|human|gpt)\s*:?\s*$", re.I | re.M)
_REFUSAL = re.compile(r"\b(i'?m sorry|i am sorry|i apologi[sz]e|i (cannot|can't|can ?not|won't|am unable to|'m "
                      r"unable to) (help|assist|provide|answer|fulfil|comply|do that)|i'm not able to (help|assist))",
                      re.I)
_ASSISTANT = re.compile(r"\bas an ai\b|\bas a (large )?language model\b|\bas an assistant\b|\bi'?m an ai\b|"
                        r"\bhow (can|may) i (help|assist) you\b|\bi hope (this|that) helps\b|"
                        r"^\s*(sure|certainly|of course|absolutely|great question)\b[!,.]", re.I)
_HERE_IS = re.compile(r"^\s*(here is|here's|here are)\b", re.I)  # an answer's opening, unless it asks something
_REQUEST = re.compile(r"\?|\b(please|can you|could you|would you|will you|help|i need|i want|i'd like|i would like|"
                      r"i|i'm|my|we|our|us|let's|suppose|imagine|pretend|act|assume|consider|given|based|if|"
                      r"tell|show|give|write|explain|describe|compose|create|draft|generate|list|summari[sz]e|"
                      r"translate|calculate|compute|solve|find|prove|implement|design|compare|analy[sz]e|extract|"
                      r"identify|evaluate|suggest|recommend|rewrite|rephrase|revise|rework|reformulate|modify|alter|"
                      r"update|edit|convert|classify|determine|discuss|outline|develop|provide|name|define|make|"
                      r"craft|come up|do|take|use|add|remove|express|build|plan|fix|debug|optimi[sz]e|refactor|"
                      r"complete|continue|check|review|rate|rank|sort|choose|pick|predict|estimate|prepare|"
                      r"organi[sz]e|change|shorten|expand|elaborate|clarify|justify|argue|illustrate|propose|"
                      r"brainstorm|invent|how|what|why|which|who|when|where)\b", re.I)
_FENCED = re.compile(r"```.*?(```|$)", re.S)


class FilterSettings(BaseModel):
    """Bounds of the prompt rules; recorded in the provenance file so a prompt set says how it was filtered."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    min_chars: int = Field(16, ge=1)
    max_chars: int = Field(2000, ge=1)
    min_tokens: int = Field(4, ge=1)
    max_tokens: int = Field(512, ge=1)
    min_ascii_letters: float = Field(0.9, ge=0.0, le=1.0)
    min_function_words: float = Field(0.1, ge=0.0, le=1.0)
    max_repeated_ngrams: float = Field(0.3, ge=0.0, le=1.0)
    min_compression_ratio: float = Field(0.3, ge=0.0, le=1.0)

    @model_validator(mode="after")
    def _bounds(self) -> "FilterSettings":
        for low, high in (("min_chars", "max_chars"), ("min_tokens", "max_tokens")):
            if getattr(self, low) > getattr(self, high):
                raise ValueError(f"{low} {getattr(self, low)} is above {high} {getattr(self, high)}")
        return self


@dataclass(frozen=True)
class _Text:
    """A prompt with the views several rules share."""

    raw: str
    words: list[str]
    prose_words: list[str]


def prompt_problem(text: str, n_tokens: int, settings: FilterSettings,
                   special_strings: Iterable[str] = ()) -> str | None:
    """The first rule `text` breaks (a name from REASONS), or None when it is a usable prompt.

    `n_tokens`: how many tokens the model generated for it; `special_strings`: the tokenizer's special and
    added tokens (`<filename>` would become a control token when the prompt is rendered)."""
    text = text.strip()
    # prose words: two letters or more, outside fenced code (`x*y = 4z` holds no words to judge English by)
    view = _Text(text, re.findall(r"[a-z']+", text.lower()),
                 re.findall(r"[a-z][a-z']+", _FENCED.sub(" ", text).lower()))
    checks = (
        ("template_leftover", lambda: _TEMPLATE.search(text) is not None or any(s in text for s in special_strings)),
        ("too_short", lambda: len(text) < settings.min_chars),
        ("too_long", lambda: len(text) > settings.max_chars),
        ("too_few_tokens", lambda: n_tokens < settings.min_tokens),
        ("too_many_tokens", lambda: n_tokens > settings.max_tokens),
        ("not_english", lambda: not _is_english(view, settings)),
        ("repetitive", lambda: _is_repetitive(view, settings)),
        ("refusal", lambda: _REFUSAL.search(text) is not None),
        ("assistant_speak", lambda: _ASSISTANT.search(text) is not None or (_HERE_IS.match(text) is not None
                                                                            and "?" not in text)),
        ("not_a_request", lambda: _REQUEST.search(text) is None),
    )
    return next((reason for reason, broken in checks if broken()), None)


def ascii_letter_share(text: str) -> float:
    """Share of the letters in `text` that are ASCII (1.0 for a text without letters)."""
    letters = [c for c in text if c.isalpha()]
    return sum(c.isascii() for c in letters) / len(letters) if letters else 1.0


def function_word_share(prose_words: list[str]) -> float:
    """Share of words that are common English function words: ~0.4-0.5 in English prose, ~0 in French."""
    return sum(w in _FUNCTION_WORDS for w in prose_words) / len(prose_words) if prose_words else 1.0


def repeated_ngram_share(tokens: list[str], n: int = 3) -> float:
    """Share of the word n-grams that repeat an earlier one (0 for a text of fewer than n words)."""
    grams = [tuple(tokens[k:k + n]) for k in range(len(tokens) - n + 1)]
    return 1.0 - len(set(grams)) / len(grams) if grams else 0.0


def compression_ratio(text: str) -> float:
    """zlib-compressed size over raw size: ~0.5 for English prose of a few hundred bytes, far less for loops."""
    data = text.encode("utf-8")
    return len(zlib.compress(data, 9)) / len(data) if data else 1.0


def _is_english(view: _Text, settings: FilterSettings) -> bool:
    if ascii_letter_share(view.raw) < settings.min_ascii_letters:
        return False
    # a short prompt ("Name one ocean.") has too few words for a share to mean anything
    return len(view.prose_words) < 8 or function_word_share(view.prose_words) >= settings.min_function_words


def _is_repetitive(view: _Text, settings: FilterSettings) -> bool:
    if len(view.words) >= 12 and repeated_ngram_share(view.words) > settings.max_repeated_ngrams:
        return True
    return len(view.raw.encode("utf-8")) >= 200 and compression_ratio(view.raw) < settings.min_compression_ratio
