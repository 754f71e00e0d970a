"""A serving engine as a process the toolkit talks to over HTTP, as users talk to theirs.

``server`` starts a vLLM OpenAI-compatible server (or attaches to a running one by URL), waits for
``/health`` and always stops what it started; ``client`` sends chat requests and reads the
spec-decode counters from ``/metrics``. Nothing here imports vLLM: the engine lives in its own
environment (``make setup`` creates ``.venv-vllm``), and a GPU user points ``url=`` at their own.
"""

from medusa_train.engine.client import ChatReply, EngineClient, EngineError, SpecCounters
from medusa_train.engine.server import VllmServer, attach, find_engine_python, serve

__all__ = ["ChatReply", "EngineClient", "EngineError", "SpecCounters", "VllmServer", "attach", "find_engine_python",
           "serve"]
