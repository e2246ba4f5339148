"""``phalanx bench``: phalanx against the loop, torch.func and the machine's own limits.

- :mod:`~phalanx._bench.workloads`: W1 to W7 of DESIGN.md and their analytic cost.
- :mod:`~phalanx._bench.contenders`: the loop, the torch.func recipe, each phalanx backend.
- :mod:`~phalanx._bench.suite`: check each contender against the loop, then time them.
- :mod:`~phalanx._bench.timing`: interleaved rounds, median and spread, peak memory.
- :mod:`~phalanx._bench.machine`: measured fp32 GEMM GFLOP/s and copy bandwidth.
- :mod:`~phalanx._bench.report`: text and Markdown tables, JSON, the speed-up plot.
- :mod:`~phalanx._bench.cli`: the command line.
"""
