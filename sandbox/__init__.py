"""Docker sandbox where every model-written command runs."""
