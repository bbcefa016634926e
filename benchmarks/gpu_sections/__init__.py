"""The sections of benchmarks/gpu_check.py, a module each; gpu_check.py parses the command line
and runs them in order.

- ``common``: the layer's shapes, the printer whose lines go to RESULTS.md, interleaved
  timing, a layer's inputs and band mask, and the CPU stand-ins of ``--cpu-dry-run``;
- ``sliding_layer``: the ``layer`` and ``short`` sections (one sliding layer against SDPA and
  torch's FA2, at long and at short lengths);
- ``global_layer``: the ``global`` section (the head_dim-512 global layer, the soft-capped layer);
- ``packed_layer``: the ``packed`` section (full-attention layers over packed documents);
- ``padded_rows``: the ``padded`` and ``profile`` sections (padded batches, the sequences' pass);
- ``model_step``: the ``model`` and ``measure`` sections (the training step; kernels measured
  on this GPU).
"""
