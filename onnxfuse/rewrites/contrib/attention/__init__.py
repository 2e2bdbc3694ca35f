"""The attention wing of the ``contrib`` family: the steps of the one rule contrib-attention
(:mod:`onnxfuse.rewrites.contrib.contrib_attention`), one job per module, none of them a rule:

* :mod:`.layout`: the three layouts of q, k and v and the dimensions read from them;
* :mod:`.facts`: scalar factors, element-type Casts and single readers on the attention's path;
* :mod:`.heads`: q, k and v traced to the tensors their heads were cut from, or taken as given heads;
* :mod:`.projections`: the q/k/v projections packed into ``Attention``'s one weight, or their biases
  folded into MultiHeadAttention's;
* :mod:`.masks`: the mask steps between the scores and the Softmax, the NaN guard;
* :mod:`.keep_masks`: those steps proved to be a 0/fill keep mask, for a raw ``mask_index``;
* :mod:`.shape_reads`: ``Shape`` reads of removed tensors, recomputed from named dims;
* :mod:`.policy`: when fusing pays (measured), decided in one place;
* :mod:`.pattern`: the dataflow walked from the anchor (a Softmax, or ONNX's own Attention);
* :mod:`.plan`: the checks every form shares, and the :class:`~.plan.AttentionPlan` they make;
* :mod:`.bias`: the mask written as the fused op takes it (``attention_bias``, raw ``mask_index``);
* :mod:`.emit`: writing com.microsoft ``Attention`` (packed) or ``MultiHeadAttention``.
"""
