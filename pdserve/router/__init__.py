"""The router: the OpenAI API on port 8000, worker pool and health, pair choice, dispatch, streaming.

app.py (routes, admission, deadlines) -> validation.py (request -> token ids + SamplingParams) ->
dispatch.py (choose a pair, forward, stream) -> responses.py (OpenAI responses and SSE).
"""
