"""HTTP edge: OpenAI-compatible API, API keys -> tenant, health."""
