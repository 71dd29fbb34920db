"""A request's life behind the routes: model versions and their engines (deployment.py, one worker
thread each: worker.py), the registry that routes a request to a version and the rollout that changes
it, admission to a lane (gateway.py, admission.py), the response cache and its replays (dispatch.py,
replay.py), readiness, request accounting, and what the app shares (runtime.py). Imports every package
below it (http, prompt, config, ops), never server.api."""
