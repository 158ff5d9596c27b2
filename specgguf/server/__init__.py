"""An OpenAI-compatible HTTP server over the speculative engine: a face, like the command
line, and as thin.

- :mod:`.app`: the endpoints (``/v1/chat/completions``, ``/v1/completions``,
  ``/v1/models``, ``/health``, ``/metrics``), request checks and response shapes;
- :mod:`.schemas`: the request bodies (pydantic);
- :mod:`.scheduler`: the engine boundary: jobs run one at a time in arrival order from a
  bounded queue on one worker thread (and where batching across requests would go);
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
