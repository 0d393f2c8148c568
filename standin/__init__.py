"""The stand-in: a scripted test double that speaks vLLM's wire format for MiniMax-M3, and its simulators."""
