"""Tools the model calls: each an argument model (its JSON schema) and an executor against a sandbox."""
