"""`pocket-mlx serve`: an OpenAI- and Anthropic-compatible HTTP server for one loaded model.

app.py is the ASGI app (Starlette), openai.py and anthropic.py the request checking and
response shapes of each API, metrics.py the counters of GET /metrics,
engine.py the thread that owns the model and generates.
"""
