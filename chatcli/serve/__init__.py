"""The serving layer: an OpenAI-compatible HTTP server over the engine, and its client.

Owns the FastAPI app (`app`), request models and limits (`requests`), the guards every
request passes (`guards`), the interface the app runs generations through (`backend`), its
two back ends: the pool of engine workers in this process (`worker_pool`, and `batch_worker`
for a worker that decodes many requests together) and a Ray Serve deployment of them across
a cluster (`ray_cluster` deploys it and runs the server, `ray_backend` is the app's side of it,
`ray_replica` a replica's, `ray_router` routes a conversation back to its replica, `ray_front`
serves from the head node for ray://), the web page (`web/`), and the client that `chatcli
chat --url` uses (`client`). May import the chat layer and everything below it; never the
terminal or CLI layers. FastAPI, uvicorn and httpx are the `[serve]` extra and are imported
only here; Ray is the `[ray]` extra, imported only by the ray_* modules, which only `--ray`
loads.
"""
