"""The local model server: an OpenAI-compatible aiohttp server over a continuous-batching torch engine.

Run it with ``python -m local_backend serve --model smollm2-135m-instruct --port 8001``. Importing
this package does not import torch; ``local_backend.engine`` and ``local_backend.boot`` do.
"""

__all__: list[str] = []
