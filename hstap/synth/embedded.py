"""The synth backend over the runtime's batched Engine: renders the chat exactly as capture will, queues it, and
decodes the answer (greedy or top-p sampling, per-row stops).

    from hstap.synth.embedded import EmbeddedBackend
    backend = EmbeddedBackend(target, max_batch=16)     # hstap.runtime.engine.Engine underneath
    completion = await backend.complete(messages, sampling)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hstap.errors import HstapError
from hstap.runtime.engine import Engine, Request

if TYPE_CHECKING:
    from hstap.synth.backend import Completion


class EmbeddedBackend:
    """The synth Backend over an Engine: renders the chat exactly as capture will, queues it, decodes the answer.

    The Engine keeps the runtime's lean prefill: nothing hooks the model here (the hidden states are captured
    later, by `hstap capture`'s own forward over the finished conversations)."""

    def __init__(self, target, max_batch: int = 16, cuda_graphs: bool | None = None, compile_step: bool = False,
                 continuous: bool | None = None):
        self.target = target
        self.model_id = target.model_id
        self.engine = Engine(target, max_batch=max_batch, cuda_graphs=cuda_graphs, compile_step=compile_step,
                             continuous=continuous)  # None: the Engine's default for the device

    async def complete(self, messages: list[dict[str, str]], sampling) -> "Completion":
        import asyncio

        from hstap.data import render_prompt
        from hstap.synth.backend import Completion, PermanentFailure, RequestFailed

        prompt = render_prompt(messages, self.target.tokenizer)
        limit = self.engine.max_len
        if len(prompt) + sampling.max_new_tokens > limit:  # the same request fails the same way every time
            fits = f"; --max-new-tokens {limit - len(prompt)} would fit" if len(prompt) < limit else ""
            raise PermanentFailure(f"prompt of {len(prompt)} tokens + max_new_tokens {sampling.max_new_tokens} "
                                   f"exceeds the model's {limit} positions{fits}", reason="over_model_positions")
        request = Request(prompt=prompt, max_new_tokens=sampling.max_new_tokens, temperature=sampling.temperature,
                          top_p=sampling.top_p, seed=sampling.seed)
        try:
            gen = await asyncio.wrap_future(self.engine.submit(request))
        except HstapError as exc:
            raise RequestFailed(str(exc)) from None
        text = self.target.tokenizer.decode(gen.tokens, skip_special_tokens=False)
        return Completion(content=text, finish_reason=gen.finish_reason, prompt_tokens=gen.prompt_tokens,
                          completion_tokens=gen.completion_tokens)

    def close(self) -> None:
        self.engine.close()
