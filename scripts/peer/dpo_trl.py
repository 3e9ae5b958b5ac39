"""TRL 1.16's DPOTrainer on a tiny model, as a user runs it: a PEFT LoRA model (B away from zero,
so the policy differs from the base from the start), a text preference dataset of one pair
(repeated, so the sampler's order does not matter), a word-level tokenizer over the model's
vocabulary. Writes what llora's preference step is compared with (tests/it/parity/llama.rs):

  OUT/config.json, model.safetensors          the base (HF)
  OUT/adapter_config.json, adapter_model.safetensors   the adapter before training (PEFT)
  OUT/expected.json    the pair's token ids as TRL tokenised them, TRL's logged metrics per step
  OUT/expected.safetensors   step 1's LoRA gradients (clipped: what the optimizer is given) and
                             the adapter after the last step

  .venv/bin/python scripts/peer/dpo_trl.py --out /tmp/dpo --preset demo --loss sigmoid
"""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--preset", default="demo", help="a Llama-style (demo) or Qwen-style (tiny-qwen2) preset")
    ap.add_argument("--loss", default="sigmoid", help="TRL loss_type, comma-separated (e.g. sigmoid,sft)")
    ap.add_argument("--weights", default=None, help="TRL loss_weights, comma-separated")
    ap.add_argument("--beta", type=float, default=0.1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--max-grad-norm", type=float, default=1.0)
    ap.add_argument("--adam-eps", type=float, default=1e-3,
                    help="AdamW's eps: at 1e-8 its first steps are ~lr*sign(g), which rounding flips for an element "
                         "whose gradient is ~0; at 1e-3 the update follows g, so the weights compare the gradients")
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reference", default="base", choices=["base", "adapter"],
                    help="base: a fresh adapter (TRL's reference = adapters off), its B then set away from zero; "
                         "adapter: an existing adapter (TRL keeps a frozen copy of it, 'ref', as the reference)")
    ap.add_argument("--bf16", action="store_true",
                    help="TRL's bf16 autocast (DPOConfig.bf16, on the CPU too): the distance llora's bf16 is held to")
    return ap.parse_args(argv)


def word_tokenizer(vocab_size):
    """Words w3 .. w{V-1} and <unk> <s> </s> (0, 1, 2), split on whitespace; a BOS first, as Llama's."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="</s>")


def main(a):
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file
    from transformers import TrainerCallback
    from trl import DPOConfig, DPOTrainer
    import recipe

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(a.threads)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = recipe.hf_config(a.preset, 64)
    base = recipe.random_model(cfg, "fp32", a.seed)
    state = {k: v.detach().contiguous().clone() for k, v in base.state_dict().items()}
    on_file = {k: v for k, v in state.items() if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
    save_file(on_file, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg.to_json_file(str(out / "config.json"))

    def away_from_zero(model):
        g = torch.Generator().manual_seed(a.seed + 7)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if ".lora_B.default." in n:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.05)

    peft_config = None
    if a.reference == "adapter":
        model = recipe.with_lora(base, 8, 16.0, 0.0)
        away_from_zero(model)
    else:
        from peft import LoraConfig
        model, peft_config = base, LoraConfig(r=8, lora_alpha=16.0, lora_dropout=0.0, bias="none", task_type="CAUSAL_LM",
                                              target_modules=list(recipe.ATTENTION_TARGETS))

    tokenizer = word_tokenizer(cfg.vocab_size)
    pair = {"prompt": "w10 w11 w12 w13 w14", "chosen": " w20 w21 w22", "rejected": " w30 w31 w32 w33 w34 w35"}
    dataset = Dataset.from_dict({k: [v] * a.steps for k, v in pair.items()})
    losses = a.loss.split(",")
    weights = [float(w) for w in a.weights.split(",")] if a.weights else None
    # fp32 unless --bf16: TRL turns bf16 autocast on by default (DPOConfig.bf16), also on the CPU.
    args = DPOConfig(output_dir=str(out / "trl"), per_device_train_batch_size=1, max_steps=a.steps,
                     learning_rate=a.lr, lr_scheduler_type="constant", warmup_steps=0, beta=a.beta,
                     loss_type=losses, loss_weights=weights, weight_decay=a.weight_decay,
                     max_grad_norm=a.max_grad_norm, adam_epsilon=a.adam_eps, report_to=[], logging_steps=1, save_strategy="no",
                     use_cpu=True, seed=a.seed, optim="adamw_torch", dataloader_num_workers=0, max_length=None,
                     disable_tqdm=True, bf16=a.bf16, fp16=False)

    def on_disk(n):
        return n.replace(".default.", ".")

    grads = {}

    class FirstGrads(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
            if state.global_step == 0:
                for n, p in model.named_parameters():
                    if p.requires_grad and ".default." in n:
                        grads[f"step1.grad.{on_disk(n)}"] = p.grad.detach().float().contiguous().clone()

    trainer = DPOTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer,
                         callbacks=[FirstGrads()], peft_config=peft_config)
    model = trainer.model
    if a.reference == "base":
        # The adapter TRL made is fresh (B = 0: policy = reference); moved so that they differ.
        away_from_zero(model)
    assert ("ref" in model.peft_config) == (a.reference == "adapter"), list(model.peft_config)
    state = {k: v.contiguous() for k, v in get_peft_model_state_dict(model, adapter_name="default").items()}
    save_file(state, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    model.peft_config["default"].save_pretrained(str(out))
    row = trainer.train_dataset[0]
    trainer.train()
    logs = [h for h in trainer.state.log_history if "rewards/chosen" in h]
    after = {f"after.{on_disk(n)}": p.detach().float().contiguous().clone()
             for n, p in model.named_parameters() if p.requires_grad and ".default." in n}
    save_file({**grads, **after}, str(out / "expected.safetensors"))
    summary = {"prompt_ids": row["prompt_ids"], "chosen_ids": row["chosen_ids"], "rejected_ids": row["rejected_ids"],
               "pad_token_id": tokenizer.pad_token_id, "logs": logs, "loss_type": losses, "loss_weights": weights,
               "beta": a.beta, "reference": a.reference, "bf16": a.bf16, "lr": a.lr, "weight_decay": a.weight_decay, "max_grad_norm": a.max_grad_norm, "adam_eps": a.adam_eps,
               "lora": {"r": 8, "alpha": 16.0, "targets": recipe.ATTENTION_TARGETS},
               "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__}}
    (out / "expected.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({"out": str(out), "losses": [h.get("loss") for h in logs]}))


if __name__ == "__main__":
    main(parse_args())
