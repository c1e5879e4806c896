"""draftwise on Ray Serve: data-parallel engine replicas behind one OpenAI endpoint.

- `replica.EngineReplica`: one engine (its own model copy, KV cache, prefix cache and suffix tree)
  on its engine thread, streaming `RequestOutput`s; reports its load for routing and fails its
  health check when its engine thread is gone, so Ray Serve replaces it.
- `router.DraftwiseRequestRouter`: Ray Serve's request-router API over `routing`
  (session and prefix affinity, held back by load).
- `client.RayEngineClient`: the ingress side: the single-process server's HTTP app (protocol,
  auth, validation, SSE) talks to it exactly as to the local engine loop; it retries a request on
  another replica while no token has reached the client, and ends a stream cut by a dead replica
  with an error.
- `launch`: `draftwise serve --data-parallel-size N` (a local cluster, or `--ray-address`).

Ray is an optional extra (`pip install draftwise[ray]`): only these modules import it, and only
when the server runs on Ray."""
