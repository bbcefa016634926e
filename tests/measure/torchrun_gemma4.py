"""One rank of ``test_ranks.py``'s torchrun run: a small Gemma-4 under DDP, compiled with the
rules in measure mode (the default), its cache in a directory of this rank's own and a thread
count of its own, on a padded batch and a packed one at lengths the measurement takes. Writes
what this rank's report says of each attention call: rewritten or kept, and the kernel.

    python -m torch.distributed.run --nproc_per_node 2 tests/measure/torchrun_gemma4.py OUT_DIR
"""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout's tests package

RANK = int(os.environ["RANK"])
OUT = Path(sys.argv[1])
os.environ["COMPILE_PASS_MEASURE"] = "measure"
os.environ["COMPILE_PASS_MEASURE_SECONDS"] = "2,12"
os.environ["COMPILE_PASS_CACHE_DIR"] = str(OUT / f"cache-rank{RANK}")  # node-local caches
os.environ.pop("COMPILE_PASS_SHORT_KEYS", None)  # the crossovers users get

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

import compile_pass  # noqa: E402
from tests.helpers.gloo import end_rank  # noqa: E402
from tests.helpers.models import tiny_gemma4, token_batch  # noqa: E402


def rewrite_only(gm, example_inputs):
    compile_pass.rewrite(gm)
    return gm.forward


def said(report) -> list:
    """Each call's decision, with the kernel named as the policy describes it (without the
    milliseconds and where they were measured, which differ by rank in words only)."""
    return [[d.node, d.rewritten, d.kernel.split(" (")[0]] for d in report if d.kind == "attention call"]


def main() -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1 + RANK % 2)
    model = DistributedDataParallel(tiny_gemma4(max_position_embeddings=4096))
    compiled = torch.compile(model, backend=rewrite_only)
    result = {}
    padded_ids = token_batch(1024, seed=RANK)
    padding = torch.ones_like(padded_ids)
    padding[1, :200] = 0  # a left-padded row
    packed_length = 2048
    positions = torch.cat([torch.arange(700), torch.arange(900), torch.arange(448)])[None]
    batches = {
        "padded": dict(input_ids=padded_ids, attention_mask=padding, labels=padded_ids),
        "packed": dict(
            input_ids=token_batch(packed_length, batch=1, seed=RANK),
            position_ids=positions,
            labels=token_batch(packed_length, batch=1, seed=RANK),
            use_cache=False,
        ),
    }
    for form, batch in batches.items():
        torch._dynamo.reset()
        with compile_pass.decisions() as report:
            compiled(**batch).loss.backward()
        result[form] = said(report)
    dist.barrier()
    (OUT / f"rank{RANK}.json").write_text(json.dumps(result))
    end_rank()


if __name__ == "__main__":
    main()
