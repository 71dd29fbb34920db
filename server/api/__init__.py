"""The HTTP API: one module per API (openai.py, tgi.py, responses.py, generate.py, tokenize.py,
admin.py, feedback.py, ops.py), the request bodies (protocol.py), and the one response path every
generation route shares (respond.py: a handle -> the JSON answer or the SSE stream of a shape; choices
and the stream guard under it). Imports every package below it; only server/app.py and server/cli.py
import it."""
