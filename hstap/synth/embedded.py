"""The synth backend over the runtime's batched Engine: renders the chat exactly as capture will, queues it, and
decodes the answer (greedy or top-p sampling, per-row stops).

    from hstap.synth.embedded import EmbeddedBackend
    backend = EmbeddedBackend(target, max_batch=16, cuda_graphs=None, compile_step=False, continuous=None)
    completion = await backend.complete(messages, sampling)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hstap.errors import HstapError
from hstap.runtime.engine import Engine, OverPositions, Request

if TYPE_CHECKING:
    from hstap.synth.backend import Completion


class EmbeddedBackend:
    """The synth Backend over an Engine: renders the chat exactly as capture will, queues it, decodes the answer.

    The Engine keeps the runtime's lean prefill: nothing hooks the model here (the hidden states are captured
    later, by `hstap capture`'s own forward over the finished conversations)."""

    def __init__(self, target, *, max_batch: int, cuda_graphs: bool | None, compile_step: bool,
                 continuous: bool | None):
        """Settings as `hstap synth` gives them (hstap.synth.config.SynthConfig holds the defaults); None: the
        Engine's default for the device."""
        self.target = target
        self.model_id = target.model_id
        self.engine = Engine(target, max_batch=max_batch, cuda_graphs=cuda_graphs, compile_step=compile_step,
                             continuous=continuous)  # None: the Engine's default for the device

    async def complete(self, messages: list[dict[str, str]], sampling) -> "Completion":
        import asyncio

        from hstap.data import render_prompt
        from hstap.synth.backend import Completion, PermanentFailure, RequestFailed

        prompt = render_prompt(messages, self.target.tokenizer)
        request = Request(prompt=prompt, max_new_tokens=sampling.max_new_tokens, temperature=sampling.temperature,
                          top_p=sampling.top_p, seed=sampling.seed)
        try:
            gen = await asyncio.wrap_future(self.engine.submit(request))
        except OverPositions as exc:  # the same request fails the same way every time
            raise PermanentFailure(str(exc), reason="over_model_positions") from None
        except HstapError as exc:
            raise RequestFailed(str(exc)) from None
        text = self.target.tokenizer.decode(gen.tokens, skip_special_tokens=False)
        return Completion(content=text, finish_reason=gen.finish_reason, prompt_tokens=gen.prompt_tokens,
                          completion_tokens=gen.completion_tokens)

    def close(self) -> None:
        self.engine.close()
