"""`pocket-mlx serve`: an OpenAI-compatible HTTP server for one loaded model.

app.py is the ASGI app (Starlette), openai.py the request checking and response shapes,
engine.py the thread that owns the model and generates.
"""
