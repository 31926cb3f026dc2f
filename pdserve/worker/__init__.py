"""A worker: one engine behind HTTP in role prefill, decode or colocated.

build.py (config -> connector, engine, app) -> app.py (routes) -> async_engine.py (the engine's
step loop on its own thread) ; peers.py (decode: prefill peers' transfer metadata) ; metrics.py.
"""
