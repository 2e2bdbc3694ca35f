"""Facts about a graph, below the rule families and the engine: what every rule, the apply loop and the
protobuf layers read, proved once.

* ``constants``: the value a ``Constant`` node writes, one reader for protobuf and graphsurgeon nodes;
* ``graph``: constants, shapes, dtypes, domains, producers, readers and subgraphs of a graphsurgeon graph;
* ``inference``: the one call of ONNX's shape inference (``onnx_inferred``, its options named; under
  ``model_io.infer_shapes``, the pipeline's), and "infer, then prove" in one step (``inferred_and_proven``,
  ``reinferred_and_proven``);
* ``shapes``: shape inference again mid-rewrite (``refresh_shapes``, on ``model_io.infer_shapes``), symbols
  proved equal renamed (``unify_dims``);
* size proofs: ``shape_values`` (what a ``Shape`` chain computes, a tensor's length along an axis),
  ``proven_dims`` (the dimensions inference leaves invented, graphsurgeon graphs), ``range_dims``
  (``Range(0, n, 1)``'s length on the protobuf model ``model_io.infer_shapes`` returns), ``row_wise``
  (a Gemm applied row by row through two Reshapes);
* ``resize``: the whole factors of a nearest ``Resize`` that repeats each input element (``nearest_upsample_factors``);
* ``scopes``: which graph owns a node, which defines a tensor.

From the engine these modules read only the rule contract's ``Refuse`` and ``edit.replace_reads``; no
rule lives here and nothing here imports a rule family.
"""
