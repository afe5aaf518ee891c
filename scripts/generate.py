"""One-shot generation with the Python API: load, stream, print stats.

    python scripts/generate.py "Tell me a fortune."
"""

import sys

import pocket_mlx
from pocket_mlx.units import size

prompt = sys.argv[1] if len(sys.argv) > 1 else "Write a short poem about the sea."
# The bundled model (or a folder / Hugging Face repo id); fuse: fewer matmuls per token.
model, tokenizer = pocket_mlx.load(fuse=True)
for response in pocket_mlx.stream_generate(model, tokenizer, prompt, max_tokens=64):
    print(response.text, end="", flush=True)
stats = response.stats
print(f"\n[{stats.prompt_tokens} prompt tokens at {stats.prompt_tps:.0f} tok/s, "
      f"{stats.generation_tokens} tokens at {stats.generation_tps:.1f} tok/s, "
      f"{size(stats.bytes_per_token)} of weights per token]")
