"""Distillation through a serving engine: replies from OpenAI-compatible servers instead of an in-process model.

    medusa-train distill engine=vllm num_prompts=1200                   # starts a vLLM server, stops it after
    medusa-train distill engine=openai url=[http://gpu1:8000,http://gpu2:8000] concurrency=128

Only the tokenizer loads here. Each conversation is answered turn by turn with its own earlier replies
(``turns.distill_batch`` on one conversation), ``concurrency`` conversations at a time spread round-robin
over the servers, and written as soon as it is done. Replies stop at the model's end-of-turn ids
(``stop_token_ids``); their token ids come from the server (vLLM's ``return_token_ids``) or, from servers
that do not return them, from tokenising the text here. A reply that ran into a loop is cut where the
loop began after the fact (the in-process path stops generating there; greedy text is the same).

A request that fails (the server is gone, or refuses) stops the run: nothing is written as a skip for
it, and a rerun of the same command continues from the records on disk.
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path

from medusa_train.backbone.chat_template import resolve_chat_template
from medusa_train.config.distill import DistillConfig
from medusa_train.data.distill.generate import Reply
from medusa_train.data.distill.prompts import Message, Prompt
from medusa_train.data.distill.repetition import LoopTracker
from medusa_train.data.distill.turns import Outcome, distill_batch
from medusa_train.engine import EngineClient, VllmServer, attach


@contextlib.contextmanager
def engine_clients(cfg: DistillConfig, model_path: str) -> Iterator[list[EngineClient]]:
    """Clients for ``cfg.engine``: a vLLM server started on ``model_path`` for the run (``vllm``), or every
    ``url`` attached to (``openai``)."""
    s = cfg.server
    if cfg.engine == "vllm":
        output = Path(cfg.output)
        kwargs = s.server_kwargs()
        if cfg.chat_template:  # the server renders the prompts; given as a file (vLLM unescapes a template's text)
            template = output.with_name(output.stem + ".chat_template.jinja")
            template.write_text(resolve_chat_template(cfg.chat_template), encoding="utf-8")
            kwargs["extra_args"] = [*kwargs["extra_args"], "--chat-template", str(template.resolve())]
        server = VllmServer(model_path, dtype=cfg.model.dtype, seed=cfg.seed,
                            log_path=output.with_name(output.stem + ".vllm.log"), **kwargs)
        print(f"[medusa_train] starting vLLM for distillation ({model_path}, dtype {cfg.model.dtype}; "
              f"log {server.log_path}) ...", flush=True)
        with server as client:
            print(f"[medusa_train] vLLM answered /health after {server.startup_seconds:.0f} s", flush=True)
            client.timeout = s.request_timeout
            yield [client]
    else:
        urls = [cfg.url] if isinstance(cfg.url, str) else list(cfg.url or [])
        yield [attach(url, timeout=s.request_timeout) for url in urls]


def served_replies(client: EngineClient, tokenizer, cfg: DistillConfig, eos_ids: Sequence[int], seed: int):
    """``replies(contexts) -> list[Reply]`` through ``client``, as ``generate.generate_replies`` returns them."""
    g, f = cfg.generation, cfg.filters
    eos = set(eos_ids)

    def replies(contexts: list[list[Message]]) -> list[Reply]:
        out = []
        for turn, context in enumerate(contexts):
            answer = client.chat(context, max_tokens=g.max_new_tokens, temperature=g.temperature, top_p=g.top_p,
                                 seed=seed + turn if g.temperature > 0 else None, stop_token_ids=eos_ids)
            tokens = answer.token_ids if answer.token_ids is not None else \
                tokenizer(answer.text, add_special_tokens=False)["input_ids"]
            finished = answer.finish_reason == "stop"
            if tokens and tokens[-1] in eos:
                tokens = tokens[:-1]
            generated = max(answer.completion_tokens, len(tokens) + int(finished))
            cut = _loop_start(tokens, f.repetition_ngram, f.loop_window) if f.loop_window else None
            if cut is not None:  # generated on past the loop; keep what came before it, as the in-process path does
                out.append(Reply(_decode(tokenizer, tokens[:cut]), tokens[:cut], False, generated, looped=True))
            else:
                out.append(Reply(_decode(tokenizer, tokens), list(tokens), finished, generated))
        return out
    return replies


def distill_served(clients: Sequence[EngineClient], tokenizer, prompts: Sequence[Prompt], cfg: DistillConfig,
                   eos_ids: Sequence[int], stop: Callable[[], bool] = lambda: False) -> Iterator[Outcome]:
    """Answer ``prompts`` through ``clients``, ``cfg.concurrency`` conversations at a time; yields each finished
    conversation's outcome as it completes. The first failed request stops the run (raised after the
    conversations in flight end; none of them is yielded half-done). Once ``stop()`` says so, no more
    conversations start and those in flight are yielded as they end."""
    def job(i: int, prompt: Prompt) -> Outcome:
        client = clients[i % len(clients)]
        seed = cfg.seed * 1_000_003 + zlib.crc32(prompt.id.encode()) * 64
        generate = served_replies(client, tokenizer, cfg, eos_ids, seed)
        return distill_batch(None, tokenizer, [prompt], cfg, eos_ids, generate=generate)[0]

    pool = ThreadPoolExecutor(max_workers=cfg.concurrency)
    pending = iter(enumerate(prompts))
    running = set()
    try:
        for i, prompt in pending:  # keep the pool exactly full: no long queue to cancel when a server dies
            running.add(pool.submit(job, i, prompt))
            if len(running) >= cfg.concurrency:
                break
        while running:
            done, running = wait(running, return_when=FIRST_COMPLETED)
            failed = [f for f in done if f.exception() is not None]
            if failed:
                wait(running)  # let the requests in flight end (they fail fast when the server is gone)
                for f in sorted(done | running, key=id):
                    if f.exception() is None:
                        yield f.result()
                raise failed[0].exception()
            for f in done:
                yield f.result()
                nxt = None if stop() else next(pending, None)
                if nxt is not None:
                    running.add(pool.submit(job, *nxt))
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _loop_start(tokens: Sequence[int], ngram: int, window: int) -> int | None:
    # where the in-process LoopTracker would have stopped generating (repetition.loop_start asks another
    # question: whether the whole reply *ends* in a loop)
    tracker = LoopTracker(ngram, window)
    for token in tokens:
        if tracker.push(token):
            return tracker.loop_start
    return None


def _decode(tokenizer, tokens: list[int]) -> str:
    return tokenizer.decode(tokens, skip_special_tokens=True)
