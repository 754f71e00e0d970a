"""Talk to an OpenAI-compatible server (vLLM's, or any other): chat requests and the ``/metrics`` counters.

Only the standard library: the toolkit needs no HTTP client package, and the engine's own Python
environment never has to be importable here.
"""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

SPEC_PREFIX = "vllm:spec_decode_"
#: one observation per request per decode step, drafted or not (vLLM V1's IterationStats): its count is the
#: decode steps taken; the older name is read where the newer one is absent
DECODE_STEP_COUNTS = ("vllm:inter_token_latency_seconds_count", "vllm:time_per_output_token_seconds_count")
#: the same histograms' sums: the seconds those decode steps took (prefill not among them)
DECODE_STEP_SECONDS = tuple(name.removesuffix("_count") + "_sum" for name in DECODE_STEP_COUNTS)
_SAMPLE = re.compile(r'^([a-zA-Z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


class EngineError(RuntimeError):
    """The engine could not answer: it is gone, refused a request, or never became healthy."""


@dataclass
class ChatReply:
    """One chat completion."""

    text: str
    token_ids: list[int] | None  # the reply's tokens, when the server returns them (vLLM's return_token_ids)
    finish_reason: str | None  # "stop" (an end-of-turn or stop token) | "length" (max_tokens reached) | ...
    completion_tokens: int  # tokens generated, the stop token included when one ended the reply
    prompt_tokens: int
    seconds: float  # wall time of the request


@dataclass
class SpecCounters:
    """vLLM's spec-decode counters (cumulative since the server started, or a difference of two readings)."""

    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted: float = 0.0
    per_position: list[float] = field(default_factory=list)  # accepted tokens at draft position 0, 1, ...
    decode_steps: float | None = None  # decode steps of every request, drafted or not (None: not exposed)
    decode_seconds: float | None = None  # the seconds those steps took, as the engine clocked them

    def __sub__(self, earlier: SpecCounters) -> SpecCounters:
        n = max(len(self.per_position), len(earlier.per_position))
        pad = lambda v: v + [0.0] * (n - len(v))  # noqa: E731
        less = lambda a, b: None if a is None or b is None else a - b  # noqa: E731
        return SpecCounters(self.drafts - earlier.drafts, self.draft_tokens - earlier.draft_tokens,
                            self.accepted - earlier.accepted,
                            [a - b for a, b in zip(pad(self.per_position), pad(earlier.per_position))],
                            less(self.decode_steps, earlier.decode_steps),
                            less(self.decode_seconds, earlier.decode_seconds))

    @property
    def step_seconds(self) -> float | None:
        """The engine's mean decode step: the steps' seconds over their count (``None`` where not exposed or
        none ran); one request at a time, the time one step of that request took."""
        return self.decode_seconds / self.decode_steps if self.decode_steps and self.decode_seconds is not None \
            else None

    @property
    def mean_acceptance_length(self) -> float | None:
        """vLLM's figure: 1 + accepted drafts / drafts, **per drafted step** (vLLM counts a step only when the
        request had draft tokens scheduled; ``None`` without drafts). For a drafter that drafts on every step
        (Medusa heads, EAGLE) it is tokens per step; for n-gram lookup it is not (see ``tokens_per_step``)."""
        return 1 + self.accepted / self.drafts if self.drafts else None

    @property
    def per_position_acceptance(self) -> list[float]:
        """Share of drafted steps whose draft was accepted up to each position (vLLM's per-drafted-step rate)."""
        return [a / self.drafts if self.drafts else 0.0 for a in self.per_position]

    @property
    def drafted_share(self) -> float | None:
        """Share of decode steps that carried a draft (``None`` when decode steps are not exposed or none ran)."""
        return self.drafts / self.decode_steps if self.decode_steps else None


def parse_metrics(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Prometheus text exposition -> ``[(name, labels, value)]`` (comments skipped)."""
    samples = []
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if not match or line.startswith("#"):
            continue
        name, labels, value = match.groups()
        try:
            number = float(value)
        except ValueError:
            continue
        samples.append((name, dict(_LABEL.findall(labels or "")), number))
    return samples


def spec_counters(samples: Sequence[tuple[str, dict[str, str], float]]) -> SpecCounters:
    """The spec-decode counters and the decode-step count from parsed ``/metrics`` (the spec-decode ones are
    all zero on a server without speculation)."""
    counters = SpecCounters()
    per_position: dict[int, float] = {}
    steps = {name: 0.0 for name in DECODE_STEP_COUNTS + DECODE_STEP_SECONDS}
    seen = set()
    for name, labels, value in samples:
        if name in steps:
            steps[name] += value
            seen.add(name)
        key = name.removeprefix(SPEC_PREFIX).removesuffix("_total")
        if not name.startswith(SPEC_PREFIX) or name.endswith("_created"):
            continue
        if key == "num_drafts":
            counters.drafts += value
        elif key == "num_draft_tokens":
            counters.draft_tokens += value
        elif key == "num_accepted_tokens":
            counters.accepted += value
        elif key == "num_accepted_tokens_per_pos" and "position" in labels:
            position = int(labels["position"])
            per_position[position] = per_position.get(position, 0.0) + value
    counters.per_position = [per_position.get(i, 0.0) for i in range(max(per_position, default=-1) + 1)]
    counters.decode_steps = next((steps[name] for name in DECODE_STEP_COUNTS if name in seen), None)
    counters.decode_seconds = next((steps[s] for c, s in zip(DECODE_STEP_COUNTS, DECODE_STEP_SECONDS)
                                    if c in seen and s in seen), None)  # the sum beside the count read
    return counters


class EngineClient:
    """Requests to one OpenAI-compatible server at ``url`` (``http://host:port``, no ``/v1``); ``server`` is the
    ``VllmServer`` that started it, or ``None`` for a server someone else runs."""

    def __init__(self, url: str, model: str | None = None, timeout: float = 600.0, server=None):
        self.url = url.rstrip("/").removesuffix("/v1")
        self.timeout = timeout
        self.server = server
        self._model = model

    def __repr__(self) -> str:
        return f"EngineClient({self.url!r})"

    # ----------------------------------------------------------------------------------------- plumbing
    def _request(self, path: str, body: dict | None = None, timeout: float | None = None) -> bytes:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.url + path, data=data,
                                         headers={"Content-Type": "application/json"} if data else {})
        try:
            with urllib.request.urlopen(request, timeout=timeout or self.timeout) as response:
                return response.read()
        except urllib.error.HTTPError as err:
            detail = err.read().decode(errors="replace")[:2000]
            raise EngineError(f"{self.url}{path}: HTTP {err.code}: {detail}") from err
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as err:
            raise EngineError(f"{self.url}{path}: the engine did not answer ({err}); is the server still running?") \
                from err

    def healthy(self) -> bool:
        """Whether ``/health`` answers 200 now."""
        try:
            self._request("/health", timeout=5)
            return True
        except EngineError:
            return False

    @property
    def model(self) -> str:
        """The served model's name (the first of ``/v1/models`` unless given)."""
        if self._model is None:
            models = json.loads(self._request("/v1/models"))["data"]
            if not models:
                raise EngineError(f"{self.url}/v1/models lists no model")
            self._model = models[0]["id"]
        return self._model

    def metrics(self) -> list[tuple[str, dict[str, str], float]]:
        """Parsed ``/metrics``."""
        return parse_metrics(self._request("/metrics").decode())

    def spec_counters(self) -> SpecCounters:
        """The server's spec-decode counters now (since its start)."""
        return spec_counters(self.metrics())

    # ----------------------------------------------------------------------------------------- requests
    def chat(self, messages: list[dict], max_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
             seed: int | None = None, stop_token_ids: Sequence[int] | None = None) -> ChatReply:
        """One chat completion (``max_tokens`` is always sent: a server's default may be the whole context)."""
        body = {"model": self.model, "messages": messages, "max_tokens": max_tokens, "temperature": temperature,
                "top_p": top_p, "return_token_ids": True, "skip_special_tokens": True,
                # no top-k and no penalty: a model's generation_config must not change what is sampled from
                "top_k": 0, "repetition_penalty": 1.0}
        if seed is not None:
            body["seed"] = seed
        if stop_token_ids:
            body["stop_token_ids"] = list(stop_token_ids)
        start = time.perf_counter()
        answer = json.loads(self._request("/v1/chat/completions", body))
        seconds = time.perf_counter() - start
        choice = answer["choices"][0]
        usage = answer.get("usage") or {}
        token_ids = choice.get("token_ids")
        return ChatReply(text=choice["message"].get("content") or "", token_ids=token_ids,
                     finish_reason=choice.get("finish_reason"),
                     completion_tokens=usage.get("completion_tokens", len(token_ids or [])),
                     prompt_tokens=usage.get("prompt_tokens", 0), seconds=seconds)


def run_concurrently(jobs: Sequence[Callable[[], object]], concurrency: int) -> list:
    """Run ``jobs`` on ``concurrency`` threads; results in order. The first failure cancels what has not
    started and is raised once the running jobs end (no request is left behind silently)."""
    if concurrency <= 1:
        return [job() for job in jobs]
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        futures = [pool.submit(job) for job in jobs]
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        failed = [f for f in futures if f.done() and f.exception() is not None]
        if failed:
            for f in futures:
                f.cancel()
            raise failed[0].exception()
        return [f.result() for f in futures]
