"""What the user promises about a model's inputs, for the rules that may rely on it.

Every rule is exact on every input by default. A few rewrites are exact only on the inputs a model is
really fed: ONNX Runtime's 1-D mask lengths equal the raw mask only when each row is ones then zeros
(:mod:`onnxfuse.runtime.right_padding`). Such a rule acts only on a promise the user states
(``--right-padded NAME``); validation then draws inputs that keep it, so the promise is what is
checked, not assumed silently.

The pipeline hands the promises to the rules once, after selecting them (:meth:`~.rule.Rule.under`):
a rule that reads them returns a configured copy, every other rule returns itself.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Assumptions:
    """``right_padded``: graph inputs promised to hold right-padded 0/1 rows (``--right-padded``)."""

    right_padded: frozenset[str] = frozenset()


#: No promise at all: every rule must be exact on any input.
NO_ASSUMPTIONS = Assumptions()
