"""Transport: what every HTTP request meets before and around a route. Connection limits and timeouts
(connections.py, guarded_protocol.py, framing.py, guarded_server.py: uvicorn with the guard), the body
limit, API-key and admin-key middleware, the error log, error bodies (errors.py: `ApiError`) and the
SSE event format. Imports nothing else of the server (the bottom package)."""
