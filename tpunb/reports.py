"""The look of tpunb's reports: a title, name/value rows and warnings, as text for a
console and as an HTML table for a notebook."""

import html


class Report:
    """A report that shows as text in a console and as a table in a notebook. Subclasses
    define ``_content()``: (title, [(name, value), ...], [warning, ...]). Dataclass
    subclasses need ``repr=False`` to keep this ``__repr__``."""

    def _content(self):
        raise NotImplementedError

    def __str__(self):
        return text(*self._content())

    def __repr__(self):
        return str(self)

    def _repr_html_(self):
        return html_table(*self._content())


def text(title, rows, warnings):
    width = max(len(name) for name, _ in rows)
    lines = [title]
    lines += [f"  {name:<{width}}  {value}" for name, value in rows]
    lines += [f"  ! {warning}" for warning in warnings]
    return "\n".join(lines)


def html_table(title, rows, warnings):
    cells = "".join(
        f"<tr><th style='text-align:left'>{html.escape(name)}</th>"
        f"<td style='text-align:left'>{html.escape(value)}</td></tr>"
        for name, value in rows
    )
    items = "".join(f"<li style='color:#b35900'>{html.escape(w)}</li>" for w in warnings)
    return (
        f"<div><strong>{html.escape(title)}</strong><table>{cells}</table>"
        + (f"<ul>{items}</ul>" if items else "")
        + "</div>"
    )


def count(number, noun):
    """ "1 core", "8 cores"."""
    return f"{number} {noun}{'s' if number != 1 else ''}"


def span(ranks):
    """ "0-7", "1, 3", "0-2, 4-7": runs of three or more ranks as a range."""
    ranks, parts = sorted(ranks), []
    start = 0
    for end in range(1, len(ranks) + 1):
        if end == len(ranks) or ranks[end] != ranks[end - 1] + 1:
            run = ranks[start:end]
            parts += [f"{run[0]}-{run[-1]}"] if len(run) > 2 else map(str, run)
            start = end
    return ", ".join(parts)


def ranks_named(ranks):
    """ "rank 3", or "ranks 0-2, 4-7"."""
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {span(ranks)}"
