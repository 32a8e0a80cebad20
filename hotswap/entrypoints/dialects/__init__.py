"""Other engines' native HTTP dialects, served over the same `AsyncLLM` as the OpenAI API:
each module adapts one route's request and response shapes and nothing else."""
