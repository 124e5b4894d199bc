"""Self-contained demo assets for grouprl.

Everything here is built locally (no Hub downloads), so examples and tests run offline:

* :mod:`grouprl.demo.tokenizer` - a tiny byte-level BPE tokenizer with a ChatML chat template.
* :mod:`grouprl.demo.task` - a procedural arithmetic dataset and its verifiable reward.
* :mod:`grouprl.demo.model` - tiny Qwen2 models and the committed SFT checkpoint (``grouprl/demo/tiny_arith``).
* :mod:`grouprl.demo.pretrain` - the checkpoint's recipe and the script that regenerates it.
* :mod:`grouprl.demo.evaluation` - held-out accuracy and stop rate of a demo model.

The submodules import torch/transformers/datasets; this package file deliberately imports none of
them so that ``import grouprl.demo`` stays cheap.
"""
