"""Self-contained demo assets for grouprl.

Everything here is built locally (no Hub downloads), so examples and tests run offline:

* :mod:`grouprl.demo.tokenizer` - a tiny byte-level BPE tokenizer with a ChatML chat template.
* :mod:`grouprl.demo.task` - a procedural arithmetic dataset and its verifiable reward.
* :mod:`grouprl.demo.model` - a tiny Qwen2 recipe, the committed SFT checkpoint
  (``grouprl/demo/tiny_arith``) and the script that regenerates it.

The submodules import torch/transformers/datasets; this package file deliberately imports none of
them so that ``import grouprl.demo`` stays cheap.
"""
