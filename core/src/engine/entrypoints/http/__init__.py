"""The HTTP API: OpenAI-compatible routes plus the pieces the native routes share.

``protocol`` holds the request models, ``errors`` the OpenAI-style error bodies,
``guards`` the API-key and body-size middleware, ``context`` what every handler
needs (tokenizer manager, model names), ``generation`` the shared request runner
and SSE helpers, and ``serving_chat`` / ``serving_completions`` / ``routes`` the
endpoints. ``engine.entrypoints.http_server`` assembles the app and runs it.
"""
