"""Whole-repository context: pack a repository into one prompt."""
