"""Pieces the server, the gateway and the security layer share: OpenAI-style errors, the body
limit, server-sent events, message text, the request log and the sentence embedder. Nothing here
imports from those three layers, so they all point one way: down to this package."""
