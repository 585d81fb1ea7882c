"""capstan.tensorpar: not implemented yet (skeleton package; see docs/architecture.md)."""
