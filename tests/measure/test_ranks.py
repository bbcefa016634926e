"""Under torch.distributed every rank routes a call as rank 0 measured it, whatever its own
cache holds, and makes the same collectives: per-rank caches with conflicting entries (a
refusal at another length, a win, a damaged file), different thread counts, a sliding call
and a padded full layer. A hang fails the test (each rank is bounded by a timeout)."""

import datetime
import json
import multiprocessing
import os

import pytest
import torch

from compile_pass.kernels import documents
from compile_pass.kernels.contract import UNBOUNDED
from tests.helpers.gloo import end_rank, free_port

KEYS = 256
SLIDING = {"left": 15, "right": 0}
PADDED_FULL_LAYER = {"left": UNBOUNDED, "right": 0, "key_padding": True}


def _plant(rank: int, facts, kernel: str) -> None:
    """What a rank's own cache holds for the call's key before the compile: each rank but
    rank 0 something that contradicts what rank 0 measures."""
    from compile_pass.measure import store
    from compile_pass.measure.table import Measured, _part, key_of

    device = torch.device("cpu")
    saved = store.MeasurementStore(store.cache_root(), device)
    key = key_of(facts, device)
    planted = {
        1: Measured(kernel, 4 * KEYS, 1, 0, None, None, refused="planted: refused at another length"),
        2: Measured(kernel, KEYS, 1, 5, 1000.0, 0.001),  # a win no kernel makes
        3: None,  # a damaged file at the call's own length
    }
    if rank in planted and planted[rank] is not None:
        saved.save(key.name, _part(planted[rank]), planted[rank].record())
    elif rank == 3:
        saved.save(key.name, _part(Measured(kernel, KEYS, 1, 5, 1.0, 1.0)), {"kernel": kernel, "keys": "many"})
    if rank == 1:  # and a refusal at the call's own length, of the first kernel asked
        refusal = Measured(kernel, KEYS, 1, 0, None, None, refused="planted: refused here")
        saved.save(key.name, _part(refusal), refusal.record())


def _rank(rank: int, world: int, port: int, directory: str, result_path: str) -> None:
    os.environ["COMPILE_PASS_MEASURE"] = "measure"
    os.environ["COMPILE_PASS_MEASURE_SECONDS"] = "1,8"
    os.environ["COMPILE_PASS_CACHE_DIR"] = os.path.join(directory, f"rank{rank}")  # node-local caches
    from compile_pass.kernels import policy
    from compile_pass.measure.table import TABLE
    from tests.measure.test_measure import call_facts

    torch.distributed.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=90),
    )
    torch.set_num_threads(1 + rank % 2)  # ranks with different thread counts: different keys
    results = {}
    try:
        for name, changes in (("sliding", SLIDING), ("padded full layer", PADDED_FULL_LAYER)):
            facts = call_facts(**changes)
            first_kernel = next(k for k in policy.POLICY.kernels if k.cannot(facts) is None)
            _plant(rank, facts, first_kernel.name)
            choice = policy.POLICY.choose(facts)
            results[name] = {
                "kernel": None if choice.kernel is None else choice.kernel.name,
                "said": "; ".join([choice.name, *choice.passed_over]),
            }
        results["measured here"] = TABLE.measured
        torch.distributed.barrier()  # the same number of collectives on every rank, or this fails
    except BaseException:
        torch.distributed.destroy_process_group()
        raise
    with open(f"{result_path}.{rank}", "w") as file:
        json.dump(results, file)
    end_rank()


def _run_ranks(tmp_path, world: int) -> list[dict]:
    context = multiprocessing.get_context("spawn")
    port, results = free_port(), str(tmp_path / "result")
    ranks = [context.Process(target=_rank, args=(r, world, port, str(tmp_path), results)) for r in range(world)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(timeout=300)
    hung = [rank for rank, process in enumerate(ranks) if process.is_alive()]
    for process in ranks:
        process.kill()
    assert not hung, f"ranks {hung} hung"
    assert [process.exitcode for process in ranks] == [0] * world
    return [json.loads((tmp_path / f"result.{r}").read_text()) for r in range(world)]


def _check_one_routing(results: list[dict]) -> None:
    first = results[0]
    for name in ("sliding", "padded full layer"):
        assert {result[name]["kernel"] for result in results} == {first[name]["kernel"]}, name
        # every rank says rank 0's words, its measurement named as rank 0's on the others
        for result in results[1:]:
            assert result[name]["said"] == first[name]["said"].replace("measured on this device", "measured on rank 0")
        assert "measured on this device" in first[name]["said"]
        assert "planted" not in first[name]["said"]
    assert first["padded full layer"]["said"].count("measured on this device") >= 1
    assert [result["measured here"] for result in results[1:]] == [0] * (len(results) - 1)
    assert first["measured here"] >= 2


def test_two_ranks_with_conflicting_caches_route_alike_and_never_hang(tmp_path):
    _check_one_routing(_run_ranks(tmp_path, 2))


@pytest.mark.slow
def test_four_ranks_with_conflicting_caches_and_threads_route_alike_and_never_hang(tmp_path):
    _check_one_routing(_run_ranks(tmp_path, 4))


def test_the_document_kernel_is_the_padded_full_layers_first_question():
    from compile_pass.kernels import policy
    from tests.measure.test_measure import call_facts

    facts = call_facts(**PADDED_FULL_LAYER)
    assert next(k for k in policy.POLICY.kernels if k.cannot(facts) is None) is documents.DOCUMENTS


@pytest.mark.slow
def test_a_gemma4_under_torchrun_with_per_rank_caches_names_the_same_kernels_on_every_rank(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).with_name("torchrun_gemma4.py")
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port())]
        + [str(script), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    first, second = (json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2))
    assert first == second
    for form in ("padded", "packed"):
        assert first[form], form
        assert any(rewritten for _, rewritten, _ in first[form]), first[form]  # lengths the op wins at
