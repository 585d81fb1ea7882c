"""The operations callers use: collectives (with timeouts that name a lost peer), point-to-point,
all-to-all, bucketed and compressed collectives, and `first_error`, the agreement on a rank's error.

Built on `job` (groups, state), `backends` and `health.errors`.
"""
