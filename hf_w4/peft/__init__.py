"""PEFT's LoRA on ``QuantLinear`` layers: :mod:`.lora` teaches PEFT the layer type (installed by
``hf_w4.install()``), :mod:`.layer` is the wrapper class (imported only once PEFT is)."""
