"""Inference process: the vLLM OpenAI-compatible server plus the admin routes `rl` needs."""
