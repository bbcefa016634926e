"""The op's kernels: the contract each keeps (``contract``), the ordered list and the one
function that picks a call's kernel (``policy``), the heads-last layouts they share
(``layout``), and one place per kernel family: ``chunked`` (any device), ``documents`` (the
CPU's packed and padded full layers), ``fa2`` (torch's FA2 and flash-attn's), ``wide_head``
(Triton, head_dim 64-512) and ``ffpa``. Nothing here imports the op or the measurement: the
measurement is handed to the policy (``policy.measured_by``)."""
