"""What ``medusa-train evaluate`` prints of its report: the headline (what the draft buys over the best free
baseline), then the settings, acceptance, rates, mismatches and served rows, and last the two lines scripts read
(``mean accepted length: X.XX``, ``speedup: Y.YYx``)."""

from __future__ import annotations

from medusa_train.evaluation.report import headline_lines, prompts_decoded
from medusa_train.evaluation.served_report import print_served


def print_summary(report: dict, turns: int, tree: str) -> None:
    """Print ``report``'s summary (its prompts decoded up to ``turns`` turns each with tree ``tree``)."""
    tps = report["tokens_per_s"]
    for line in headline_lines(report):
        print(line)
    print(f"report: {report['files']['json']}")
    print(f"prompts: {prompts_decoded(report)} x up to {turns} turns = {report['totals']['count']} generations; "
          f"tree: {tree} ({report['settings']['tree_nodes']} nodes); dtype: {report['settings']['dtype']}")
    print("per-head acceptance: " + (", ".join(f"{a:.3f}" for a in report["per_head_acceptance"])
                                     or "none (the tree is the root alone)"))
    print(f"tokens/s (wall, prefill + decode): draft {tps['draft']:.1f}, plain ({report['settings']['plain_decoding']}) "
          f"{tps['plain']:.1f}; "
          f"decode-only speedup {report['decode_speedup']:.2f}x")
    lookup = report["methods"].get("prompt_lookup")
    if lookup:
        chosen = report["settings"]["prompt_lookup"]
        print(f"prompt lookup (HF generate, N={chosen['num_tokens']}, ngram {chosen['max_matching_ngram_size']}): "
              f"{lookup['tokens_per_s']:.1f} tokens/s, {lookup['speedup']:.2f}x, "
              f"{lookup['tokens_per_forward']:.2f} tokens per forward")
    if report["mismatches"] is not None:
        print(f"greedy mismatches vs plain decoding: {report['mismatches']}")
        for m in report["mismatch_details"]:
            print(f"  id {m['id']} turn {m['turn']}: first difference at token {m['position']}, "
                  f"base top-2 logit gap {m['top2_gap']:.3g}")
    print_served(report)
    print(f"mean accepted length: {report['mean_accepted_length']:.2f}")
    print(f"speedup: {report['speedup']:.2f}x")
