"""OpenAI-compatible serving on Ray Serve."""
