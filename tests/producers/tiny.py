"""The tiny model, calibration set and probe input shared by every producer script.

Runs inside each producer's own venv (no hf_w4 import): only torch, transformers and safetensors.
"""
import json
import os

import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

# Small enough that a 4-bit checkpoint is ~200 KB, big enough that every Linear has several 32-wide groups and
# the down projection (K = 256) two 128-wide ones.
CONFIG = dict(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)
SEED = 1234
CALIB_SAMPLES, CALIB_LEN = 16, 64
PROBE_SHAPE = (2, 16)


def tiny_model(dtype=torch.bfloat16) -> LlamaForCausalLM:
    """A seeded random LlamaForCausalLM. The weights get a heavy-tailed spread (some larger columns) so that scales
    and zero points differ between groups and a wrong group index or zero convention shows in the logits."""
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG)).eval()
    g = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                w = 0.05 * torch.randn(p.shape, generator=g)
                if p.dim() == 2:
                    # per-input-column gain, 0.5x .. 4x: groups of K see different ranges
                    w *= torch.exp(torch.rand(p.shape[1], generator=g) * 2.08 - 0.69)
                    # an asymmetric shift per output row, so asymmetric schemes store zeros away from the middle
                    w += 0.02 * torch.randn(p.shape[0], 1, generator=g)
                p.copy_(w)
    return model.to(dtype)


def dense_checkpoint(path: str) -> str:
    """Saves tiny_model() (bf16) to path and returns it: producers that read the model's name_or_path from disk
    get a real checkpoint, as they would from a hub download."""
    tiny_model().save_pretrained(path)
    return path


def calibration_ids() -> torch.Tensor:
    """[CALIB_SAMPLES, CALIB_LEN] random token ids (no tokenizer, no data set)."""
    g = torch.Generator().manual_seed(SEED + 1)
    return torch.randint(0, CONFIG["vocab_size"], (CALIB_SAMPLES, CALIB_LEN), generator=g)


def stub_tokenizer():
    """A word-level tokenizer over the ids "0".."vocab-1", built in memory. Producers that insist on a
    tokenizer get this one; the calibration data are already token ids, so it never tokenizes real text."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {str(i): i for i in range(CONFIG["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="0", pad_token="0", eos_token="1", bos_token="2")


def probe_ids() -> torch.Tensor:
    g = torch.Generator().manual_seed(SEED + 2)
    return torch.randint(0, CONFIG["vocab_size"], PROBE_SHAPE, generator=g)


@torch.no_grad()
def fp32_logits(model) -> tuple[torch.Tensor, torch.Tensor]:
    ids = probe_ids()
    # Not model.float(): transformers refuses it on quantized models, and fp8 scales must keep their dtype.
    # A producer that dequantized into bf16 / fp16 gets those (exact) values widened to fp32.
    for t in list(model.parameters()) + list(model.buffers()):
        if t.dtype in (torch.bfloat16, torch.float16):
            t.data = t.data.float()
    return ids, model(input_ids=ids).logits.float()


def save_reference(out_dir: str, ids: torch.Tensor, logits: torch.Tensor, **meta) -> None:
    """reference.safetensors: the probe input and the producer's fp32 logits, with how they were made (one JSON
    metadata entry, so that the file's bytes do not depend on the order the header's keys are written in)."""
    save_file({"input_ids": ids.contiguous(), "logits": logits.contiguous()},
              os.path.join(out_dir, "reference.safetensors"),
              metadata={"reference": json.dumps(meta, sort_keys=True)})


KEEP = ("config.json", "model.safetensors", "reference.safetensors", "quantization_config.json",
        "hf_quant_config.json", "recipe.yaml")


def strip_side_files(out_dir: str, keep=KEEP) -> None:
    """Drop what a loader never reads (generation_config, tokenizer files if any) to keep the data small."""
    for f in os.listdir(out_dir):
        if f not in keep:
            os.remove(os.path.join(out_dir, f))
