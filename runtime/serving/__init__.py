"""Serving: the OpenAI-compatible HTTP server and its wire protocol, over an `Engine`."""
