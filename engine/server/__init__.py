"""The HTTP server: OpenAI and Anthropic APIs, health, stats and metrics over the engine thread."""
