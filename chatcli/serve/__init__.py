"""The serving layer: an OpenAI-compatible HTTP server over the engine, and its client.

Owns the FastAPI app (`app`), request models and limits (`requests`), the guards every
request passes (`guards`), the pool of engine workers (`worker_pool`, and `batch_worker` for a
worker that decodes many requests together), the web page (`web/`),
and the client that `chatcli chat --url` uses (`client`). May import the chat layer and
everything below it; never the terminal or CLI layers. FastAPI, uvicorn and httpx are the
`[serve]` extra and are imported only here.
"""
