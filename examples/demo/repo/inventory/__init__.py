"""A tiny inventory library: the demo repository m3-agent fixes."""
