"""The router: the OpenAI API on port 8000, worker pool and health, pair choice, dispatch, streaming.

app.py (routes) -> serving.py (admission, deadlines, streaming) -> validation.py (request -> token ids +
SamplingParams) -> dispatch.py (choose a pair, forward; upstream.py: the HTTP calls to workers) ->
responses.py (OpenAI responses and SSE).
"""
