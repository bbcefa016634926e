"""Small attention functions compiled through compile_pass's rewrite and run eagerly: the
helpers the rule tests share."""

import collections
import contextlib

import torch

from compile_pass.kernels import policy
from compile_pass.kernels.chunked.plan import ChunkTuning
from compile_pass.ops import runtime_mask
from tests.helpers.models import Capture


@contextlib.contextmanager
def mask_input_paths():
    """The paths the mask_input op took in the block, counted from its profiler records
    (``{"band": 5, "sdpa causal": 1}``); filled when the block ends."""
    paths = collections.Counter()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        yield paths
    for event in profile.events():
        if event.name.startswith(runtime_mask.PATH_RECORD):
            paths[event.name.removeprefix(runtime_mask.PATH_RECORD)] += 1


def tune_chunks(monkeypatch, **tuning):
    """Make the op's chunked kernel use ``ChunkTuning(**tuning)`` for the rest of the test
    (small chunks cross many chunk edges at short lengths)."""
    monkeypatch.setattr(policy, "POLICY", policy.POLICY.with_chunking(ChunkTuning(**tuning)))


def qkv(seq=16, seed=0, batch=1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, 2, seq, 8, generator=gen, dtype=torch.float64).requires_grad_() for _ in range(3)]


def compiled_with_capture(fn, **switches):
    torch._dynamo.reset()
    capture = Capture(**switches)
    return torch.compile(fn, backend=capture, fullgraph=True), capture


def assert_same_as_eager(fn, compiled, inputs=None, *extra):
    """Forward at every position and the gradients of q, k, v equal eager's (fp64, same
    arithmetic or reassociated), NaN where eager has NaN; ``extra`` are further arguments of
    both calls (a mask, a padding)."""
    q, k, v = inputs if inputs is not None else qkv()
    out = compiled(q, k, v, *extra)
    grads = torch.autograd.grad(out.nan_to_num().sum(), (q, k, v), allow_unused=True)
    ref = fn(q, k, v, *extra)
    ref_grads = torch.autograd.grad(ref.nan_to_num().sum(), (q, k, v), allow_unused=True)
    for a, b in zip((out, *grads), (ref, *ref_grads), strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0, equal_nan=True)


class _AsIfOnCuda(policy.KernelPolicy):
    def choose(self, facts, **kwargs):
        return super().choose(facts._replace(device=torch.device("cuda")), **kwargs)


def ask_as_if_on_cuda(monkeypatch):
    """The kernel policy answers every question as if the call ran on CUDA (with an FA2
    kernel there only where a test says so); the op still runs its kernels on the CPU."""
    monkeypatch.setattr(policy, "POLICY", _AsIfOnCuda(policy.POLICY.kernels))


def pretend_gpu(monkeypatch, capability=(9, 0)):
    """CUDA devices report this compute capability to the FA2 kernels' one seam, as if this
    machine had such a GPU: graph-time answers only (CPU tensors still run CPU kernels)."""
    from compile_pass.kernels import fa2

    monkeypatch.setattr(fa2, "device_capability", lambda device: capability if device.type == "cuda" else None)


class NothingRegistered:
    """A flash implementation for ``torch.nn.attention.register_flash_attention_impl`` that
    registers no kernel: activated, torch reports it as the one under aten's flash ops."""

    def remove(self) -> None:
        pass
