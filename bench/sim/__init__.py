"""The SGLang simulator: a protocol-exact stand-in for an SGLang server with a batching model."""
