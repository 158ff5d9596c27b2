"""An OpenAI-compatible HTTP server over the speculative engine: a face, like the command
line, and as thin.

- :mod:`.app`: the application: the routers, the API key, request counts;
- :mod:`.completions`: ``/v1/chat/completions`` and ``/v1/completions``; :mod:`.status`:
  ``/v1/models``, ``/health``, ``/metrics``; :mod:`.service`: what they share, request
  checks, ``timings`` and ``usage``;
- :mod:`.schemas`: the request bodies (pydantic);
- :mod:`.scheduler`: the engine boundary: jobs run in arrival order from a bounded queue
  on one worker thread, up to ``--parallel`` at once, each on the sequence the engine
  picks for its prompt;
- :mod:`.metrics`: Prometheus metrics; :mod:`.errors`: OpenAI's error shape;
- :mod:`.listen`: binding and serving with uvicorn until SIGINT/SIGTERM.

From Python::

    from specgguf.engine import Engine, EngineConfig, ModelConfig
    from specgguf.server import ServerSettings, bind, serve

    sock = bind("127.0.0.1", 8080)
    with Engine(EngineConfig(ModelConfig("target.gguf"), ModelConfig("draft.gguf"))) as engine:
        serve(engine, ServerSettings(model_id="target"), sock, on_ready=print)
"""

from specgguf.server.app import ServerSettings, create_app
from specgguf.server.listen import bind, serve

__all__ = ["ServerSettings", "bind", "create_app", "serve"]
