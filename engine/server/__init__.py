"""OpenAI-compatible HTTP server: a front-end process (HTTP, tokenizer, text) driving an engine-core process."""
