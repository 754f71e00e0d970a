"""What a decode step costs on this device, in this dtype: a plain step, and a verify step per tree size.

A verify step is everything Medusa decoding does per step: the heads' candidates (for heads that
read their path, one head call per tree depth; for prefix attention, the layer's pass), one
backbone pass over every tree node with the 4D tree mask, the LM head at every node, greedy
acceptance and KV-cache compaction. A plain step is one token through the backbone, the LM head
and argmax; ``generate_ms`` is what Hugging Face ``generate`` spends per greedy token, the users'
baseline and the one the evaluation's speedup is measured against.

``choose_tree_size`` turns a cost curve and the expected accepted length of each size into the size
with the most expected tokens per second (expected accepted length / step cost: Sequoia's objective;
the Medusa paper picked its 64-node tree on an A100 by such a sweep). It reads the curve through
``nondecreasing``: a tree pass over more nodes does at least the work of one over fewer, so a bigger
tree timed cheaper than a smaller one is timing noise, and a size picked for such a dip is promised
more speed than it has (one demo run: 19% above the measured speedup, 16% with the fit; docs/results.md).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch

from medusa_train.backbone.row_layers import linear_path
from medusa_train.decoding.acceptance import greedy_accept, top_token
from medusa_train.decoding.cache import new_cache
from medusa_train.decoding.generate import compact_cache, propose, tree_pass
from medusa_train.decoding.graphs import StaticSteps, graphs_wanted
from medusa_train.decoding.tree import TokenTree

AUTO_SIZES = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 48, 64, 96, 128)


@dataclass
class CostCurve:
    """Median milliseconds per step on one device and dtype at ``context`` cached tokens."""

    device: str
    dtype: str
    threads: int
    context: int
    repeats: int
    plain_ms: float  #: one token: backbone + LM head + argmax
    generate_ms: float  #: Hugging Face ``generate``'s cost per greedy token after the first
    verify_ms: dict[int, float] = field(default_factory=dict)  #: tree nodes (root included) -> verify step
    #: sizes timed in the first round only: screened out there (``screened_sizes``), their one timing in ``verify_ms``
    once: list[int] = field(default_factory=list)
    #: the backbone's passes replayed from CUDA graphs over a static cache (``decoding/graphs.py``), as a server's
    graphs: bool = False

    @property
    def baseline_ms(self) -> float:
        """What a plain token costs in the fastest plain decoding timed: ``generate``'s, or with graphs the graphed
        plain step's when faster (the evaluation's "plain, graphed" row): what expected speedups divide by."""
        return min(self.generate_ms, self.plain_ms) if self.graphs else self.generate_ms

    def as_dict(self) -> dict:
        return {**asdict(self), "baseline_ms": self.baseline_ms}


@dataclass
class SizeChoice:
    """One tree size's expected figures (``expected_speedup`` is over ``generate``, as the evaluation measures)."""

    nodes: int
    expected_accept_length: float
    verify_ms: float  #: the step cost the choice uses: the measured curve made non-decreasing (``nondecreasing``)
    relative_cost: float  #: verify step / plain step: the accepted length at which Medusa breaks even
    expected_tokens_per_s: float
    expected_speedup: float


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_rounds(steps: Sequence[Callable[[], float | None]], repeats: int, warmup: int,
                 device: torch.device) -> list[list[float]]:
    """Seconds of each step in each of ``repeats`` rounds; the steps take turns in every round, so load drift hits
    them alike. A step that returns a number is taken at its word (seconds it timed itself, e.g. per token)."""
    for fn in steps:
        for _ in range(warmup):
            fn()
    times: list[list[float]] = [[] for _ in steps]
    for _ in range(repeats):
        for fn, record in zip(steps, times):
            synchronize(device)
            start = time.perf_counter()
            own = fn()
            synchronize(device)
            record.append(own if isinstance(own, float) else time.perf_counter() - start)
    return times


def median_times(steps: Sequence[Callable[[], float | None]], repeats: int, warmup: int,
                 device: torch.device) -> list[float]:
    """Median seconds of each step over ``timed_rounds``."""
    return [statistics.median(t) for t in timed_rounds(steps, repeats, warmup, device)]


def screened_sizes(first_ms: dict[int, float], expected: dict[int, float], screen: float) -> list[int]:
    """The sizes worth timing in every round, from one round's timings (``first_ms``, after warm-up): every size up
    to the biggest whose expected tokens per second there (``expected / first_ms``) reaches the best size's divided
    by ``screen``. The sizes past it would need their step to cost under ``1 / screen`` of its one timing to win:
    a 2-core CPU's 32-128-node steps (4-14x a plain step, where 8 nodes win at 1.4x), never a GPU's flat curve."""
    rate = {n: expected[n] / first_ms[n] for n in first_ms}
    floor = max(rate.values()) / screen
    last = max(n for n, r in rate.items() if r >= floor)
    return [n for n in sorted(first_ms) if n <= last]


class DecodeSteps:
    """One decode state at ``context`` cached tokens (a random prompt) and the steps timed from it, each
    leaving the cache (and the heads' state) as it found it, so they can be repeated in any order. With
    ``graphs`` (CUDA), the backbone's passes run over a static cache, each size replayed from its CUDA graph."""

    @torch.no_grad()
    def __init__(self, model, context: int = 256, seed: int = 0, graphs: bool = False, max_nodes: int = 128):
        self.model, self.context = model, context
        self.device = device = model.lm_head.weight.device
        g = torch.Generator().manual_seed(seed)
        self.prompt = torch.randint(0, model.lm_head.weight.shape[0], (1, context), generator=g).to(device)
        self.graphs = StaticSteps(model, graphs=True) if graphs else None
        self.cache = (self.graphs.cache_for(context + max_nodes + 1) if graphs
                      else new_cache("dynamic", model.backbone, context + max_nodes + 1))
        self.backbone_pass = self.graphs or tree_pass
        self.out = model(self.prompt, past_key_values=self.cache, use_cache=True)
        self.dtype = self.out.hidden_states.dtype
        # the root alone as a tree (its mask and offset), made once: the graphed plain step's inputs
        self._root = (TokenTree([]).attention_mask(self.dtype).to(device), torch.zeros(1, dtype=torch.long, device=device))
        self.root = int(model.base_logits(self.out.hidden_states[:, -1])[0].argmax())  # the backbone's own next token
        # what the draft keeps between steps (e.g. its own cache); graphed, over fixed buffers, its passes graphed
        self.heads_state = self.graphs.draft_state() if graphs else model.new_decode_state()
        # the draft has read every position but the last, which each step reads as its accepted one
        self.heads_read = context - 1
        model.propose(TokenTree([]), self.out.draft_inputs[0, :-1], self.prompt[0, :-1], int(self.prompt[0, -1]),
                      self.heads_state)

    @torch.no_grad()
    def plain_step(self, explicit_mask: bool = False) -> None:
        """One token through the backbone, the LM head and argmax (``explicit_mask``: given a 4D mask, as
        the tree pass is, instead of the model's own causal mask)."""
        token = torch.tensor([[self.root]], device=self.device)
        if self.graphs is not None:  # the 1-node graph: what a graphed decoder's plain step is
            step = self.graphs(self.model, token[0], *self._root, self.cache, self.context)
        else:
            extra = {} if not explicit_mask else {
                "attention_mask": torch.zeros(1, 1, 1, self.context + 1, dtype=self.dtype, device=self.device),
                "position_ids": torch.tensor([[self.context]], device=self.device)}
            step = self.model(token, past_key_values=self.cache, use_cache=True, **extra)
        top_token(self.model.base_logits(step.hidden_states[:, -1])[0])
        self._back()

    def _back(self) -> None:
        """The cache back to ``context`` tokens (a step's nodes dropped)."""
        if self.graphs is None:
            self.cache.crop(self.context - self.cache.get_seq_length())  # crop takes the tokens to drop, negated
        else:
            for layer in self.cache.layers:
                layer.cumulative_length.fill_(self.context)

    def verify_step(self, tree: TokenTree) -> Callable[[], None]:
        """A full verify step over ``tree``: the draft's candidates (its own passes included: an EAGLE-3 draft runs
        once per depth, so a deeper tree costs more there too), the tree pass, the LM head at every node (a lookup
        chain's too), greedy acceptance and cache compaction."""
        mask, offsets = tree.attention_mask(self.dtype).to(self.device), tree.position_offsets.to(self.device)

        @torch.no_grad()
        def step():
            model, context = self.model, self.context
            tokens = propose(model, tree.heads_tree, self.out.draft_inputs[0, -1:], self.prompt[0, -1:], self.root,
                             self.heads_state)
            if tree.lookup_depth:  # the chain's nodes cost the pass what any node does, whatever they hold
                tokens = torch.cat([tokens, tokens.new_full((tree.lookup_depth,), self.root)])
            logits = model.base_logits(self.backbone_pass(model, tokens, mask, offsets, self.cache,
                                                          context).hidden_states[0])
            result = greedy_accept(tree, tokens, logits)
            (self.graphs.compact if self.graphs else compact_cache)(self.cache, context, result.path)
            self._back()  # back to the same context for the next round
            self.heads_state.rewind(self.heads_read)

        return step

    @torch.no_grad()
    def generate_per_token(self, tokens: int = 32) -> float:
        """Seconds Hugging Face ``generate`` spends per greedy token after the first (no end of sequence)."""
        from medusa_train.backbone.generation import plain_generate

        pad = self.model.backbone.config.pad_token_id or 0
        _, timing = plain_generate(self.model.backbone, self.prompt, tokens, [], pad)
        return timing["decode_s"] / (tokens - 1)


def measure_cost_curve(model, trees: dict[int, TokenTree], context: int = 256, repeats: int = 10, warmup: int = 2,
                       seed: int = 0, generate_tokens: int = 32, graphs: bool | None = False,
                       expected: dict[int, float] | None = None, screen: float | None = None) -> CostCurve:
    """Time a plain step, ``generate``'s per-token cost and each tree's verify step at ``context`` tokens.

    Args:
        model: A ``MedusaModel`` on its device, in the dtype it will decode with (eval mode).
        trees: ``{nodes: tree}`` to time (e.g. prefixes of the fitted tree).
        graphs: Time the backbone's passes replayed from CUDA graphs (CUDA only): what a graphed decoder pays;
            None: where the model is on CUDA (``decoding.graphs.graphs_wanted``).
        expected, screen: With both (each size's expected accepted length), the first round screens the sizes
            (``screened_sizes``): the rest are timed that once (``CostCurve.once``), the kept ones in every round.
    """
    graphs = graphs_wanted(graphs, model.lm_head.weight.device)
    steps = DecodeSteps(model, context, seed, graphs=graphs, max_nodes=max(trees, default=1))
    sizes = sorted(trees)
    # generate takes its turn in every round too: timed apart, machine drift alone moved the expected
    # speedup by 10-20% (generate 56 ms per token against a 48 ms plain step in one curve, 43 against 48 in another)
    plain = [steps.plain_step, lambda: steps.generate_per_token(generate_tokens)]
    verify = {n: steps.verify_step(trees[n]) for n in sizes}
    times = dict(zip(["plain", "generate", *sizes], timed_rounds(plain + list(verify.values()), 1, warmup,
                                                                  steps.device)))
    kept = (sizes if expected is None or not screen
            else screened_sizes({n: times[n][0] for n in sizes}, expected, screen))
    for key, more in zip(["plain", "generate", *kept], timed_rounds(plain + [verify[n] for n in kept], repeats - 1,
                                                                    0, steps.device)):
        times[key] += more
    ms = {key: statistics.median(t) * 1e3 for key, t in times.items()}
    linears = "" if steps.device.type == "cuda" else f", {linear_path(model.backbone)}"
    return CostCurve(device=device_name(steps.device) + linears, dtype=str(steps.dtype).removeprefix("torch."),
                     threads=torch.get_num_threads(), context=context, repeats=repeats, plain_ms=ms["plain"],
                     generate_ms=ms["generate"], verify_ms={n: ms[n] for n in sizes},
                     once=[n for n in sizes if n not in kept], graphs=graphs)


def nondecreasing(verify_ms: dict[int, float], start: int = 2) -> dict[int, float]:
    """``verify_ms`` made non-decreasing in tree size from ``start`` nodes on, by pooling adjacent violators
    (each run of sizes timed out of order is replaced by its mean: the least-squares monotone fit).

    Sizes below ``start`` keep their timing: one node is a one-row pass, which oneDNN's bf16 kernels
    run slower than two rows, so a 2-node step can truly cost less than a 1-node one."""
    pooled = [n for n in sorted(verify_ms) if n >= start]
    blocks: list[tuple[float, int]] = []  # (mean, count) of pooled runs, in size order
    for n in pooled:
        blocks.append((verify_ms[n], 1))
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m2, c2), (m1, c1) = blocks.pop(), blocks.pop()
            blocks.append(((m1 * c1 + m2 * c2) / (c1 + c2), c1 + c2))
    values = [mean for mean, count in blocks for _ in range(count)]
    return {**{n: ms for n, ms in verify_ms.items() if n < start}, **dict(zip(pooled, values))}


def choose_tree_size(curve: CostCurve, expected: dict[int, float]) -> tuple[int, list[SizeChoice]]:
    """The measured size with the most expected tokens per second, and every size's figures (by size),
    under the measured curve made non-decreasing (``nondecreasing``)."""
    cost = nondecreasing(curve.verify_ms)
    rows = [SizeChoice(nodes=n, expected_accept_length=expected[n], verify_ms=cost[n],
                       relative_cost=cost[n] / curve.plain_ms,
                       expected_tokens_per_s=expected[n] / cost[n] * 1e3,
                       expected_speedup=expected[n] * curve.baseline_ms / cost[n])
            for n in sorted(cost) if n in expected]
    if not rows:
        raise ValueError("no tree size has both a measured cost and an expected accepted length")
    best = max(rows, key=lambda r: r.expected_tokens_per_s)
    return best.nodes, rows


def auto_sizes(max_nodes: int, available: int) -> list[int]:
    """The sizes ``nodes=auto`` times: ``AUTO_SIZES`` up to ``max_nodes`` and the fitted tree's own size."""
    top = min(max_nodes, available)
    return sorted({n for n in AUTO_SIZES if n <= top} | {top})


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(device)})"
    import platform

    name = platform.machine()
    try:
        name = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"cpu ({name}, {torch.get_num_threads()} threads)"
