"""The OpenAI-compatible generation API of `hotswap serve` (vLLM's dialect plus hotswap's
`weight_versions` / `max_weight_lag` extensions)."""
