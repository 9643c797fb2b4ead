"""Security and governance: API keys, rate limits and budgets, size limits, guardrails, audit log."""
