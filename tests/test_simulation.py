import os
import warnings

import pytest
from conftest import run_python

import tpunb
from tpunb.simulation import COMPILE_LEVEL


@pytest.mark.parametrize("cores", [0, -8, "8", 2.0, True])
def test_simulate_refuses_a_bad_core_count(cores):
    with pytest.raises(tpunb.TpunbError, match="positive integer"):
        tpunb.simulate(cores=cores)


def test_simulate_refuses_once_the_runtime_runs():
    result = run_python(
        """
        import tpunb, torch_xla
        tpunb.simulate(cores=8)
        torch_xla.device()
        try:
            tpunb.simulate(cores=4)
        except tpunb.TpunbError as error:
            print("refused:", error)
        """
    )
    assert "refused: The XLA runtime is already running" in result.stdout, result.stderr


def _collectives(rank):
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm

    device = torch_xla.device()
    value = torch.tensor([float(rank + 1)], device=device)
    total = xm.all_reduce(xm.REDUCE_SUM, value)
    biggest = xm.all_reduce(xm.REDUCE_MAX, value, groups=[[0, 1, 2, 3], [4, 5, 6, 7]])
    gathered = xm.all_gather(torch.tensor([rank, 10 * rank], device=device))
    columns = xm.all_gather(torch.tensor([[rank], [rank]], dtype=torch.float, device=device), dim=1)
    native = xm.all_gather(torch.tensor([rank], device=device), pin_layout=False)
    torch_xla.sync()
    payloads = xm.rendezvous("exchange", f"from {rank}".encode())
    mean = xm.mesh_reduce("mean", rank, lambda values: sum(values) / len(values))
    return {
        "sum": total.item(),
        "max": biggest.item(),
        "gathered": gathered.tolist(),
        "columns": columns.tolist(),
        "native": native.tolist(),
        "payloads": payloads,
        "mean": mean,
    }


def test_collectives_complete_on_8_simulated_cores(cores8):
    results = tpunb.launch(_collectives)
    for rank, result in enumerate(results):
        assert result["sum"] == 36.0
        assert result["max"] == (4.0 if rank < 4 else 8.0)
        assert result["gathered"] == [v for r in range(8) for v in (r, 10 * r)]
        assert result["columns"] == [[float(r) for r in range(8)]] * 2
        assert result["native"] == list(range(8))
        assert result["payloads"] == [f"from {r}".encode() for r in range(8)]
        assert result["mean"] == 3.5


def _rank_zero_evaluates_alone(rank):
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm

    device = torch_xla.device()
    weight = torch.ones(4, device=device)
    evaluations = 0
    for step in range(3):
        local = torch.tensor([float(rank)] * 4, device=device)  # data, not a graph constant
        gradient = xm.all_reduce(xm.REDUCE_SUM, local)
        weight = weight - 0.01 * gradient
        torch_xla.sync()
        if rank == 0:  # work on one rank only: its syncs must not wait for the others
            for _ in range(step + 1):
                (weight * 2).sum().item()
                torch_xla.sync()
                evaluations += 1
    return weight.tolist(), evaluations


def test_syncs_on_one_rank_only_do_not_block_collectives(cores8):
    # Rank 0's evaluation reads a value after a sync, the only one pending: its own small
    # graph, no step cut, nothing for the watch to say.
    with warnings.catch_warnings():
        warnings.simplefilter("error", tpunb.TpunbWarning)
        results = tpunb.launch(_rank_zero_evaluates_alone)
    assert all(weights == results[0][0] for weights, _ in results)
    assert results[0][0] == pytest.approx([1 - 3 * 0.01 * 28] * 4)
    assert [evaluations for _, evaluations in results] == [6] + [0] * 7


def _fallback_counters_at_the_start(rank):
    import torch
    import torch_xla
    import torch_xla.debug.metrics as met

    at_start = met.executed_fallback_ops(), met.counter_value("xla::_to_cpu")
    torch.tensor([2.0]).to(torch_xla.device()).item()  # the rank's own first fallback
    return at_start, met.counter_value("aten::_local_scalar_dense")


@pytest.mark.parametrize("cores", [8, 1])
def test_ranks_start_with_no_fallback_counted_and_count_their_own(cores8, cores):
    # torch_xla's counters are per process, and each rank is a process of its own: it counts
    # its own .item() and nothing else, as on a v5e-8.
    results = tpunb.launch(_fallback_counters_at_the_start, cores=cores, live=False)
    assert [at_start for at_start, _ in results] == [([], None)] * cores
    assert [counted for _, counted in results] == [1] * cores


def test_a_machine_that_holds_fewer_cores_simulates_those_and_says_so(monkeypatch):
    # Binder's 2 GB: binder/start caps the simulated cores, each a process of its own.
    monkeypatch.setenv("TPUNB_MAX_SIMULATED_CORES", "4")
    with pytest.warns(tpunb.TpunbWarning, match="Simulating 4 cores instead of 8: TPUNB_MAX_"):
        assert tpunb.simulate(cores=8).cores == 4
    with warnings.catch_warnings():
        warnings.simplefilter("error", tpunb.TpunbWarning)  # fewer than the cap: no word
        assert tpunb.simulate(cores=2).cores == 2
    monkeypatch.setenv("TPUNB_MAX_SIMULATED_CORES", "lots")
    with pytest.raises(tpunb.TpunbError, match="TPUNB_MAX_SIMULATED_CORES='lots': give the most"):
        tpunb.simulate(cores=8)


def test_simulation_is_refused_on_a_machine_with_a_tpu(monkeypatch):
    from tpunb import hardware

    monkeypatch.setattr(hardware, "detect", lambda: hardware.Tpu("v5e", 8))
    with pytest.raises(tpunb.TpunbError, match="has a TPU") as refused:
        tpunb.simulate(cores=8)
    assert "tpunb.simulate(cores=8, instead_of_tpu=True)" in str(refused.value)


def test_a_learner_on_a_one_core_tpu_can_ask_for_8_simulated_cores_instead():
    result = run_python(
        """
        import tpunb
        from tpunb import hardware
        from tpunb.launcher import preflight

        hardware.detect = lambda: hardware.Tpu("v5e", 1)  # Colab's TPU
        print(tpunb.env().warnings[-1])
        report = tpunb.simulate(cores=8, instead_of_tpu=True)
        print(report.cores, report.tpu, report.accelerator)
        print(preflight.plan())
        """
    )
    warning, simulated, plan = result.stdout.splitlines()
    assert warning.startswith("Only 1 TPU core (Colab's TPU is a v5e-1 or a v6e-1)")
    assert warning.endswith("tpunb.simulate(cores=8, instead_of_tpu=True)."), result.stderr
    assert simulated == "8 None 8 TPU cores simulated on the CPU instead of this host's TPU v5e-1"
    assert plan.startswith("Plan(cores=8, simulated=True,")  # a v5e-8's


def test_torch_xla_imported_before_simulate_still_gets_working_collectives():
    result = run_python(
        """
        import torch, torch_xla, torch_xla.core.xla_model as xm  # a notebook's first cell
        import tpunb
        tpunb.simulate(cores=8)

        def total(rank):
            value = xm.all_reduce(xm.REDUCE_SUM, torch.ones(1, device=torch_xla.device()))
            torch_xla.sync()
            return value.item()

        print(tpunb.launch(total))
        """
    )
    assert result.stdout.strip() == str([8.0] * 8), result.stderr


def _compiled_graph(rank):
    import torch
    import torch_xla

    return (torch.ones(3, device=torch_xla.device()) * (rank + 1)).tolist()


def _compile_levels(dump):
    """The level each graph compiled at, from the options XLA dumps with it (only those
    that differ from XLA's defaults: level 3 is the default)."""
    levels = set()
    for options in dump.glob("*.debug_options"):
        lines = options.read_text().splitlines()
        found = [line.split(": ")[1] for line in lines if "backend_optimization_level" in line]
        levels.add(int(found[0]) if found else 3)
    return levels


@pytest.mark.parametrize("own_level", [None, 2])
def test_simulated_cores_compile_at_the_quick_level_unless_xla_flags_set_one(
    cores8, tmp_path, monkeypatch, own_level
):
    # The flags as torch_xla's import left them, less the level an earlier simulate() set.
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "optimization_level" not in f]
    flags.append(f"--xla_dump_to={tmp_path}")
    if own_level is not None:
        flags.append(f"--xla_backend_optimization_level={own_level}")
    monkeypatch.setenv("XLA_FLAGS", " ".join(flags))
    tpunb.simulate(cores=8)  # XLA reads the flags as the ranks start its runtime
    assert tpunb.launch(_compiled_graph, live=False) == [[r + 1.0] * 3 for r in range(8)]
    expected = COMPILE_LEVEL if own_level is None else own_level
    assert _compile_levels(tmp_path) == {expected}
