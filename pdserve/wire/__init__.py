"""What router and workers share on the wire: the internal protocol (protocol.py), OpenAI error
objects (errors.py), HTTP middleware (http.py), disconnect handling (disconnect.py) and the
metrics exposition (metrics.py)."""
