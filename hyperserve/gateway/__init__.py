"""The gateway: OpenAI-compatible front for many backends, with response caching and routing."""
