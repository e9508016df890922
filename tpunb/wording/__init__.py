"""How tpunb words what it reports: the look of its reports, the user's own lines, and
the current spellings of older tutorials' calls."""
