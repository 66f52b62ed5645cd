"""User-facing entry points: the offline Engine and the HTTP server."""
