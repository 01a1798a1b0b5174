"""Errors of the sandbox manager, as the runtime's service errors (so gRPC statuses come for free and the
REST facade maps the same classes onto HTTP)."""

from services.runtime import errors as rt

SandboxError = rt.ServiceError
InvalidRequest = rt.InvalidArgument  # (field, message)
NotFound = rt.NotFound
QuotaExceeded = rt.ResourceExhausted  # (message, retry_after_ms=...)
WrongState = rt.FailedPrecondition  # valid request, but not in the sandbox's current state


class BackendUnavailable(rt.Unavailable):
    """The backend cannot run on this host (missing tool, failed `criu check`, no KVM)."""


class BackendFailure(rt.Internal):
    """A host tool (runc, CRIU, mount) failed; the message carries its diagnostics."""
