"""The compile watch on 8 simulated cores: compilations and CPU fallbacks step by step,
their causes, and the fixes (buckets, a padded last batch, a graph limit)."""

import copy
import multiprocessing
import os
import pathlib
import re
import warnings

import pytest
import torch
from conftest import in_forked_process
from torch.utils.data import DataLoader, TensorDataset

import tpunb

LENGTHS = range(8, 56)  # 48 distinct sequence lengths


def _sequences(count=1024, seed=0):
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(LENGTHS.start, LENGTHS.stop, (count,), generator=generator)
    return [
        (torch.randn(int(n), 4, generator=generator), torch.randn((), generator=generator))
        for n in lengths
    ]


def _model():
    torch.manual_seed(0)
    return torch.nn.Linear(4, 1)  # built in the notebook: every rank starts from its weights


def _masked_mean_model_step(rank, model, loader):
    """Trains a per-position linear model whose loss ignores padding: the same losses
    whatever the batches are padded to. Returns the rank's process and the graphs in the
    process's compilation cache as the rank ends."""
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    device = torch_xla.device()
    model = copy.deepcopy(model).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for inputs, targets, lengths in tpunb.shard(loader):
        mask = torch.arange(inputs.shape[1], device=device) < lengths[:, None]
        per_position = model(inputs).squeeze(-1) * mask
        prediction = per_position.sum(1) / lengths
        loss = ((prediction - targets) ** 2).mean()
        loss.backward()
        xm.optimizer_step(optimizer)
        optimizer.zero_grad()
        tpunb.log(loss=loss)
    return os.getpid(), xr.get_num_cached_compilation_graph()


def _train(collate):
    loader = DataLoader(_sequences(), batch_size=8, collate_fn=collate, drop_last=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = tpunb.launch(_masked_mean_model_step, _model(), loader)
    messages = [str(w.message) for w in caught if issubclass(w.category, tpunb.TpunbWarning)]
    return results, messages


def _graphs_by_process(results):
    """{pid: the graphs in the process's compilation cache as its last rank ended}: each
    graph it compiled, counted once (torch_xla compiles and counts per process)."""
    graphs = {}
    for pid, cached in results:
        graphs[pid] = max(cached, graphs.get(pid, 0))
    return graphs


def _losses(history):
    return [history.values("loss")[rank][1] for rank in range(history.ranks)]


@pytest.fixture(scope="module")
def naive_and_bucketed():
    saved = dict(os.environ)  # simulate's variables must not reach the later tests
    try:
        tpunb.simulate(cores=8)
        naive = _train(tpunb.BucketCollate(range(1, LENGTHS.stop)))  # pad to the longest
        lengths = [len(sequence) for sequence, _ in _sequences()]
        bucketed = _train(tpunb.BucketCollate(tpunb.choose_buckets(lengths, 4, batch_size=8)))
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return naive, bucketed


def test_without_buckets_every_new_shape_compiles_and_is_named_as_the_cause(naive_and_bucketed):
    (results, messages), _ = naive_and_bucketed
    compiles = results.compiles
    lengths_seen = {shape[0][1] for shape in compiles.shapes}
    assert len(lengths_seen) >= 20  # batches padded to their longest: many lengths
    # Every shape compiled, in the process of a rank that met it.
    assert compiles.all_processes_compiles >= len(lengths_seen)
    shape_warnings = [m for m in messages if "not seen before" in m]
    assert len(shape_warnings) == 1, messages  # once for the cause, not once a step
    assert "distinct shapes so far" in shape_warnings[0]
    assert "tpunb.BucketCollate" in shape_warnings[0]
    # The per-step compilations add up to the total, and the history keeps them.
    # The figure's bars are the summary's counts: the same total, the same warm-up.
    per_step = results.history.compiles_per_step()
    assert sum(at.compiles for at in per_step) == compiles.compiles
    assert sum(at.warmup for at in per_step) == compiles.warmup_compiles
    assert compiles.compile_seconds == pytest.approx(sum(at.seconds for at in per_step))


def test_four_buckets_compile_at_most_four_step_graphs_after_the_warm_up(naive_and_bucketed):
    (naive, _), (bucketed, messages) = naive_and_bucketed
    compiles = bucketed.compiles
    assert len({shape[0][1] for shape in compiles.shapes}) <= 4
    assert compiles.compiles_after_warmup <= 4
    # Each batch shape the buckets remove is a graph less to compile.
    removed_shapes = len(naive.compiles.shapes) - len(compiles.shapes)
    assert removed_shapes >= 16
    naive_graphs = sum(_graphs_by_process(naive).values())
    assert naive_graphs - sum(_graphs_by_process(bucketed).values()) >= removed_shapes
    assert naive.compiles.all_processes_compiles >= naive_graphs
    # A bucket met after the warm-up compiles its graph once: no warning for 4 shapes.
    assert not [m for m in messages if "not seen before" in m], messages


def test_ranks_that_meet_a_new_graph_together_compile_it_once(cores8):
    # One shape: every rank makes the same graphs, in the same steps, and leaves each
    # all-reduce together with the next one to compile.
    results, _ = _train(tpunb.BucketCollate([LENGTHS.stop]))
    assert len(results.compiles.shapes) == 1
    graphs = _graphs_by_process(results)
    assert set(graphs.values()) == {results.compiles.compiles}  # the same graphs in each
    assert results.compiles.all_processes_compiles == sum(graphs.values())


def _reference_losses(collate, steps):
    """Each rank's loss a step, trained on one CPU device: per-rank gradients averaged, as
    xm.optimizer_step's all-reduce does."""
    from torch.utils.data import DistributedSampler

    data = _sequences()
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loaders = [
        iter(
            DataLoader(
                data,
                batch_size=8,
                collate_fn=collate,
                drop_last=True,
                sampler=DistributedSampler(data, 8, rank, shuffle=False),
            )
        )
        for rank in range(8)
    ]
    losses = [[] for _ in range(8)]
    for _ in range(steps):
        optimizer.zero_grad()
        for rank in range(8):
            inputs, targets, lengths = next(loaders[rank])
            mask = torch.arange(inputs.shape[1]) < lengths[:, None]
            prediction = (model(inputs).squeeze(-1) * mask).sum(1) / lengths
            loss = ((prediction - targets) ** 2).mean()
            (loss / 8).backward()
            losses[rank].append(loss.item())
        optimizer.step()
    return losses


def test_ranks_with_different_shapes_train_like_one_device(naive_and_bucketed):
    (naive, _), (bucketed, _) = naive_and_bucketed
    steps = 1024 // 8 // 8
    reference = in_forked_process(_reference_losses, tpunb.BucketCollate([LENGTHS.stop]), steps)
    # Padding is masked out of the loss: same losses, step for step, on every rank,
    # whether each rank's batch is padded to its own longest sequence or to a bucket.
    for results in (naive, bucketed):
        for rank, losses in enumerate(_losses(results.history)):
            assert len(losses) == steps
            assert losses == pytest.approx(reference[rank], rel=1e-5, abs=1e-6)


def _reads_mid_step(rank):
    """Reads, each of a value the step has not computed yet (each cuts the graph), then reads
    that cut nothing: of computed values, in a step closure, after the last sync."""
    import torch_xla
    import torch_xla.core.xla_model as xm

    model = torch.nn.Linear(4, 1).to(torch_xla.device())
    x = torch.ones(8, 4, device=torch_xla.device())
    big = torch.ones(1024, 1024, device=torch_xla.device())
    for step in range(STEPS):
        loss = model(x).pow(2).mean()
        loss.backward()
        (loss + 1).item()  # read: .item()
        (loss + 2).cpu()  # read: .cpu()
        (loss + 3).tolist()  # read: .tolist()
        print(loss + 4, end="\r")  # read: print() or repr()
        if loss + 5 > 0:  # read: bool() or `if` on a tensor
            float(loss + 6)  # read: float()
        slow = (big @ big).sum()  # milliseconds of execution after the sync
        torch_xla.sync()
        slow.item()  # still being computed: no cut, the host waits for the device
        loss.item()  # computed and there (read after the wait): nothing to name
        if step == STEPS - 1:  # at the last sync: the closure's read waits for the device
            xm.add_step_closure(lambda value: (value * 2).item(), args=(loss,))
    return loss.cpu().item()  # after the last sync


STEPS = 6


def test_every_read_that_cuts_a_step_is_named_once_with_its_line(cores8):
    source = pathlib.Path(__file__).read_text().splitlines()
    lines = {
        line.split("# read: ")[1]: number
        for number, line in enumerate(source, start=1)
        if "# read: " in line and "split" not in line
    }
    assert len(lines) == 6
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = tpunb.launch(_reads_mid_step)
    messages = [str(w.message) for w in caught if issubclass(w.category, tpunb.TpunbWarning)]
    for what, line in lines.items():  # once a read, however many steps and ranks
        [message] = [m for m in messages if f"{what} at {__file__}, line {line} " in m]
        assert "not computed yet" in message
        [cause] = [c for c in results.compiles.causes if f"line {line} " in c]
        assert cause.endswith(f"It cut {STEPS} steps.")
    # The read right after each sync cuts nothing, but the host waits there: named once it
    # has waited in 5 steps. The reads of a value there, in the step closure and after the
    # last sync: nothing.
    [waits] = [m for m in messages if "not computed yet" not in m]
    waiting = next(n for n, line in enumerate(source, 1) if "cut, the host waits" in line)
    assert f".item() at {__file__}, line {waiting} has waited for the device in 5 steps" in waits
    assert len(messages) == 7


def _reads_around_the_all_reduce(rank):
    """Reads of values a TPU computes in the step's one graph, its all-reduce inside it: each
    cuts the step, after ``xm.optimizer_step`` as before it. Reads of values a read, a sync
    or a step closure has computed cut nothing, nor does a read of the only value pending."""
    import torch_xla
    import torch_xla.core.xla_model as xm

    device = torch_xla.device()
    model = torch.nn.Linear(4, 1).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(STEPS):
        # A batch copied to the device in the step, as torch_xla's loaders copy it: data.
        x, y = xm.send_cpu_data_to_device([torch.ones(8, 4), torch.arange(8)], device)
        loss = model(x).pow(2).mean()
        loss.backward()
        doubled = loss * 2
        doubled.item()  # cuts
        xm.optimizer_step(optimizer)  # the all-reduce: inside the step's graph on a TPU
        loss.item()  # cuts
        doubled.item()  # computed by the read before the all-reduce: nothing to name
        y.tolist()  # data before the all-reduce: nothing to name
        (xm.all_reduce(xm.REDUCE_SUM, loss.detach()) / 2).item()  # cuts
        xm.add_step_closure(lambda value: value.item(), args=(loss,))
        optimizer.zero_grad()
        torch_xla.sync()
        xm.all_gather(loss.detach().reshape(1) * 2).tolist()  # nothing else pending: no cut


@pytest.mark.pair("colab", reason="the simulation's rule for reads, alike on both pairs")
def test_a_read_after_the_optimizer_step_cuts_the_step_as_on_a_tpu():
    # A simulated core computes the step's pending work before the host all-reduce; a TPU
    # runs the all-reduce inside the step's graph, so the loss is still to compute after it.
    tpunb.simulate(cores=2)
    source = pathlib.Path(__file__).read_text().splitlines()
    cuts = {n for n, line in enumerate(source, start=1) if line.endswith(".item()  # cuts")}
    assert len(cuts) == 3
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = tpunb.launch(_reads_around_the_all_reduce, live=False)
    named = [str(w.message) for w in caught if "not computed yet" in str(w.message)]
    assert {int(re.search(r"line (\d+) read", m).group(1)) for m in named} == cuts, named
    assert len(results.compiles.causes) == 3


def test_the_reads_and_the_compile_watch_left_out_record_nothing_in_the_ranks(cores8):
    import dataclasses

    from tpunb.launcher import preflight, supervise
    from tpunb.launcher.launchers import XmpSpawn

    plan = preflight.checked(hang_timeout=600, view=False, fn=_reads_mid_step)
    plan = dataclasses.replace(plan, unwatched=frozenset({"reads", "compiles"}))
    with warnings.catch_warnings():
        warnings.simplefilter("error", tpunb.TpunbWarning)  # none of the 7 above
        results = supervise(plan, XmpSpawn(plan.cores), _reads_mid_step)
    assert len(results) == 8
    steps = [step for steps in results.history.steps.values() for step in steps]
    assert len(steps) >= 8 * STEPS
    assert all(not step.reads and step.compiles is None for step in steps)
    assert results.compiles.compiles == 0


def _syncs_in_a_batch(rank, model, loader, where):
    """A loader's steps with a sync of the notebook's own: in the middle of the step (the
    step runs as two graphs) or at its end (the loader's sync then has nothing to run)."""
    import torch_xla
    import torch_xla.core.xla_model as xm

    model = copy.deepcopy(model).to(torch_xla.device())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for inputs, targets, lengths in tpunb.shard(loader):
        loss = ((model(inputs).squeeze(-1).sum(1) / lengths - targets) ** 2).mean()
        loss.backward()
        if where == "mid-step":
            torch_xla.sync()  # splits the step
        xm.optimizer_step(optimizer)
        optimizer.zero_grad()
        if where == "step end":
            torch_xla.sync()
    return model.weight.cpu()


@pytest.mark.parametrize("where", ["mid-step", "step end"])
def test_a_sync_that_splits_a_loaders_step_is_named_once_with_its_line(cores8, where):
    loader = DataLoader(
        _sequences(512), batch_size=8, collate_fn=tpunb.BucketCollate([LENGTHS.stop])
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = tpunb.launch(_syncs_in_a_batch, _model(), loader, where, live=False)
    messages = [str(w.message) for w in caught if issubclass(w.category, tpunb.TpunbWarning)]
    assert results.compiles.fallbacks == {}
    if where == "step end":  # one graph a step: the loader's sync runs nothing
        assert messages == [] and results.compiles.causes == []
        return
    line = next(n for n, text in enumerate(open(__file__), 1) if "# splits the step" in text)
    [message] = messages
    assert f"torch_xla.sync() at {__file__}, line {line} ran the step's work before" in message
    [cause] = results.compiles.causes
    steps = 512 // 8 // 8
    assert cause.endswith(f"It split {steps} steps.")


def _reads_values_the_torch_xla_way(rank, model, loader):
    """Reads device values only after a step's sync: in a step closure, through
    xm.mesh_reduce and xm.rendezvous (each calls .item() on computed values)."""
    import torch_xla
    import torch_xla.core.xla_model as xm

    model = copy.deepcopy(model).to(torch_xla.device())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for inputs, targets, lengths in tpunb.shard(loader):
        loss = ((model(inputs).squeeze(-1).sum(1) / lengths - targets) ** 2).mean()
        loss.backward()
        xm.optimizer_step(optimizer)
        optimizer.zero_grad()
        xm.add_step_closure(lambda loss: losses.append(loss.item()), args=(loss,))
    xm.rendezvous("losses read")
    return xm.mesh_reduce("steps", len(losses), sum)


def test_values_read_after_the_sync_by_torch_xlas_helpers_are_not_fallbacks(cores8):
    loader = DataLoader(_sequences(), batch_size=8, collate_fn=tpunb.BucketCollate([LENGTHS.stop]))
    with warnings.catch_warnings():
        warnings.simplefilter("error", tpunb.TpunbWarning)
        results = tpunb.launch(_reads_values_the_torch_xla_way, _model(), loader, live=False)
    assert list(results) == [8 * (1024 // 8 // 8)] * 8  # every closure ran on every rank
    assert results.compiles.fallbacks.get("aten::_local_scalar_dense", 0) == 0


def _warm_up_while_the_others_wait(rank, model, loader, compiled, left):
    """Ranks 1 to 7 take 6 steps (the first ones compile the step's graphs) and wait in a
    rendezvous; rank 0 starts once they have (``compiled``: a semaphore each of them
    releases), takes 6 steps (the graphs are cached: no compilation of its own), joins
    them, and ends once they have left it (``left``). No collective in the steps: the ranks
    are apart. (The semaphores are the fork's: shared by ranks that are processes too.)"""
    import torch_xla
    import torch_xla.core.xla_model as xm

    model = copy.deepcopy(model).to(torch_xla.device())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    if rank == 0:
        for _ in range(7):
            compiled.acquire()
    for step, (inputs, labels) in enumerate(tpunb.shard(loader), start=1):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(inputs), labels).backward()
        optimizer.step()
        if step == 6:
            if rank != 0:
                compiled.release()  # its steps have compiled the step graphs
            xm.rendezvous("together")
            if rank == 0:
                for _ in range(7):
                    left.acquire()
            else:
                left.release()


def test_warm_up_compilations_counted_while_ranks_wait_in_a_rendezvous_stay_the_warm_ups(cores8):
    # The reporting rank (rank 0, the first to start) reads the counts at its syncs; while
    # any rank is inside a helper they are read later (they cannot be told from the
    # helper's own). The step that gets them spans the steps the ranks were in meanwhile:
    # the warm-up's graphs, read late, were once blamed on a later step ("the graph itself
    # changed").
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(2048, 16, generator=generator),
        torch.randint(0, 4, (2048,), generator=generator),
    )
    loader = DataLoader(data, batch_size=32, drop_last=True)
    model = torch.nn.Linear(16, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", tpunb.TpunbWarning)
        fork = multiprocessing.get_context("fork")
        compiled, left = fork.Semaphore(0), fork.Semaphore(0)
        results = tpunb.launch(
            _warm_up_while_the_others_wait, model, loader, compiled, left, live=False
        )
    assert results.compiles.compiles_after_warmup == 0
    assert results.compiles.warmup_compiles > 0


def test_a_short_last_batch_is_named_and_padding_it_removes_the_compilation(cores8):
    def run(collate):
        loader = DataLoader(_sequences(count=1000), batch_size=8, collate_fn=collate)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            results = tpunb.launch(_masked_mean_model_step, _model(), loader)
        return results, [str(w.message) for w in caught]

    # 1000 samples: 125 a core, the last batch of each core holds 5.
    short, messages = run(tpunb.BucketCollate([LENGTHS.stop]))
    assert {shape[0][0] for shape in short.compiles.shapes} == {8, 5}
    [warning] = [m for m in messages if "short last batch" in m]
    assert "drop_last=True" in warning and "batch_size=8" in warning
    padded, messages = run(tpunb.BucketCollate([LENGTHS.stop], batch_size=8))
    assert {shape[0][0] for shape in padded.compiles.shapes} == {8}
    assert not [m for m in messages if "short last batch" in m]
    # The short batch compiled after the warm-up; padded, nothing did.
    assert padded.compiles.compiles_after_warmup == 0 < short.compiles.compiles_after_warmup


def _limited_step(rank, sizes, max_graphs):
    import torch_xla

    device = torch_xla.device()
    weight = torch.ones(4, device=device)
    step = tpunb.limit_graphs(lambda x: (x * weight).sum(), max_graphs=max_graphs)
    for size in sizes:
        step(torch.ones(size, 4).to(device))
        torch_xla.sync()
    return len(sizes)


@pytest.mark.parametrize("cores", [8, 1], ids=["every-core", "one-core"])
def test_limit_graphs_fails_fast_on_one_graph_too_many(cores8, cores):
    assert tpunb.launch(_limited_step, [5, 7, 5, 7], 2, cores=cores) == [4] * cores
    with pytest.raises(tpunb.RankError) as caught:
        tpunb.launch(_limited_step, [5, 7, 5, 9], 2, cores=cores)
    message = str(caught.value)
    assert "raised TpunbError" in message and "max_graphs=2" in message
    assert re.search(r"\b9, ?4\]", message) and "tpunb.BucketCollate" in message


def test_bucket_collate_pads_to_the_smallest_bucket_that_fits():
    collate = tpunb.BucketCollate([4, 8, 16], pad_value=-1)
    samples = [(torch.ones(3, 2), torch.tensor(1.0)), (torch.ones(6, 2), torch.tensor(2.0))]
    padded, targets, lengths = collate(samples)
    assert padded.shape == (2, 8, 2) and lengths.tolist() == [3, 6]
    assert padded[0, 3:].eq(-1).all() and padded[1, :6].eq(1).all()
    assert targets.tolist() == [1.0, 2.0]
    padded, targets, lengths = tpunb.BucketCollate([8], batch_size=4)(samples)
    assert padded.shape == (4, 8, 2) and targets.shape == (4,)
    assert lengths.tolist() == [3, 6, 0, 0]
    with pytest.raises(tpunb.TpunbError, match="longer than the largest bucket"):
        tpunb.BucketCollate([4])(samples)


def test_buckets_are_chosen_from_the_length_distribution():
    lengths = list(range(1, 101))
    assert tpunb.choose_buckets(lengths, 4) == [25, 50, 75, 100]
    assert tpunb.choose_buckets([5] * 10 + [9], 4) == [5, 9]
    # Batches are padded to their longest: buckets follow the longest length of a batch.
    by_batch = tpunb.choose_buckets(lengths, 4, batch_size=8)
    assert len(by_batch) == 4 and by_batch[-1] == 100 and by_batch[0] > 25
    with pytest.raises(tpunb.TpunbError, match="number of buckets"):
        tpunb.choose_buckets(lengths, 0)


def test_log_and_limit_graphs_outside_a_launch_say_where_they_belong():
    with pytest.raises(tpunb.TpunbError, match="inside the function given to tpunb.launch"):
        tpunb.log(loss=1.0)
    with pytest.raises(tpunb.TpunbError, match="inside the function given to tpunb.launch"):
        tpunb.limit_graphs(lambda x: x, max_graphs=2)


def test_the_history_keeps_every_logged_value_and_survives_a_round_trip(
    naive_and_bucketed, tmp_path
):
    (naive, _), _ = naive_and_bucketed
    history = naive.history
    steps = 1024 // 8 // 8
    assert history.names() == ["loss"]
    assert all(len(history.values("loss")[rank][1]) == steps for rank in range(8))
    assert sum(row["samples"] for row in history.rows()) == 1024  # each sample once
    history.save(tmp_path / "history.json")
    loaded = tpunb.History.load(tmp_path / "history.json")
    assert loaded.rows() == history.rows()
    figure = loaded.plot()  # Agg, no display: loss per core, samples/s, compilations
    titles = [ax.get_title() for ax in figure.axes if ax.get_title()]
    assert titles[0] == "loss per core"
    assert titles[1].startswith("samples/s, each the mean of the last 10 steps")
    assert titles[2] == "graphs compiled per training step (per process)"
    [loss_axes] = [ax for ax in figure.axes if ax.get_title() == "loss per core"]
    cores = {line.get_label(): line for line in loss_axes.lines if line.get_label() != "_"}
    cores = {label: line for label, line in cores.items() if label.startswith("core")}
    assert list(cores) == [f"core {rank}" for rank in range(8)]
    # A learner's axis: training steps 1, 2, ... (a batch each), whatever syncs the loop made.
    assert list(cores["core 3"].get_xdata()) == list(range(1, steps + 1))
    assert list(cores["core 3"].get_ydata()) == history.values("loss")[3][1]


def _record(step, batch, compiles=None):
    from tpunb.watch.history import Step

    counters = {} if compiles is None else {"compiles": compiles, "compile_seconds": 0.1}
    return Step(step, 0.0, {}, [[(batch, 16)]], batch, fallbacks={}, **counters)


@pytest.mark.parametrize("lag", [0, -1], ids=["same-step", "one-step-early"])
def test_a_compilation_read_a_step_early_is_still_blamed_on_its_new_shape(lag):
    # Where ranks share a process, rank 0 reads the process's counters after its step;
    # another rank may already have compiled its next step by then (seen on CI).
    watch = tpunb.watch.compile_watch.CompileWatch(ranks=2)
    batches = [8] * 9 + [5]
    compiles = [2, 1, 0] + [0] * 7
    compiles[9 + lag] += 1
    messages = []
    for step, (batch, count) in enumerate(zip(batches, compiles, strict=True)):
        messages += watch.add(0, [_record(step, batch, compiles=count)])
        messages += watch.add(1, [_record(step, batch)])
    messages += watch.finish()
    [message] = messages
    assert message.startswith("step 9 compiled 1 new graph: batch shape (5, 16)")
    assert "short last batch" in message
    summary = watch.summary()
    assert (summary.compiles, summary.compiles_after_warmup, summary.steps) == (4, 1, 10)


def test_a_few_shapes_met_after_the_warm_up_compile_without_a_warning_and_a_fifth_warns():
    # Buckets: each bucket's first batch compiles its graph once, whenever it comes.
    watch = tpunb.watch.compile_watch.CompileWatch(ranks=1)
    lengths = [16, 16, 16, 32, 16, 48, 64, 16, 80, 16]  # 80: a fifth shape
    messages = []
    for step, length in enumerate(lengths):
        first = lengths.index(length) == step
        record = tpunb.watch.history.Step(
            step, 0.0, {}, [[(8, length)]], 8, compiles=int(first), compile_seconds=0.1
        )
        messages += watch.add(0, [record])
    messages += watch.finish()
    [message] = messages
    assert message.startswith("step 8 compiled 1 new graph: batch shape (8, 80) not seen")
    assert "5 distinct shapes so far" in message
    assert watch.summary().compiles_after_warmup == 4  # each counted, 3 without a warning


def test_a_process_compiling_a_shape_another_met_first_is_blamed_on_that_shape():
    # A process a rank (a v5e-8): rank 1 meets at step 6 the bucket rank 0 met at step 4,
    # and its process compiles the graph then: a shape new to the process, not a changed
    # graph (it was once warned about as one, on the process layout).
    watch = tpunb.watch.compile_watch.CompileWatch(ranks=2)
    lengths = {0: [16] * 4 + [32] * 6, 1: [16] * 6 + [32] * 4}
    messages = []
    for step in range(10):
        for rank in (0, 1):
            first = lengths[rank].index(lengths[rank][step]) == step
            record = tpunb.watch.history.Step(
                step,
                0.0,
                {},
                [[(8, lengths[rank][step])]],
                8,
                compiles=int(first),
                compile_seconds=0.1,
            )
            messages += watch.add(rank, [record])
    messages += watch.finish()
    assert messages == []
    summary = watch.summary()
    assert (summary.compiles, summary.compiles_after_warmup) == (2, 1)
    assert summary.all_processes_compiles == 4


def test_each_process_counts_its_own_compilations_as_on_a_v5e_8():
    # One process a rank (a v5e-8, the process layout): every rank reports its process's
    # counters, and each process compiles the same graphs.
    from tpunb.watch.history import History

    watch, history = tpunb.watch.compile_watch.CompileWatch(ranks=2), History(2)
    compiles = [2, 1, 0] + [0] * 6 + [1]
    batches = [8] * 9 + [5]
    messages = []
    for step, (batch, count) in enumerate(zip(batches, compiles, strict=True)):
        for rank in (0, 1):
            record = _record(step, batch, compiles=count)
            history.add(rank, [record])
            messages += watch.add(rank, [record])
            history.judge(watch.take_verdicts())
    messages += watch.finish()
    history.judge(watch.take_verdicts())
    [message] = messages
    assert message.startswith("step 9 compiled 1 new graph: batch shape (5, 16)")
    summary = watch.summary()
    assert (summary.compiles, summary.compiles_after_warmup) == (4, 1)
    assert (summary.processes, summary.all_processes_compiles) == (2, 8)
    assert "4 in each of 2 processes" in str(summary)
    per_step = history.compiles_per_step()
    assert sum(at.compiles for at in per_step) == summary.compiles == watch.compiles
    assert sum(at.warmup for at in per_step) == summary.warmup_compiles == 3
    assert [at.step for at in per_step if at.compiles > at.warmup] == [9]  # drawn red there
    assert sum(at.seconds for at in per_step) == pytest.approx(summary.compile_seconds)


def _same_graph_every_step(rank, steps):
    """The same graph every step, then the result's (x.sum(), computed after the loop, as
    its result is sent back)."""
    import torch_xla

    x = torch.zeros(4, device=torch_xla.device())
    for _ in range(steps):
        x = x + 1
        torch_xla.sync()
    return x.sum()


def test_the_same_graph_every_step_is_never_called_a_changed_graph(cores8):
    with warnings.catch_warnings():
        warnings.simplefilter("error", tpunb.TpunbWarning)
        results = tpunb.launch(_same_graph_every_step, 100, live=False)
    assert [float(total) for total in results] == [4 * 100.0] * 8
    assert results.compiles.causes == []


def _adam_with_accumulation(rank, accumulate):
    """Adam over micro-batches of one shape, stepping every ``accumulate`` of them."""
    import torch_xla
    import torch_xla.core.xla_model as xm
    from torch_xla.distributed.parallel_loader import MpDeviceLoader

    device = torch_xla.device()
    model = _model().to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    data = TensorDataset(torch.randn(96, 4), torch.randn(96, 1))
    for batch, (x, y) in enumerate(MpDeviceLoader(DataLoader(data, batch_size=8), device), 1):
        ((model(x) - y) ** 2).mean().backward()
        if batch % accumulate == 0:
            xm.optimizer_step(optimizer)
            optimizer.zero_grad()


def test_the_warm_up_lasts_until_the_optimizers_second_step(cores8):
    # Adam's second step reads the state its first created: a graph of its own, expected
    # however many micro-batches a step accumulates (here the 6th batch, past the warm-up
    # counted in batches); afterwards every graph is one seen before.
    with warnings.catch_warnings():
        warnings.simplefilter("error", tpunb.TpunbWarning)
        results = tpunb.launch(_adam_with_accumulation, 3, live=False)
    assert results.compiles.causes == []
    assert results.compiles.compiles_after_warmup == 0


def _evaluated_each_epoch(rank, epochs):
    """SGD over one loader, then at each epoch's end an evaluation over another and its
    accuracy reduced across cores; then predictions: each path a graph of its own."""
    import torch_xla
    import torch_xla.core.xla_model as xm
    from torch_xla.distributed.parallel_loader import MpDeviceLoader

    device = torch_xla.device()
    model = _model().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    train = DataLoader(TensorDataset(torch.randn(64, 4), torch.randn(64, 1)), batch_size=8)
    held_out = DataLoader(TensorDataset(torch.randn(24, 4), torch.randn(24, 1)), batch_size=6)
    for _ in range(epochs):
        for x, y in MpDeviceLoader(train, device):
            ((model(x) - y) ** 2).mean().backward()
            xm.optimizer_step(optimizer)
            optimizer.zero_grad()
        with torch.no_grad():
            error = sum(((model(x) - y) ** 2).sum() for x, y in MpDeviceLoader(held_out, device))
        xm.all_reduce(xm.REDUCE_SUM, error).item()
    with torch.no_grad():
        return [model(x).argmax().item() for x, _ in MpDeviceLoader(held_out, device)][:1]


def test_the_work_between_epochs_compiles_its_own_graphs_unblamed(cores8):
    # Evaluating, reducing a metric and predicting each compile graphs the training steps
    # never ran, the first time they run: no changed graph, at any epoch's end.
    with warnings.catch_warnings():
        warnings.simplefilter("error", tpunb.TpunbWarning)
        results = tpunb.launch(_evaluated_each_epoch, 3, live=False)
    assert results.compiles.causes == []


def _compile_time_around_new_shapes(rank, shapes):
    """torch_xla's CompileTime (seconds) once every rank has started, and after the ranks
    have compiled a graph for each of ``shapes`` shapes."""
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.debug.metrics as met

    def compile_seconds():
        data = met.metric_data("CompileTime")
        return data[1] / 1e9 if data else 0.0

    xm.rendezvous("started")
    start = compile_seconds()
    kept = []  # live at the sync, so each is computed: a graph a shape
    for length in range(1, shapes + 1):
        kept.append((torch.ones(length, device=torch_xla.device()) * rank).sum())
        torch_xla.sync()
    xm.wait_device_ops()
    xm.rendezvous("compiled")
    return os.getpid(), start, compile_seconds()


def test_the_compile_time_summed_up_holds_all_of_torch_xlas(cores8):
    with warnings.catch_warnings():
        # A new graph every step: the watch rightly says so; not what this test checks.
        warnings.simplefilter("ignore", tpunb.TpunbWarning)
        results = tpunb.launch(_compile_time_around_new_shapes, 6, live=False)
    # The summary counts the process that compiled most: each compiled the same 6 graphs,
    # so the lowest rank's (torch_xla times compilations per process).
    pid = results[0][0]
    start = min(start for p, start, _ in results if p == pid)
    end = max(end for p, _, end in results if p == pid)
    assert end > start  # the 6 new graphs took time to compile
    # The steps' compile seconds hold at least what torch_xla timed while the graphs compiled.
    assert results.compiles.compile_seconds >= end - start
    per_step = results.history.compiles_per_step()
    assert sum(at.seconds for at in per_step) == pytest.approx(results.compiles.compile_seconds)


def _result_read_after_the_last_sync(rank, steps):
    import torch_xla

    x = torch.zeros(4, device=torch_xla.device())
    for _ in range(steps):
        x = x + 1
        torch_xla.sync()
    return x.sum().item()  # the usual end of a rank's function: its result as a number


def test_a_result_read_after_the_last_sync_is_counted_but_not_blamed(cores8):
    with warnings.catch_warnings():
        warnings.simplefilter("error", tpunb.TpunbWarning)
        results = tpunb.launch(_result_read_after_the_last_sync, 6, live=False)
    assert list(results) == [24.0] * 8
    assert results.compiles.fallbacks == {"aten::_local_scalar_dense": 8}
    assert results.compiles.causes == []


def _framework_run(last_batch=8, graph_change_at=None):
    """Rank 0's and rank 1's records of a Lightning-like run: 2 setup steps of the
    framework's own between 2 of the notebook's, then 2 epochs of 4 batches with two
    syncs a batch (its loader's, which hands out the batch, and its optimizer step's),
    each epoch's last step the framework's epoch end, then a teardown step. Epoch e,
    batch b starts at step 4 + 8e + 2(b - 1)."""
    from tpunb.watch.history import Step

    rows = [(None, None, False, None)] + [(None, None, True, None)] * 2
    rows += [(None, None, False, None)]
    for epoch in range(2):
        for batch in range(1, 5):
            size = last_batch if batch == 4 else 8
            rows += [(epoch, batch, False, size), (epoch, batch, batch == 4, None)]
    rows += [(1, 4, True, None)]
    compiles = {0: 2, 1: 1, 4: 2, 6: 1, 11: 3, 12: 1}  # warm-up, second batch, epoch end
    if last_batch != 8:
        compiles[10] = 1  # the short last batch
    if graph_change_at is not None:
        compiles[graph_change_at] = 1
    watch = tpunb.watch.compile_watch.CompileWatch(ranks=2)
    messages = []
    for step, (epoch, batch, framework, size) in enumerate(rows):
        for rank in (0, 1):
            counters = {"compiles": compiles.get(step, 0), "compile_seconds": 0.1, "fallbacks": {}}
            record = Step(
                step,
                0.0,
                {},
                [[(size, 16)]] if size else [],
                size or 0,
                epoch=epoch,
                epoch_batch=batch,
                epoch_batches=4,
                framework=framework,
                **(counters if rank == 0 else {}),
            )
            messages += watch.add(rank, [record])
    return messages + watch.finish()


def test_a_frameworks_own_steps_and_its_second_batch_are_not_blamed_on_the_notebook():
    assert _framework_run() == []


def test_after_a_frameworks_warm_up_a_changed_graph_is_still_named():
    [message] = _framework_run(graph_change_at=9)  # epoch 0, batch 3's second sync
    assert message.startswith("epoch 1, batch 3 compiled 1 new graph with batch shapes seen")


def test_a_short_last_batch_before_a_frameworks_epoch_end_is_still_named():
    messages = _framework_run(last_batch=5)
    assert len(messages) == 1 and "short last batch" in messages[0]
