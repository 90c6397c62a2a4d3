"""The README's library path on the embedded SmolLM2, for comparison with ``hf-tapernorm taper`` on the same data.

``patch_model(model, tokenizer=tok)`` + ``Trainer`` + ``TaperCallback()`` and nothing else, with the CLI's
training arguments and data (the same packing, seed and held-out blocks), then the held-out loss at g = 0.
tests/test_cli.py checks on a tiny model that the two paths train the same weights; this is the real run.

    python -m conversion_scripts.experiments.library_path --seed 42 --output /tmp/library_path.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from transformers import Trainer, default_data_collator

from hf_tapernorm import TaperCallback, patch_model
from hf_tapernorm.cli.arguments import TaperTrainingArguments
from hf_tapernorm.data import blocks_tensor, load_text_dataset, prepare_data
from hf_tapernorm.evaluation import heldout_loss, load_model, load_tokenizer, resolve_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--max_steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--block_size", type=int, default=128)
    parser.add_argument("--heldout_blocks", type=int, default=64)
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args()

    source = resolve_model(None)
    tokenizer = load_tokenizer(source)
    model = load_model(source)
    model = patch_model(model, tokenizer=tokenizer)  # the recipe for this architecture
    packed = prepare_data(
        load_text_dataset(None),
        tokenizer,
        block_size=args.block_size,
        train_blocks=args.max_steps * args.batch,
        heldout_blocks=args.heldout_blocks,
        prefix_ids=model.tapernorm_config.sink_token_ids,
    )
    training = TaperTrainingArguments(
        output_dir=str(args.output.with_suffix("")),
        max_steps=args.max_steps,
        per_device_train_batch_size=args.batch,
        seed=args.seed,
        report_to=[],
        disable_tqdm=True,
        save_strategy="no",
    )
    Trainer(
        model=model,
        args=training,
        train_dataset=packed.train,
        data_collator=default_data_collator,
        callbacks=[TaperCallback()],
    ).train()
    result = heldout_loss(
        model, blocks_tensor(packed.heldout), prefix_length=len(packed.prefix_ids), desc="held-out (library path)"
    )
    result.update(seed=args.seed, max_steps=args.max_steps, recipe=model.tapernorm_config.to_dict())
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
