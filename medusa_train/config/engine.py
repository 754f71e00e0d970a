"""Typed configuration of a serving engine the toolkit starts or attaches to (``server:`` in the commands'
YAML), and of the served measurement (``served:`` in ``configs/commands/evaluate.yaml``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from medusa_train.config.check import Problems

ENGINES = ("vllm", "openai")


@dataclass
class ServerConfig:
    python: str | None = None  #: the engine's Python (null: $MEDUSA_TRAIN_VLLM_PYTHON, else .venv-vllm/bin/python from make setup)
    port: int | None = None  #: port to listen on (null: a free one)
    args: list[str] = field(default_factory=list)  #: more vLLM server flags, as typed after `vllm serve MODEL`
    enforce_eager: bool | None = None  #: --enforce-eager (null: where there is no CUDA; it skips a slow compile on CPU)
    kv_cache_gib: int = 2  #: VLLM_CPU_KVCACHE_SPACE (whole GiB) for the CPU build (GPU builds ignore it)
    #: VLLM_CPU_NUM_OF_RESERVED_CPU for the CPU build: cores kept from the engine's compute threads (0: every core
    #: computes, as our decoders' threads do; vLLM's own default, 1 on x86, halves a 2-core machine's engine:
    #: distillation 305 -> 476 tokens/s with 0, docs/log/2026-11-29-engine-on-every-core.md; null: vLLM's default)
    reserved_cpus: int | None = 0
    startup_timeout: float = 600  #: seconds to wait for /health
    request_timeout: float = 600  #: seconds one request may take

    def server_kwargs(self) -> dict:
        """The ``engine.VllmServer`` arguments these settings give."""
        return {"python": self.python, "port": self.port, "enforce_eager": self.enforce_eager,
                "extra_args": self.args, "kv_cache_gib": self.kv_cache_gib, "reserved_cpus": self.reserved_cpus,
                "startup_timeout": self.startup_timeout}


@dataclass
class ServedConfig:
    """What ``engine=vllm`` measures in the served engine."""

    num_speculative_tokens: int | None = None  #: K heads proposed per step (null: every head, as the simulated chain)
    concurrency: int = 8  #: the higher concurrency measured beside 1
    sampled_temperature: float = 0.7  #: a sampled pass (seeded): acceptance and speed only; 0 = skip it
    ngram: bool = True  #: also serve the engine's n-gram speculation (no training at all) on the same prompts
    ngram_tokens: int = 4  #: its num_speculative_tokens
    #: also serve the engine's suffix decoding (no training; vLLM's method suffix needs arctic-inference in the engine's
    #: environment: bash scripts/suffix_env.sh, else the row is left out and the report says why), its cache of
    #: earlier replies off (suffix_decoding_max_cached_requests 0): it cannot copy a reply it has already served
    suffix: bool = True
    plain: bool = True  #: also serve without speculation (the speed and output baseline)
    #: servers you already run, one URL per row (http://host:port), measured instead of started; their counters
    #: include any other traffic they get. plain_url: no speculation; draft_url: this draft (heads or EAGLE-3) as its
    #: speculator (K: num_speculative_tokens if set, else read from its counters); ngram_url: vLLM's n-gram
    plain_url: str | None = None
    draft_url: str | None = None
    ngram_url: str | None = None
    suffix_url: str | None = None  #: vLLM's suffix decoding
    sampled_check_threshold: float = 1e-4  #: a sampled reply token below this probability under the backbone is suspect

    def url(self, name: str) -> str | None:
        """The attached server's URL for row ``name`` (plain | draft | ngram | suffix), or ``None`` to start one."""
        return getattr(self, f"{name}_url")


def check_server(s: ServerConfig, prefix: str = "server") -> list[str]:
    p = Problems()
    p.need(s.port is None or 0 < s.port < 65536, f"{prefix}.port", s.port, "must be a port number or null")
    p.need(s.kv_cache_gib >= 1, f"{prefix}.kv_cache_gib", s.kv_cache_gib, "must be a whole number of GiB >= 1")
    p.need(s.startup_timeout > 0, f"{prefix}.startup_timeout", s.startup_timeout, "must be > 0")
    p.need(s.request_timeout > 0, f"{prefix}.request_timeout", s.request_timeout, "must be > 0")
    return p


def check_served(s: ServedConfig, depth: int | None) -> list[str]:
    p = Problems()
    p.need(s.num_speculative_tokens is None or s.num_speculative_tokens >= 1, "served.num_speculative_tokens",
           s.num_speculative_tokens, "must be >= 1 or null (every head)")
    if depth and s.num_speculative_tokens:
        p.need(s.num_speculative_tokens <= depth, "served.num_speculative_tokens", s.num_speculative_tokens,
               f"must be at most the heads' {depth} (vLLM fails to load more)")
    p.need(s.concurrency >= 1, "served.concurrency", s.concurrency, "must be >= 1")
    p.need(s.sampled_temperature >= 0, "served.sampled_temperature", s.sampled_temperature, "must be >= 0")
    p.need(s.ngram_tokens >= 1, "served.ngram_tokens", s.ngram_tokens, "must be >= 1")
    for name in ("plain", "draft", "ngram", "suffix"):
        url = s.url(name)
        p.need(url is None or url.startswith(("http://", "https://")), f"served.{name}_url", url,
               "must be http://host:port (or null: start a server)")
    p.need(0 < s.sampled_check_threshold < 1, "served.sampled_check_threshold", s.sampled_check_threshold,
           "must be in (0, 1)")
    return p
