"""`pocket-mlx serve`: an OpenAI- and Anthropic-compatible HTTP server for one loaded model.

app.py assembles the ASGI app (Starlette): the route table, auth.py's key check, errors.py's
error objects, and `app.state` for the handlers. routes_openai.py and routes_anthropic.py are
the endpoints, over replies.py (request to job to reply) and streaming.py (a job's events
out); openai.py and anthropic.py the request checking and response shapes of each API,
requests.py the request and error types they share; metrics.py the counters of GET /metrics,
engine.py the thread that owns the model and generates.
"""
