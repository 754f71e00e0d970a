"""Peak memory and time of one Medusa loss step: naive vs head-by-head vs head-by-head + chunked.

    python -m benchmarks loss                         # the real model's sizes, CPU, float32
    python -m benchmarks loss device=cuda dtype=bfloat16 repeat=3
    python -m benchmarks loss targets=teacher         # soft targets from an LM head (loss.targets=teacher)

Options (``key=value``): heads=5 batch=4 seq=1024 vocab=49152 hidden=576 chunk=256
dtype=float32|bfloat16 device=cpu|cuda repeat=1 variants=naive,head_by_head,chunked force=0
targets=text|teacher.

One step is the loss forward *and* backward, on ``heads`` Medusa heads (a ResBlock + their
own randomly initialised hidden -> vocab layer, float32 weights) over a random leaf
``hidden`` tensor that requires grad, standing for a trainable backbone. Every token is
labelled, so the head-by-head variants gain nothing from skipping ignored positions.
``dtype=bfloat16`` means mixed precision: bf16 hidden states and ``torch.autocast`` (bf16
logits), with the cross-entropy in float32 as in training. ``targets=teacher`` learns soft
targets instead: the softmax of a frozen, randomly initialised hidden -> vocab layer (standing
for the backbone's LM head) at the position each head's target follows.

"Peak loss memory" is the peak *above* what exists in every variant before and after a step:
head parameters, their gradients, the hidden states and their gradient, the labels. Those are
allocated (gradients pre-filled with zeros) before the baseline is taken, so the figure is the
memory the loss itself needs: logits, softmax / log-softmax, logits gradients and their
temporaries. That is what head-by-head computation shrinks, so the ratio naive / variant says
how much. On CUDA it is ``max_memory_allocated`` minus the allocated baseline (after one
warm-up step). On CPU each variant runs in a fresh process and the figure is the kernel's
peak resident set (VmHWM, reset through /proc/self/clear_refs after set-up; the process's
``ru_maxrss`` where that reset is not allowed) minus the resident set at the baseline; large
tensors are mmap'd and returned to the system on free, so the RSS tracks live tensors.

Time is the wall clock of one step (the fastest of ``repeat``), synchronised on CUDA.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULTS = dict(heads=5, batch=4, seq=1024, vocab=49152, hidden=576, chunk=256, dtype="float32",
                device="cpu", repeat=1, variants="naive,head_by_head,chunked", force=0, seed=0, targets="text")
VARIANTS = ("naive", "head_by_head", "chunked")
MiB = 2**20


def main(**overrides) -> int:
    """Run every variant in its own process and print a Markdown table; returns an exit code."""
    unknown = sorted(set(overrides) - set(DEFAULTS))
    if unknown:
        print(f"unknown option(s) {', '.join(unknown)}; known: {', '.join(DEFAULTS)}", file=sys.stderr)
        return 2
    opts = {key: type(default)(overrides.get(key, default)) for key, default in DEFAULTS.items()}
    variants = opts["variants"].split(",")
    if bad := [v for v in variants if v not in VARIANTS]:
        print(f"variants={','.join(bad)}: choose from {', '.join(VARIANTS)}", file=sys.stderr)
        return 2
    if opts["dtype"] not in ("float32", "bfloat16"):
        print(f"dtype={opts['dtype']}: must be float32 or bfloat16", file=sys.stderr)
        return 2
    if opts["targets"] not in ("text", "teacher"):
        print(f"targets={opts['targets']}: must be text or teacher", file=sys.stderr)
        return 2

    print(f"Medusa loss step (forward + backward): {opts['heads']} heads, batch {opts['batch']} x "
          f"{opts['seq']} tokens, vocab {opts['vocab']}, hidden {opts['hidden']}, {opts['dtype']}, "
          f"{opts['device']}, chunk {opts['chunk']}, {opts['targets']} targets\n")
    rows = {}
    for variant in variants:
        need, have = _estimate_bytes(opts, variant), _available_bytes(opts["device"])
        if have is not None and need > 0.85 * have and not opts["force"]:
            rows[variant] = f"skipped: needs ~{need / 2**30:.1f} GiB, {have / 2**30:.1f} GiB available (force=1 to try)"
            continue
        cmd = [sys.executable, "-m", "benchmarks.bench_loss", "--worker", json.dumps({**opts, "variant": variant})]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)  # -m finds benchmarks/ here
        if proc.returncode != 0:
            why = "killed, probably out of memory" if proc.returncode in (-9, 137) else proc.stderr.strip()[-300:]
            rows[variant] = f"failed (exit {proc.returncode}): {why}"
            continue
        rows[variant] = json.loads(proc.stdout.strip().splitlines()[-1])

    naive = rows.get("naive")
    print("| variant | peak loss memory (MiB) | naive / variant | time (s) | loss |")
    print("|---|---:|---:|---:|---:|")
    for variant, row in rows.items():
        if isinstance(row, str):
            print(f"| {_label(variant, opts)} | {row} | | | |")
            continue
        ratio = f"{naive['peak'] / row['peak']:.2f}" if isinstance(naive, dict) and row["peak"] > 0 else "-"
        print(f"| {_label(variant, opts)} | {row['peak'] / MiB:,.0f} | {ratio} | {row['time']:.2f} | {row['loss']:.5f} |")
    logits = opts["heads"] * opts["batch"] * opts["seq"] * opts["vocab"] * (2 if opts["dtype"] == "bfloat16" else 4)
    print(f"\n(all heads' logits alone: {logits / MiB:,.0f} MiB; one head's: {logits / opts['heads'] / MiB:,.0f} MiB)")
    return 0 if all(isinstance(r, dict) for r in rows.values()) else 1


def _label(variant: str, opts: dict) -> str:
    return f"chunked (chunk={opts['chunk']})" if variant == "chunked" else variant.replace("_", "-")


def _estimate_bytes(opts: dict, variant: str) -> int:
    """Rough upper bound of the loss memory, to skip a variant that cannot fit (in float32 units)."""
    unit = opts["batch"] * opts["seq"] * opts["vocab"] * 4  # one head's float32 logits
    if opts["targets"] == "teacher":  # the soft targets are one more float32 logits-sized tensor per head
        unit *= 2
    if variant == "naive":  # every head's logits + float32 log-softmax, and a float32 copy in flight
        per_head = 1.5 if opts["dtype"] == "bfloat16" else 2
        return int(unit * (opts["heads"] * per_head + 2))
    share = 1 if variant == "head_by_head" else min(1, opts["chunk"] / opts["seq"])
    return int(unit * share * 2)


def _available_bytes(device: str) -> int | None:
    if device != "cpu":
        return None  # the worker fails cleanly with a CUDA out-of-memory error instead
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None


# ----------------------------------------------------------------------------- worker (one variant)
def _worker(opts: dict) -> dict:
    import torch
    from torch import nn

    from medusa_train.families.medusa.heads import MedusaHead
    from medusa_train.training.losses import depthwise_loss_backward, depthwise_loss_naive
    from medusa_train.training.targets import Teacher, teacher_targets, text_targets

    torch.manual_seed(opts["seed"])
    device = torch.device(opts["device"])
    cuda = device.type == "cuda"
    dtype = getattr(torch, opts["dtype"])
    n, variant = opts["heads"], opts["variant"]
    heads = nn.ModuleList(MedusaHead(opts["hidden"], opts["vocab"], num_layers=1) for _ in range(n)).to(device)
    hidden = torch.randn(opts["batch"], opts["seq"], opts["hidden"], device=device, dtype=dtype, requires_grad=True)
    labels = torch.randint(opts["vocab"], (opts["batch"], opts["seq"]), device=device)
    targets = text_targets(labels, n)
    if opts["targets"] == "teacher":
        lm_head = nn.Linear(opts["hidden"], opts["vocab"], bias=False).to(device).requires_grad_(False)
        targets = teacher_targets(labels, n, Teacher(lm_head, hidden))
    for tensor in [*heads.parameters(), hidden]:  # gradients exist in every variant: not loss memory
        tensor.grad = torch.zeros_like(tensor)

    def head_logits(h, k):
        return heads[k](h)

    def step() -> float:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            if variant == "naive":
                loss, result = depthwise_loss_naive(head_logits, hidden, targets)
            else:
                chunk = opts["chunk"] if variant == "chunked" else None
                result = depthwise_loss_backward(head_logits, hidden, targets, chunk_size=chunk)
        if variant == "naive":
            loss.backward()
            del loss
        return result.loss.item()

    def timed_step() -> tuple[float, float]:
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        loss = step()
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start, loss

    if cuda:
        step()  # warm-up: cuBLAS handles, allocator pools
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        baseline = torch.cuda.memory_allocated()
    else:
        baseline = _reset_peak_rss()
    seconds, loss = timed_step()
    peak = (torch.cuda.max_memory_allocated() if cuda else _peak_rss()) - baseline
    times = [seconds] + [timed_step()[0] for _ in range(opts["repeat"] - 1)]
    return dict(peak=peak, time=min(times), loss=loss)


def _reset_peak_rss() -> int:
    """Reset the kernel's peak-RSS mark if allowed; returns the current RSS in bytes."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass
    return _status_kib("VmRSS") * 1024


def _peak_rss() -> int:
    hwm = _status_kib("VmHWM")
    if hwm:
        return hwm * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        print(json.dumps(_worker(json.loads(sys.argv[2]))))
    else:
        sys.exit(main(**dict(arg.split("=", 1) for arg in sys.argv[1:])))
