"""capstan.pipeline: not implemented yet (skeleton package; see docs/architecture.md)."""
