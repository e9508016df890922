"""What a launch recorded, per rank and per step: values given to ``tpunb.log``, batch
shapes, samples, compilations. Plain data, to plot again or save after the run."""

import dataclasses
import json

from tpunb._steps import Step


class History:
    """``history.steps[rank]`` is the list of that rank's steps, in order (see
    ``tpunb._steps.Step``). ``rows()`` flattens them to dicts; ``save``/``load`` keep them
    as JSON; ``plot()`` draws loss, throughput and compilations per step."""

    def __init__(self, ranks):
        self.steps = {rank: [] for rank in range(ranks)}

    def add(self, rank, steps):
        self.steps[rank].extend(steps)

    @property
    def ranks(self):
        return len(self.steps)

    def names(self):
        """The names given to ``tpunb.log``, in the order first seen."""
        seen = {}
        for steps in self.steps.values():
            for step in steps:
                seen.update(dict.fromkeys(step.values))
        return list(seen)

    def values(self, name):
        """{rank: ([step, ...], [value, ...])} for the steps where ``name`` was logged."""
        found = {}
        for rank, steps in self.steps.items():
            pairs = [(s.step, s.values[name]) for s in steps if name in s.values]
            if pairs:
                found[rank] = tuple(map(list, zip(*pairs, strict=True)))
        return found

    def compiles_per_step(self):
        """[(step, compilations, compile seconds)] summed over the processes' reports."""
        totals = {}
        for steps in self.steps.values():
            for s in steps:
                if s.compiles is not None:
                    count, seconds = totals.get(s.step, (0, 0.0))
                    totals[s.step] = (count + s.compiles, seconds + s.compile_seconds)
        return [(step, *totals[step]) for step in sorted(totals)]

    def samples_per_second(self, rank=None, window=1.0):
        """([time, ...], [samples/s, ...]) for ``rank`` (None: all ranks together),
        averaged over ``window`` seconds."""
        times, rates = [], []
        ranks = self.steps if rank is None else [rank]
        steps = sorted((s for r in ranks for s in self.steps[r] if s.samples), key=lambda s: s.time)
        start = 0
        for end, step in enumerate(steps):
            while steps[start].time < step.time - window:
                start += 1
            span = step.time - steps[start].time
            if span >= window / 4:  # shorter spans measure bursts of arrival, not speed
                times.append(step.time)
                rates.append(sum(s.samples for s in steps[start + 1 : end + 1]) / span)
        return times, rates

    def rows(self):
        """Every step of every rank as a plain dict (rank first), for pandas or a CSV."""
        return [
            {"rank": rank, **dataclasses.asdict(step)}
            for rank, steps in self.steps.items()
            for step in steps
        ]

    def save(self, path):
        with open(path, "w") as file:
            json.dump({"ranks": self.ranks, "rows": self.rows()}, file)

    @classmethod
    def load(cls, path):
        with open(path) as file:
            saved = json.load(file)
        history = cls(saved["ranks"])
        for row in saved["rows"]:
            rank = row.pop("rank")
            row["shapes"] = [[tuple(shape) for shape in batch] for batch in row["shapes"]]
            history.steps[rank].append(Step(**row))
        return history

    def plot(self, **figure_options):
        """A matplotlib figure of the run: logged values per core, samples/s, compilations."""
        from tpunb import plots

        return plots.history_figure(self, **figure_options)

    def __repr__(self):
        counts = {len(steps) for steps in self.steps.values()}
        steps = counts.pop() if len(counts) == 1 else f"{min(counts)}-{max(counts)}"
        return f"<History: {self.ranks} ranks, {steps} steps each, values {self.names()}>"
