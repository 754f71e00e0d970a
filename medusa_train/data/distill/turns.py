"""A batch of conversations answered turn by turn, each turn in the context of the model's own earlier replies."""

from __future__ import annotations

from dataclasses import dataclass

from medusa_train.config.distill import DistillConfig
from medusa_train.data.distill.filters import degenerate_reason
from medusa_train.data.distill.generate import generate_replies
from medusa_train.data.distill.prompts import Message, Prompt, render_length


@dataclass
class Outcome:
    """What became of one conversation: a record to write, or a skip reason."""

    id: str
    messages: list[Message]
    new_tokens: int  # tokens of the kept replies (with their end-of-turn tokens)
    stopped: str | None  # why fewer turns than asked were answered (None: all answered)
    generated: int = 0  # tokens generated, kept or not

    def line(self) -> dict:
        """The jsonl line: a record with its messages, or ``{"id", "reason"}`` when no reply was kept."""
        if not any(m["role"] == "assistant" for m in self.messages):
            return {"id": self.id, "reason": self.stopped}
        return {"id": self.id, "messages": self.messages, "new_tokens": self.new_tokens, "stopped": self.stopped}


def distill_batch(model, tokenizer, prompts: list[Prompt], cfg: DistillConfig, eos_ids: list[int],
                  generate=None) -> list[Outcome]:
    """Answer every turn of a batch of conversations, turn by turn, each with its own earlier replies.

    ``generate(contexts) -> list[Reply]`` replaces the in-process ``generate_replies(model, ...)`` (a serving
    engine's replies, ``served.served_replies``); ``model`` is then unused."""
    outcomes = [Outcome(p.id, [], 0, None) for p in prompts]
    active = list(range(len(prompts)))
    for turn in range(max(len(p.segments) for p in prompts)):
        ready = []
        for i in active:
            if turn >= len(prompts[i].segments):
                continue
            context = outcomes[i].messages + prompts[i].segments[turn]
            if turn and render_length(tokenizer, context) > cfg.max_prompt_tokens:
                outcomes[i].stopped = "prompt_too_long"
                continue
            ready.append((i, context))
        if not ready:
            break
        contexts = [c for _, c in ready]
        replies = generate(contexts) if generate is not None else \
            generate_replies(model, tokenizer, contexts, cfg.generation, eos_ids, cfg.filters)
        active = []
        for (i, context), reply in zip(ready, replies):
            outcomes[i].generated += reply.generated
            reason = degenerate_reason(reply.text, reply.tokens, reply.finished, cfg.filters, reply.looped)
            if reason:
                outcomes[i].stopped = reason
                continue
            outcomes[i].new_tokens += len(reply.tokens) + int(reply.finished)
            outcomes[i].messages = context + [{"role": "assistant", "content": reply.text}]
            if reply.looped:  # its text was cut where the loop began: the conversation ends here
                outcomes[i].stopped = "loop_trimmed"
            else:
                active.append(i)
    return outcomes
