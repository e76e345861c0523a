"""The serving engine: sampling, scheduling, the model runner and the LLM API (issue 5)."""
