"""One exception type for problems the user can fix; the CLI prints it as a single line."""


class HstapError(Exception):
    """Bad input or environment: the message names the file/field and what was expected."""


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM stopped a command after it kept its work; the CLI prints the message, exits 128 + signum."""

    def __init__(self, signum: int, message: str = "") -> None:
        super().__init__(message)
        self.signum = signum


def first_line(exc: BaseException) -> str:
    """`Type: first line of the message`: a compiler's pages-long error as the one line a fallback prints."""
    text = str(exc)
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"
