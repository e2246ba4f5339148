"""``phalanx bench``: phalanx against the loop, torch.func and the machine's own limits.

- :mod:`~phalanx_tools.bench.workloads`: W1 to W7 of DESIGN.md and their analytic cost.
- :mod:`~phalanx_tools.bench.contenders`: the loop, the torch.func recipe, each phalanx backend.
- :mod:`~phalanx_tools.bench.suite`: check each contender against the loop, then time them.
- :mod:`~phalanx_tools.bench.timing`: interleaved rounds, median and spread, peak memory.
- :mod:`~phalanx_tools.bench.machine`: measured fp32 GEMM GFLOP/s and copy bandwidth.
- :mod:`~phalanx_tools.bench.report`: text and Markdown tables, JSON, the speed-up plot.
- :mod:`~phalanx_tools.bench.cli`: the command line.
"""
