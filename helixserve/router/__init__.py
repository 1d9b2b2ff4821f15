"""helixserve.router: the OpenAI front door (torch-free).

The request path, one file per hop:

1. ``router/app.py``: auth (Bearer keys), parsing (4xx OpenAI bodies), model check (404),
   admission (bounded inflight + queue, else 429).
2. ``router/pool.py``: a healthy ctx worker by policy (round robin / least loaded / cache aware:
   ``router/prompt_keys.py`` and ``router/prefix_index.py``).
3. ``router/proxy.py``: ctx ``context_only`` call; a finished ctx answer is returned directly.
4. ``ctx_server/app.py`` -> ``engine/async_engine.py``: prefill + first token, cache held
   (``ctx_server/ctx_requests.py``).
5. ``router/proxy.py``: a healthy gen worker; ``generation_only`` call with the ctx params.
6. ``gen_server/app.py`` -> ``gen_server/kv_source.py``: prompt state into the gen engine, decode.
7. ``router/proxy.py``: the gen answer or SSE stream relayed as produced; the ctx hold released.

Every hop to a worker goes through ``router/upstream.py`` (one aiohttp session; it says why).

Failures: a worker that cannot be reached or breaks a stream is marked unhealthy and the request
fails at once with a 503 naming the worker and the cause; the health loop re-admits it when its
``/health`` answers again. A client that disconnects cancels the request on every worker it
touched (``POST /v1/abort``).
"""
