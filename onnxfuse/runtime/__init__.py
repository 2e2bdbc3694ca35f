"""The runtime layer every command stands on: ONNX Runtime sessions and providers, model inputs, and
the one comparator.

* :mod:`~onnxfuse.runtime.session` — provider choice (a quiet CUDA probe), sessions with our custom-op
  library, running a model on samples (``run_samples``, ``run_model``);
* :mod:`~onnxfuse.runtime.inputs` — seeded draws from a model's signature, ``--shape``, the user's
  samples (arrays or ``.npz``), saving them, the second size validation also runs at;
* :mod:`~onnxfuse.runtime.input_ranges` — the range an integer input can take, read from the graph;
* :mod:`~onnxfuse.runtime.compare` — the comparator: ``compare_arrays`` (one tensor), ``Tolerance``,
  ``compare_tensor`` (one tensor over samples), ``compare_runs`` (every output of two runs).

Validation (:mod:`onnxfuse.validate`), ``diff`` (:mod:`onnxfuse.drift`) and timing
(:mod:`onnxfuse.timing`) use these and nothing of each other's. Submodules are imported by name: this
package imports nothing itself.
"""
