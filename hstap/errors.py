"""One exception type for problems the user can fix; the CLI prints it as a single line."""


class HstapError(Exception):
    """Bad input or environment: the message names the file/field and what was expected."""
