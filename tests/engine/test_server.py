"""Process handling of a served engine: what is started is always stopped (with its children, after a crash
of ours too), failures say why with the server's log, and /metrics counters parse.

The lifecycle tests run a stand-in server (a Python that answers /health and spawns a child, as vLLM's API
server spawns its engine core): what is under test is our process handling, not vLLM. The real engine is
in test_vllm.py."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from medusa_train.engine import EngineError, VllmServer, attach
from medusa_train.engine.client import SpecCounters, parse_metrics, spec_counters
from medusa_train.engine.server import find_engine_python, free_port

STAND_IN = textwrap.dedent('''\
    #!{python}
    # answers like `python -m vllm.entrypoints.openai.api_server --port N ...`, with a child process
    import http.server, subprocess, sys, os
    args = sys.argv
    port = int(args[args.index("--port") + 1])
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    open(os.environ["STAND_IN_PIDS"], "w").write(f"{{os.getpid()}} {{child.pid}}")
    print("reserved cpus:", os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU"), flush=True)
    if "--fail" in args:
        print("RuntimeError: no such model", flush=True); sys.exit(3)
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
        def log_message(self, *a): pass
    http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
''')


@pytest.fixture
def stand_in(tmp_path, monkeypatch):
    script = tmp_path / "python"
    script.write_text(STAND_IN.format(python=sys.executable))
    script.chmod(0o755)
    monkeypatch.setenv("STAND_IN_PIDS", str(tmp_path / "pids"))
    return script


def _pids(tmp_path: Path) -> list[int]:
    return [int(p) for p in (tmp_path / "pids").read_text().split()]


def _gone(pid: int, within: float = 10.0) -> bool:
    deadline = time.time() + within
    while time.time() < deadline:
        try:
            os.kill(pid, 0)
            if Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z":  # a zombie has ended
                return True
        except (ProcessLookupError, FileNotFoundError):
            return True
        time.sleep(0.1)
    return False


@pytest.mark.integration
def test_stop_ends_the_server_and_the_processes_it_started(stand_in, tmp_path):
    server = VllmServer("/some/model", dtype="float32", python=str(stand_in), log_path=tmp_path / "log")
    with server as client:
        assert client.healthy()
        assert "--dtype float32" in " ".join(server.command) and "--enforce-eager" in server.command
        parent, child = _pids(tmp_path)
    assert _gone(parent) and _gone(child)
    assert not client.healthy()


@pytest.mark.integration
def test_the_engine_computes_on_every_core_unless_told_otherwise(stand_in, tmp_path, monkeypatch):
    """vLLM's CPU build keeps one core of an x86 machine from its compute threads unless told otherwise: on the
    2-core CPUs the engine computed on one core while our decoders ran on two. The server is started with none
    kept (``reserved_cpus=0``); the user's own ``VLLM_CPU_NUM_OF_RESERVED_CPU`` stands, and ``None`` is vLLM's default."""
    def started_with(name: str, **kwargs) -> str:
        log = tmp_path / f"{name}.log"
        with VllmServer("/m", dtype="float32", python=str(stand_in), log_path=log, **kwargs):
            pass
        return next(line for line in log.read_text().splitlines() if line.startswith("reserved cpus:"))

    monkeypatch.delenv("VLLM_CPU_NUM_OF_RESERVED_CPU", raising=False)
    assert started_with("default") == "reserved cpus: 0"
    assert started_with("vllm-default", reserved_cpus=None) == "reserved cpus: None"
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    assert started_with("user") == "reserved cpus: 1"


@pytest.mark.integration
def test_a_server_that_died_leaves_no_workers_behind(stand_in, tmp_path):
    """Killed from outside (an OOM kill), the server's children live on in its process group; stop ends them."""
    server = VllmServer("/m", dtype="float32", python=str(stand_in), log_path=tmp_path / "log")
    server.start()
    parent, child = _pids(tmp_path)
    os.kill(parent, 9)
    assert _gone(parent) and not _gone(child, within=0.5)
    server.stop()
    assert _gone(child)


@pytest.mark.integration
def test_an_exception_inside_the_block_still_stops_the_server(stand_in, tmp_path):
    with pytest.raises(KeyboardInterrupt):
        with VllmServer("/m", dtype="float32", python=str(stand_in), log_path=tmp_path / "log"):
            raise KeyboardInterrupt  # Ctrl-C
    assert all(_gone(pid) for pid in _pids(tmp_path))


@pytest.mark.integration
def test_servers_launched_side_by_side_all_answer_and_stop(stand_in, tmp_path, monkeypatch):
    """``launch`` returns at once and ``wait_ready`` waits: two servers start together (as the engine tests' free
    servers do), from this thread, so each lives until stopped."""
    servers = []
    for name in ("a", "b"):
        monkeypatch.setenv("STAND_IN_PIDS", str(tmp_path / f"pids-{name}"))  # read by the child at its start
        server = VllmServer("/m", dtype="float32", python=str(stand_in), log_path=tmp_path / f"{name}.log")
        server.launch()
        servers.append(server)
    try:
        clients = [server.wait_ready() for server in servers]
        assert all(client.healthy() for client in clients) and servers[0].url != servers[1].url
    finally:
        for server in servers:
            server.stop()
    assert all(_gone(int((tmp_path / f"pids-{n}").read_text().split()[0])) for n in ("a", "b"))


@pytest.mark.integration
def test_a_killed_toolkit_process_leaves_no_server_behind(stand_in, tmp_path):
    """SIGKILL gives us no chance to clean up: the kernel's parent-death signal stops the server."""
    code = (f"from medusa_train.engine import VllmServer\n"
            f"s = VllmServer('/m', dtype='float32', python={str(stand_in)!r}, log_path={str(tmp_path / 'log')!r})\n"
            f"s.start()\nimport os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")
    result = subprocess.run([sys.executable, "-c", code], timeout=120, env=os.environ)
    assert result.returncode == -9
    parent, child = _pids(tmp_path)
    assert _gone(parent)  # (vLLM's API server stops its engine core on SIGTERM; the stand-in's child we end here)
    os.kill(child, 9)


@pytest.mark.integration
def test_a_server_that_exits_says_so_with_its_log(stand_in, tmp_path):
    server = VllmServer("/m", dtype="float32", python=str(stand_in), extra_args=["--fail"], log_path=tmp_path / "log")
    with pytest.raises(EngineError, match=r"exited with status 3 .*\n(.*\n)*RuntimeError: no such model"):
        server.start()
    assert server.process is None


@pytest.mark.integration
def test_a_server_that_never_answers_times_out_naming_the_key(tmp_path):
    script = tmp_path / "python"
    script.write_text(f"#!{sys.executable}\nimport time; print('loading...', flush=True); time.sleep(600)\n")
    script.chmod(0o755)
    server = VllmServer("/m", dtype="float32", python=str(script), startup_timeout=3, log_path=tmp_path / "log")
    with pytest.raises(EngineError, match=r"within 3 s \(server.startup_timeout\).*\n(.*\n)*loading"):
        server.start()


def test_attach_needs_a_server_that_answers(tmp_path):
    with pytest.raises(EngineError, match=r"url=http://127.0.0.1:\d+: no server answers .*engine=vllm"):
        attach(f"http://127.0.0.1:{free_port()}")


def test_no_engine_python_says_how_to_get_one(tmp_path):
    with pytest.raises(EngineError, match="server.python=/nonexistent/python: no such file"):
        find_engine_python("/nonexistent/python")


def test_spec_decode_counters_parse_and_subtract():
    text = textwrap.dedent('''\
        # HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
        # TYPE vllm:spec_decode_num_drafts_total counter
        vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0
        vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 30.0
        vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 4.0
        vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 3.0
        vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 0.0
        vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 1.0
        vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.7e9
        vllm:num_requests_running{engine="0",model_name="m"} 0.0
    ''')
    now = spec_counters(parse_metrics(text))
    assert now == SpecCounters(10.0, 30.0, 4.0, [3.0, 1.0, 0.0])
    delta = now - SpecCounters(4.0, 12.0, 1.0, [1.0])
    assert delta == SpecCounters(6.0, 18.0, 3.0, [2.0, 1.0, 0.0])
    assert delta.mean_acceptance_length == pytest.approx(1.5)
    assert delta.per_position_acceptance == pytest.approx([2 / 6, 1 / 6, 0.0])
    assert SpecCounters().mean_acceptance_length is None  # no speculation: no figure, not 1.0
    assert now.decode_steps is None and delta.drafted_share is None  # this exposition has no step count
    assert now.step_seconds is None


def test_decode_steps_are_the_inter_token_latency_count_and_give_the_drafted_share():
    """vLLM observes one inter-token latency per request per decode step, drafted or not: its count is the
    decode steps, the denominator every served row shares; drafts / decode steps is the share drafted."""
    def exposition(steps, drafts):
        return textwrap.dedent(f'''\
            vllm:inter_token_latency_seconds_bucket{{engine="0",le="0.01",model_name="m"}} 3.0
            vllm:inter_token_latency_seconds_count{{engine="0",model_name="m"}} {steps}
            vllm:inter_token_latency_seconds_sum{{engine="0",model_name="m"}} {steps / 50}
            vllm:spec_decode_num_drafts_total{{engine="0",model_name="m"}} {drafts}
            vllm:spec_decode_num_accepted_tokens_total{{engine="0",model_name="m"}} 5.0
        ''')
    before, after = (spec_counters(parse_metrics(exposition(*v))) for v in ((100.0, 10.0), (140.0, 20.0)))
    assert after.decode_steps == 140.0
    delta = after - before
    assert delta.decode_steps == 40.0 and delta.drafts == 10.0
    assert delta.drafted_share == pytest.approx(0.25)
    assert delta.decode_seconds == pytest.approx(0.8) and delta.step_seconds == pytest.approx(0.02)  # 20 ms a step
    older = spec_counters(parse_metrics('vllm:time_per_output_token_seconds_count{engine="0"} 7.0\n'
                                        'vllm:time_per_output_token_seconds_sum{engine="0"} 0.35\n'))
    assert older.decode_steps == 7.0  # the metric's earlier name is read where the newer one is absent
    assert older.step_seconds == pytest.approx(0.05)
    assert SpecCounters(decode_steps=0.0, decode_seconds=0.0).step_seconds is None  # no step ran: no figure


def test_the_server_gets_vllms_dtype_names(stand_in):
    """vLLM's --dtype takes the long names only: the short spellings every command accepts are translated."""
    server = VllmServer("/m", dtype="bf16", python=str(stand_in))
    assert server.command[server.command.index("--dtype") + 1] == "bfloat16"
    with pytest.raises(EngineError, match=r"dtype='bf17': must be one of float32, bfloat16, float16"):
        VllmServer("/m", dtype="bf17", python=str(stand_in))
