"""Start a vLLM OpenAI-compatible server as a child process, or attach to one that runs already.

    with serve("/path/to/hf/model", dtype="float32", speculative_config={...}) as client:
        client.chat([{"role": "user", "content": "Hi"}], max_tokens=32)

The server runs in its own process group, so stopping it takes its engine workers too; it is
stopped when the ``with`` block ends (normally, on an exception or on Ctrl-C), at interpreter exit,
and, on Linux, by the kernel when this process dies without a chance to clean up (a parent-death
signal). It is started as ``python -m vllm.entrypoints.openai.api_server`` from the engine's own
environment (the ``vllm`` console script of the CPU build is broken), with ``--dtype`` always given
(``auto`` runs a float32 checkpoint in bf16 on CPU) and ``--enforce-eager`` where there is no CUDA (no
slow compile at start-up; on a GPU, CUDA graphs are kept).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from medusa_train.engine.client import EngineClient, EngineError

ENGINE_PYTHON_ENV = "MEDUSA_TRAIN_VLLM_PYTHON"
ENTRY_POINT = "vllm.entrypoints.openai.api_server"
#: the CPU build's count of cores kept from its compute threads (its default on x86: one; ours: ``reserved_cpus``)
RESERVED_CPUS_ENV = "VLLM_CPU_NUM_OF_RESERVED_CPU"
_RUNNING: set[VllmServer] = set()


def find_engine_python(python: str | None = None) -> str:
    """The Python that has vLLM: ``python``, ``$MEDUSA_TRAIN_VLLM_PYTHON``, or ``.venv-vllm`` (``make setup``)
    in the working directory or the checkout this package runs from."""
    if python:
        if not Path(python).expanduser().is_file():
            raise EngineError(f"server.python={python}: no such file")
        return str(Path(python).expanduser())
    candidates = [os.environ.get(ENGINE_PYTHON_ENV), Path.cwd() / ".venv-vllm/bin/python",
                  Path(__file__).resolve().parents[2] / ".venv-vllm/bin/python"]
    for candidate in candidates:
        if candidate and Path(candidate).expanduser().is_file():
            return str(Path(candidate).expanduser())
    raise EngineError("no Python with vLLM found: run `make setup` (it creates .venv-vllm), set "
                      f"server.python=<a python with vllm> (or ${ENGINE_PYTHON_ENV}), or attach to a running "
                      "server with url=http://host:port")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:  # runs in the child before exec: the kernel sends SIGTERM when we die
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class VllmServer:
    """One vLLM server process serving ``model`` (a local Hugging Face folder or a hub id).

    Args:
        model: What vLLM loads (``packaged:`` names mean nothing to it: pass the resolved folder).
        dtype: ``--dtype`` (float32 | bfloat16 | float16); always explicit.
        speculative_config: ``--speculative-config`` as a dict (``None``: no speculation).
        python: The engine's Python (see ``find_engine_python``).
        port: Port to listen on (``None``: a free one).
        host: Interface to listen on.
        enforce_eager: Pass ``--enforce-eager`` (``None``: where this machine has no CUDA; on a GPU eager mode
            gives up CUDA graphs, on the CPU build it skips a slow compile at start-up).
        seed: ``--seed``.
        extra_args: More server flags, as a user would type them.
        kv_cache_gib: ``VLLM_CPU_KVCACHE_SPACE`` (whole GiB) for the CPU build (ignored by GPU builds).
        reserved_cpus: ``VLLM_CPU_NUM_OF_RESERVED_CPU`` for the CPU build: cores kept from the engine's compute
            threads for its front end (``None``: vLLM's default, one on x86, which leaves a 2-core machine one core
            to compute on while our decoders run two threads). GPU builds ignore it.
        log_path: Where the server's output goes (default: a temporary file, named in errors).
        startup_timeout: Seconds to wait for ``/health``.
    """

    def __init__(self, model: str, *, dtype: str, speculative_config: dict | None = None, python: str | None = None,
                 port: int | None = None, host: str = "127.0.0.1", enforce_eager: bool | None = None, seed: int = 0,
                 extra_args: Sequence[str] = (), kv_cache_gib: int | None = 2, reserved_cpus: int | None = 0,
                 log_path: str | os.PathLike | None = None, startup_timeout: float = 600.0):
        from medusa_train.config.dtype import canonical_dtype, dtype_rule

        if canonical_dtype(dtype) is None:  # vLLM's --dtype takes the long names only: bf16 becomes bfloat16
            raise EngineError(f"dtype={dtype!r}: {dtype_rule()}")
        self.model, self.dtype, self.speculative_config = str(model), canonical_dtype(dtype), speculative_config
        self.python = find_engine_python(python)
        self.host, self.port = host, port or free_port(host)
        if enforce_eager is None:
            import torch

            enforce_eager = not torch.cuda.is_available()
        self.enforce_eager, self.seed, self.extra_args = enforce_eager, seed, list(extra_args)
        self.kv_cache_gib, self.reserved_cpus, self.startup_timeout = kv_cache_gib, reserved_cpus, startup_timeout
        self.log_path = Path(log_path) if log_path else Path(tempfile.mkstemp(prefix="vllm-", suffix=".log")[1])
        self.process: subprocess.Popen | None = None
        self.startup_seconds: float | None = None
        self._started = 0.0

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def command(self) -> list[str]:
        """The server's command line."""
        cmd = [self.python, "-m", ENTRY_POINT, "--model", self.model, "--dtype", self.dtype, "--host", self.host,
               "--port", str(self.port), "--seed", str(self.seed)]
        if self.enforce_eager:
            cmd.append("--enforce-eager")
        if self.speculative_config:
            cmd += ["--speculative-config", json.dumps(self.speculative_config)]
        return cmd + self.extra_args

    def start(self) -> EngineClient:
        """Start the server and wait until ``/health`` answers; returns a client for it.

        Raises:
            EngineError: the server exited or did not answer within ``startup_timeout`` (with its log's end).
        """
        self.launch()
        return self.wait_ready()

    def launch(self) -> None:
        """Start the server process and return at once (``wait_ready`` waits for it): several servers start side by
        side this way. Launch from a thread that lives as long as the server (the main thread): the server is
        stopped when the thread that started it ends (Linux's parent-death signal is the starting thread's)."""
        env = dict(os.environ)
        if self.kv_cache_gib is not None:
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(int(self.kv_cache_gib)))  # vLLM reads an int
        if self.reserved_cpus is not None:
            env.setdefault(RESERVED_CPUS_ENV, str(int(self.reserved_cpus)))
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._started = time.perf_counter()
        with open(self.log_path, "ab") as log:
            log.write(("$ " + " ".join(self.command) + "\n").encode())
            log.flush()
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                            start_new_session=True, preexec_fn=_die_with_parent)
        _RUNNING.add(self)

    def wait_ready(self) -> EngineClient:
        """Wait until the launched server answers ``/health`` (stopping it if it exits or times out first)."""
        client = EngineClient(self.url, server=self)
        try:
            while not client.healthy():
                if self.process.poll() is not None:
                    raise EngineError(f"the vLLM server exited with status {self.process.returncode} before it "
                                      f"answered /health; its log ({self.log_path}) ends:\n{self.log_tail()}")
                if time.perf_counter() - self._started > self.startup_timeout:
                    raise EngineError(f"the vLLM server did not answer {self.url}/health within "
                                      f"{self.startup_timeout:.0f} s (server.startup_timeout); its log "
                                      f"({self.log_path}) ends:\n{self.log_tail()}")
                time.sleep(1.0)
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.perf_counter() - self._started
        return client

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the server and every process it started (its process group): SIGTERM, then SIGKILL."""
        process, self.process = self.process, None
        _RUNNING.discard(self)
        if process is None:
            return
        if process.poll() is None:
            for sig, wait_s in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10.0)):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, sig)
                try:
                    process.wait(wait_s)
                    break
                except subprocess.TimeoutExpired:
                    continue
        # the engine core and its workers outlive a server that died (an OOM kill): the group still names them
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)

    def __enter__(self) -> EngineClient:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


@atexit.register
def _stop_all() -> None:
    for server in list(_RUNNING):
        server.stop(timeout=10.0)


@contextlib.contextmanager
def serve(model: str, **kwargs) -> Iterator[EngineClient]:
    """``with serve(model, dtype=..., ...) as client:`` a ``VllmServer`` for the block (see its arguments)."""
    server = VllmServer(model, **kwargs)
    previous = signal.getsignal(signal.SIGTERM)
    if previous is signal.SIG_DFL and _main_thread():  # a kill of this process still stops the server
        signal.signal(signal.SIGTERM, _raise_exit)
    try:
        yield server.start()
    finally:
        server.stop()
        if previous is signal.SIG_DFL and _main_thread():
            signal.signal(signal.SIGTERM, previous)


def attach(url: str, model: str | None = None, timeout: float = 600.0) -> EngineClient:
    """A client for a server that runs already (a GPU user's own vLLM); it must answer ``/health``."""
    client = EngineClient(url, model=model, timeout=timeout)
    if not client.healthy():
        raise EngineError(f"url={url}: no server answers {client.url}/health; start it first, or leave url unset "
                          "and pass engine=vllm to have one started")
    return client


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _raise_exit(signum, frame):
    raise SystemExit(128 + signum)
