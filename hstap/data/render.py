"""Render a Conversation through the tokenizer's chat template into token ids and an assistant-only loss mask.

The mask is token-exact: each assistant turn's masked tokens are `tokenize(content + end_of_turn)`, the very
tokens the target emits when it generates that answer after the `<|im_start|>assistant\\n` header. To get
that, the rendered text is cut at character spans found by rendering prefixes of the conversation, and each
piece is tokenized on its own (a single tokenization of the whole text could merge across a turn boundary).

    from hstap.data import render
    sample = render(conv, tokenizer, max_tokens=2048)   # RenderedSample(id, input_ids, loss_mask) or None
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from hstap.config import Loops
from hstap.data.loops import cut_loops
from hstap.data.types import Conversation, SkipReport
from hstap.errors import HstapError


@dataclass
class RenderedSample:
    """Token ids of one rendered conversation; `loss_mask[t]` is True where token t belongs to an answer."""

    id: str
    input_ids: list[int]
    loss_mask: list[bool]


def render(conv: Conversation, tokenizer, max_tokens: int | None = None,
           overlong: Literal["truncate", "skip"] = "truncate",
           report: SkipReport | None = None, loops: Loops = "keep") -> RenderedSample | None:
    """Tokens and assistant-only mask of `conv`, or None (reason counted in `report`) when it is unusable.

    `loops="cut"`: an answer ending in a repetition loop keeps its first period and one repeat in the loss
    (hstap/data/loops.py); counted as `loop_cut` (answers) and `loop_tokens_cut` (tokens out of the loss).

    Over `max_tokens`: "truncate" keeps the first max_tokens tokens (counted `truncated`), "skip" drops the
    sample (`too_long`). A sample whose first answer starts past max_tokens (a 1 MB question, say) would keep no
    answer token: it is dropped as `prompt_over_max_tokens` (raise `--max-tokens` to keep it), as is one whose
    text contains a special-token string such as `<|endoftext|>`
    (`special_token_text`): the tokenizer would turn it into a control token nobody typed.
    """
    if overlong not in ("truncate", "skip"):
        raise HstapError(f"overlong must be 'truncate' or 'skip', got {overlong!r}")
    if _has_special_text(conv.messages, tokenizer):
        return _drop(report, "special_token_text", conv)
    text, spans = _assistant_spans(conv.messages, tokenizer)
    ids, mask = _tokenize_pieces(text, spans, tokenizer)
    if loops == "cut":
        ids, mask, cuts = cut_loops(ids, mask, tokenizer.eos_token_id)
        if cuts and report is not None:
            report.add("loop_cut", len(cuts))
            report.add("loop_tokens_cut", sum(cuts))
    elif loops != "keep":
        raise HstapError(f"loops must be 'keep' or 'cut', got {loops!r}")
    if max_tokens is not None and len(ids) > max_tokens:
        if overlong == "skip":
            return _drop(report, "too_long", conv)
        ids, mask = ids[:max_tokens], mask[:max_tokens]
        if spans and not any(mask):
            return _drop(report, "prompt_over_max_tokens", conv)
        if report is not None:
            report.add("truncated")
    return RenderedSample(id=conv.id, input_ids=ids, loss_mask=mask)


def render_prompt(messages: list[dict[str, str]], tokenizer) -> list[int]:
    """Token ids of `messages` plus the assistant header, ready for the target to generate the next answer.

    Earlier answers are tokenized as in `render`, so the prompt equals the rendered sample's ids up to the
    header of the answer that follows it.
    """
    text, spans = _assistant_spans(messages, tokenizer, add_generation_prompt=True)
    return _tokenize_pieces(text, spans, tokenizer)[0]


def _drop(report: SkipReport | None, reason: str, conv: Conversation) -> None:
    if report is not None:
        report.add(reason, where=f"{conv.source} record {conv.id!r}")
    return None


def _has_special_text(messages: list[dict[str, str]], tokenizer) -> bool:
    added = tokenizer.get_added_vocab() if hasattr(tokenizer, "get_added_vocab") else {}
    specials = set(added) | set(tokenizer.all_special_tokens)
    return any(s in m["content"] for m in messages for s in specials)


def _apply(tokenizer, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
    if getattr(tokenizer, "chat_template", None) is None:
        raise HstapError(f"tokenizer {tokenizer.name_or_path!r} has no chat template: use an instruct model")
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def _assistant_spans(messages: list[dict[str, str]], tokenizer,
                     add_generation_prompt: bool = False) -> tuple[str, list[tuple[int, int]]]:
    """The full rendered text and, per assistant turn, the [start, end) chars of its content + end-of-turn.

    start = length of the render of the turns before it with the generation prompt (i.e. up to the header);
    end = just after the first end-of-turn string (the tokenizer's eos) following the content.
    """
    full = _apply(tokenizer, messages, add_generation_prompt)
    eot = tokenizer.eos_token
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        if i == 0:
            raise HstapError("conversation starts with an assistant turn: the template has no header to cut at")
        head = _apply(tokenizer, messages[:i], add_generation_prompt=True)
        through = _apply(tokenizer, messages[:i + 1], add_generation_prompt=False)
        if not (through.startswith(head) and full.startswith(through)):
            raise HstapError(f"chat template of {tokenizer.name_or_path!r} is not prefix-stable (rendering the "
                             f"first {i} turns is not a prefix of the full render): loss masks would be wrong")
        start = len(head)
        after = start + len(m["content"]) if through.startswith(m["content"], start) else start
        end = through.find(eot, after)
        if end < 0:
            raise HstapError(f"chat template of {tokenizer.name_or_path!r} does not close assistant turn {i} "
                             f"with the eos token {eot!r}")
        spans.append((start, end + len(eot)))
    return full, spans


def _tokenize_pieces(text: str, spans: list[tuple[int, int]], tokenizer) -> tuple[list[int], list[bool]]:
    pieces, cut = [], 0
    for start, end in spans:
        pieces += [(text[cut:start], False), (text[start:end], True)]
        cut = end
    pieces.append((text[cut:], False))
    pieces = [(p, masked) for p, masked in pieces if p]
    encoded = tokenizer([p for p, _ in pieces], add_special_tokens=False)["input_ids"]
    ids, mask = [], []
    for (_, masked), piece_ids in zip(pieces, encoded):
        ids += piece_ids
        mask += [masked] * len(piece_ids)
    return ids, mask
