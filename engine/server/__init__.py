"""The HTTP server: OpenAI, Anthropic and Ollama APIs, health, stats and metrics over the engine thread."""
