"""The rewrite engine: the rule contract (``rule``), the apply loop (``apply``), what the user promises
(``assumptions``), edit helpers (``edit``, ``carriers``), the polynomial matcher (``polynomial``), the
opset raise (``opset``) and cleanup (``cleanup``). Facts about the graph are in ``rewrites/facts/``.
No rule lives here."""
