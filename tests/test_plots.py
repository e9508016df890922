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


def test_launch_layouts_draws_a_box_a_process_and_a_numbered_dot_a_rank():
    from matplotlib.patches import Circle, FancyBboxPatch

    figure = plots.launch_layouts({"v3-8": (4, 2), "v5e-1": (1, 1), "simulated": (8, 1)})
    ax = figure.axes[0]
    assert sum(isinstance(p, FancyBboxPatch) for p in ax.patches) == 4 + 1 + 8
    assert sum(isinstance(p, Circle) for p in ax.patches) == 8 + 1 + 8
    texts = [t.get_text() for t in ax.texts]
    assert "v3-8\n4 processes x 2 threads = 8 ranks" in texts
    assert "v5e-1\n1 process x 1 thread = 1 rank" in texts
    assert "simulated\n8 processes x 1 thread = 8 ranks" in texts
    assert sorted(t for t in texts if t.isdigit()) == sorted([str(r) for r in range(8)] * 2 + ["0"])


def test_samples_seen_puts_each_cores_samples_on_its_row():
    figure = plots.samples_seen({"shared": [[0, 2, 200], [1, 3]]}, first=96)
    ax = figure.axes[0]
    rows = [collection.get_offsets().tolist() for collection in ax.collections]
    assert rows == [[[0, 0], [2, 0]], [[1, 1], [3, 1]]]  # 200 is past the first 96
    assert ax.get_xlabel() == "sample index (the first 96 samples)"


def test_lines_at_given_x_values_on_a_log_axis_ticks_them():
    figure = plots.lines(
        {"all cores": [1.0, 2.0, 4.0]}, "batch", "samples/s", x=[8, 16, 32], log_x=True
    )
    ax = figure.axes[0]
    assert ax.get_xscale() == "log"
    assert [t.get_text() for t in ax.get_xticklabels()] == ["8", "16", "32"]
    assert ax.get_legend() is None  # one line: nothing to tell apart
