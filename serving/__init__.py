"""Launch, plan and benchmark a self-hosted MiniMax-M3 endpoint (vLLM or SGLang)."""
