"""The gateway's log as lines: one record, one line, whatever its message holds.

A message quotes what callers and backends sent (an upstream error page that echoes a prompt,
a model name, an error event's text): a newline in it began a line of its own that read as a
record of the gateway's (a forged time, level and logger), and an ANSI escape could rewrite the
terminal. Control characters in a record's message are written escaped (`\\n`, `\\x1b`); a
traceback, which the record carries apart from its message, keeps its lines.
"""

from __future__ import annotations

import logging

__all__ = ["OneLineFormatter", "escaped"]

# C0 controls, DEL and C1 controls, as Python writes them in a string literal.
_ESCAPES = {c: repr(chr(c))[1:-1] for c in (*range(0x20), *range(0x7F, 0xA0))}
_ESCAPES.update({0x2028: "\\u2028", 0x2029: "\\u2029"})  # line separators to some readers


def escaped(text: str) -> str:
    """`text` with its control characters escaped (one line, nothing a terminal acts on)."""
    return text.translate(_ESCAPES)


class OneLineFormatter(logging.Formatter):
    """A Formatter whose records' messages are one line each (their tracebacks follow as usual)."""

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802  (logging's name)
        record.message = escaped(record.message)
        return super().formatMessage(record)
