"""capstan.native: the shared C/C++ library and its ctypes binding.

Not built yet: the library and its kernels land with the native issue.
`status()` reports that honestly so `capstan info` never claims a feature
the package does not have.
"""

__all__ = ["status"]


def status() -> dict[str, object]:
    """What `capstan info` prints about the native library."""
    return {"built": False, "reason": "capstan-native has no compiled library yet"}
