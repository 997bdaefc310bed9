"""The ``greenroom`` command: the dispatcher (``main``), one module per subcommand, and
what they share (the flag names the benches and ``doctor`` take from ``train``, the budget)."""
