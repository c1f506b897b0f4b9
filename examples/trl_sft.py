"""TRL's SFTTrainer with packing under block-diagonal CP, on CPU (gloo) or GPUs (NCCL):

    accelerate launch --num_processes 2 --cpu examples/trl_sft.py --cp 2            # CP 2
    torchrun --standalone --nproc-per-node 2 examples/trl_sft.py --cp 2             # the same, by torchrun
    python examples/trl_sft.py                                                      # CP 1, one process

A tiny model from its config (``--model llama | qwen3 | qwen3_5 | nemotron_h | lfm2 | gpt_oss``), a tokenizer built
in memory and a synthetic pre-tokenized dataset of documents of assorted lengths: nothing is downloaded. TRL packs
the documents (``--packing-strategy bfd``: padding-free rows whose ``position_ids`` restart at every document), and
``BlockdiagSFTTrainer`` shards each packed row over the CP group. Prints one line per logged step (the step's loss,
the same on every rank) and, with ``--out FILE``, writes the losses as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository's packages

VOCAB = 96


def tiny_tokenizer():
    """A word-level tokenizer over ``t0 .. t{VOCAB-3}`` plus ``<pad>`` and ``</s>``, built in memory."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "</s>": 1} | {f"t{i}": i + 2 for i in range(VOCAB - 2)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>")


def documents(n: int, seed: int = 0, longest: int = 40) -> list[list[int]]:
    """``n`` token documents of lengths 3 .. ``longest`` (ids 2 .. VOCAB-1), each ending with ``</s>``."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, longest + 1, (n,), generator=g).tolist()
    return [torch.randint(2, VOCAB, (k - 1,), generator=g).tolist() + [1] for k in lengths]


def tiny_model(model_type: str, dtype: torch.dtype = torch.float32, seed: int = 0):
    """A tiny causal LM of ``model_type`` from its config, with blockdiag's attention registered."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from blockdiag_dist.integrations import register_transformers_attention

    small = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8, pad_token_id=0, eos_token_id=1, bos_token_id=1)
    extra = {
        "qwen3_5_text": dict(layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
                             linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                             linear_conv_kernel_dim=4),
        "nemotron_h": dict(hybrid_override_pattern="M*", layers_block_type=["mamba", "attention"], mamba_num_heads=4,
                           mamba_head_dim=8, ssm_state_size=8, n_groups=2, conv_kernel=4, mamba_chunk_size=8),
        "lfm2": dict(layer_types=["conv", "full_attention"], conv_L_cache=3, block_ff_dim=64),
        "gpt_oss": dict(num_local_experts=2, num_experts_per_tok=1, sliding_window=8,
                        layer_types=["sliding_attention", "full_attention"]),
    }
    name = {"qwen3_5": "qwen3_5_text"}.get(model_type, model_type)
    kw = {k: v for k, v in (small | extra.get(name, {})).items()}
    config = AutoConfig.for_model(name, **kw)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation=register_transformers_attention(), dtype=dtype)


def main(argv: list[str] | None = None) -> list[float]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cp", type=int, default=1, help="ranks per CP group (a divisor of the number of processes)")
    p.add_argument("--model", default="qwen3_5", help="llama | qwen3 | qwen3_5 | nemotron_h | lfm2 | gpt_oss")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--packing-strategy", default="bfd", help="TRL's: bfd (padding-free rows) or wrapped")
    p.add_argument("--max-length", type=int, default=64, help="tokens per packed row")
    p.add_argument("--out", default=None, help="write the logged losses here as JSON (rank 0)")
    a = p.parse_args(argv)

    from datasets import Dataset
    from trl import SFTConfig

    from blockdiag_dist.integrations.trainer import BlockdiagSFTTrainer

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.distributed.is_initialized():
        torch.distributed.init_process_group(backend)
    args = SFTConfig(
        output_dir=tempfile.mkdtemp(prefix="blockdiag-sft-"), max_steps=a.steps, per_device_train_batch_size=4,
        learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[], packing=True,
        packing_strategy=a.packing_strategy, max_length=a.max_length, use_cpu=not torch.cuda.is_available(),
        seed=0, data_seed=0, dataloader_drop_last=True, disable_tqdm=True,
    )
    train = Dataset.from_dict({"input_ids": documents(200)})
    trainer = BlockdiagSFTTrainer(model=tiny_model(a.model), args=args, train_dataset=train,
                                  processing_class=tiny_tokenizer(), cp_size=a.cp)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    if trainer.args.process_index == 0:
        for i, loss in enumerate(losses, 1):
            print(f"step {i:3d} loss {loss:.6f}")
        if a.out:
            with open(a.out, "w") as f:
                json.dump({"cp": a.cp, "model": a.model, "losses": losses}, f)
    return losses


if __name__ == "__main__":
    main()
