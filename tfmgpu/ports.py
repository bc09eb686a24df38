"""The ports a cluster's tasks listen on: the address family and the error.

The launcher picks or checks ports for local tasks, and the cluster preflight
checks this task's own port before training; both bind the way TensorFlow's
gRPC server listens (on all interfaces) and fail with `PortInUseError`.
"""

from __future__ import annotations

import socket


class PortInUseError(ValueError):
  """A port the cluster needs cannot be bound on this machine."""


def address_family(host: str) -> socket.AddressFamily:
  """`AF_INET6` for an IPv6 host (`"::1"`, `"[::1]"`), else `AF_INET`."""
  return socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
