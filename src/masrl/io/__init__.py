"""General input and output: the row reader (``masrl.io.rows``, on bounded lines from
``masrl.io.lines``), the bounded YAML reader (``masrl.io.bounded_yaml``) and atomic writes
(``masrl.io.atomic``).

A service at the bottom of the stack: it imports nothing from masrl but ``masrl.errors``, so the
config, the tasks, the retrieval corpora and the commands all read and write through it. Import
from the submodules (this package imports nothing, so ``import masrl.io.rows`` stays light).
"""
