"""Load-aware OpenAI-compatible router for speculative and baseline SGLang pools."""
