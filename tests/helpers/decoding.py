"""Decoding tests' shared pieces: prompts, plain greedy, heads made to disagree or to know the answer, and
logits and distances for the acceptance rules' exact laws."""

from __future__ import annotations

import torch

from medusa_train import MedusaModel

V = 10


def prompts(n: int, seed: int = 0, vocab: int = 256) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (1, int(torch.randint(1, 24, (), generator=g))), generator=g) for _ in range(n)]


def repeating_prompts() -> list[torch.Tensor]:
    """Three prompts that repeat themselves, so a lookup chain accepts paths of several tokens."""
    g = torch.Generator().manual_seed(7)
    out = []
    for length in (5, 9, 14):
        piece = torch.randint(3, 256, (length,), generator=g)
        out.append(torch.cat([piece, piece, piece[: length // 2]])[None])
    return out


def decode_recording_candidates(model, ids, tree, max_new_tokens: int = 40, **kwargs):
    """``tree_generate`` with every step's candidates recorded: (output, [candidate tokens per step])."""
    proposed = []

    def wrap(name, function):
        if name != "candidates":
            return function

        def recorded(*args):
            tokens, valid = function(*args)
            proposed.append(tokens.tolist())
            return tokens, valid

        return recorded

    from medusa_train.decoding import tree_generate

    out = tree_generate(model, ids, tree, max_new_tokens=max_new_tokens, eos_token_id=[], wrap_phase=wrap, **kwargs)
    return out, proposed


def hf_greedy(backbone, ids: torch.Tensor, max_new_tokens: int, eos_token_id) -> torch.Tensor:
    return backbone.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens, eos_token_id=eos_token_id, pad_token_id=0)


def perturb_heads(model: MedusaModel, seed: int, scale: float = 0.05) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.heads.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)


def install_oracle_heads(model: MedusaModel, reference: torch.Tensor, seed: int = 0) -> None:
    """Make every head an oracle for ``reference`` (1, L): it finds the position whose hidden state it
    was given (nearest reference hidden state) and puts the true token k+2 ahead at a rank chosen by
    a fixed pattern (mostly top-1, sometimes top-2/top-3, so side branches get accepted too). Off the
    reference (or past its end) its guesses are arbitrary."""
    with torch.no_grad():
        ref_hidden = model(reference).hidden_states[0].float()
    tokens = reference[0].tolist()
    vocab = model.lm_head.weight.shape[0]
    ranks = [0, 0, 1, 0, 2, 0, 0, 1]

    def head_logits(hidden: torch.Tensor, k: int) -> torch.Tensor:
        flat = hidden.reshape(-1, hidden.shape[-1]).float()
        dist, pos = torch.cdist(flat, ref_hidden).min(-1)
        rows = []
        for d, j in zip(dist.tolist(), pos.tolist()):
            order = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed + 1000 * j + k)).tolist()
            target = j + k + 2
            if d < 1e-2 and target < len(tokens):
                order.remove(tokens[target])
                order.insert(ranks[(j + 3 * k + seed) % len(ranks)], tokens[target])
            logits = torch.empty(vocab)
            logits[order] = torch.arange(vocab, 0, -1, dtype=torch.float)
            rows.append(logits)
        return torch.stack(rows).reshape(*hidden.shape[:-1], vocab)

    model.head_logits = head_logits


def logits_from(probs_by_node: dict[int, dict[int, float]], n: int = 7, vocab: int = V) -> torch.Tensor:
    """Logits whose softmax gives the listed probabilities (the rest of the mass spread evenly)."""
    rows = []
    for node in range(n):
        listed = probs_by_node.get(node, {})
        rest = (1.0 - sum(listed.values())) / (vocab - len(listed))
        row = torch.full((vocab,), rest, dtype=torch.float64)
        for token, p in listed.items():
            row[token] = p
        rows.append(row.log().float())
    return torch.stack(rows)


def tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * (a - b).abs().sum().item()


def noise_bound(law: torch.Tensor, n: int, seed: int = 0) -> float:
    """TV that an exact sampler stays below with n draws: the max over 200 simulated runs, plus 10%."""
    g = torch.Generator().manual_seed(seed)
    runs = [tv(torch.bincount(torch.multinomial(law, n, replacement=True, generator=g), minlength=len(law)) / n, law)
            for _ in range(200)]
    return 1.1 * max(runs)
