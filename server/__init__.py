"""tokenmill's HTTP server, in packages by concern, each importing only those below it
(tests/test_layering.py): http < prompt < config < ops < serving < api < app.py, cli.py."""
