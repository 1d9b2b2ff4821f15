"""Pieces the ctx and gen workers (and, torch-free, the router) share.

- :mod:`.http`: OpenAI-shaped error handlers, client-disconnect detection, uvicorn start-up
  (torch-free: the router uses it).
- :mod:`.openai_serving`: OpenAI request -> engine inputs, engine outputs -> answers / SSE.
- :mod:`.worker_app`: the FastAPI app of a worker; roles plug in their request handlers.
- :mod:`.engine_errors`: the engine's errors (:mod:`helixserve.engine.errors`) as OpenAI/HTTP
  errors, in one table.
- :mod:`.shutdown`: a worker stopping itself (SIGTERM to its own process; torch-free).
- :mod:`.auth`: who may call a worker (the deployment's internal secret; torch-free).
- :mod:`.loading`: build a worker's engine from a :class:`~helixserve.config.DeploymentConfig`.
"""
