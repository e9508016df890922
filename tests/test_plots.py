"""The lessons' one-call figures draw what they are given, in order, labelled."""

import pytest

from tpunb import plots

pytest.importorskip("matplotlib")


def test_lines_draws_each_series_against_steps_from_one_with_its_label():
    figure = plots.lines({"a": [3, 2, 1], "b": [5, 5]}, xlabel="training step", ylabel="nodes")
    (ax,) = figure.axes
    drawn = {
        line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.lines
    }
    assert drawn == {"a": ([1, 2, 3], [3, 2, 1]), "b": ([1, 2], [5, 5])}
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["a", "b"]
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("training step", "nodes")


def test_bars_reads_top_to_bottom_in_the_order_given_each_with_its_number():
    figure = plots.bars({"first": 50.5, "second": 42.0}, xlabel="steps/s")
    (ax,) = figure.axes
    by_height = sorted(ax.patches, key=lambda bar: -bar.get_y())  # top first
    labels = [label.get_text() for label in ax.get_yticklabels()][::-1]
    assert labels == ["first", "second"]
    assert [bar.get_width() for bar in by_height] == [50.5, 42.0]
    assert [text.get_text() for text in ax.texts] == ["42", "50.5"]
