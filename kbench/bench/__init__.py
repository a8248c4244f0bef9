"""The robust kernel benchmark: tasks (kbench.bench.tasks.TASKS), task filters, the harness
that scores an implementation without being fooled, and the `bench` command (cli.main).

Only torch and the standard library are needed; nothing here touches the C core, so the
benchmark runs (and its self-tests pass) even where kbench's kernels cannot be built."""
