"""The project's measuring instruments, above the engine they measure: ``specgguf bench``'s
runs (:mod:`.bench`), the planner's simulator over machine curves (:mod:`.simulate`) and
the traces it replays (:mod:`.traces`). Nothing a request runs through lives here: the
engine never imports this package (pyproject.toml's import contracts).
"""
