"""The router: the OpenAI API (and Anthropic's Messages API, OpenAI's Responses API) on port 8000,
worker pool and health, pair choice, dispatch, streaming.

app.py (routes) -> serving.py (admission, deadlines, streaming) -> validation.py (request -> token ids +
SamplingParams) -> dispatch.py (choose a pair, forward; upstream.py: the HTTP calls to workers) ->
responses.py (OpenAI responses and SSE; `sse_event`, the typed streams' frames).
The Messages and Responses APIs translate into the chat request first (messages.py, responses_api.py,
chat_translation.py) and format the chat path's answer their own way (messages_format.py,
responses_api_format.py).
"""
