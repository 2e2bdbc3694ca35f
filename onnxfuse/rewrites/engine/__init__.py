"""The rewrite engine: the rule contract (``rule``), the apply loop (``apply``), graph facts
(``facts``), edit helpers (``edit``), the polynomial matcher (``polynomial``), the opset raise
(``opset``), cleanup (``cleanup``) and graph scopes (``scopes``). No rule lives here."""
