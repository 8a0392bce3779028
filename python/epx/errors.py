"""epx errors as Python exceptions.

Every failure of epx is an :class:`Error` with the code and message of the C++ ``epx::Error``
(``include/epx/error.hpp``); each code has its own subclass, so ``except epx.PeerFailed`` works as
well as ``err.code == epx.ErrorCode.peer_failed``. Refusals of the Python layer's own checks (a
tensor of the wrong dtype, device or layout) are :class:`InvalidArgument` too, and like epx's own
they fail the same call on every rank.
"""

import enum


class ErrorCode(enum.IntEnum):
    invalid_argument = 1  # bad shape, dtype, id, option: the caller's input
    config_mismatch = 2  # ranks disagree on a collective's configuration or call order
    peer_failed = 3  # another rank rejected its input or failed; this rank stops too
    timeout = 4  # a peer never arrived within the timeout
    unsupported = 5  # valid request this build or backend cannot serve
    internal = 6  # a bug in epx; please report


class Error(RuntimeError):
    """Base of every epx error; ``code`` is an :class:`ErrorCode`, ``message`` the text."""

    default_code = ErrorCode.internal

    def __init__(self, message, code=None):
        super().__init__(message)
        self.code = ErrorCode(code) if code is not None else self.default_code
        self.message = message


class InvalidArgument(Error, ValueError):
    default_code = ErrorCode.invalid_argument


class ConfigMismatch(Error):
    default_code = ErrorCode.config_mismatch


class PeerFailed(Error):
    default_code = ErrorCode.peer_failed


class Timeout(Error):
    default_code = ErrorCode.timeout


class Unsupported(Error, NotImplementedError):
    default_code = ErrorCode.unsupported


class InternalError(Error):
    default_code = ErrorCode.internal


BY_CODE = {
    ErrorCode.invalid_argument: InvalidArgument,
    ErrorCode.config_mismatch: ConfigMismatch,
    ErrorCode.peer_failed: PeerFailed,
    ErrorCode.timeout: Timeout,
    ErrorCode.unsupported: Unsupported,
    ErrorCode.internal: InternalError,
}
